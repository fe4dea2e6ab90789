"""Pure-torch reference ops, part 2: sparse shared-KV attention and the lightning indexer.

Same conventions as :mod:`cpkv.backends.reference` (which re-exports everything here):
fp64 stays fp64, lower precisions accumulate in fp32, every op walks ``block_size`` query
rows at a time and the backward recomputes per block.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from cpkv.backends.reference import (
    _NEG_INF,
    AttentionResult,
    _acc_dtype,
    _Apply,
    _check_positive_int,
    _check_same,
    _check_sinks,
    _check_tensor,
    _Config,
    _probs,
    _scale_or_default,
)

__all__ = ["IndexerTopK", "indexer_scores", "indexer_topk", "sparse_attention", "sparse_attention_head_probs"]


class IndexerTopK(NamedTuple):
    """Selected indexer entries of each query."""

    indices: Tensor  # [T, topk] int64 absolute rows of k, by descending score, -1 padded
    scores: Tensor  # [T, topk] fp32 (fp64 for fp64 input), -inf at padding


# --------------------------------------------------------------------------- sparse (shared KV)


def _check_sparse(q: Tensor, kv: Tensor, indices: Tensor, d_v: int | None) -> None:
    _check_tensor("q", q, 3)
    _check_tensor("kv", kv, 2)
    _check_tensor("indices", indices, 2, floating=False)
    _check_same("kv.dtype must match q", kv.dtype, q.dtype)
    _check_same("kv.device, indices.device must match q", (kv.device, indices.device), (q.device,) * 2)
    _check_same("kv.shape[1] must match q (D)", kv.shape[1], q.shape[2])
    _check_same("indices.shape[0] must match q (T)", indices.shape[0], q.shape[0])
    if d_v is not None:
        _check_positive_int("d_v", d_v)
        if d_v > kv.shape[1]:
            raise ValueError(f"d_v must be <= kv.shape[1]={kv.shape[1]}, got {d_v}")
    if indices.numel() > 0 and (int(indices.min()) < -1 or int(indices.max()) >= kv.shape[0]):
        raise ValueError(f"indices must lie in [-1, N_c={kv.shape[0]}), got "
                         f"[{int(indices.min())}, {int(indices.max())}]")


def _sparse_scores(qb: Tensor, kva: Tensor, idx: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Masked scaled scores [Bt, H, K] and gathered rows [Bt, K, D] of one query block."""
    rows = kva[idx.clamp_min(0).long()]
    s = torch.einsum("thd,tkd->thk", qb, rows) * scale
    return s.masked_fill((idx < 0).unsqueeze(1), _NEG_INF), rows


def _sparse_forward(
    q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, cfg: _Config
) -> tuple[Tensor, Tensor]:
    """One softmax per row over its listed keys (+ sink); out and lse in the accumulation dtype."""
    qa, kva = q.to(_acc_dtype(q.dtype)), kv.to(_acc_dtype(q.dtype))
    out, lse = qa.new_zeros((*q.shape[:2], cfg.d_v)), qa.new_zeros(q.shape[:2])
    for t0 in range(0, q.shape[0], cfg.block_size):
        rows_t = slice(t0, t0 + cfg.block_size)
        s, rows = _sparse_scores(qa[rows_t], kva, indices[rows_t], cfg.scale)
        lse_b = torch.logsumexp(s, -1)
        if sinks is not None:
            lse_b = torch.logaddexp(lse_b, sinks.to(qa.dtype))
        out[rows_t] = torch.einsum("thk,tkd->thd", _probs(s, lse_b), rows[..., : cfg.d_v])
        lse[rows_t] = lse_b
    return out, lse


def _sparse_backward(
    d_out: Tensor, d_lse: Tensor, saved: tuple[Tensor, ...], sinks: Tensor | None, cfg: _Config
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Recompute P per query block; scatter-add the row gradients into kv. Returns dq, dkv, dsinks."""
    q, kv, indices, out, lse = saved
    qa, kva, do = q.to(out.dtype), kv.to(out.dtype), d_out.to(out.dtype)
    delta = (do * out).sum(-1) - d_lse.to(out.dtype)
    dq, dkv = torch.zeros_like(qa), torch.zeros_like(kva)
    for t0 in range(0, q.shape[0], cfg.block_size):
        rows_t = slice(t0, t0 + cfg.block_size)
        s, rows = _sparse_scores(qa[rows_t], kva, indices[rows_t], cfg.scale)
        p = _probs(s, lse[rows_t])
        dp = torch.einsum("thd,tkd->thk", do[rows_t], rows[..., : cfg.d_v])
        ds = p * (dp - delta[rows_t].unsqueeze(-1)) * cfg.scale
        dq[rows_t] = torch.einsum("thk,tkd->thd", ds, rows)
        d_rows = torch.einsum("thk,thd->tkd", ds, qa[rows_t])
        d_rows[..., : cfg.d_v] += torch.einsum("thk,thd->tkd", p, do[rows_t])
        dkv.index_add_(0, indices[rows_t].clamp_min(0).long().flatten(), d_rows.flatten(0, 1))
    dsinks = None
    if sinks is not None:
        dsinks = -(torch.exp(sinks.to(out.dtype) - lse) * delta).sum(0).to(sinks.dtype)
    return dq.to(q.dtype), dkv.to(kv.dtype), dsinks


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, cfg: _Config
    ) -> tuple[Tensor, Tensor]:
        out, lse = _sparse_forward(q, kv, indices, sinks, cfg)
        ctx.save_for_backward(q, kv, indices, out, lse, sinks)
        ctx.cfg = cfg
        return out.to(q.dtype), lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor | None, ...]:
        *saved, sinks = ctx.saved_tensors
        dq, dkv, dsinks = _sparse_backward(d_out, d_lse, tuple(saved), sinks, ctx.cfg)
        return dq, dkv, None, dsinks, None


def sparse_attention(
    q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float | None = None,
    sinks: Tensor | None = None, block_size: int = 1024,
) -> AttentionResult:
    """Shared-KV (MQA) sparse attention: each query attends to exactly its listed kv rows.

    Row ``t`` attends in one softmax (plus the sink) to keys ``kv[indices[t, k]]`` with values
    ``kv[indices[t, k], :d_v]``. ``-1`` entries are padding, anywhere in the row; a row with no
    valid entry and no sink gives out 0 and lse -inf. Duplicate valid indices count as separate
    keys (callers avoid them). A custom autograd Function recomputes P per block in backward;
    memory is O(block_size * K * (D + H)) beyond the inputs.

    Args:
        q: [T, H, D] float. kv: [N_c, D], dtype of q (one head shared by all query heads).
        indices: [T, K] int32/int64 rows of kv in ``[-1, N_c)``. d_v: ``1 <= d_v <= D``.
        scale: default ``1/sqrt(D)``. sinks: [H] float per-head logit. block_size: rows per block.

    Returns:
        ``AttentionResult(out [T, H, d_v] dtype of q, lse [T, H] fp32/fp64)``, differentiable
        w.r.t. q, kv and sinks (once).

    Raises:
        TypeError: non-tensor or non-float q/kv/sinks, non-int indices/d_v/block_size.
        ValueError: dtype/shape/device mismatches, indices out of range, d_v/block_size bad.

    Example:
        >>> q, kv = torch.randn(3, 2, 8), torch.randn(6, 8)
        >>> idx = torch.tensor([[0, 1, -1], [2, 3, 4], [-1, -1, -1]])
        >>> sparse_attention(q, kv, idx, d_v=4).out.shape
        torch.Size([3, 2, 4])
    """
    _check_sparse(q, kv, indices, d_v)
    _check_positive_int("block_size", block_size)
    _check_sinks(sinks, q)
    cfg = _Config(_scale_or_default(scale, q), block_size, d_v=d_v)
    out, lse = cast(_Apply, _SparseAttention.apply)(q, kv, indices, sinks, cfg)
    return AttentionResult(out, lse)


def sparse_attention_head_probs(
    q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, scale: float | None = None,
    block_size: int = 1024,
) -> Tensor:
    """Head-summed attention probability of every listed entry (the indexer KL target).

    ``P[t, k] = sum_h exp(score[t, h, k] - lse[t, h])``, 0 at ``-1`` padding, with ``lse`` (and
    ``scale``) those of ``sparse_attention``, so the sink and all listed keys are in the
    denominator. No gradient. Args as ``sparse_attention``; ``lse``: [T, H] float.

    Returns:
        [T, K] fp32 (fp64 for fp64 q).

    Raises:
        TypeError, ValueError: as ``sparse_attention``; ValueError if ``lse`` is not [T, H].
    """
    _check_sparse(q, kv, indices, None)
    _check_tensor("lse", lse, 2)
    _check_same("lse.shape must match q ([T, H])", tuple(lse.shape), tuple(q.shape[:2]))
    _check_positive_int("block_size", block_size)
    acc = _acc_dtype(q.dtype)
    qa, kva, lse_a = q.detach().to(acc), kv.detach().to(acc), lse.detach().to(acc)
    probs = qa.new_zeros(indices.shape)
    for t0 in range(0, q.shape[0], block_size):
        rows_t = slice(t0, t0 + block_size)
        s, _ = _sparse_scores(qa[rows_t], kva, indices[rows_t], _scale_or_default(scale, q))
        probs[rows_t] = _probs(s, lse_a[rows_t]).sum(1)
    return probs


# --------------------------------------------------------------------------- lightning indexer


def _check_indexer(q: Tensor, k: Tensor, weights: Tensor) -> None:
    _check_tensor("q", q, 3)
    _check_tensor("k", k, 2)
    _check_tensor("weights", weights, 2)
    _check_same("k.shape[1] must match q (D_I)", k.shape[1], q.shape[2])
    _check_same("weights.shape must match q ([T, H_I])", tuple(weights.shape), tuple(q.shape[:2]))
    _check_same("k.device, weights.device must match q", (k.device, weights.device), (q.device,) * 2)


def _indexer_block(q: Tensor, k: Tensor, weights: Tensor) -> Tensor:
    acc = _acc_dtype(q.dtype)
    s = torch.einsum("thd,nd->thn", q.to(acc), k.to(acc)).relu()
    return torch.einsum("thn,th->tn", s, weights.to(acc))


def indexer_scores(q: Tensor, k: Tensor, weights: Tensor) -> Tensor:
    """Dense lightning-indexer scores ``I[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])``.

    For small inputs and tests (materialises [T, H_I, N_c]); differentiable.
    Args: q [T, H_I, D_I], k [N_c, D_I], weights [T, H_I] (already scaled), all float.
    Returns: [T, N_c] fp32 (fp64 for fp64 q).
    Raises: TypeError for non-tensor/non-float inputs, ValueError for shape/device mismatches.
    """
    _check_indexer(q, k, weights)
    return _indexer_block(q, k, weights)


def _topk_block(
    q: Tensor, k: Tensor, weights: Tensor, start: Tensor, end: Tensor, topk: int, block_size: int
) -> tuple[Tensor, Tensor]:
    """Running top-k of one query block over ``block_size`` keys at a time of its union range."""
    best_s = q.new_full((q.shape[0], topk), _NEG_INF, dtype=_acc_dtype(q.dtype))
    best_i = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    j_end = int(end.max())
    for j0 in range(int(start.min()), j_end, block_size):
        j = torch.arange(j0, min(j0 + block_size, j_end), device=q.device)
        seen = (j >= start.unsqueeze(1)) & (j < end.unsqueeze(1))
        s = _indexer_block(q, k[j0 : j0 + j.numel()], weights).masked_fill(~seen, _NEG_INF)
        # Stable sort: among equal scores the earlier row wins (relu makes exact ties common),
        # so the selection does not depend on how rows are blocked or offset.
        merged_s, pos = torch.cat([best_s, s], 1).sort(dim=1, descending=True, stable=True)
        best_s, pos = merged_s[:, :topk], pos[:, :topk]
        best_i = torch.cat([best_i, torch.where(seen, j, -1)], 1).gather(1, pos)
    return best_s, best_i


def indexer_topk(
    q: Tensor, k: Tensor, weights: Tensor, visible_start: Tensor, visible_count: Tensor, *,
    topk: int, block_size: int = 1024,
) -> IndexerTopK:
    """Top-``topk`` rows of k by indexer score, each query restricted to its visible range.

    Query ``t`` may select rows ``visible_start[t] .. visible_start[t] + visible_count[t] - 1``.
    Blocks of ``block_size`` queries score ``block_size`` keys at a time within the union of
    their ranges, merging a running top-k. No gradient. Ties go to the lower row (the earlier entry).

    Args:
        q: [T, H_I, D_I] float. k: [N_c, D_I] float. weights: [T, H_I] float.
        visible_start, visible_count: [T] int32/int64, ranges within ``[0, N_c]``.
        topk: entries per row (>= 1). block_size: queries and keys per block.

    Returns:
        ``IndexerTopK`` (indices [T, topk] int64, -1 padded where fewer than topk are visible;
        scores [T, topk] fp32/fp64, -inf at padding), by descending score.

    Raises:
        TypeError: non-tensor/non-float inputs, non-int ranges, topk or block_size.
        ValueError: shape/device mismatches, ranges outside ``[0, N_c]``, topk/block_size < 1.
    """
    _check_indexer(q, k, weights)
    for name, x in (("visible_start", visible_start), ("visible_count", visible_count)):
        _check_tensor(name, x, 1, floating=False)
        _check_same(f"{name}.shape must match q ([T])", tuple(x.shape), tuple(q.shape[:1]))
    _check_positive_int("topk", topk)
    _check_positive_int("block_size", block_size)
    start = visible_start.to(q.device, torch.int64)
    end = start + visible_count.to(q.device, torch.int64)
    if q.shape[0] > 0 and (int(start.min()) < 0 or bool((end < start).any()) or int(end.max()) > k.shape[0]):
        raise ValueError(f"visible_start/visible_count ranges must lie within [0, N_c={k.shape[0]}]")
    scores = q.new_full((q.shape[0], topk), _NEG_INF, dtype=_acc_dtype(q.dtype))
    indices = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    with torch.no_grad():
        for t0 in range(0, q.shape[0], block_size):
            rows = slice(t0, t0 + block_size)
            block = _topk_block(q[rows], k, weights[rows], start[rows], end[rows], topk, block_size)
            scores[rows], indices[rows] = block
    return IndexerTopK(indices, scores)
