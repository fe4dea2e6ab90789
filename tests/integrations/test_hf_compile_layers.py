"""Hugging Face's DeepSeek-V4 under CP with every decoder layer compiled as torchtitan does (issue 47).

:func:`cpkv.bench.hf_compile.hf_layers_over_packings` on 2 gloo ranks: the small random
``DeepseekV4ForCausalLM`` of test_transformers_lm.py (one sliding-window layer with the
hash-routed MoE, one CSA layer, ratio 4 with its indexer, and one HCA layer, ratio 16), in
float32, with Hugging Face's default experts implementation (``"grouped_mm"``), every decoder
layer compiled in place with ``layer.compile(fullgraph=True, backend=...)`` (``aot_eager``: Dynamo
and AOTAutograd; ``fullgraph=True`` raises on any graph break, so a step that ran had 0 breaks),
``torch.fx.experimental._config.backed_size_oblivious = True`` and Dynamo's recompile limit at
its default (8 graphs for the one code object all decoder layers share). 20 packings of 96
tokens through :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss` (balanced
layout, need exchange: the defaults), forward and backward: first the edge packings of both
ratios (one document, a document shorter than the ratio, many tiny documents, the last rank
owning no entry, one block straddling the rank boundary, documents cut at the rank boundary),
then log-normal documents.

Graphs are counted per decoder layer type: each type's layers compile with their own counting
backend (Dynamo calls a backend once per graph it compiles). At most 2 per type on every rank:
the first, and one with symbolic sizes.

Tolerance of the last step against the same model run eagerly (the same weights): the eager
experts call ``torch.nn.functional.grouped_mm``, compiled ones (float32 weights) Hugging Face's
``transformers::grouped_mm_fallback`` (one ``torch.mm`` per expert), and AOTAutograd may
decompose ops into others, so the two may differ by float32 rounding (eps 1.2e-7) in the summation
order; on CPU with aot_eager they measured bit-equal (0 on the loss, about 4.2, and on every
gradient). Bounds: 1e-6 absolute on the loss, 1e-5 relative (to each gradient's largest
magnitude) on the gradients: rounding slack for another kernel, while a wrong plan, a graph
reused for another packing or a lost gradient gives >= 1e-3. Every parameter with a gradient on
one side has one on the other.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers>=5.23 (the transformers/test extra) is missing")

from cpkv.bench.hf_compile import LAYER_TYPES, hf_layers_over_packings  # noqa: E402
from cpkv.launch import spawn  # noqa: E402

PACKINGS = 20
LOSS_ABS, GRAD_REL = 1e-6, 1e-5


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(hf_layers_over_packings, 2, PACKINGS, "aot_eager", 96, True, None, timeout=400.0)


@pytest.mark.timeout(420)
def test_every_step_runs_compiled(runs: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(runs):
        assert result["failed"] == 0, (rank, result["reason"])
        assert len(result["seconds"]) == PACKINGS
        assert len(result["packings"]) == PACKINGS and [96] in result["packings"] and [2] * 48 in result["packings"]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("layer_type", LAYER_TYPES)
def test_at_most_two_graphs_per_layer_type(runs: list[dict[str, Any]], layer_type: str) -> None:
    for rank, result in enumerate(runs):
        graphs = result["graphs"][layer_type]
        assert len(graphs) == PACKINGS and 1 <= graphs[-1] <= 2, (rank, layer_type, graphs)


@pytest.mark.timeout(420)
def test_last_step_equals_eager(runs: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(runs):
        assert result["missing"] == [], (rank, result["missing"])
        assert result["loss_error"] <= LOSS_ABS, (rank, result["loss_error"])
        assert result["grad_error"] <= GRAD_REL, (rank, result["grad_error"])
