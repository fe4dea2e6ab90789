#!/usr/bin/env python
"""GPU check of cpkv's CUDA backend: correctness against the reference, then speed against a bare kernel.

Runs on a bare CUDA machine with only torch installed (cpkv need not be installed: the
repository root is put on ``sys.path``; no network). One GPU, about 5 minutes at most.

1. Correctness, single rank (an in-process 1-rank NCCL group): the V4-style layer in every
   compress mode (NO_COMPRESS with a window and dense, COMPRESSOR_ONLY ratio 8, INDEXER
   ratio 4), forward and backward, bf16 through ``backend=CUDABackend()`` and through the
   reference backend, both against an fp64 reference run. Pass: for the output, the input
   gradient and every parameter gradient, ``err_cuda <= 2 * err_reference_bf16 + floor``
   with ``floor = 2**-8 * max|fp64|`` (one bf16 ulp of the largest value: both bf16 runs
   round the same inputs and weights and differ in accumulation order and in a few extra
   roundings of the kernel path). Any fallback warning in NO_COMPRESS modes fails too.
2. Speed: varlen attention as ``attention_forward`` calls it (``backend.varlen_attention``) (MQA shared kv, bottom-right
   causal prefix: ``L`` local queries over a prefix of ``L * (r + 1)`` keys, rank ``r`` of
   one long document; D = 128, bf16, window None and 128) against a bare ``varlen_attn``
   call on the same shapes; forward and forward+backward; cpkv with and without sinks
   (sinks cost one extra kernel forward and backward in backward: the kernel drops the
   LSE's gradient, see cpkv/backends/cuda.py). TFLOP/s count only visible (causal/window)
   pairs: forward ``4 * D * H * pairs``, backward 2.5x that.

3. DeepSeek-V4-Flash (benchmarks/v4_flash_section.py): cpkv's Triton sparse kernels at
   H=64, D=512, d_v=512, K=640 (128 window + 512 selected), sinks, bf16, 8K and 32K
   queries: correctness against the reference ops (same 2x rule), deterministic dkv
   bitwise, forward/backward ms and TFLOP/s over the gathered rows, speed-up over the
   reference ops, the indexer top-k time.
4. The V4 sparse grid (benchmarks/v4_sparse_section.py): H 64 (V4-Flash) and 128 (V4-Pro),
   K 640 and 2048, T 8K and 32K: bf16 correctness (atomic and deterministic dkv) against
   fp64 by the same 2x rule, deterministic bitwise, forward and backward (atomic and
   deterministic) ms and counted TFLOP/s, deterministic/atomic, fwd+bwd against the
   reference ops at 8K. ``--v4-flash-only`` runs sections 3 and 4 only.

Triton's launcher compiles a small C module at the first kernel call: the script checks for
a C compiler (``cc``/``gcc``/``clang`` on PATH, or ``$CC``) first and exits 2 without one.

Prints markdown tables; writes them to ``$OUT/gpu_check.md`` when ``OUT`` is set. Exits 1 on
a correctness failure, 2 without a GPU.

    python benchmarks/gpu_check.py [--quick] [--max-seconds 270] [--v4-flash-only]
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cpkv.plan.attention import plan_attention  # noqa: E402
from cpkv.backends import ReferenceBackend  # noqa: E402
from cpkv.backends.cuda import CUDABackend  # noqa: E402
from cpkv.v4 import V4Config  # noqa: E402
from device_common import compare, run_layer, visible_pairs  # noqa: E402
import v4_flash_section  # noqa: E402
import v4_sparse_section  # noqa: E402

CASES = {
    "window": V4Config(hidden=256, heads=8, head_dim=128, rope_dim=32, window=64),
    "dense": V4Config(hidden=256, heads=8, head_dim=128, rope_dim=32, window=None),
    "compressor": V4Config(hidden=256, heads=8, head_dim=128, rope_dim=32, window=64, compress_ratio=8, index_head_dim=64),
    "indexer": V4Config(hidden=256, heads=8, head_dim=128, rope_dim=32, window=64, compress_ratio=4, topk=32, index_head_dim=64),
}
BENCH = [  # (local tokens L, rank r: prefix L * (r + 1), heads, window)
    (8192, 3, 16, None), (8192, 3, 16, 128), (16384, 1, 32, None), (16384, 1, 32, 128),
    (32768, 1, 32, None), (32768, 1, 32, 128), (65536, 1, 32, None), (65536, 1, 64, 128),
]


def check_correctness(device: torch.device) -> tuple[list[str], bool]:
    rows, ok = ["| mode | tensor | err cuda bf16 | err reference bf16 | bound | ok |", "|---|---|---|---|---|---|"], True
    for name, config in CASES.items():
        exact = run_layer(config, torch.float64, ReferenceBackend(), device)
        low = run_layer(config, torch.bfloat16, ReferenceBackend(), device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run_layer(config, torch.bfloat16, CUDABackend(), device)
        fallbacks = [str(w.message) for w in caught if "falling back" in str(w.message)]
        if fallbacks and not config.mode.compresses:
            rows.append(f"| {name} | (fallback) | {fallbacks[0]} | | | FAIL |")
            ok = False
        mode_rows, mode_ok = compare(name, exact, low, got)
        rows += mode_rows
        ok &= mode_ok
    return rows, ok


def cuda_time(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


def bench_one(local: int, rank: int, heads: int, window: int | None, reps: int, device: torch.device) -> str:
    from torch.nn.attention.varlen import varlen_attn

    dim, prefix = 128, local * (rank + 1)
    # rank r of r + 1 ranks of one document: the segments attention_forward gives the kernel (all-gather exchange)
    segments = plan_attention(torch.tensor([0, prefix], device=device), rank + 1, rank).segments
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(local, heads, dim, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    kv = torch.randn(prefix, dim, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    sinks = torch.randn(heads, device=device, generator=gen).requires_grad_(True)
    grad = torch.randn(local, heads, dim, device=device, dtype=torch.bfloat16, generator=gen)
    cu_q, cu_k = segments.cu_seqlens_q, segments.cu_seqlens_kv
    backend = CUDABackend()
    window_size = (-1, 0) if window is None else (window - 1, 0)

    gqa = "enable_gqa" in inspect.signature(varlen_attn).parameters  # torch >= 2.12; else expand the kv head

    def bare() -> torch.Tensor:
        k = kv[:, None] if gqa else kv[:, None].expand(-1, heads, -1)
        extra = {"enable_gqa": True} if gqa else {}
        out = varlen_attn(q, k, k, cu_q, cu_k, local, prefix, scale=dim**-0.5, window_size=window_size, **extra)
        assert isinstance(out, torch.Tensor)
        return out

    def cpkv(with_sinks: bool) -> Callable[[], torch.Tensor]:
        return lambda: backend.varlen_attention(
            q, kv[:, None], kv[:, None], segments, scale=dim**-0.5, window=window, sinks=sinks if with_sinks else None
        ).out

    def fwd(fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return fn()
        return run

    def fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        return lambda: torch.autograd.backward(fn(), grad)

    flops = 4.0 * dim * heads * visible_pairs(local, prefix, window)
    t: dict[str, float] = {}
    for phase, wrap in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        for name, fn in (("bare", bare), ("cpkv", cpkv(False)), ("sinks", cpkv(True))):
            t[f"{name} {phase}"] = cuda_time(wrap(fn), reps)
    tflops = {key: (flops if key.endswith(" fwd") else 3.5 * flops) / (ms * 1e-3) / 1e12 for key, ms in t.items()}
    return (f"| {local // 1024}K | {prefix // 1024}K | {heads} | {window or '-'} "
            + "".join(f"| {t[f'bare {p}']:.2f} | {t[f'cpkv {p}'] / t[f'bare {p}']:.2f}x | {t[f'sinks {p}'] / t[f'bare {p}']:.2f}x "
                      f"| {tflops[f'bare {p}']:.0f} / {tflops[f'cpkv {p}']:.0f} " for p in ("fwd", "fwd_bwd")) + "|")


def c_compiler() -> str | None:
    """The C compiler Triton's launcher would use (``$CC``, else cc/gcc/clang on PATH), or None."""
    import shutil

    if os.environ.get("CC"):
        return shutil.which(os.environ["CC"])
    return next((path for path in map(shutil.which, ("cc", "gcc", "clang")) if path), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two smallest benchmark shapes, 2 repetitions")
    parser.add_argument("--max-seconds", type=float, default=270.0, help="skip the remaining benchmark shapes after this")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (median)")
    parser.add_argument("--v4-flash-only", action="store_true", help="only the DeepSeek-V4-Flash Triton section")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    if c_compiler() is None:
        print("gpu_check: no C compiler (cc, gcc or clang on PATH, or $CC): Triton's launcher needs one", file=sys.stderr)
        return 2
    started, device = time.monotonic(), torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)  # type: ignore[attr-defined]
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
        try:
            rows, ok, bench = [], True, []
            if not args.v4_flash_only:
                rows, ok, bench = run_varlen_sections(args, started, device)
            flash_rows, flash_ok = v4_flash_section.check(device)
            print(f"V4-Flash correctness: {'PASS' if flash_ok else 'FAIL'} ({time.monotonic() - started:.0f} s)", flush=True)
            for num_q in (8192, 32768):
                flash_rows += v4_flash_section.bench(num_q, device, 2 if args.quick else args.reps, with_reference=True)
                print("\n".join(flash_rows[-5:]), flush=True)
            ok &= flash_ok
            grid_rows, grid_ok = v4_sparse_section.run(device, 2 if args.quick else args.reps)
            print(f"V4 sparse grid correctness: {'PASS' if grid_ok else 'FAIL'} ({time.monotonic() - started:.0f} s)", flush=True)
            ok &= grid_ok
        finally:
            dist.destroy_process_group()
    header = (f"# cpkv gpu_check\n\n{datetime.date.today()} on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
              f"{time.monotonic() - started:.0f} s\n")
    text = "\n".join([header, f"## Correctness (bf16 vs fp64): {'PASS' if ok else 'FAIL'}\n", *rows,
                      "\n## Varlen attention as attention_forward calls it vs bare varlen_attn (bf16, D=128, MQA)\n", *bench,
                      "\n## DeepSeek-V4-Flash sparse attention (Triton; H=64, D=d_v=512, K=640, sinks, bf16)\n",
                      *v4_flash_section.HEADER, *flash_rows, "", v4_flash_section.cudnn_note(), "",
                      "\n## V4 sparse attention grid (Triton; H 64/128, D=d_v=512, K 640/2048, sinks, bf16)\n",
                      *v4_sparse_section.HEADER, *grid_rows, ""])
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.md").write_text(text)
    return 0 if ok else 1


def run_varlen_sections(args: argparse.Namespace, started: float, device: torch.device) -> tuple[list[str], bool, list[str]]:
    """Sections 1 and 2: the layer's correctness through CUDABackend, and varlen speed against a bare kernel."""
    rows, ok = check_correctness(device)
    print(f"correctness: {'PASS' if ok else 'FAIL'} ({time.monotonic() - started:.0f} s)", flush=True)
    bench = ["| L | prefix | H | W | bare fwd ms | cpkv/bare fwd | +sinks/bare fwd | TFLOP/s bare/cpkv fwd "
             "| bare fwd+bwd ms | cpkv/bare fwd+bwd | +sinks/bare fwd+bwd | TFLOP/s bare/cpkv fwd+bwd |",
             "|---" * 12 + "|"]
    for local, rank, heads, window in BENCH[:2] if args.quick else BENCH:
        if time.monotonic() - started > args.max_seconds:
            bench.append(f"| {local // 1024}K | skipped (time budget) |||||||||||")
            continue
        bench.append(bench_one(local, rank, heads, window, 2 if args.quick else args.reps, device))
        print(bench[-1], flush=True)
    return rows, ok, bench


if __name__ == "__main__":
    sys.exit(main())
