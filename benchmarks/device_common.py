"""Shared pieces of the device check scripts (gpu_check.py, npu_check.py) and of the bf16 interpreter tests.

Run the V4-style layer on one rank through a backend, and compare a low-precision run
against float64 with the same bound as the test suite (:func:`rule_check`, the 2x rule):
``err <= 2 * err_reference_bf16 + 2**-8 * max|fp64|`` (both low-precision runs round the same
inputs and weights and differ in accumulation order and in a few extra roundings of the
kernel path).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

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


class RuleCheck(NamedTuple):
    """One tensor against the 2x rule: ``ok`` when ``err <= bound = 2 * ref_err + 2**-8 * max|fp64|``."""

    err: float
    ref_err: float
    bound: float

    @property
    def ok(self) -> bool:
        """Whether the error is within the bound."""
        return self.err <= self.bound


def rule_check(got: torch.Tensor, exact: torch.Tensor, low: torch.Tensor) -> RuleCheck:
    """``got`` (a kernel in low precision) against ``exact`` (fp64), bounded by ``low`` (the reference in that precision).

    ``err = max|got - exact|``, ``ref_err = max|low - exact|``, floor ``2**-8 * max|exact|`` (one
    bf16 ulp of the largest value). Entries where ``exact`` is not finite (an LSE of ``-inf``)
    are left out; ``got`` must equal it there (else ``err`` is ``inf``).
    """
    exact = exact.double()
    finite = torch.isfinite(exact)
    got, low = got.double(), low.double()
    if not torch.equal(got[~finite], exact[~finite]):
        return RuleCheck(float("inf"), 0.0, 0.0)
    err = float((got - exact)[finite].abs().max()) if finite.any() else 0.0
    ref_err = float((low - exact)[finite].abs().max()) if finite.any() else 0.0
    scale = float(exact[finite].abs().max()) if finite.any() else 0.0
    return RuleCheck(err, ref_err, 2 * ref_err + 2**-8 * scale)


def compare(name: str, exact: dict[str, torch.Tensor], low: dict[str, torch.Tensor],
            got: dict[str, torch.Tensor]) -> tuple[list[str], bool]:
    """Markdown rows and the verdict of ``got`` (device bf16) against ``exact`` (fp64), bounded by ``low``."""
    rows, ok = [], True
    for key, ref in exact.items():
        check = rule_check(got[key], ref, low[key])
        ok &= check.ok
        if key in SHOWN or not check.ok:
            rows.append(f"| {name} | {key} | {check.err:.3e} | {check.ref_err:.3e} | {check.bound:.3e} "
                        f"| {'ok' if check.ok else 'FAIL'} |")
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
