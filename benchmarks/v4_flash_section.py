"""The DeepSeek-V4-Flash section of gpu_check.py: cpkv's Triton sparse kernels at the real shapes.

H = 64 query heads over one shared kv head of D = 512 (values: all 512 channels), K = 640
entries per query (its 128-token window + 512 compressed entries), per-head sinks, bf16,
T = 8K and 32K queries over ``N = T + T / 4`` kv rows (tokens, then the compressed entries).

* Correctness (T = 8K): out, lse, dq, dkv, dsinks of ``cpkv_triton::sparse_attention``
  (atomic dkv) against the fp64 reference op, bounded by the bf16 reference op's own error:
  ``err <= 2 * err_reference_bf16 + 2**-8 * max|fp64|``; the indexer top-k (H_I = 64,
  D_I = 128, top 512) against the reference op (the selected scores' sums must agree).
* Determinism: ``deterministic=True`` dkv twice, bitwise.
* Speed: forward, backward (atomic and deterministic dkv) ms and TFLOP/s over the gathered
  rows (forward ``2*T*H*K*(D + d_v)``, backward ``2*T*H*K*(3*D + 2*d_v)``), the reference
  ops' forward + backward and the speed-up; the indexer top-k ms.
* ``cudnn`` (nvidia-cudnn-frontend): reported when importable (its DSA graphs are not run).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from cpkv.backends.reference.indexer import indexer_topk_op as ref_topk
from cpkv.backends.reference.sparse import sparse_attention_op as ref_sparse
from cpkv.backends.triton.indexer_ops import indexer_topk_op
from cpkv.backends.triton.ops import sparse_attention_op

from v4_sparse_section import grads_of, inputs  # noqa: E402 - benchmarks/ is on sys.path when run
from device_common import attention_timers, median_ms, rule_check  # noqa: E402 - benchmarks/ is on sys.path when run

H, D, DV, WINDOW, TOPK = 64, 512, 512, 128, 512
HEADER = ["| T | check / phase | value | bound or reference | ok / TFLOP/s |", "|---|---|---|---|---|"]


def _inputs(num_q: int, device: torch.device) -> dict[str, Any]:
    """The V4 sparse grid's inputs at H 64 and K = the window plus top-512."""
    return inputs(num_q, H, WINDOW + TOPK, device)


def _triton(deterministic: bool) -> Callable[..., Any]:
    return lambda q, kv, s, idx: sparse_attention_op(q, kv, idx, s, D**-0.5, DV, deterministic)


def _reference(q: torch.Tensor, kv: torch.Tensor, s: torch.Tensor, idx: torch.Tensor) -> Any:
    return ref_sparse(q, kv, idx, s, D**-0.5, DV, 256)


def check(device: torch.device) -> tuple[list[str], bool]:
    x = _inputs(8192, device)
    exact = grads_of(_reference, x, torch.float64)
    low = grads_of(_reference, x, torch.bfloat16)
    got = grads_of(_triton(False), x, torch.bfloat16)
    rows, ok = [], True
    for name, e, lo, g in zip(("out", "lse", "dq", "dkv", "dsinks"), exact, low, got):
        c = rule_check(g, e, lo)
        ok &= c.ok
        rows.append(f"| 8K | {name} err vs fp64 | {c.err:.3e} | {c.bound:.3e} (ref bf16 {c.ref_err:.3e}) | {'ok' if c.ok else 'FAIL'} |")
    first, second = grads_of(_triton(True), x, torch.bfloat16), grads_of(_triton(True), x, torch.bfloat16)
    same = all(torch.equal(a, b) for a, b in zip(first[2:], second[2:]))
    ok &= same
    rows.append(f"| 8K | deterministic dq/dkv/dsinks bitwise equal twice | {same} | | {'ok' if same else 'FAIL'} |")
    qi, ki, w, start, end = _indexer_inputs(8192, device)
    got_i, got_s = indexer_topk_op(qi, ki, w, None, start, end - start, TOPK)
    want_i, want_s = ref_topk(qi, ki, w, start, end, TOPK, 1024)
    diff = float((got_s.nan_to_num(neginf=0).sum(1) - want_s.nan_to_num(neginf=0).sum(1)).abs().max())
    bound = 1e-3 * float(want_s.nan_to_num(neginf=0).sum(1).abs().max())
    same_set = float((got_i.sort(1).values == want_i.sort(1).values).float().mean())
    ok &= diff <= bound
    rows.append(f"| 8K | indexer top-k: max diff of selected score sums | {diff:.3e} | {bound:.3e} (same index set: {same_set:.1%}) "
                f"| {'ok' if diff <= bound else 'FAIL'} |")
    return rows, ok


def _indexer_inputs(num_q: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(1)
    qi = torch.randn(num_q, 64, 128, device=device, generator=gen).bfloat16()
    ki = torch.randn(num_q // 4, 128, device=device, generator=gen).bfloat16()
    w = torch.rand(num_q, 64, device=device, generator=gen) / 64
    start = torch.zeros(num_q, dtype=torch.int64, device=device)
    return qi, ki, w, start, (torch.arange(num_q, device=device) + 1) // 4


def bench(num_q: int, device: torch.device, reps: int, with_reference: bool) -> list[str]:
    x = _inputs(num_q, device)
    q, kv, s = (x[k].clone().requires_grad_(True) for k in ("q", "kv", "sinks"))
    flops_f, flops_b = 2.0 * num_q * H * (WINDOW + TOPK) * (D + DV), 2.0 * num_q * H * (WINDOW + TOPK) * (3 * D + 2 * DV)
    rows, t = [], {}

    fwd, fwd_bwd = attention_timers(q, kv, s, x)

    size = f"{num_q // 1024}K"
    t["fwd"] = median_ms(fwd(_triton(False)), reps)
    for mode, det in (("atomic", False), ("deterministic", True)):
        t[mode] = median_ms(fwd_bwd(_triton(det)), reps) - t["fwd"]
        rows.append(f"| {size} | backward ({mode} dkv) ms | {t[mode]:.2f} | | {flops_b / t[mode] / 1e9:.0f} |")
    rows.insert(0, f"| {size} | forward ms | {t['fwd']:.2f} | | {flops_f / t['fwd'] / 1e9:.0f} |")
    if with_reference:
        ref = median_ms(fwd_bwd(_reference), 1)
        total = t["fwd"] + t["atomic"]
        rows.append(f"| {size} | fwd+bwd ms, triton vs reference ops | {total:.2f} | {ref:.2f} | {ref / total:.1f}x speed-up |")
    qi, ki, w, start, end = _indexer_inputs(num_q, device)
    rows.append(f"| {size} | indexer top-{TOPK} ms (H_I=64, D_I=128) | "
                f"{median_ms(lambda: indexer_topk_op(qi, ki, w, None, start, end - start, TOPK), reps):.2f} | | |")
    return rows


def cudnn_note() -> str:
    try:
        import cudnn  # type: ignore[import-not-found]
    except ImportError:
        return "cudnn (nvidia-cudnn-frontend): not importable, no comparison."
    return f"cudnn {getattr(cudnn, '__version__', '?')} importable; its DSA graphs are not run by this script."
