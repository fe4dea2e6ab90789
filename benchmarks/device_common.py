"""Shared pieces of the device check scripts (gpu_check.py, npu_check.py).

Run the V4-style layer on one rank through a backend, and compare a low-precision run
against float64 with the same bound as the test suite: ``err <= 2 * err_reference_bf16 +
2**-8 * max|fp64|`` (both low-precision runs round the same inputs and weights and differ in
accumulation order and in a few extra roundings of the kernel path).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from cpkv.collectives import Group  # noqa: E402
from cpkv.plan.attention import plan_attention  # noqa: E402
from cpkv.plan.conventions import seqlens_to_cu_seqlens  # noqa: E402
from cpkv.v4 import V4Attention, V4Config  # noqa: E402

LENGTHS = [700, 0, 1500, 37, 3, 900, 1, 955]  # 4096 tokens: zero-length, tiny and multi-window documents
SHOWN = ("out", "grad x", "grad wq.weight", "grad sinks")


def run_layer(config: V4Config, dtype: torch.dtype, backend: Any, device: torch.device,
              group: Group = None) -> dict[str, torch.Tensor]:
    """Output, input gradient and parameter gradients (on the CPU) of the layer run on one rank of ``group``.

    ``group`` (default: the default group) must have one rank and a backend that serves
    ``device`` (its all-gather carries the kv and hidden states).
    """
    cu = seqlens_to_cu_seqlens(LENGTHS, device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(int(cu[-1]), config.hidden, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_(True)
    grad_out = torch.randn(int(cu[-1]), config.hidden, generator=gen, dtype=torch.float64).to(device, dtype)
    layer = V4Attention(config, seed=1).to(device, dtype)
    plan = plan_attention(cu, 1, 0, compress_ratios=[config.compress_ratio] if config.mode.compresses else [])
    result = layer(x, plan, group, backend=backend)
    torch.autograd.backward(result.out, grad_out)
    grads = {f"grad {n}": p.grad.cpu() for n, p in layer.named_parameters() if p.grad is not None}
    grad_x = x.grad.cpu() if x.grad is not None else torch.zeros(0)
    return {"out": result.out.detach().cpu(), "grad x": grad_x, **grads}


def compare(name: str, exact: dict[str, torch.Tensor], low: dict[str, torch.Tensor],
            got: dict[str, torch.Tensor]) -> tuple[list[str], bool]:
    """Markdown rows and the verdict of ``got`` (device bf16) against ``exact`` (fp64), bounded by ``low``."""
    rows, ok = [], True
    for key, ref in exact.items():
        err = float((got[key].double() - ref.double()).abs().max())
        ref_err = float((low[key].double() - ref.double()).abs().max())
        bound = 2 * ref_err + 2**-8 * float(ref.abs().max())
        passed = err <= bound
        ok &= passed
        if key in SHOWN or not passed:
            rows.append(f"| {name} | {key} | {err:.3e} | {ref_err:.3e} | {bound:.3e} | {'ok' if passed else 'FAIL'} |")
    return rows, ok


def visible_pairs(num_q: int, num_kv: int, window: int | None) -> int:
    """Sum over queries of visible keys (bottom-right causal, optional window)."""
    counts = torch.arange(num_kv - num_q + 1, num_kv + 1, dtype=torch.float64)
    return int((counts if window is None else counts.clamp(max=window)).sum())


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    """Median wall milliseconds of ``fn()`` over ``reps`` calls on CUDA (one warm-up call; synchronised)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def attention_timers(q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor, x: dict[str, Any]
                     ) -> tuple[Callable[[Callable[..., Any]], Callable[[], Any]], Callable[[Callable[..., Any]], Callable[[], Any]]]:
    """``(fwd, fwd_bwd)``: for an op ``fn(q, kv, sinks, idx) -> (out, ...)``, a no-grad forward call and a
    forward + backward call (``x["d_out"]`` into out) on the given leaves and ``x["idx"]``, for :func:`median_ms`."""

    def fwd(fn: Callable[..., Any]) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return fn(q, kv, sinks, x["idx"])
        return run

    def fwd_bwd(fn: Callable[..., Any]) -> Callable[[], Any]:
        return lambda: torch.autograd.backward(fn(q, kv, sinks, x["idx"])[0], x["d_out"])

    return fwd, fwd_bwd
