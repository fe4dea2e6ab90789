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
``python scripts/compile_report.py`` runs every case with inductor and reports compile times.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.launch import spawn
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.v4 import V4Attention, V4Config

MODES = {
    "window": V4Config(compress_ratio=0, window=8),
    "dense": V4Config(compress_ratio=0, window=None),
    "compressor": V4Config(compress_ratio=8, window=8),
    "indexer": V4Config(compress_ratio=4, window=8, topk=3),
}
LENGTHS = {"contiguous": [5, 0, 23, 3, 17], "zigzag": [16, 0, 32], "balanced": [5, 0, 23, 3, 17]}  # 48 tokens; zigzag: multiples of 2*cp (cp <= 4)
LAYOUTS = [(layout, exchange, 1) for layout in LENGTHS for exchange in ("allgather", "need")] + [
    (layout, "need", 2) for layout in LENGTHS
]
ALL_CASES = [(mode, *layout) for mode in MODES for layout in LAYOUTS]
# CI compiles a cover of every mode, layout and exchange (the full table: scripts/compile_report.py).
CASES = [
    ("window", "contiguous", "need", 2), ("dense", "zigzag", "allgather", 1), ("compressor", "contiguous", "need", 1),
    ("indexer", "contiguous", "allgather", 1), ("indexer", "contiguous", "need", 2),
    ("indexer", "zigzag", "need", 1), ("indexer", "balanced", "need", 2),
]


def _case_id(mode: str, layout: str, exchange: str, ring: int) -> str:
    return f"{mode}/{layout}/{exchange}" + (f"/ring{ring}" if ring > 1 else "")


def attention_call(layer: V4Attention, x: torch.Tensor, plan: Any, group: Any, *, backend: str, grad_scale: float) -> Any:
    """``attention_forward`` itself (what a user's own module calls), with the layer's projections outside."""
    q, kv = layer.project(x, plan.q_positions)
    return attention_forward(
        q, kv, plan, group, spec=layer.config.spec, sinks=layer.sinks, hidden=x, compressor=layer.compressor,
        indexer=layer.indexer, backend=backend, grad_scale=grad_scale,  # type: ignore[arg-type]
    )


def _run(layer: V4Attention, fn: Any, x: torch.Tensor, plan: Any, grad: torch.Tensor) -> list[torch.Tensor]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = fn(x, plan, None, backend="reference", grad_scale=2.0).out
    if out.ndim == 3:  # attention_forward's [T, H, d_v]: reduce with a fixed projection
        out = out.flatten(1) @ torch.ones(out.shape[1] * out.shape[2], grad.shape[1])
    out.backward(grad)
    assert x.grad is not None
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in layer.parameters()]
    return [out.detach(), x.grad, *grads]


def compile_cases(
    rank: int, world: int, cases: list[tuple[str, str, str, int]], backend: str, target: str = "layer"
) -> dict[str, Any]:
    """Per case: max relative error compiled vs eager, compile+first-call seconds, and graph breaks."""
    import torch._dynamo
    import torch._inductor.config

    torch._dynamo.config.cache_size_limit = 64
    torch._inductor.config.fx_graph_cache = False  # always compile what the current ops are
    results: dict[str, Any] = {}
    for mode, layout, exchange, ring in cases:
        config = MODES[mode]
        cu = seqlens_to_cu_seqlens(LENGTHS[layout])
        gen = torch.Generator().manual_seed(3)
        x_all, g_all = torch.randn(48, 64, generator=gen), torch.randn(48, 64, generator=gen)
        ratios = [config.compress_ratio] if config.mode.compresses else []
        plan = plan_attention(
            cu, world, rank, layout=layout, exchange=exchange, ring_degree=ring,  # type: ignore[arg-type]
            compress_ratios=ratios, windows=[config.window],
        )
        shard = plan.shard
        layer = V4Attention(config, seed=5)
        fn = layer.forward if target == "layer" else functools.partial(attention_call, layer)
        eager = _run(layer, fn, shard(x_all), plan, shard(g_all))
        torch._dynamo.reset()
        compiled_fn = torch.compile(fn, fullgraph=True, backend=backend)
        start = time.perf_counter()
        compiled = _run(layer, compiled_fn, shard(x_all), plan, shard(g_all))
        seconds = time.perf_counter() - start
        errors = [float((c - e).abs().max() / e.abs().max().clamp(min=1e-12)) for c, e in zip(compiled, eager)]
        results[_case_id(mode, layout, exchange, ring)] = {"error": max(errors), "seconds": seconds}
    return results


GQA_CASES = [("zigzag", "allgather", 1), ("contiguous", "need", 2)]  # kv heads: 4 query heads over 2 kv heads


def compile_gqa(rank: int, world: int, cases: list[tuple[str, str, int]], backend: str) -> dict[str, Any]:
    """``attention_forward`` with kv heads (keys ``[T/cp, 2, 16]``, values ``[T/cp, 2, 8]``, window, sinks), compiled vs eager."""
    import torch._dynamo

    results: dict[str, Any] = {}
    for layout, exchange, ring in cases:
        plan = plan_attention(seqlens_to_cu_seqlens(LENGTHS[layout]), world, rank, layout=layout,  # type: ignore[arg-type]
                              exchange=exchange, ring_degree=ring, windows=[8])  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(4)
        inputs = [plan.shard(torch.randn(48, *shape, generator=gen)) for shape in ((4, 16), (2, 16), (2, 8))]
        sinks, grad = torch.randn(4, generator=gen), plan.shard(torch.randn(48, 4, 8, generator=gen))
        spec = AttentionSpec(d_v=8, window=8)

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = attention_forward(q, k, plan, None, spec=spec, v=v, sinks=s, backend="reference").out
            return out

        def run(fn: Any) -> list[torch.Tensor]:
            leaves = [x.clone().requires_grad_(True) for x in (*inputs, sinks)]
            out = fn(*leaves)
            out.backward(grad)
            return [out.detach(), *(x.grad for x in leaves)]

        eager = run(call)
        torch._dynamo.reset()
        compiled = run(torch.compile(call, fullgraph=True, backend=backend))  # fullgraph: any graph break raises
        errors = [float((c - e).abs().max() / e.abs().max().clamp(min=1e-12)) for c, e in zip(compiled, eager)]
        results[f"gqa:{layout}/{exchange}" + (f"/ring{ring}" if ring > 1 else "")] = {"error": max(errors)}
    return results


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
@pytest.mark.parametrize("case", [_case_id(*c) for c in CASES] + ["attention_forward:indexer/contiguous/need",
                                                                   "gqa:zigzag/allgather", "gqa:contiguous/need/ring2"])
def test_layer_call_compiles_fullgraph_and_matches_eager(compiled_runs: dict[str, Any], case: str) -> None:
    for rank_result in compiled_runs[case]:
        assert rank_result["error"] <= 1e-5, (case, rank_result)
