"""Pure-torch reference ops: the oracle of every test and the CPU path.

Shapes legend: ``T_q``/``T`` query tokens, ``T_kv`` key/value tokens, ``B`` segments, ``H``
query heads, ``H_kv`` kv heads (``H % H_kv == 0``), ``G = H // H_kv``, ``D`` query/key dim,
``D_v`` value dim, ``N_c`` rows of a shared KV or indexer key, ``K`` entries per sparse row,
``H_I``/``D_I`` indexer heads/dim.

Precision: fp64 inputs are computed in fp64; fp16/bf16/fp32 inputs accumulate in fp32 and
outputs come back in the input dtype. LSEs, probabilities and indexer scores are fp32 (fp64
for fp64 inputs). Memory: every op walks ``block_size`` query rows at a time
(``varlen_attention`` also ``block_size`` keys, with an online softmax) and the backward
recomputes probabilities per block (flash-attention style): no ``[T_q, T_kv]`` matrix exists.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["AttentionResult", "IndexerTopK", "indexer_scores", "indexer_topk", "range_attention", "sparse_attention",
           "sparse_attention_head_probs", "varlen_attention"]

_NEG_INF = float("-inf")
_INT_DTYPES = (torch.int32, torch.int64)
_Apply = Callable[..., tuple[Tensor, Tensor]]  # autograd.Function.apply is untyped


class AttentionResult(NamedTuple):
    """Attention output and its natural-log logsumexp (both differentiable)."""

    out: Tensor  # [T_q, H, D_v], dtype of q
    # [T_q, H], fp32 (fp64 for fp64 input): logsumexp of the scaled scores of the visible keys,
    # including exp(sink_h) when sinks are given; -inf for a fully masked row without sink.
    lse: Tensor


@dataclasses.dataclass(frozen=True)
class _Config:
    """Per-call options of the autograd Functions (kept on ctx, never on the class)."""

    scale: float
    block_size: int
    d_v: int = 0  # sparse only


# --------------------------------------------------------------------------- validation


def _check_tensor(name: str, x: object, ndim: int, *, floating: bool = True) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if floating and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if not floating and x.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")


def _check_same(what: str, actual: object, expected: object) -> None:
    if actual != expected:
        raise ValueError(f"{what}: expected {expected}, got {actual}")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_sinks(sinks: Tensor | None, q: Tensor) -> None:
    if sinks is not None:
        _check_tensor("sinks", sinks, 1)
        _check_same("sinks.shape must be [H]", tuple(sinks.shape), (q.shape[1],))
        _check_same("sinks.device must match q", sinks.device, q.device)


def _check_cu_seqlens(name: str, cu: Tensor, total: int) -> Tensor:
    """Validate a [B+1] cu_seqlens (leading 0, non-decreasing, last = total); int64 copy."""
    _check_tensor(name, cu, 1, floating=False)
    if cu.numel() == 0 or int(cu[0]) != 0:
        raise ValueError(f"{name} must start with a leading 0, got {cu[:4].tolist()}...")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] must equal the token count {total}, got {int(cu[-1])}")
    return cu.to(torch.int64)


def _check_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor
) -> tuple[Tensor, Tensor]:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x, 3)
        _check_same(f"{name}.device must match q", x.device, q.device)
    _check_same("k.dtype, v.dtype must match q", (k.dtype, v.dtype), (q.dtype, q.dtype))
    _check_same("v.shape[:2] must match k ([T_kv, H_kv])", tuple(v.shape[:2]), tuple(k.shape[:2]))
    _check_same("k.shape[2] must match q (D)", k.shape[2], q.shape[2])
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"q heads H={q.shape[1]} must be a multiple of k heads H_kv={k.shape[1]}")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    cu_kv = _check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, k.shape[0])
    _check_same("len(cu_seqlens_kv) must match cu_seqlens_q", cu_kv.numel(), cu_q.numel())
    short = (cu_kv.diff() < cu_q.diff()).nonzero().flatten()
    if short.numel() > 0:
        raise ValueError(f"cu_seqlens_kv segment {int(short[0])} is shorter than its cu_seqlens_q one")
    return cu_q.to(q.device), cu_kv.to(q.device)


# --------------------------------------------------------------------------- shared math


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scale_or_default(scale: float | None, q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _finite_or_zero(x: Tensor) -> Tensor:
    """Replace -inf (fully masked rows) by 0 so that ``exp(s - x)`` never forms NaN."""
    return x.masked_fill(x == _NEG_INF, 0.0)


def _probs(s: Tensor, lse: Tensor) -> Tensor:
    """``exp(s - lse)`` with -inf scores giving exactly 0, also on rows whose lse is -inf."""
    return torch.exp(s - _finite_or_zero(lse).unsqueeze(-1))


# --------------------------------------------------------------------------- varlen


def _row_key_ranges(cu_q: Tensor, cu_kv: Tensor, window: int | None) -> tuple[Tensor, Tensor]:
    """Per query row, its visible keys as a half-open range ``[lo, hi)`` of k ([T_q] int64 each).

    Row ``i`` of a segment sees ``j <= i + (Lkv - Lq)`` (and ``j > i + (Lkv - Lq) - window``);
    both bounds are non-decreasing over the rows, so a block of rows sees ``[lo[t0], hi[t1-1])``.
    """
    lens_q, lens_kv = cu_q.diff(), cu_kv.diff()
    seg = torch.repeat_interleave(torch.arange(lens_q.numel(), device=cu_q.device), lens_q)
    pos = torch.arange(seg.numel(), device=cu_q.device) - cu_q[seg]
    hi = cu_kv[seg] + (lens_kv - lens_q)[seg] + pos + 1
    lo = cu_kv[seg] if window is None else torch.maximum(cu_kv[seg], hi - window)
    return lo, hi


def _query_blocks(lo: Tensor, hi: Tensor, block_size: int) -> list[tuple[int, int, int, int]]:
    """``(t0, t1, k_lo, k_hi)`` per query block: rows ``[t0, t1)`` see only keys ``[k_lo, k_hi)``."""
    starts = torch.arange(0, lo.numel(), block_size, device=lo.device)
    ends = (starts + block_size).clamp_max(lo.numel())
    return list(zip(starts.tolist(), ends.tolist(), lo[starts].tolist(), hi[ends - 1].tolist()))


def _grouped(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q as [T_q, H_kv, G, D] (head h uses kv head h // G), k and v, in the accumulation dtype."""
    acc = _acc_dtype(q.dtype)
    (t_q, h, d), h_kv = q.shape, k.shape[1]
    return q.to(acc).reshape(t_q, h_kv, h // h_kv, d), k.to(acc), v.to(acc)


def _varlen_scores(qb: Tensor, kb: Tensor, lo: Tensor, hi: Tensor, k0: int, scale: float) -> Tensor:
    """Masked scaled scores [Bq, H_kv, G, Bk] of qb [Bq, H_kv, G, D] against keys k0 onwards."""
    j = torch.arange(k0, k0 + kb.shape[0], device=kb.device)
    visible = (j >= lo.unsqueeze(1)) & (j < hi.unsqueeze(1))
    s = torch.einsum("qhgd,khd->qhgk", qb, kb) * scale
    return s.masked_fill(~visible[:, None, None, :], _NEG_INF)


def _varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, sinks: Tensor | None, cfg: _Config
) -> tuple[Tensor, Tensor]:
    """Online softmax; out [T_q, H_kv, G, D_v] and lse [T_q, H_kv, G] in the accumulation dtype."""
    qa, ka, va = _grouped(q, k, v)
    out, lse, bs = qa.new_zeros((*qa.shape[:3], v.shape[2])), qa.new_zeros(qa.shape[:3]), cfg.block_size
    for t0, t1, k_lo, k_hi in _query_blocks(lo, hi, bs):
        m = qa.new_full(lse[t0:t1].shape, _NEG_INF)
        if sinks is not None:  # the sink is one extra logit: start the online softmax from it
            m = torch.maximum(m, sinks.to(qa.dtype).reshape(qa.shape[1:3]))
        den, num = (m > _NEG_INF).to(qa.dtype), torch.zeros_like(out[t0:t1])
        for k0 in range(k_lo, k_hi, bs):
            k1 = min(k0 + bs, k_hi)
            s = _varlen_scores(qa[t0:t1], ka[k0:k1], lo[t0:t1], hi[t0:t1], k0, cfg.scale)
            m_new = torch.maximum(m, s.amax(-1))
            alpha, p = torch.exp(m - _finite_or_zero(m_new)), _probs(s, m_new)
            den = den * alpha + p.sum(-1)
            num = num * alpha.unsqueeze(-1) + torch.einsum("qhgk,khd->qhgd", p, va[k0:k1])
            m = m_new
        lse[t0:t1] = m + torch.log(den)
        out[t0:t1] = num / torch.where(den > 0, den, 1.0).unsqueeze(-1)
    return out, lse


def _varlen_backward(
    d_out: Tensor, d_lse: Tensor, saved: tuple[Tensor, ...], sinks: Tensor | None, cfg: _Config
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Recompute P per tile; dS = P * (dP - rowsum(dO * O) + dLSE). Returns dq, dk, dv, dsinks."""
    q, k, v, out, lse, lo, hi = saved  # out, lse grouped, in the accumulation dtype
    qa, ka, va = _grouped(q, k, v)
    do = d_out.to(qa.dtype).reshape(out.shape)
    delta = (do * out).sum(-1) - d_lse.to(qa.dtype).reshape(lse.shape)
    dq, dk, dv, bs = torch.zeros_like(qa), torch.zeros_like(ka), torch.zeros_like(va), cfg.block_size
    for t0, t1, k_lo, k_hi in _query_blocks(lo, hi, bs):
        for k0 in range(k_lo, k_hi, bs):
            kb, vb = ka[k0 : min(k0 + bs, k_hi)], va[k0 : min(k0 + bs, k_hi)]
            p = _probs(_varlen_scores(qa[t0:t1], kb, lo[t0:t1], hi[t0:t1], k0, cfg.scale), lse[t0:t1])
            dp = torch.einsum("qhgd,khd->qhgk", do[t0:t1], vb)
            ds = p * (dp - delta[t0:t1].unsqueeze(-1)) * cfg.scale
            dq[t0:t1] += torch.einsum("qhgk,khd->qhgd", ds, kb)
            dk[k0 : k0 + kb.shape[0]] += torch.einsum("qhgk,qhgd->khd", ds, qa[t0:t1])
            dv[k0 : k0 + kb.shape[0]] += torch.einsum("qhgk,qhgd->khd", p, do[t0:t1])
    dsinks = None
    if sinks is not None:  # p_sink = exp(sink - lse), finite since lse >= sink
        p_sink = torch.exp(sinks.to(qa.dtype).reshape(lse.shape[1:]) - lse)
        dsinks = -(p_sink * delta).sum(0).flatten().to(sinks.dtype)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # lo, hi: [T_q] int64, the visible key range [lo, hi) of each query row
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, sinks: Tensor | None, cfg: _Config
    ) -> tuple[Tensor, Tensor]:
        out, lse = _varlen_forward(q, k, v, lo, hi, sinks, cfg)
        ctx.save_for_backward(q, k, v, out, lse, lo, hi, sinks)
        ctx.cfg = cfg
        return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor | None, ...]:
        *saved, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = _varlen_backward(d_out, d_lse, tuple(saved), sinks, ctx.cfg)
        return dq, dk, dv, None, None, dsinks, None


def varlen_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, *,
    scale: float | None = None, window: int | None = None, sinks: Tensor | None = None,
    block_size: int = 1024,
) -> AttentionResult:
    """Exact varlen (packed TND) attention, bottom-right causal within each segment pair.

    Segment ``b`` pairs queries ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` with keys
    ``cu_seqlens_kv[b]:cu_seqlens_kv[b+1]`` (``Lkv >= Lq``); no cross-segment attention. Query
    ``i`` sees key ``j`` iff ``j <= i + (Lkv - Lq)`` and, with ``window=W``, ``j > i + (Lkv - Lq)
    - W``. For ``Lq = 3, Lkv = 5`` (1 = visible; window 2 keeps the last two 1s of each row)::

        1 1 1 0 0
        1 1 1 1 0
        1 1 1 1 1

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
    cu_q, cu_kv = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_kv)
    if window is not None:
        _check_positive_int("window", window)
    _check_positive_int("block_size", block_size)
    _check_sinks(sinks, q)
    lo, hi = _row_key_ranges(cu_q, cu_kv, window)
    cfg = _Config(_scale_or_default(scale, q), block_size)
    out, lse = cast(_Apply, _VarlenAttention.apply)(q, k, v, lo, hi, sinks, cfg)
    return AttentionResult(out, lse)


def range_attention(
    q: Tensor, k: Tensor, v: Tensor, key_lo: Tensor, key_hi: Tensor, *,
    scale: float | None = None, sinks: Tensor | None = None, block_size: int = 1024,
) -> AttentionResult:
    """Attention where query ``t`` sees exactly the keys ``key_lo[t] <= j < key_hi[t]``.

    The building block of ring rounds: a round holds one contiguous part of the prefix, and
    each query sees a contiguous range of it (all of it, a window's tail, or nothing).

    Args:
        q: [T_q, H, D]; k: [T_kv, H_kv, D]; v: [T_kv, H_kv, D_v] (as :func:`varlen_attention`).
        key_lo, key_hi: [T_q] int64, **non-decreasing** over the rows, ``0 <= lo``, ``hi <= T_kv``;
            ``lo >= hi`` means the row sees nothing (output 0, lse -inf without sink).
        scale, sinks, block_size: as :func:`varlen_attention`.

    Returns:
        ``AttentionResult(out, lse)``, differentiable w.r.t. q, k, v, sinks (and through lse).

    Raises:
        ValueError: shapes, decreasing or out-of-range bounds.
    """
    for name, bound in (("key_lo", key_lo), ("key_hi", key_hi)):
        _check_tensor(name, bound, 1, floating=False)
        _check_same(f"{name}.shape must match q ([T_q])", tuple(bound.shape), tuple(q.shape[:1]))
    lo, hi = key_lo.to(q.device, torch.int64), key_hi.to(q.device, torch.int64)
    hi = torch.maximum(lo, hi)
    if lo.numel() and (bool((lo.diff() < 0).any()) or bool((hi.diff() < 0).any())):
        raise ValueError("key_lo and key_hi must be non-decreasing over the query rows")
    if lo.numel() and (int(lo.min()) < 0 or int(hi.max()) > k.shape[0]):
        raise ValueError(f"key ranges must lie within [0, T_kv={k.shape[0]}]")
    _check_positive_int("block_size", block_size)
    _check_sinks(sinks, q)
    cfg = _Config(_scale_or_default(scale, q), block_size)
    out, lse = cast(_Apply, _VarlenAttention.apply)(q, k, v, lo, hi, sinks, cfg)
    return AttentionResult(out, lse)


# The sparse and indexer ops live in reference_sparse (which builds on the helpers above).
from cpkv.backends.reference_sparse import (  # noqa: E402
    IndexerTopK,
    indexer_scores,
    indexer_topk,
    sparse_attention,
    sparse_attention_head_probs,
)
