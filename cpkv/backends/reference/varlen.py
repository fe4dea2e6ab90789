"""Exact varlen and key-range attention (pure torch), as the custom ops ``cpkv::range_attention``.

Every query row ``t`` sees a contiguous key range ``[lo[t], hi[t])``: a varlen segment's
bottom-right causal mask (with or without a sliding window) and a ring round's visible
part are both of this form. The op walks ``block_size`` query rows and ``block_size``
keys at a time with an online softmax; its backward (``cpkv::range_attention_backward``)
recomputes the probabilities per tile (flash-attention style): no ``[T_q, T_kv]`` matrix.

Shapes legend: ``T_q`` query tokens, ``T_kv`` key/value tokens, ``B`` segments, ``H`` query
heads, ``H_kv`` kv heads (``H % H_kv == 0``), ``G = H // H_kv``, ``D`` query/key dim, ``D_v``
value dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpkv.backends.base import AttentionResult
from cpkv.backends.reference.common import (
    DEFAULT_BLOCK_SIZE,
    NEG_INF,
    acc_dtype,
    block_bounds,
    finite_or_zero,
    finite_rows,
    probs,
    ranges_cover,
    ranges_hit,
    scale_or_default,
)
from cpkv.checks import check_cu_seqlens, check_positive_int, check_same, check_sinks, check_tensor_form

__all__ = ["range_attention", "varlen_attention"]


# --------------------------------------------------------------------------- kernels


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q as [T_q, H_kv, G, D] (head h uses kv head h // G), k and v, in the accumulation dtype."""
    acc = acc_dtype(q.dtype)
    (t_q, h, d), h_kv = q.shape, k.shape[1]
    return q.to(acc).reshape(t_q, h_kv, h // h_kv, d), k.to(acc), v.to(acc)


def _range_scores(qb: Tensor, kb: Tensor, lo: Tensor, hi: Tensor, k0: int, scale: float) -> Tensor:
    """Masked scaled scores [Bq, H_kv, G, Bk] of qb [Bq, H_kv, G, D] against keys k0 onwards.

    The fill also drops the NaN scores of invisible pairs (a NaN query or key of another segment).
    """
    j = torch.arange(k0, k0 + kb.shape[0], device=kb.device)
    visible = (j >= lo.unsqueeze(1)) & (j < hi.unsqueeze(1))
    s = torch.einsum("qhgd,khd->qhgk", qb, kb) * scale
    return s.masked_fill(~visible[:, None, None, :], NEG_INF)


@torch.library.custom_op("cpkv::range_attention", mutates_args=())
def range_attention_op(
    q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, sinks: Tensor | None, scale: float, block_size: int
) -> tuple[Tensor, Tensor]:
    """Attention of each query row over its key range; the op behind both public functions.

    Args:
        q: [T_q, H, D] float. k: [T_kv, H_kv, D], v: [T_kv, H_kv, D_v], dtype of q.
        lo, hi: [T_q] int32/int64: row ``t`` sees keys ``lo[t] <= j < hi[t]`` (empty if ``lo >= hi``).
        sinks: [H] float or None. scale: score scale. block_size: query rows and keys per tile.

    Returns:
        ``(out [T_q, H, D_v] dtype of q, lse [T_q, H] fp32/fp64)``; differentiable w.r.t. q, k,
        v, sinks, also through lse.

    Non-finite inputs stay where they belong, as in fused kernels: a NaN/inf query, key or
    value reaches only the rows that see it (tiles spanning segments never multiply a masked
    0 by it); rows that see nothing give out 0 (and lse -inf without sink).

    Raises:
        Nothing is validated (no host sync beyond the tile bounds); malformed input gives
        torch's indexing or shape errors.
    """
    qa, ka, va = _grouped(q, k, v)
    va, bad_v = finite_rows(va)  # P @ V on finite values; rows that see a bad one are poisoned below
    out, lse = qa.new_zeros((*qa.shape[:3], v.shape[2])), qa.new_zeros(qa.shape[:3])
    lo, hi = lo.long(), hi.long()
    for t0, t1, k_lo, k_hi in block_bounds(lo, hi, block_size):
        m = qa.new_full(lse[t0:t1].shape, NEG_INF)
        if sinks is not None:  # the sink is one extra logit: start the online softmax from it
            m = torch.maximum(m, sinks.to(qa.dtype).reshape(qa.shape[1:3]))
        den, num = (m > NEG_INF).to(qa.dtype), torch.zeros_like(out[t0:t1])
        for k0 in range(max(k_lo, 0), k_hi, block_size):
            k1 = min(k0 + block_size, k_hi)
            s = _range_scores(qa[t0:t1], ka[k0:k1], lo[t0:t1], hi[t0:t1], k0, scale)
            m_new = torch.maximum(m, s.amax(-1))
            alpha, p = torch.exp(m - finite_or_zero(m_new)), probs(s, m_new)
            den = den * alpha + p.sum(-1)
            num = num * alpha.unsqueeze(-1) + torch.einsum("qhgk,khd->qhgd", p, va[k0:k1])
            m = m_new
        lse[t0:t1] = m + torch.log(den)
        out[t0:t1] = num / torch.where(den > 0, den, 1.0).unsqueeze(-1)
    out = out.masked_fill(ranges_hit(lo, hi, bad_v)[:, :, None, None], float("nan"))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


@range_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, sinks: Tensor | None, scale: float,
      block_size: int) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:2], v.shape[2])), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("cpkv::range_attention_backward", mutates_args=())
def range_attention_backward_op(
    d_out: Tensor, d_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lo: Tensor,
    hi: Tensor, sinks: Tensor | None, scale: float, block_size: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Backward of ``cpkv::range_attention``, recomputing P per tile: dS = P * (dP - rowsum(dO * O) + dLSE).

    Args:
        d_out: [T_q, H, D_v], d_lse: [T_q, H]: upstream gradients. out, lse: the forward's outputs.
        q, k, v, lo, hi, sinks, scale, block_size: the forward's inputs.

    Returns:
        ``(dq, dk, dv, dsinks)`` in the dtypes of q, k, v, sinks; dsinks is ``[H]``, or ``[0]``
        without sinks.
    """
    qa, ka, va = _grouped(q, k, v)
    shape = (*qa.shape[:3], v.shape[2])
    do, lse_g = d_out.to(qa.dtype).reshape(shape), lse.to(qa.dtype).reshape(qa.shape[:3])
    delta = (do * out.to(qa.dtype).reshape(shape)).sum(-1) - d_lse.to(qa.dtype).reshape(lse_g.shape)
    dq, dk, dv = torch.zeros_like(qa), torch.zeros_like(ka), torch.zeros_like(va)
    lo, hi = lo.long(), hi.long()
    # Non-finite isolation: tiles span segments, and an invisible pair has p = 0, but 0 * NaN is
    # NaN. So the tile loop sees only finite operands (zeroed bad rows of q, k, v, dO; 0 for a
    # NaN/+inf lse or delta, which keeps p exactly 0 off a bad row's range), and afterwards the
    # gradients that depend on a bad row are poisoned with NaN, range by range (no per-tile work).
    # Scores use the raw q, k: a NaN/inf score stays on its (bad row, visible key) pair.
    (ka0, bad_k), (qa0, bad_q), (va0, bad_v), (do0, bad_do) = (finite_rows(x) for x in (ka, qa, va, do))
    bad_lse, bad_delta = lse_g.isnan() | lse_g.isposinf(), ~delta.isfinite()
    lse_0, delta_0 = lse_g.masked_fill(bad_lse, 0.0), delta.masked_fill(bad_delta, 0.0)
    for t0, t1, k_lo, k_hi in block_bounds(lo, hi, block_size):
        for k0 in range(max(k_lo, 0), k_hi, block_size):
            k1 = min(k0 + block_size, k_hi)
            kb, vb = ka0[k0:k1], va0[k0:k1]
            p = probs(_range_scores(qa[t0:t1], ka[k0:k1], lo[t0:t1], hi[t0:t1], k0, scale), lse_0[t0:t1])
            dp = torch.einsum("qhgd,khd->qhgk", do0[t0:t1], vb)
            ds = p * (dp - delta_0[t0:t1].unsqueeze(-1)) * scale
            dq[t0:t1] += torch.einsum("qhgk,khd->qhgd", ds, kb)
            dk[k0:k1] += torch.einsum("qhgk,qhgd->khd", ds, qa0[t0:t1])
            dv[k0:k1] += torch.einsum("qhgk,qhgd->khd", p, do0[t0:t1])
    nan, bad_row = float("nan"), bad_lse | bad_do  # rows whose p or dO is not finite
    bad_dq = bad_row | bad_delta | (ranges_hit(lo, hi, bad_k) | ranges_hit(lo, hi, bad_v)).unsqueeze(-1)
    dq = dq.masked_fill(bad_dq.unsqueeze(-1), nan)
    bad_dk = ranges_cover(lo, hi, (bad_row | bad_delta | bad_q).any(-1), ka.shape[0])
    dk = dk.masked_fill(bad_dk.unsqueeze(-1), nan)
    dv = dv.masked_fill(ranges_cover(lo, hi, bad_row.any(-1), va.shape[0]).unsqueeze(-1), nan)
    dsinks = q.new_zeros(0)
    if sinks is not None:  # p_sink = exp(sink - lse), finite since lse >= sink (NaN from a bad row)
        p_sink = torch.exp(sinks.to(qa.dtype).reshape(lse_g.shape[1:]) - lse_g)
        dsinks = -(p_sink * delta).sum(0).flatten().to(sinks.dtype)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


@range_attention_backward_op.register_fake
def _(d_out: Tensor, d_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lo: Tensor,
      hi: Tensor, sinks: Tensor | None, scale: float, block_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, lo, hi, sinks, scale, block_size = inputs
    ctx.save_for_backward(q, k, v, *output, lo, hi, sinks)
    ctx.scale, ctx.block_size = scale, block_size


def _backward(ctx: Any, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, lo, hi, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = range_attention_backward_op(
        d_out, d_lse, q, k, v, out, lse, lo, hi, sinks, ctx.scale, ctx.block_size
    )
    return dq, dk, dv, None, None, None if sinks is None else dsinks, None, None


range_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- validated entry points


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor_form(name, x, 3)
        check_same(f"{name}.device must match q", x.device, q.device)
    check_same("k.dtype, v.dtype must match q", (k.dtype, v.dtype), (q.dtype, q.dtype))
    check_same("v.shape[:2] must match k ([T_kv, H_kv])", tuple(v.shape[:2]), tuple(k.shape[:2]))
    check_same("k.shape[2] must match q (D)", k.shape[2], q.shape[2])
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads H={q.shape[1]} must be a multiple of k heads H_kv={k.shape[1]}")


def _check_varlen(q: Tensor, k: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor) -> tuple[Tensor, Tensor]:
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_kv = check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, k.shape[0])
    check_same("len(cu_seqlens_kv) must match cu_seqlens_q", cu_kv.numel(), cu_q.numel())
    short = (cu_kv.diff() < cu_q.diff()).nonzero().flatten()
    if short.numel() > 0:
        raise ValueError(f"cu_seqlens_kv segment {int(short[0])} is shorter than its cu_seqlens_q one")
    return cu_q.to(q.device), cu_kv.to(q.device)


def _row_key_ranges(cu_q: Tensor, cu_kv: Tensor, window: int | None) -> tuple[Tensor, Tensor]:
    """Per query row, its visible keys as a half-open range ``[lo, hi)`` of k ([T_q] int64 each).

    Row ``i`` of a segment sees ``j <= i + (Lkv - Lq)`` (and ``j > i + (Lkv - Lq) - window``).
    """
    lens_q, lens_kv = cu_q.diff(), cu_kv.diff()
    seg = torch.repeat_interleave(torch.arange(lens_q.numel(), device=cu_q.device), lens_q)
    pos = torch.arange(seg.numel(), device=cu_q.device) - cu_q[seg]
    hi = cu_kv[seg] + (lens_kv - lens_q)[seg] + pos + 1
    lo = cu_kv[seg] if window is None else torch.maximum(cu_kv[seg], hi - window)
    return lo, hi


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, *,
    scale: float | None = None, window: int | None = None, sinks: Tensor | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> AttentionResult:
    """Exact varlen (packed TND) attention, bottom-right causal within each segment pair.

    Segment ``b`` pairs queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` with keys
    ``cu_seqlens_kv[b]:cu_seqlens_kv[b+1]`` (``Lkv >= Lq``); no cross-segment attention. Query
    ``i`` sees key ``j`` iff ``j <= i + (Lkv - Lq)`` and, with ``window=W``, ``j > i + (Lkv - Lq)
    - W``. For ``Lq = 3, Lkv = 5`` (1 = visible; window 2 keeps the last two 1s of each row)::

        1 1 1 0 0
        1 1 1 1 0
        1 1 1 1 1

    Validates (host-syncing on cu_seqlens), then calls the custom op ``cpkv::range_attention``.

    Args:
        q: [T_q, H, D] float. k: [T_kv, H_kv, D], v: [T_kv, H_kv, D_v], dtype of q. Query head
            ``h`` uses kv head ``h // (H // H_kv)``. Shared KV: pass ``v = k[..., :D_v]``.
        cu_seqlens_q, cu_seqlens_kv: [B+1] int32/int64 WITH the leading 0, non-decreasing, last
            entries ``T_q`` / ``T_kv``; same B. Zero-length segments are legal.
        scale: default ``1/sqrt(D)``. window: the query plus ``W - 1`` earlier keys; None = off.
        sinks: [H] float per-head logit added to every softmax denominator.
        block_size: query rows and keys per tile; memory O(T * H * D + block_size^2 * H).

    Returns:
        ``AttentionResult(out [T_q, H, D_v] dtype of q, lse [T_q, H] fp32/fp64)``, both
        differentiable w.r.t. q, k, v, sinks (once; no double backward).

    Raises:
        TypeError: non-tensor or non-float q/k/v/sinks, non-int cu_seqlens/window/block_size.
        ValueError: dtype/shape/device mismatches, ``H % H_kv != 0``, malformed cu_seqlens,
            different B, a kv segment shorter than its q segment, window/block_size < 1.

    Example:
        >>> q, k, v = torch.randn(5, 2, 8), torch.randn(7, 1, 8), torch.randn(7, 1, 4)
        >>> cu_q, cu_kv = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 7])
        >>> varlen_attention(q, k, v, cu_q, cu_kv, window=2).out.shape
        torch.Size([5, 2, 4])
    """
    _check_qkv(q, k, v)
    cu_q, cu_kv = _check_varlen(q, k, cu_seqlens_q, cu_seqlens_kv)
    if window is not None:
        check_positive_int("window", window)
    check_positive_int("block_size", block_size)
    check_sinks(sinks, q)
    lo, hi = _row_key_ranges(cu_q, cu_kv, window)
    out, lse = range_attention_op(q, k, v, lo, hi, sinks, scale_or_default(scale, q), block_size)
    return AttentionResult(out, lse)


def range_attention(
    q: Tensor, k: Tensor, v: Tensor, key_lo: Tensor, key_hi: Tensor, *,
    scale: float | None = None, sinks: Tensor | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
) -> AttentionResult:
    """Attention where query ``t`` sees exactly the keys ``key_lo[t] <= j < key_hi[t]``.

    The building block of ring rounds: a round holds one contiguous part of the prefix, and
    each query sees a contiguous range of it (all of it, a window's tail, or nothing).
    Validates (host-syncing on the bounds), then calls the custom op ``cpkv::range_attention``.

    Args:
        q: [T_q, H, D]; k: [T_kv, H_kv, D]; v: [T_kv, H_kv, D_v] (as :func:`varlen_attention`).
        key_lo, key_hi: [T_q] int64, **non-decreasing** over the rows, ``0 <= lo``, ``hi <= T_kv``;
            ``lo >= hi`` means the row sees nothing (output 0, lse -inf without sink).
        scale, sinks, block_size: as :func:`varlen_attention`.

    Returns:
        ``AttentionResult(out, lse)``, differentiable w.r.t. q, k, v, sinks (and through lse).

    Raises:
        TypeError: non-tensor or non-float q/k/v/sinks, non-int bounds or block_size.
        ValueError: shapes, decreasing or out-of-range bounds.
    """
    _check_qkv(q, k, v)
    for name, bound in (("key_lo", key_lo), ("key_hi", key_hi)):
        check_tensor_form(name, bound, 1, floating=False)
        check_same(f"{name}.shape must match q ([T_q])", tuple(bound.shape), tuple(q.shape[:1]))
    lo, hi = key_lo.to(q.device, torch.int64), key_hi.to(q.device, torch.int64)
    hi = torch.maximum(lo, hi)
    if lo.numel() and (bool((lo.diff() < 0).any()) or bool((hi.diff() < 0).any())):
        raise ValueError("key_lo and key_hi must be non-decreasing over the query rows")
    if lo.numel() and (int(lo.min()) < 0 or int(hi.max()) > k.shape[0]):
        raise ValueError(f"key ranges must lie within [0, T_kv={k.shape[0]}]")
    check_positive_int("block_size", block_size)
    check_sinks(sinks, q)
    out, lse = range_attention_op(q, k, v, lo, hi, sinks, scale_or_default(scale, q), block_size)
    return AttentionResult(out, lse)
