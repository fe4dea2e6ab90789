#!/usr/bin/env python
"""NPU check of cpkv's Ascend backend: correctness against the reference, then speed against a bare kernel.

For an Ascend machine with torch, torch_npu and CANN installed (cpkv need not be
installed: the repository root is put on ``sys.path``; no network). One NPU.

0. First, when CANN's custom ops import: the points docs/backends.md reads in the fused
   kernels' sources ("NPU fused path: the kernels read", issue 46;
   ``benchmarks/npu_kernel_reads.py``): the indexer KL op on cpkv's ``mask_mode=3`` batches
   against the composed KL (and cpkv's former ``mask_mode=0`` call, expected to differ), the
   CSA kernel at ``K = 1024`` and ``2048`` with 16 heads, the grad under deterministic
   algorithms (and the KL op under them), the grad with ``metadata=None``, ``-inf`` sinks.
   A property cpkv relies on failing fails the run; a reading refuted is reported.
1. Correctness, single rank (an in-process 1-rank HCCL group): the V4-style layer in every
   compress mode, forward and backward, bf16 through ``NPUBackend()`` and through the
   reference backend on the NPU, both against an fp64 reference run on the CPU. Pass:
   ``err_npu <= 2 * err_reference_bf16 + 2**-8 * max|fp64|`` for the output, the input
   gradient and every parameter gradient, and no fallback warning. Shapes follow the
   kernels' documented limits: NO_COMPRESS modes use head dim 128 (npu_fusion_attention
   takes D <= 512); compressed modes use 512 value + 64 rope channels
   (npu_sparse_flash_attention's fixed MLA-absorb dims) and indexer head dim 128.
2. Speed: varlen attention as ``attention_forward`` calls it (``backend.varlen_attention``) against a bare
   ``npu_fusion_attention`` call on the same shapes (MQA shared kv, ``L`` local queries over
   a prefix of ``L * (r + 1)`` keys, D = 128, bf16, window None and 128), forward and
   forward+backward, with TFLOP/s over visible pairs (forward ``4 * D * H * pairs``,
   backward 2.5x).

3. The fused path (``NPUBackend(fused=True)``, CANN's ``cann_ops_transformer`` custom ops, when
   they import; skipped otherwise): correctness of the V4 layer in CSA (ratio 4, indexer topk
   512, its KL through ``sparse_lightning_indexer_kl_loss_grad``) and HCA (ratio 128) at the
   ops' A2/A3 shapes (D = 448 value + 64 rope = 512, window 128, indexer 8 heads of 128),
   bf16 against fp64 by the same rule, no fallback warning; then one compressed layer's
   attention (``compressed_attention``: ``sparse_flash_mla`` + its grad) timed beside the
   composed path (``npu_sparse_flash_attention``) and the reference on the NPU, forward and
   forward+backward, on the same inputs (a composed-path kernel error is reported as such).

This is the only place cpkv's NPU marshalling meets the hardware: the unit tests check it
against the documented semantics with a stand-in module. Prints markdown; writes
``$OUT/npu_check.md`` when ``OUT`` is set. Exit status 1 on a correctness failure, 2
without torch_npu or an NPU.

    python benchmarks/npu_check.py [--quick] [--skip-bench] [--max-seconds 600]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from cpkv.plan.attention import plan_attention  # noqa: E402
from cpkv.backends import ReferenceBackend  # noqa: E402
from cpkv.backends.base import CompressedLayer  # noqa: E402
from cpkv.backends.npu import MASK_SIZE, NPUBackend  # noqa: E402
from cpkv.collectives import Group  # noqa: E402
from cpkv.v4 import V4Config  # noqa: E402
from device_common import compare, run_layer, visible_pairs  # noqa: E402
from npu_kernel_reads import kernel_read_checks  # noqa: E402

_SMALL = {"hidden": 512, "heads": 8, "head_dim": 128, "rope_dim": 64, "window": 128}
_MLA = {"hidden": 512, "heads": 16, "head_dim": 576, "rope_dim": 64, "window": 128, "index_heads": 8, "index_head_dim": 128}
CASES = {
    "window": V4Config(**_SMALL),  # type: ignore[arg-type]
    "dense": V4Config(**{**_SMALL, "window": None}),  # type: ignore[arg-type]
    "compressor": V4Config(**_MLA, compress_ratio=8),  # type: ignore[arg-type]
    "indexer": V4Config(**_MLA, compress_ratio=4, topk=64),  # type: ignore[arg-type]
}
_FUSED = {"hidden": 512, "heads": 16, "head_dim": 512, "rope_dim": 64, "window": 128, "index_heads": 8, "index_head_dim": 128}
FUSED_CASES = {
    "HCA fused": V4Config(**_FUSED, compress_ratio=128),  # type: ignore[arg-type]
    "CSA fused": V4Config(**_FUSED, compress_ratio=4, topk=512),  # type: ignore[arg-type]
}
FUSED_BENCH = [(8192, 3, 64, 4), (8192, 3, 64, 128), (16384, 1, 128, 4), (16384, 1, 128, 128)]  # L, r, H, ratio
BENCH = [(8192, 3, 16, None), (8192, 3, 16, 128), (16384, 1, 32, None), (16384, 1, 32, 128),
         (32768, 1, 32, None), (32768, 1, 32, 128), (65536, 1, 32, None), (65536, 1, 64, 128)]


def check_mode(name: str, config: V4Config, device: torch.device, cpu_group: Group,
               backend: Callable[[], NPUBackend] = NPUBackend) -> tuple[list[str], bool]:
    exact = run_layer(config, torch.float64, ReferenceBackend(), torch.device("cpu"), cpu_group)  # hccl gathers no CPU tensors
    low = run_layer(config, torch.bfloat16, ReferenceBackend(), device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_layer(config, torch.bfloat16, backend(), device)
    rows, ok = [], True
    for message in (str(w.message) for w in caught if "falling back" in str(w.message)):
        rows.append(f"| {name} | fallback | {message} | | | FAIL |")
        ok = False
    mode_rows, mode_ok = compare(name, exact, low, got)
    return rows + mode_rows, ok and mode_ok


def check_correctness(device: torch.device, cpu_group: Group, fused: bool) -> tuple[list[str], bool]:
    """Every mode through the composed path; with ``fused``, CSA and HCA through the fused path too."""
    rows, ok = ["| mode | tensor | err npu bf16 | err reference bf16 | bound | ok |", "|---|---|---|---|---|---|"], True
    cases = [(n, c, lambda: NPUBackend(fused=False)) for n, c in CASES.items()]
    cases += [(n, c, lambda: NPUBackend(fused=True)) for n, c in FUSED_CASES.items()] if fused else []
    for name, config, backend in cases:
        print(f"correctness: {name} ...", flush=True)
        try:
            mode_rows, mode_ok = check_mode(name, config, device, cpu_group, backend)
        except Exception as err:  # report every mode, do not stop at the first kernel error
            traceback.print_exc()
            mode_rows, mode_ok = [f"| {name} | raised | {type(err).__name__}: {str(err)[:200]} | | | FAIL |"], False
        rows += mode_rows
        ok &= mode_ok
    return rows, ok


def npu_time(fn: Callable[[], Any], reps: int) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after one warm-up (device synchronised)."""
    fn()
    times = []
    for _ in range(reps):
        torch.npu.synchronize()  # type: ignore[attr-defined]
        start = time.perf_counter()
        fn()
        torch.npu.synchronize()  # type: ignore[attr-defined]
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def bench_one(torch_npu: Any, local: int, rank: int, heads: int, window: int | None, reps: int, device: torch.device) -> str:
    dim, prefix = 128, local * (rank + 1)
    # rank r of r + 1 ranks of one document: the segments attention_forward gives the kernel (all-gather exchange)
    segments = plan_attention(torch.tensor([0, prefix], device=device), rank + 1, rank).segments
    q = torch.randn(local, heads, dim, dtype=torch.bfloat16).to(device).requires_grad_(True)
    kv = torch.randn(prefix, dim, dtype=torch.bfloat16).to(device).requires_grad_(True)
    grad = torch.randn(local, heads, dim, dtype=torch.bfloat16).to(device)
    mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu(1)
    backend = NPUBackend(torch_npu)
    mode = (3, 2147483647, 0) if window is None else (4, window - 1, 0)

    def bare() -> torch.Tensor:
        k = kv[:, None]
        out: torch.Tensor = torch_npu.npu_fusion_attention(
            q, k, k, heads, input_layout="TND", atten_mask=mask, scale=dim**-0.5, pre_tockens=mode[1], next_tockens=mode[2],
            actual_seq_qlen=[local], actual_seq_kvlen=[prefix], sparse_mode=mode[0], softmax_layout="TND")[0]
        return out

    def cpkv() -> torch.Tensor:
        out: torch.Tensor = backend.varlen_attention(
            q, kv[:, None], kv[:, None], segments, scale=dim**-0.5, window=window, sinks=None
        ).out
        return out

    def fwd(fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return fn()
        return run

    def fwd_bwd(fn: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        return lambda: torch.autograd.backward(fn(), grad)

    flops = 4.0 * dim * heads * visible_pairs(local, prefix, window)
    cells = []
    for phase, wrap, factor in (("fwd", fwd, 1.0), ("fwd+bwd", fwd_bwd, 3.5)):
        t_bare, t_cpkv = npu_time(wrap(bare), reps), npu_time(wrap(cpkv), reps)
        cells.append(f"{t_bare:.2f} | {t_cpkv / t_bare:.2f}x | {factor * flops / t_bare / 1e9:.0f} / {factor * flops / t_cpkv / 1e9:.0f}")
    return f"| {local // 1024}K | {prefix // 1024}K | {heads} | {window or '-'} | " + " | ".join(cells) + " |"


def bench_fused(local: int, rank: int, heads: int, ratio: int, reps: int, device: torch.device) -> str:
    """One compressed layer's attention (rank ``rank`` of ``rank + 1`` over one document, all-gather):
    fused vs composed vs the reference on the NPU, bf16, D = 512 (448 value + 64 rope), window 128."""
    dim, d_v, window, topk, prefix = 512, 448, 128, 512, local * (rank + 1)
    plan = plan_attention(torch.tensor([0, prefix]), rank + 1, rank, compress_ratios=[ratio]).to(device)
    segments, visible = plan.segments, plan.visible_for(ratio)
    gen = torch.Generator().manual_seed(0)
    selected = None
    cmp_rows = visible.visible_indices()
    if ratio == 4:  # CSA: the first topk visible entries (the selection's content does not change the cost)
        cmp_rows = selected = torch.nn.functional.pad(cmp_rows, (0, max(topk - cmp_rows.shape[1], 0)), value=-1)[:, :topk]
    layer = CompressedLayer(segments, segments, visible, window, segments.num_kv, selected)
    indices = torch.cat([segments.window_indices(window), torch.where(cmp_rows >= 0, cmp_rows + segments.num_kv, -1)], 1)
    q = torch.randn(local, heads, dim, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
    kv = torch.randn(segments.num_kv + visible.num_entries, dim, generator=gen).to(device, torch.bfloat16).requires_grad_(True)
    sinks = torch.randn(heads, generator=gen).to(device).requires_grad_(True)
    grad = torch.randn(local, heads, d_v, generator=gen).to(device, torch.bfloat16)
    backends: dict[str, NPUBackend | ReferenceBackend] = {
        "fused": NPUBackend(fused=True), "composed": NPUBackend(fused=False), "reference": ReferenceBackend(),
    }

    def call(name: str) -> torch.Tensor:
        backend = backends[name]
        if isinstance(backend, NPUBackend):
            out: torch.Tensor = backend.compressed_attention(
                q, kv, indices, layer, d_v=d_v, scale=dim**-0.5, sinks=sinks, probs_from=None).result.out
            return out
        return backend.sparse_attention(q, kv, indices, d_v=d_v, scale=dim**-0.5, sinks=sinks).out

    cells = []
    for name in backends:
        for phase in ("fwd", "fwd+bwd"):
            def run(name: str = name, phase: str = phase) -> Any:
                if phase == "fwd":
                    with torch.no_grad():
                        return call(name)
                return torch.autograd.backward(call(name), grad)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    cells.append(f"{npu_time(run, reps):.2f}")
            except Exception as err:  # a kernel outside its limits: report, keep going
                cells.append(f"error: {type(err).__name__}")
    kind = "CSA" if ratio == 4 else "HCA"
    return f"| {kind} | {local // 1024}K | {prefix // 1024}K | {heads} | " + " | ".join(cells) + " |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two smallest benchmark shapes, 2 repetitions")
    parser.add_argument("--skip-bench", action="store_true", help="correctness only")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="skip the remaining benchmark shapes after this")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (median)")
    args = parser.parse_args()
    try:
        torch_npu = importlib.import_module("torch_npu")
    except Exception as err:  # ImportError, or CANN errors while loading
        print(f"npu_check: torch_npu is not usable here ({err!r}); run it on an Ascend machine with CANN", file=sys.stderr)
        return 2
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        print("npu_check: no NPU device", file=sys.stderr)
        return 2
    started, device = time.monotonic(), torch.device("npu", 0)
    torch.npu.set_device(device)  # type: ignore[attr-defined]
    bench = ["| L | prefix | H | W | bare fwd ms | cpkv/bare fwd | TFLOP/s bare/cpkv fwd | bare fwd+bwd ms "
             "| cpkv/bare fwd+bwd | TFLOP/s bare/cpkv fwd+bwd |", "|---" * 10 + "|"]
    fused_bench = ["| layer | L | prefix | H | fused fwd ms | fused fwd+bwd ms | composed fwd ms | composed fwd+bwd ms "
                   "| reference fwd ms | reference fwd+bwd ms |", "|---" * 10 + "|"]
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)  # type: ignore[attr-defined]
        dist.init_process_group("hccl", store=store, rank=0, world_size=1)
        try:
            fused = NPUBackend().attention_path == "fused"  # cann_ops_transformer imports
            reads, reads_ok = (kernel_read_checks(importlib.import_module("cann_ops_transformer.ops"), device) if fused
                               else (["skipped: cann_ops_transformer does not import"], True))
            print(f"kernel reads: {'PASS' if reads_ok else 'FAIL'} ({time.monotonic() - started:.0f} s)", flush=True)
            rows, ok = check_correctness(device, dist.new_group([0], backend="gloo"), fused)
            ok &= reads_ok
            print(f"correctness: {'PASS' if ok else 'FAIL'} ({time.monotonic() - started:.0f} s)", flush=True)
            for local, rank, heads, window in [] if args.skip_bench else BENCH[:2] if args.quick else BENCH:
                if time.monotonic() - started > args.max_seconds:
                    bench.append(f"| {local // 1024}K | skipped (time budget) ||||||||")
                    continue
                bench.append(bench_one(torch_npu, local, rank, heads, window, 2 if args.quick else args.reps, device))
                print(bench[-1], flush=True)
            for local, rank, heads, ratio in [] if args.skip_bench or not fused else FUSED_BENCH[:2] if args.quick else FUSED_BENCH:
                if time.monotonic() - started > args.max_seconds:
                    fused_bench.append(f"| {local // 1024}K | skipped (time budget) |||||||||")
                    continue
                fused_bench.append(bench_fused(local, rank, heads, ratio, 2 if args.quick else args.reps, device))
                print(fused_bench[-1], flush=True)
        finally:
            dist.destroy_process_group()
    name = torch.npu.get_device_name(0)  # type: ignore[attr-defined]
    header = f"# cpkv npu_check\n\n{datetime.date.today()} on {name}, torch {torch.__version__}, torch_npu {torch_npu.__version__}\n"
    text = "\n".join([header, f"## The fused kernels as read (docs/backends.md, issue 46): {'PASS' if reads_ok else 'FAIL'}\n",
                      *reads, f"\n## Correctness (bf16 vs fp64): {'PASS' if ok else 'FAIL'}\n", *rows,
                      "\n## Varlen attention as attention_forward calls it vs bare npu_fusion_attention (bf16, D=128, MQA)\n", *bench,
                      "\n## One compressed layer's attention: fused sparse_flash_mla vs composed vs reference (bf16, D=512, W=128)\n",
                      *(fused_bench if fused else ["skipped: cann_ops_transformer does not import (composed path only)"]), ""])
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "npu_check.md").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
