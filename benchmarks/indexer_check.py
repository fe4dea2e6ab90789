"""GPU check of the lightning indexer (``cpkv_triton::indexer_topk`` and the KL loss ``cpkv_triton::indexer_kl``) on DeepSeek-V4 shapes.

    python benchmarks/indexer_check.py                 # H200: about 1-2 minutes
    python benchmarks/indexer_check.py --no-long       # without the 1M-token cp 8 shape
    python benchmarks/indexer_check.py --no-long --sweep   # and other tile configurations
    TRITON_INTERPRET=1 python benchmarks/indexer_check.py --smoke   # CPU, tiny shapes, fp8 and bf16 (tests the script;
                                                                    # ~2 min; benchmarks/interpreter_patch.py)

One markdown table, columns ``| shape | dtype | check / phase | value | bound or target | ok |``:

* exactness at the smallest shape: the selected score sums against the reference op on the
  same (dequantized) inputs in fp32 (bound ``1e-3`` of the largest sum), the kernel's scores
  against the reference scores of the entries it picked, and the share of identical index sets;
* per shape and dtype (fp8 e4m3 with per-key and per-(query, head) scales folded into the
  weights, as DeepSeek scores; bf16): ms per call, TFLOP/s over the counted work (visible
  pairs x H_I x D_I x 2; target >= 600 fp8, >= 350 bf16), the selection's share of the time
  (``1 - t(scores only) / t(scores + top-k)``, target <= 15%);
* per layer call through ``CUDABackend.indexer_topk``: device kernels (torch profiler), host
  syncs (``torch.cuda.set_sync_debug_mode("error")`` raises on any), and the call captured in
  a CUDA graph and replayed (bitwise the eager indices; replay ms);
* the KL loss over the selected entries (``cpkv_triton::indexer_kl``, bf16, the top-k's own
  selection, a random target), at the two smaller shapes: loss and gradients against the
  torch op ``cpkv::indexer_kl`` on the same inputs in fp32 (bound ``1e-3`` relative for the
  loss, ``1e-2`` of the largest gradient: the kernels round ``d_dots`` to bf16 for the MMAs,
  ``2**-9`` a term), ms of the forward, the backward with atomic and with deterministic dk
  (deterministic/atomic, target <= 1.25) and the torch op's forward + backward, host syncs of
  forward + backward (0), and the deterministic forward + backward captured in a CUDA graph
  (bitwise the eager gradients).

Shapes (H_I = 64, D_I = 128, top-512, compress ratio 4, one document, the last rank of an
all-gather plan): 8K tokens at cp 1 (T = 8,192, N_c = 2,048), 256K at cp 8 (T = 32,768,
N_c = 65,536), 1M at cp 8 (T = 131,072, N_c = 262,144: the issue's example). Exits 1 if a
check fails. Needs only torch (and the Triton it ships) and this checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cpkv.backends.reference.indexer import indexer_topk_op as ref_topk  # noqa: E402
from cpkv.backends.triton.indexer_ops import (  # noqa: E402
    fp8_rows,
    indexer_kl_backward,
    indexer_kl_forward,
    indexer_topk_launches,
)
from cpkv.plan.attention import plan_attention  # noqa: E402

FP8 = torch.float8_e4m3fn
HEADER = ["| shape | dtype | check / phase | value | bound or target | ok |", "|---|---|---|---|---|---|"]
TARGET_TFLOPS = {"fp8": 600.0, "bf16": 350.0}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One indexer call: ``tokens`` of one document at ``cp``, the last rank."""

    name: str
    tokens: int
    cp: int
    heads: int = 64
    dim: int = 128
    topk: int = 512


def _plan(shape: Shape, device: torch.device) -> tuple[Any, Any]:
    plan = plan_attention(torch.tensor([0, shape.tokens]), shape.cp, shape.cp - 1, compress_ratios=[4])
    visible = plan.segments.visible_for(4)
    visible = dataclasses.replace(visible, visible_start=visible.visible_start.to(device),
                                  visible_count=visible.visible_count.to(device))
    return plan.segments, visible


def _inputs(shape: Shape, num_q: int, num_c: int, device: torch.device, dtype: str) -> dict[str, Any]:
    """Kernel inputs and their fp32 dequantized values (the reference's inputs)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(num_q, shape.heads, shape.dim, device=device, generator=gen)
    k = torch.randn(num_c, shape.dim, device=device, generator=gen)
    w = torch.rand(num_q, shape.heads, device=device, generator=gen) * (shape.heads * shape.dim) ** -0.5
    if dtype == "fp8":
        q8, q_scale = fp8_rows(q)  # per (query, head): folded into the weights
        k8, k_scale = fp8_rows(k)
        return {"q": q8, "k": k8, "w": w * q_scale, "k_scale": k_scale,
                "ref": (q8.float() * q_scale[..., None], k8.float() * k_scale[:, None], w)}
    qb, kb = q.bfloat16(), k.bfloat16()
    return {"q": qb, "k": kb, "w": w, "k_scale": None, "ref": (qb.float(), kb.float(), w)}


def _call(x: dict[str, Any], start: torch.Tensor, count: torch.Tensor, topk: int, select: bool = True) -> tuple[Any, ...]:
    launches, indices, scores = indexer_topk_launches(x["q"], x["k"], x["w"], x["k_scale"], start, count, topk, select=select)
    for launch in launches:
        launch()
    return indices, scores


def sweep(shape: Shape, dtype: str, x: dict[str, Any], start: torch.Tensor, count: torch.Tensor, reps: int,
          device: torch.device) -> list[str]:
    """TFLOP/s of other tile configurations (block_t x block_n, warps): data for choosing the defaults."""
    flops = float(count.sum()) * shape.heads * shape.dim * 2
    rows = []
    configs = ((64, 128, 8), (64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 256, 8))
    for block_t, block_n, warps in configs if device.type == "cuda" else ((16, 32, 4),):
        launches, _, _ = indexer_topk_launches(x["q"], x["k"], x["w"], x["k_scale"], start, count, shape.topk,
                                               block_t=block_t, block_n=block_n)
        launches = [dataclasses.replace(launch, num_warps=warps) for launch in launches]

        def run(launches: list[Any] = launches) -> None:
            for launch in launches:
                launch()

        ms = _ms(run, reps, device)
        rows.append(f"| {shape.name} | {dtype} | tiles {block_t} x {block_n}, {warps} warps: TFLOP/s (ms) | "
                    f"{flops / ms / 1e9:.0f} ({ms:.2f}) | | |")
    return rows


def _ms(fn: Callable[[], Any], reps: int, device: torch.device) -> float:
    fn()
    if device.type != "cuda":
        return float("nan")
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def exactness(shape: Shape, dtype: str, x: dict[str, Any], start: torch.Tensor, count: torch.Tensor) -> tuple[list[str], bool]:
    """Kernel vs the reference op on the same (dequantized) inputs in fp32."""
    got_i, got_s = _call(x, start, count, shape.topk)
    q, k, w = x["ref"]
    want_i, want_s = ref_topk(q, k, w, start, start + count, shape.topk, 1024)
    sums = [s.nan_to_num(neginf=0.0).double().sum(1) for s in (got_s, want_s)]
    diff, bound = float((sums[0] - sums[1]).abs().max()), 1e-3 * float(sums[1].abs().max())
    picked = torch.where(got_i >= 0, got_i, 0)
    rescored = torch.einsum("thd,tkd->tkh", q, k[picked]).relu().mul(w[:, None, :]).sum(-1)  # dequantized: scales inside
    rescored = torch.where(got_i >= 0, rescored, float("-inf"))
    score_err = float((got_s - rescored).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).abs().max())
    score_bound = 1e-3 * float(rescored.nan_to_num(neginf=0.0).abs().max())
    same = float((got_i.sort(1).values == want_i.sort(1).values).all(1).float().mean())
    ok = diff <= bound and score_err <= score_bound
    return [
        f"| {shape.name} | {dtype} | selected score sums vs reference | {diff:.3e} | {bound:.3e} | {'ok' if diff <= bound else 'FAIL'} |",
        f"| {shape.name} | {dtype} | scores vs reference at the picked entries | {score_err:.3e} | {score_bound:.3e} "
        f"| {'ok' if score_err <= score_bound else 'FAIL'} |",
        f"| {shape.name} | {dtype} | identical index sets | {same:.1%} | | |",
    ], ok


def speed(shape: Shape, dtype: str, x: dict[str, Any], start: torch.Tensor, count: torch.Tensor, reps: int,
          device: torch.device) -> list[str]:
    flops = float(count.sum()) * shape.heads * shape.dim * 2
    full = _ms(lambda: _call(x, start, count, shape.topk), reps, device)
    scores_only = _ms(lambda: _call(x, start, count, shape.topk, select=False), reps, device)
    tflops = flops / full / 1e9
    share = 1.0 - scores_only / full
    target = TARGET_TFLOPS[dtype]
    return [
        f"| {shape.name} | {dtype} | scores + top-{shape.topk} ms | {full:.2f} | | |",
        f"| {shape.name} | {dtype} | TFLOP/s (counted pairs x H_I x D_I x 2 = {flops / 1e12:.1f} TFLOP) | {tflops:.0f} "
        f"| >= {target:.0f} | {'ok' if tflops >= target else 'below'} |",
        f"| {shape.name} | {dtype} | top-k share of the time (scores only {scores_only:.2f} ms) | {share:.1%} | <= 15% "
        f"| {'ok' if share <= 0.15 else 'above'} |",
    ]


def layer_call(shape: Shape, x: dict[str, Any], segments: Any, visible: Any, device: torch.device) -> tuple[list[str], bool]:
    """One ``CUDABackend.indexer_topk`` call: device kernels, host syncs, CUDA graph capture."""
    from cpkv.backends.cuda import CUDABackend

    backend = CUDABackend(triton_kernels=True)
    q, k, w = x["q"], x["k"], x["w"]

    def call() -> torch.Tensor:
        return backend.indexer_topk(q, k, w, segments, visible, topk=shape.topk)

    eager = call()
    if device.type != "cuda":
        return [f"| {shape.name} | bf16 | layer call (CPU interpreter: no profiler, sync or graph check) | ran | | ok |"], True
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    syncs, sync_note = _no_sync(call)
    graph, captured = _captured(call)
    same = torch.equal(captured, eager)
    replay = _ms(graph.replay, 3, device)
    ok = syncs == 0 and same
    return [
        f"| {shape.name} | bf16 | device kernels per layer call | {len(kernels)} ({', '.join(sorted(set(kernels)))[:80]}) | 1 | "
        f"{'ok' if len(kernels) == 1 else 'more'} |",
        f"| {shape.name} | bf16 | host syncs per layer call{sync_note} | {syncs} | 0 | {'ok' if syncs == 0 else 'FAIL'} |",
        f"| {shape.name} | bf16 | CUDA graph capture: replay equals eager (replay ms) | {same} ({replay:.2f}) | True "
        f"| {'ok' if same else 'FAIL'} |",
    ], ok


def _no_sync(fn: Callable[[], Any]) -> tuple[int, str]:
    """Run ``fn`` with CUDA host syncs made errors: ``(0, "")``, or ``(1, the error's first line)``."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return 0, ""
    except RuntimeError as exc:
        return 1, f" ({str(exc).splitlines()[0][:60]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _captured(fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``fn`` warmed up on a side stream, captured in a CUDA graph and replayed once: ``(graph, captured outputs)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, captured


def kl_loss(shape: Shape, x: dict[str, Any], start: torch.Tensor, count: torch.Tensor, reps: int,
            device: torch.device) -> tuple[list[str], bool]:
    """The KL loss's op bodies on the top-k's selection: exactness, times, host syncs, CUDA graph capture."""
    from cpkv.indexer_loss import indexer_kl_backward_op as ref_backward
    from cpkv.indexer_loss import indexer_kl_op as ref_kl

    selected, _ = _call(x, start, count, shape.topk)
    gen = torch.Generator(device=device).manual_seed(1)
    target = torch.rand(selected.shape, device=device, generator=gen) * (selected >= 0)
    target = target / target.sum(1, keepdim=True).clamp_min(1e-30)
    q, k, w = x["q"], x["k"], x["w"]
    factor = 1.0 / selected.shape[0]
    loss = indexer_kl_forward(q, k, w, selected, target)
    grads = indexer_kl_backward(q, k, w, selected, target, factor, False)
    det = indexer_kl_backward(q, k, w, selected, target, factor, True)
    q32, k32, w32 = x["ref"]
    want_loss = ref_kl(q32, k32, w32, selected, target, factor)[0]
    want = ref_backward(q32, k32, w32, selected, target, factor)
    loss_err = abs(float(loss) - float(want_loss)) / max(abs(float(want_loss)), 1e-30)
    grad_err = max(max(float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(got, want))
                   for got in (grads, det))
    rows = [
        f"| {shape.name} | bf16 | KL loss vs the torch op (relative) | {loss_err:.2e} | 1e-3 | {'ok' if loss_err <= 1e-3 else 'FAIL'} |",
        f"| {shape.name} | bf16 | KL gradients vs the torch op (of the largest; atomic and deterministic) | {grad_err:.2e} "
        f"| 1e-2 | {'ok' if grad_err <= 1e-2 else 'FAIL'} |",
    ]
    ok = loss_err <= 1e-3 and grad_err <= 1e-2
    if device.type != "cuda":
        return rows, ok
    fwd = _ms(lambda: indexer_kl_forward(q, k, w, selected, target), reps, device)
    bwd = _ms(lambda: indexer_kl_backward(q, k, w, selected, target, factor, False), reps, device)
    bwd_det = _ms(lambda: indexer_kl_backward(q, k, w, selected, target, factor, True), reps, device)
    torch_ms = _ms(lambda: (ref_kl(q, k, w, selected, target, factor), ref_backward(q, k, w, selected, target, factor)),
                   reps, device)
    syncs, note = _no_sync(lambda: (indexer_kl_forward(q, k, w, selected, target),
                                    indexer_kl_backward(q, k, w, selected, target, factor, True)))

    def step() -> tuple[torch.Tensor, ...]:
        return (indexer_kl_forward(q, k, w, selected, target), *indexer_kl_backward(q, k, w, selected, target, factor, True))

    _graph, captured = _captured(step)
    same = all(torch.equal(c, e) for c, e in zip(captured, (loss, *det)))
    ratio = bwd_det / bwd
    ok &= syncs == 0 and same
    return rows + [
        f"| {shape.name} | bf16 | KL forward / backward atomic / deterministic ms | {fwd:.2f} / {bwd:.2f} / {bwd_det:.2f} | | |",
        f"| {shape.name} | bf16 | KL deterministic / atomic backward | {ratio:.2f} | <= 1.25 | {'ok' if ratio <= 1.25 else 'above'} |",
        f"| {shape.name} | bf16 | KL forward + backward vs the torch op ({torch_ms:.2f} ms) | {torch_ms / (fwd + bwd):.1f}x | | |",
        f"| {shape.name} | bf16 | KL host syncs (forward + backward){note} | {syncs} | 0 | {'ok' if syncs == 0 else 'FAIL'} |",
        f"| {shape.name} | bf16 | KL CUDA graph: replay equals eager (deterministic) | {same} | True | {'ok' if same else 'FAIL'} |",
    ], ok


def main(argv: list[str] | None = None) -> int:
    """Run every check and timing; print the table; 0 if every check passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
    parser.add_argument("--no-long", action="store_true", help="skip the 1M-token cp 8 shape")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations (256K shape)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:
        from interpreter_patch import patch_interpreter  # benchmarks/: the interpreter's bf16 as on a GPU

        patch_interpreter()
        shapes = [Shape("smoke 256 cp 2", 256, 2, heads=2, dim=16, topk=4)]
        dtypes = ["fp8", "bf16"]
    else:
        shapes = [Shape("8K cp 1", 8192, 1), Shape("256K cp 8", 262144, 8)]
        shapes += [] if args.no_long else [Shape("1M cp 8", 1 << 20, 8)]
        dtypes = ["fp8", "bf16"]
    rows, ok = list(HEADER), True
    for i, shape in enumerate(shapes):
        segments, visible = _plan(shape, device)
        start, count = visible.visible_start, visible.visible_count
        for dtype in dtypes:
            x = _inputs(shape, start.numel(), visible.num_entries, device, dtype)
            if i == 0:
                got, passed = exactness(shape, dtype, x, start, count)
                rows += got
                ok &= passed
            rows += speed(shape, dtype, x, start, count, args.reps, device)
            if args.sweep and (i == 1 or args.smoke):
                rows += sweep(shape, dtype, x, start, count, args.reps, device)
            if dtype == "bf16" and i == 0:
                got, passed = layer_call(shape, x, segments, visible, device)
                rows += got
                ok &= passed
            if dtype == "bf16" and i < 2:
                got, passed = kl_loss(shape, x, start, count, args.reps, device)
                rows += got
                ok &= passed
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print("\n".join(rows[-1:]), file=sys.stderr, flush=True)
    print(f"indexer check: {'PASS' if ok else 'FAIL'}\n")
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
