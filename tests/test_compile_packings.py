"""A compiled layer call over changing packings keeps at most 2 graphs per rank (issue 47).

``torch.compile(fullgraph=True)`` of ``V4Attention.forward`` (and of ``attention_forward`` itself)
on 2 gloo ranks over 20 packings of 96 tokens: first the edge packings of
:func:`cpkv.bench.torch_compile.edge_packings` (one document, a document shorter than the
ratio, many tiny documents, the last rank owning no entry, one block straddling the rank
boundary, documents cut at the rank boundary: no halo traffic), then log-normal documents.
Dynamo's recompile limit stays at its default (8, where ``fullgraph=True`` raises), with
``torch.fx.experimental._config.backed_size_oblivious`` set (PyTorch's switch that keeps dynamic
sizes of 0 and 1 symbolic; without it every size that is sometimes 0 or 1 recompiles once).
Each case: at most 2 graphs on every rank (the first, and one with symbolic sizes), no step
failed, and the last step's outputs and gradients equal eager. Twelve cases: every compress mode
with every layout, with both exchanges and with ring 2, two of them through ``attention_forward``
(``python -m cpkv.bench.torch_compile --packings 50 --size-oblivious`` measures all 28 mode x layout x
exchange cases); one spawn of its own (Dynamo's configuration).
"""

from __future__ import annotations

from typing import Any

import pytest

from cpkv.bench.torch_compile import case_id, graphs_over_packings
from cpkv.launch import spawn

PACKINGS = 20
CASES = [  # every mode x layout; every mode with both exchanges and ring 2; attention_forward for two
    ("compressor", "contiguous", "need", 2, "layer"),
    ("compressor", "zigzag", "allgather", 1, "layer"),
    ("compressor", "balanced", "need", 1, "attention"),
    ("indexer", "contiguous", "allgather", 1, "layer"),
    ("indexer", "zigzag", "need", 1, "layer"),
    ("indexer", "balanced", "need", 2, "attention"),
    ("window", "contiguous", "need", 2, "layer"),
    ("window", "zigzag", "allgather", 1, "layer"),
    ("window", "balanced", "need", 1, "layer"),
    ("dense", "contiguous", "allgather", 1, "layer"),
    ("dense", "zigzag", "need", 2, "layer"),
    ("dense", "balanced", "allgather", 1, "layer"),
]


def _name(mode: str, layout: str, exchange: str, ring: int, target: str) -> str:
    return ("attention_forward:" if target == "attention" else "") + case_id(mode, layout, exchange, ring)


def _every_case(rank: int, world: int) -> dict[str, Any]:
    return {
        _name(*case): graphs_over_packings(rank, world, case[0], PACKINGS, "aot_eager", 96, case[1], case[2], case[3], case[4],
                                           None, True)
        for case in CASES
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    per_rank = spawn(_every_case, 2, timeout=900.0)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


@pytest.mark.timeout(920)
@pytest.mark.parametrize("case", [_name(*c) for c in CASES])
def test_at_most_two_graphs_per_rank_over_twenty_packings(runs: dict[str, list[dict[str, Any]]], case: str) -> None:
    for rank, result in enumerate(runs[case]):
        assert result["failed"] == 0, (case, rank, result["reason"])
        assert len(result["graphs"]) == PACKINGS
        assert result["graphs"][-1] <= 2, (case, rank, result["graphs"])
        assert result["error"] <= 1e-5, (case, rank, result["error"])
