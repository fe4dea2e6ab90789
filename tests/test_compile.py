"""``torch.compile(fullgraph=True)`` of a layer call, on gloo ranks, matches eager.

Every compress mode under every layout and exchange (ring rounds included), and
``attention_forward`` with several kv heads (GQA keys and values, window, sinks), compiles as one
graph (``fullgraph=True`` raises on any graph break) through ``V4Attention.forward`` ->
``attention_forward`` on the reference backend, and its outputs and input/parameter
gradients equal eager to fp32 round-off (<= 1e-5 relative: the same ops, possibly fused
differently by the compiler backend). CI compiles with ``backend="aot_eager"`` (Dynamo +
AOTAutograd, no code generation: the part that decides graph breaks) to keep the suite
fast, plus one ring case with inductor, whose scheduler reorders anything not ordered by a
data dependency (the backward collectives must stay in one order on every rank), all in one
spawn of 2 ranks (its own: Dynamo's configuration and inductor's workers stay out of the
shared groups of tests/shared_spawn.py);
``python -m cpkv.bench.torch_compile`` runs every case with inductor and reports compile times
(the cases and runners live in :mod:`cpkv.bench.torch_compile`).
"""

from __future__ import annotations

from typing import Any

import pytest

from cpkv.bench.torch_compile import CASES, GQA_CASES, case_id, compile_cases, compile_gqa
from cpkv.launch import spawn


INDUCTOR_CASE = ("compressor", "contiguous", "need", 2)


def _every_case(rank: int, world: int) -> dict[str, Any]:
    """One spawn: the layer cases, ``attention_forward`` itself on a V4 INDEXER case and the kv-heads
    cases with aot_eager, then the inductor case (each case resets Dynamo before it compiles)."""
    direct = compile_cases(rank, world, [("indexer", "contiguous", "need", 1)], "aot_eager", "attention")
    inductor = compile_cases(rank, world, [INDUCTOR_CASE], "inductor")
    return {**compile_cases(rank, world, CASES, "aot_eager"),
            **{"attention_forward:" + key: value for key, value in direct.items()},
            **compile_gqa(rank, world, GQA_CASES, "aot_eager"),
            **{"inductor:" + key: value for key, value in inductor.items()}}


@pytest.fixture(scope="module")
def compiled_runs() -> dict[str, Any]:
    per_rank = spawn(_every_case, 2, timeout=540.0)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.mark.timeout(560)
def test_inductor_keeps_backward_collectives_in_order_on_every_rank(compiled_runs: dict[str, Any]) -> None:
    """Inductor schedules the compiled backward by data dependencies only: every backward collective
    consumes the previous one's token, so no rank reorders them (before, this case mismatched
    collective sizes across ranks and aborted gloo)."""
    for rank_result in compiled_runs["inductor:" + case_id(*INDUCTOR_CASE)]:
        assert rank_result["error"] <= 1e-5


@pytest.mark.timeout(560)
@pytest.mark.parametrize("case", [case_id(*c) for c in CASES] + ["attention_forward:indexer/contiguous/need",
                                                                   "gqa:zigzag/allgather", "gqa:contiguous/need/ring2"])
def test_layer_call_compiles_fullgraph_and_matches_eager(compiled_runs: dict[str, Any], case: str) -> None:
    for rank_result in compiled_runs[case]:
        assert rank_result["error"] <= 1e-5, (case, rank_result)
