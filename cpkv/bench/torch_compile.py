"""``torch.compile(fullgraph=True)`` of every layer case on gloo ranks, against eager.

``python -m cpkv.bench.torch_compile [--backend inductor|aot_eager] [--cp 2]`` prints, for each
compress mode x layout x exchange (ring rounds included), through ``V4Attention.forward`` and
through ``attention_forward`` itself: whether the call compiled as one graph
(``fullgraph=True`` raises on any graph break, so "yes" means 0 breaks), the seconds of the
first compiled call (compile + run, forward and backward, rank 0) and the max relative error
of outputs and gradients against eager. The case list and the per-rank runners live here, so
that tests/test_compile.py (a cover of the cases, with ``aot_eager``) and this report run the
same code. (``benchmarks/compile_report.py`` is another job: the Triton kernels compiled for
sm_90a.)

``python -m cpkv.bench.torch_compile --packings 20 [--backend aot_eager]`` reports instead how
many graphs each compress mode's compiled layer collects over 20 steps whose documents change
(the same tokens packed anew each step): what a training run's compiled layers recompile.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
import traceback
from typing import Any

import torch

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.launch import RankError, spawn
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.plan.cost import CostModel
from cpkv.v4 import V4Attention, V4Config

__all__ = ["ALL_CASES", "CASES", "GQA_CASES", "LENGTHS", "MODES", "attention_call", "case_id", "compile_cases", "compile_gqa",
           "compile_settings", "edge_packings", "failure_reason", "graphs_over_packings", "lognormal_packing", "main"]

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
# CI compiles a cover of every mode, layout and exchange (the full table: python -m cpkv.bench.torch_compile).
CASES = [
    ("window", "contiguous", "need", 2), ("dense", "zigzag", "allgather", 1), ("compressor", "contiguous", "need", 1),
    ("indexer", "contiguous", "allgather", 1), ("indexer", "contiguous", "need", 2),
    ("indexer", "zigzag", "need", 1), ("indexer", "balanced", "need", 2),
]


def case_id(mode: str, layout: str, exchange: str, ring: int) -> str:
    return f"{mode}/{layout}/{exchange}" + (f"/ring{ring}" if ring > 1 else "")


def attention_call(layer: V4Attention, x: torch.Tensor, plan: Any, group: Any, *, backend: str, grad_scale: float) -> Any:
    """``attention_forward`` itself (what a user's own module calls), with the layer's projections outside."""
    q, kv = layer.project(x, plan.q_positions)
    return attention_forward(
        q, kv, plan, group, spec=layer.config.spec, sinks=layer.sinks, hidden=x, compressor=layer.compressor,
        indexer=layer.indexer, backend=backend, grad_scale=grad_scale,  # type: ignore[arg-type]
    )


def _call(layer: V4Attention, fn: Any, x: torch.Tensor, plan: Any, grad: torch.Tensor) -> list[torch.Tensor]:
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

    compile_settings(False)  # always compile what the current ops are
    torch._dynamo.config.cache_size_limit = 64
    results: dict[str, Any] = {}
    for mode, layout, exchange, ring in cases:
        config = MODES[mode]
        cu = seqlens_to_cu_seqlens(LENGTHS[layout])
        gen = torch.Generator().manual_seed(3)
        x_all, g_all = torch.randn(48, 64, generator=gen), torch.randn(48, 64, generator=gen)
        ratios = [config.compress_ratio] if config.mode.compresses else []
        plan = plan_attention(
            cu, world, rank, layout=layout, exchange=exchange, ring_degree=ring,  # type: ignore[arg-type]
            compress_ratios=ratios, windows=[config.window], cost_model=CostModel.from_v4(config),
        )
        shard = plan.shard
        layer = V4Attention(config, seed=5)
        fn = layer.forward if target == "layer" else functools.partial(attention_call, layer)
        eager = _call(layer, fn, shard(x_all), plan, shard(g_all))
        torch._dynamo.reset()
        compiled_fn = torch.compile(fn, fullgraph=True, backend=backend)
        start = time.perf_counter()
        compiled = _call(layer, compiled_fn, shard(x_all), plan, shard(g_all))
        seconds = time.perf_counter() - start
        errors = [float((c - e).abs().max() / e.abs().max().clamp(min=1e-12)) for c, e in zip(compiled, eager)]
        results[case_id(mode, layout, exchange, ring)] = {"error": max(errors), "seconds": seconds}
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


def edge_packings(tokens: int, world: int, ratio: int, unit: int = 1) -> list[list[int]]:
    """The edge packings of ``tokens`` (document lengths, multiples of ``unit``): one document, a
    document shorter than the ratio, many tiny documents, a rank owning no entry (the last rank's
    documents all shorter than the ratio), one block straddling each rank boundary, and documents
    cut at the rank boundaries (no halo traffic in the need exchange)."""
    ratio = max(ratio, 2)
    local = tokens // world
    short = max(unit, (ratio - 1) // unit * unit)
    tiny = unit * max(1, (ratio // 2) // unit)
    last = [tiny] * ((tokens - local * (world - 1)) // tiny)
    packings = [
        [tokens],
        [short, tokens - short],
        [tiny] * (tokens // tiny),
        [local * (world - 1), *last] if sum(last) == tokens - local * (world - 1) else [tokens],
        [unit * max(1, (ratio // 2) // unit), tokens - unit * max(1, (ratio // 2) // unit)],
        [local] * world,
    ]
    return [[n for n in lengths if n] for lengths in packings]


def lognormal_packing(rng: Any, tokens: int, unit: int = 1, mean: float = 3.0, sigma: float = 1.0) -> list[int]:
    """Documents of log-normal lengths (multiples of ``unit``, median ``e**mean``) filling ``tokens``."""
    lengths: list[int] = []
    while sum(lengths) < tokens:
        n = max(unit, int(rng.lognormvariate(mean, sigma)) // unit * unit)
        lengths.append(min(n, tokens - sum(lengths)))
    return lengths


def compile_settings(size_oblivious: bool, recompile_limit: int | None = None) -> None:
    """This process's compile settings for counting graphs over packings.

    Inductor's FX graph cache and AOTAutograd's cache off (every graph counted is compiled in the
    run, none read from a cache built by other code); ``size_oblivious``: PyTorch's
    ``torch.fx.experimental._config.backed_size_oblivious`` (dynamic sizes of 0 and 1 stay
    symbolic); ``recompile_limit``: Dynamo's (``None``: its default, 8).
    """
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    import torch.fx.experimental._config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    if recompile_limit is not None:
        torch._dynamo.config.recompile_limit = recompile_limit
    if size_oblivious:
        torch.fx.experimental._config.backed_size_oblivious = True


def failure_reason(exc: BaseException) -> str:
    """``exc`` in one line for a table (its traceback printed when ``CPKV_BENCH_TRACEBACK`` is set)."""
    if os.environ.get("CPKV_BENCH_TRACEBACK"):
        traceback.print_exception(exc)
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line[:300]}"


def graphs_over_packings(
    rank: int, world: int, mode: str, packings: int, backend: str, tokens: int = 96, layout: str = "contiguous",
    exchange: str = "need", ring: int = 1, target: str = "layer", recompile_limit: int | None = None,
    size_oblivious: bool = False,
) -> dict[str, Any]:
    """Graphs Dynamo holds for one compiled layer call after each of ``packings`` steps.

    The first steps are the :func:`edge_packings`, the others pack the same ``tokens`` into new
    log-normal documents (:func:`lognormal_packing`, the same boundaries on every rank); each runs
    the compiled call (``V4Attention.forward``, or ``attention_forward`` itself with ``target=
    "attention"``) forward and backward. ``graphs``: Dynamo's ``unique_graphs`` after each step
    (a step that recompiled adds one); ``failed``: the step (1-based) whose call raised (for example
    ``FailOnRecompileLimitHit`` at Dynamo's default limit of 8 graphs, ``recompile_limit=None``), else 0,
    and ``reason`` its exception;
    ``seconds``: each step's wall time; ``error``: max relative difference of the last step vs eager,
    ``eager_seconds``: that eager step's wall time.
    ``size_oblivious``: set ``torch.fx.experimental._config.backed_size_oblivious`` (PyTorch's switch
    that keeps dynamic sizes of 0 and 1 symbolic instead of specialising them).
    """
    import random

    import torch._dynamo
    from torch._dynamo.utils import counters

    compile_settings(size_oblivious, recompile_limit)
    config = MODES[mode]
    layer = V4Attention(config, seed=5)
    fn = layer.forward if target == "layer" else functools.partial(attention_call, layer)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    torch._dynamo.reset()
    counters.clear()
    rng, gen = random.Random(0), torch.Generator().manual_seed(1)
    ratios = [config.compress_ratio] if config.mode.compresses else []
    unit = 2 * world if layout == "zigzag" else 1
    tokens = tokens // (2 * world) * (2 * world)
    steps = edge_packings(tokens, world, config.compress_ratio, unit)
    graphs: list[int] = []
    seconds: list[float] = []
    failed, error, reason, eager_seconds = 0, 0.0, "", 0.0
    for step in range(packings):
        lengths = steps[step] if step < len(steps) else lognormal_packing(rng, tokens, unit)
        plan = plan_attention(seqlens_to_cu_seqlens(lengths), world, rank, layout=layout,  # type: ignore[arg-type]
                              exchange=exchange, ring_degree=ring, compress_ratios=ratios,  # type: ignore[arg-type]
                              windows=[config.window], cost_model=CostModel.from_v4(config))
        x, grad = (torch.randn(plan.local_len, config.hidden, generator=gen) for _ in range(2))
        start = time.perf_counter()
        try:
            got = _call(layer, compiled, x, plan, grad)
        except Exception as exc:  # noqa: BLE001 - reported as the failing step
            failed, reason = step + 1, failure_reason(exc)
            break
        seconds.append(time.perf_counter() - start)
        graphs.append(int(counters["stats"]["unique_graphs"]))
        if step == packings - 1:
            start = time.perf_counter()
            eager = _call(layer, fn, x, plan, grad)
            eager_seconds = time.perf_counter() - start
            error = max(float((c - e).abs().max() / e.abs().max().clamp(min=1e-12)) for c, e in zip(got, eager))
    return {"graphs": graphs, "failed": failed, "seconds": seconds, "error": error, "reason": reason, "eager_seconds": eager_seconds}


PACKING_CASES = [(layout, exchange, 1) for layout in LENGTHS for exchange in ("need", "allgather")] + [("contiguous", "need", 2)]


def _packings_table(
    cp: int, packings: int, backend: str, modes: list[str], target: str, limit: int | None, oblivious: bool, tokens: int,
    layouts: list[str] | None = None,
) -> None:
    where = "V4Attention.forward" if target == "layer" else "attention_forward"
    print(f"{where}, cp {cp}, {tokens} tokens, {packings} packings, backend {backend}, recompile_limit {limit or 'default (8)'},"
          f" backed_size_oblivious {oblivious}\n")
    print("| mode | layout | exchange | graphs per rank | failed at step | step of the last new graph | compile s per step"
          " (mean over steps) | compiled step s (median) | eager step s (last) | max rel. error vs eager (last step) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for layout, exchange, ring in PACKING_CASES:
            if layouts and layout not in layouts:
                continue
            per_rank = spawn(graphs_over_packings, cp, mode, packings, backend, tokens, layout, exchange, ring, target, limit,
                             oblivious, timeout=900.0)
            graphs = [r["graphs"][-1] if r["graphs"] else 0 for r in per_rank]
            last = [next(i + 1 for i, g in enumerate(r["graphs"]) if g == r["graphs"][-1]) if r["graphs"] else 0 for r in per_rank]
            failed = [r["failed"] for r in per_rank]
            secs = per_rank[0]["seconds"]
            steady = sorted(secs)[len(secs) // 2] if secs else 0.0
            compile_s = sum(max(0.0, t - steady) for t in secs) / max(1, len(secs))
            name = exchange + (f", ring {ring}" if ring > 1 else "")
            print(f"| {mode} | {layout} | {name} | {', '.join(map(str, graphs))} | {', '.join(str(f) if f else '-' for f in failed)}"
                  f" | {', '.join(map(str, last))} | {compile_s:.2f} | {steady:.3f} | {per_rank[0]['eager_seconds']:.3f}"
                  f" | {per_rank[0]['error']:.1e} |", flush=True)


def main() -> int:
    """Compile every case on ``--cp`` gloo ranks and print the table; 1 if any case failed to compile as one graph."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--cp", type=int, default=2, choices=[1, 2, 3, 4])
    parser.add_argument("--packings", type=int, default=0,
                        help="instead: the graphs each mode's layer compiles over this many random packings")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="with --packings")
    parser.add_argument("--target", default="layer", choices=["layer", "attention"],
                        help="with --packings: V4Attention.forward or attention_forward itself")
    parser.add_argument("--recompile-limit", type=int, default=None, help="with --packings (default: Dynamo's, 8)")
    parser.add_argument("--size-oblivious", action="store_true",
                        help="with --packings: torch.fx.experimental._config.backed_size_oblivious = True")
    parser.add_argument("--tokens", type=int, default=96, help="with --packings: tokens per packing")
    parser.add_argument("--layouts", nargs="+", default=None, choices=list(LENGTHS), help="with --packings (default: all)")
    args = parser.parse_args()
    if args.packings:
        _packings_table(args.cp, args.packings, args.backend, args.modes, args.target, args.recompile_limit,
                        args.size_oblivious, args.tokens, args.layouts)
        return 0
    print(f"| case | fullgraph | graph breaks | first call s ({args.backend}) | max rel. error vs eager |")
    print("|---|---|---|---|---|")
    failed = False
    for target in ("layer", "attention"):
        for case in ALL_CASES:
            name = ("V4Attention.forward " if target == "layer" else "attention_forward ") + case_id(*case)
            try:
                result = spawn(compile_cases, args.cp, [case], args.backend, target, timeout=900.0)[0]
                row = next(iter(result.values()))
                print(f"| {name} | yes | 0 | {row['seconds']:.1f} | {row['error']:.1e} |", flush=True)
            except RankError as err:
                failed = True
                print(f"| {name} | no | - | - | {str(err).splitlines()[-1][:80]} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
