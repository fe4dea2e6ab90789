"""The lightning indexer (pure torch): dense scores and the custom op ``cpkv::indexer_topk``.

Score of query ``t`` for key row ``j``: ``I[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])``.

Shapes legend: ``T`` query tokens, ``H_I`` indexer heads, ``D_I`` indexer dim, ``N_c`` key rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from cpkv.backends.reference.common import DEFAULT_BLOCK_SIZE, NEG_INF, acc_dtype
from cpkv.checks import check_positive_int, check_same, check_tensor_form

__all__ = ["IndexerTopK", "indexer_scores", "indexer_topk"]


class IndexerTopK(NamedTuple):
    """Selected indexer entries of each query.

    Attributes:
        indices: ``[T, topk]`` int64 absolute rows of k, by descending score, -1 padded.
        scores: ``[T, topk]`` fp32 (fp64 for fp64 input), -inf at padding.
    """

    indices: Tensor
    scores: Tensor


def _scores(q: Tensor, k: Tensor, weights: Tensor) -> Tensor:
    acc = acc_dtype(q.dtype)
    s = torch.einsum("thd,nd->thn", q.to(acc), k.to(acc)).relu()
    return torch.einsum("thn,th->tn", s, weights.to(acc))


def _topk_block(
    q: Tensor, k: Tensor, weights: Tensor, start: Tensor, end: Tensor, topk: int, block_size: int
) -> tuple[Tensor, Tensor]:
    """Running top-k of one query block over ``block_size`` keys at a time of its union range."""
    best_s = q.new_full((q.shape[0], topk), NEG_INF, dtype=acc_dtype(q.dtype))
    best_i = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    j_end = int(end.max())
    for j0 in range(max(int(start.min()), 0), j_end, block_size):
        j = torch.arange(j0, min(j0 + block_size, j_end), device=q.device)
        seen = (j >= start.unsqueeze(1)) & (j < end.unsqueeze(1))
        s = _scores(q, k[j0 : j0 + j.numel()], weights).masked_fill(~seen, NEG_INF)
        # Stable sort: among equal scores the earlier row wins (relu makes exact ties common),
        # so the selection does not depend on how rows are blocked or offset.
        merged_s, pos = torch.cat([best_s, s], 1).sort(dim=1, descending=True, stable=True)
        best_s, pos = merged_s[:, :topk], pos[:, :topk]
        best_i = torch.cat([best_i, torch.where(seen, j, -1)], 1).gather(1, pos)
    return best_s, best_i


@torch.library.custom_op("cpkv::indexer_topk", mutates_args=())
def indexer_topk_op(
    q: Tensor, k: Tensor, weights: Tensor, start: Tensor, end: Tensor, topk: int, block_size: int
) -> tuple[Tensor, Tensor]:
    """Running top-k of the indexer scores; the op behind :func:`indexer_topk`.

    Args:
        q: [T, H_I, D_I] float. k: [N_c, D_I] float. weights: [T, H_I] float.
        start, end: [T] int32/int64: query ``t`` picks among rows ``[start[t], end[t])``.
        topk: entries per row. block_size: queries and keys per block.

    Returns:
        ``(indices [T, topk] int64 -1 padded, scores [T, topk] fp32/fp64 -inf at padding)``,
        by descending score, ties to the earlier row. No autograd: pass detached inputs.

    Raises:
        Nothing is validated (no host sync beyond the block ranges).
    """
    scores = q.new_full((q.shape[0], topk), NEG_INF, dtype=acc_dtype(q.dtype))
    indices = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    start, end = start.long(), end.long()
    for t0 in range(0, q.shape[0], block_size):
        rows = slice(t0, t0 + block_size)
        scores[rows], indices[rows] = _topk_block(q[rows], k, weights[rows], start[rows], end[rows], topk, block_size)
    return indices, scores


@indexer_topk_op.register_fake
def _(q: Tensor, k: Tensor, weights: Tensor, start: Tensor, end: Tensor, topk: int,
      block_size: int) -> tuple[Tensor, Tensor]:
    shape = (q.shape[0], topk)
    return q.new_empty(shape, dtype=torch.int64), q.new_empty(shape, dtype=acc_dtype(q.dtype))


def _check_indexer(q: Tensor, k: Tensor, weights: Tensor) -> None:
    check_tensor_form("q", q, 3)
    check_tensor_form("k", k, 2)
    check_tensor_form("weights", weights, 2)
    check_same("k.shape[1] must match q (D_I)", k.shape[1], q.shape[2])
    check_same("weights.shape must match q ([T, H_I])", tuple(weights.shape), tuple(q.shape[:2]))
    check_same("k.device, weights.device must match q", (k.device, weights.device), (q.device,) * 2)


def indexer_scores(q: Tensor, k: Tensor, weights: Tensor) -> Tensor:
    """Dense lightning-indexer scores ``I[t, j] = sum_h weights[t, h] * relu(q[t, h] . k[j])``.

    For small inputs and tests (materialises ``[T, H_I, N_c]``); differentiable (plain torch).

    Args:
        q: [T, H_I, D_I] float. k: [N_c, D_I] float. weights: [T, H_I] float (already scaled).

    Returns:
        [T, N_c] fp32 (fp64 for fp64 q).

    Raises:
        TypeError: non-tensor or non-float inputs. ValueError: shape or device mismatches.
    """
    _check_indexer(q, k, weights)
    return _scores(q, k, weights)


def indexer_topk(
    q: Tensor, k: Tensor, weights: Tensor, visible_start: Tensor, visible_count: Tensor, *,
    topk: int, block_size: int = DEFAULT_BLOCK_SIZE,
) -> IndexerTopK:
    """Top-``topk`` rows of k by indexer score, each query restricted to its visible range.

    Query ``t`` may select rows ``visible_start[t] .. visible_start[t] + visible_count[t] - 1``.
    Blocks of ``block_size`` queries score ``block_size`` keys at a time within the union of
    their ranges, merging a running top-k. No gradient. Ties go to the lower row (the earlier
    entry). Validates (host-syncing on the ranges), then calls the custom op ``cpkv::indexer_topk``.

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
        check_tensor_form(name, x, 1, floating=False)
        check_same(f"{name}.shape must match q ([T])", tuple(x.shape), tuple(q.shape[:1]))
    check_positive_int("topk", topk)
    check_positive_int("block_size", block_size)
    start = visible_start.to(q.device, torch.int64)
    end = start + visible_count.to(q.device, torch.int64)
    if q.shape[0] > 0 and (int(start.min()) < 0 or bool((end < start).any()) or int(end.max()) > k.shape[0]):
        raise ValueError(f"visible_start/visible_count ranges must lie within [0, N_c={k.shape[0]}]")
    indices, scores = indexer_topk_op(q.detach(), k.detach(), weights.detach(), start, end, topk, block_size)
    return IndexerTopK(indices, scores)
