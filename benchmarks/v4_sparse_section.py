"""The V4 sparse-attention grid of gpu_check.py: cpkv's Triton kernels at V4-Flash and V4-Pro shapes.

Shapes: H = 64 (V4-Flash) and 128 (V4-Pro) query heads over one shared kv head of D = 512
(values: all 512 channels), K = 640 (128 window rows + 512 compressed entries) and K = 2048
(128 + 1920: cuDNN's top-k 2048 figures), per-head sinks, bf16, T = 8K and 32K queries over
``N = T + T / 4`` kv rows (tokens, then the compressed entries; ``-1`` where fewer are visible).

* Correctness (T = 2K, every (H, K)): out, lse, dq, dkv, dsinks of
  ``cpkv_triton::sparse_attention`` in bf16, atomic and deterministic dkv (and out, lse of
  the opt-in Gluon forward, ``CPKV_TRITON_GLUON=1``), against the fp64
  reference op, bounded by the bf16 reference op's own error (the 2x rule:
  ``err <= 2 * err_reference_bf16 + 2**-8 * max|fp64|``); deterministic twice, bitwise; the
  KL target of the compressed entries from the forward (``cpkv_triton::sparse_attention_probs``)
  against the fp64 reference ``selected_probs``, by the same rule.
* Speed (every (H, K, T)): forward ms (plain Triton and Gluon), backward ms with atomic and with deterministic dkv,
  counted TFLOP/s (cuDNN's convention: forward ``2*T*H*K*(D + d_v)``, backward
  ``2*T*H*K*(3*D + 2*d_v)``), deterministic / atomic; the forward with the KL target against
  the forward plus the separate ``selected_probs`` pass; at T = 8K also the reference ops'
  forward + backward and the speed-up.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Callable

import torch

from cpkv.backends.reference.sparse import selected_probs_op as ref_probs
from cpkv.backends.reference.sparse import sparse_attention_op as ref_sparse
from cpkv.backends.triton.ops import selected_probs_op, sparse_attention_op, sparse_attention_probs_op
from device_common import RuleCheck, attention_timers, median_ms, rule_check  # noqa: E402 - benchmarks/ is on sys.path when run

D, DV, WINDOW = 512, 512, 128
HEADS, TOPKS, TOKENS = (64, 128), (640, 2048), (8192, 32768)
HEADER = ["| H | K | T | check / phase | value | bound or reference | ok / TFLOP/s |", "|---|---|---|---|---|---|---|"]


def flops(num_q: int, heads: int, topk: int) -> tuple[float, float]:
    """Counted (forward, backward) FLOPs, cuDNN's convention."""
    return 2.0 * num_q * heads * topk * (D + DV), 2.0 * num_q * heads * topk * (3 * D + 2 * DV)


def inputs(num_q: int, heads: int, topk: int, device: torch.device, dim: int = D, d_v: int = DV) -> dict[str, Any]:
    """q, kv, sinks, idx (``[T, topk]`` int32: the window, then compressed entries) and d_out, seeded."""
    gen = torch.Generator(device=device).manual_seed(0)
    num_kv, picked_k = num_q + num_q // 4, topk - WINDOW
    pos = torch.arange(num_q, device=device)
    window = pos[:, None] - torch.arange(WINDOW - 1, -1, -1, device=device)
    window = torch.where(window >= 0, window, -1)
    visible = (pos + 1) // 4  # compressed entries j < floor((t + 1) / 4), as in V4
    picked = (torch.rand(num_q, picked_k, device=device, generator=gen) * visible[:, None]).long()
    picked = torch.where(torch.arange(picked_k, device=device) < visible[:, None], num_q + picked, -1)
    return {
        "q": torch.randn(num_q, heads, dim, device=device, generator=gen).bfloat16(),
        "kv": torch.randn(num_kv, dim, device=device, generator=gen).bfloat16(),
        "sinks": torch.randn(heads, device=device, generator=gen),
        "idx": torch.cat([window, picked], 1).int(),
        "d_out": torch.randn(num_q, heads, d_v, device=device, generator=gen).bfloat16(),
    }


def grads_of(fn: Callable[..., Any], x: dict[str, Any], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[out, lse, dq, dkv, dsinks]`` of ``fn(q, kv, sinks, idx)`` in ``dtype`` (gradients from ``x["d_out"]``,
    and ``x["d_lse"]`` into the finite LSEs where given, else none).

    Each call takes fresh copies of the inputs as its leaves: a bf16 input cast to bf16 is the
    same tensor, and two runs on one leaf would accumulate into (and return) one ``.grad``.
    """
    leaves = [x[k].detach().to(dtype, copy=True).requires_grad_(True) for k in ("q", "kv", "sinks")]
    out, lse = fn(*leaves, x["idx"])
    d_lse = torch.zeros_like(lse) if x.get("d_lse") is None else torch.where(
        torch.isfinite(lse), x["d_lse"].to(lse.dtype), 0.0)
    torch.autograd.backward((out, lse), (x["d_out"].to(out.dtype), d_lse))
    return [out.detach(), lse.detach()] + [leaf.grad for leaf in leaves]  # type: ignore[misc]


@contextlib.contextmanager
def gluon_forward() -> Iterator[None]:
    """The ops' forward through the Gluon kernel (``CPKV_TRITON_GLUON=1``) inside the block."""
    before = os.environ.get("CPKV_TRITON_GLUON")
    os.environ["CPKV_TRITON_GLUON"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CPKV_TRITON_GLUON")
        else:
            os.environ["CPKV_TRITON_GLUON"] = before


def _triton(deterministic: bool) -> Callable[..., Any]:
    return lambda q, kv, s, idx: sparse_attention_op(q, kv, idx, s, D**-0.5, DV, deterministic)


def _reference(q: torch.Tensor, kv: torch.Tensor, s: torch.Tensor, idx: torch.Tensor) -> Any:
    return ref_sparse(q, kv, idx, s, D**-0.5, DV, 256)


def _row(heads: int, topk: int, num_q: int, what: str, check: RuleCheck) -> str:
    return (f"| {heads} | {topk} | {num_q // 1024}K | {what} err vs fp64 | {check.err:.3e} | "
            f"{check.bound:.3e} (ref bf16 {check.ref_err:.3e}) | {'ok' if check.ok else 'FAIL'} |")


def check(device: torch.device, num_q: int = 2048) -> tuple[list[str], bool]:
    """Correctness rows for every (H, K) at ``num_q`` queries, and the verdict."""
    rows, ok = [], True
    for heads in HEADS:
        for topk in TOPKS:
            x = inputs(num_q, heads, topk, device)
            exact = grads_of(_reference, x, torch.float64)
            low = grads_of(_reference, x, torch.bfloat16)
            for mode, det in (("atomic", False), ("deterministic", True)):
                got = grads_of(_triton(det), x, torch.bfloat16)
                for name, e, lo, g in zip(("out", "lse", "dq", "dkv", "dsinks"), exact, low, got):
                    check = rule_check(g, e, lo)
                    ok &= check.ok
                    rows.append(_row(heads, topk, num_q, f"{name} ({mode})", check))
            with gluon_forward():
                gluon = grads_of(_triton(False), x, torch.bfloat16)
            for name, e, lo, g in zip(("out", "lse"), exact, low, gluon):
                check = rule_check(g, e, lo)
                ok &= check.ok
                rows.append(_row(heads, topk, num_q, f"{name} (gluon forward)", check))
            with torch.no_grad():
                q, kv, s, idx = (x[k] for k in ("q", "kv", "sinks", "idx"))
                _, _, probs = sparse_attention_probs_op(q.bfloat16(), kv.bfloat16(), idx, s, D**-0.5, DV, False, WINDOW)
                probs_exact, probs_low = (
                    ref_probs(q.to(dt), kv.to(dt), idx[:, WINDOW:], ref_sparse(q.to(dt), kv.to(dt), idx, s.to(dt), D**-0.5,
                                                                                DV, 256)[1], D**-0.5, 256)
                    for dt in (torch.float64, torch.bfloat16))
            check = rule_check(probs, probs_exact, probs_low)
            ok &= check.ok
            rows.append(_row(heads, topk, num_q, "KL target (from the forward)", check))
            again = grads_of(_triton(True), x, torch.bfloat16)
            same = all(torch.equal(a, b) for a, b in zip(got[2:], again[2:]))
            ok &= same
            rows.append(f"| {heads} | {topk} | {num_q // 1024}K | deterministic dq/dkv/dsinks bitwise twice | {same} | | "
                        f"{'ok' if same else 'FAIL'} |")
    return rows, ok


def bench(num_q: int, heads: int, topk: int, device: torch.device, reps: int, with_reference: bool) -> list[str]:
    """Timing rows of one (H, K, T)."""
    x = inputs(num_q, heads, topk, device)
    q, kv, s = (x[k].clone().requires_grad_(True) for k in ("q", "kv", "sinks"))
    flops_f, flops_b = flops(num_q, heads, topk)
    tag = f"| {heads} | {topk} | {num_q // 1024}K "

    fwd, fwd_bwd = attention_timers(q, kv, s, x)

    t = {"fwd": median_ms(fwd(_triton(False)), reps)}
    with gluon_forward():
        t["gluon"] = median_ms(fwd(_triton(False)), reps)
    with torch.no_grad():
        t["probs"] = median_ms(lambda: sparse_attention_probs_op(q, kv, x["idx"], s, D**-0.5, DV, False, WINDOW), reps)
        t["separate"] = median_ms(lambda: selected_probs_op(q, kv, x["idx"][:, WINDOW:], sparse_attention_op(
            q, kv, x["idx"], s, D**-0.5, DV, False)[1], D**-0.5), reps)
    rows = [f"{tag}| forward ms | {t['fwd']:.2f} | | {flops_f / t['fwd'] / 1e9:.0f} |",
            f"{tag}| forward (gluon) ms | {t['gluon']:.2f} | | {flops_f / t['gluon'] / 1e9:.0f} |",
            f"{tag}| forward with the KL target ms (forward + selected_probs ms) | {t['probs']:.2f} | "
            f"{t['separate']:.2f} | {flops_f / t['probs'] / 1e9:.0f} |"]
    for mode, det in (("atomic", False), ("deterministic", True)):
        t[mode] = median_ms(fwd_bwd(_triton(det)), reps) - t["fwd"]
        rows.append(f"{tag}| backward ({mode} dkv) ms | {t[mode]:.2f} | | {flops_b / t[mode] / 1e9:.0f} |")
    rows.append(f"{tag}| deterministic / atomic backward | {t['deterministic'] / t['atomic']:.2f}x | <= 1.25x | |")
    if with_reference:
        ref = median_ms(fwd_bwd(_reference), 1)
        total = t["fwd"] + t["atomic"]
        rows.append(f"{tag}| fwd+bwd ms, triton vs reference ops | {total:.2f} | {ref:.2f} | {ref / total:.1f}x speed-up |")
    return rows


def run(device: torch.device, reps: int, tokens: tuple[int, ...] = TOKENS) -> tuple[list[str], bool]:
    """Every row of the section (correctness first), printed as they come, and the correctness verdict."""
    rows, ok = check(device)
    print("\n".join(rows), flush=True)
    for heads in HEADS:
        for topk in TOPKS:
            for num_q in tokens:
                rows += bench(num_q, heads, topk, device, reps, with_reference=num_q <= 8192)
                print("\n".join(rows[-7:]), flush=True)
    return rows, ok
