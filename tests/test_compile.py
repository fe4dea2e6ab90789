"""``torch.compile(fullgraph=True)`` of a layer call, on gloo ranks, matches eager.

Every compress mode under every layout and exchange (ring rounds included), and
``attention_forward`` with several kv heads (GQA keys and values, window, sinks), compiles as one
graph (``fullgraph=True`` raises on any graph break) through ``V4Attention.forward`` ->
``attention_forward`` on the reference backend, and its outputs and input/parameter
gradients equal eager to fp32 round-off (<= 1e-5 relative: the same ops, possibly fused
differently by the compiler backend). CI compiles with ``backend="aot_eager"`` (Dynamo +
AOTAutograd, no code generation: the part that decides graph breaks) to keep the suite
fast, plus one ring case with inductor, whose scheduler reorders anything not ordered by a
data dependency (the backward collectives must stay in one order on every rank);
``python -m cpkv.bench.torch_compile`` runs every case with inductor and reports compile times
(the cases and runners live in :mod:`cpkv.bench.torch_compile`).
"""

from __future__ import annotations

from typing import Any

import pytest

from cpkv.bench.torch_compile import CASES, GQA_CASES, case_id, compile_cases, compile_gqa
from cpkv.launch import spawn


def _direct_and_gqa(rank: int, world: int) -> dict[str, Any]:
    """One spawn: ``attention_forward`` itself on a V4 INDEXER case, and the kv-heads cases."""
    direct = compile_cases(rank, world, [("indexer", "contiguous", "need", 1)], "aot_eager", "attention")
    return {**{"attention_forward:" + key: value for key, value in direct.items()},
            **compile_gqa(rank, world, GQA_CASES, "aot_eager")}


@pytest.fixture(scope="module")
def compiled_runs() -> dict[str, Any]:
    per_rank = spawn(compile_cases, 2, CASES, "aot_eager", timeout=500.0)
    direct = spawn(_direct_and_gqa, 2, timeout=300.0)
    return {key: [r[key] for r in runs] for runs in (per_rank, direct) for key in runs[0]}


@pytest.mark.timeout(300)
def test_inductor_keeps_backward_collectives_in_order_on_every_rank() -> None:
    """Inductor schedules the compiled backward by data dependencies only: every backward collective
    consumes the previous one's token, so no rank reorders them (before, this case mismatched
    collective sizes across ranks and aborted gloo)."""
    per_rank = spawn(compile_cases, 2, [("compressor", "contiguous", "need", 2)], "inductor", timeout=280.0)
    for rank_result in per_rank:
        assert rank_result["compressor/contiguous/need/ring2"]["error"] <= 1e-5


@pytest.mark.timeout(560)
@pytest.mark.parametrize("case", [case_id(*c) for c in CASES] + ["attention_forward:indexer/contiguous/need",
                                                                   "gqa:zigzag/allgather", "gqa:contiguous/need/ring2"])
def test_layer_call_compiles_fullgraph_and_matches_eager(compiled_runs: dict[str, Any], case: str) -> None:
    for rank_result in compiled_runs[case]:
        assert rank_result["error"] <= 1e-5, (case, rank_result)
