"""Sparse shared-KV attention (pure torch), as the custom ops ``cpkv::sparse_attention`` and
``cpkv::selected_probs``.

Each query row attends in one softmax (plus the sink) to exactly its listed rows of one
shared kv head; ``-1`` entries are padding. Padding never reads or writes a kv row: the
kernels gather from (and scatter into) an extra zero row past the end, so a NaN in kv
row 0 cannot leak through padding. Every op walks ``block_size`` query rows at a time;
the backward (``cpkv::sparse_attention_backward``) recomputes the probabilities per block.

Shapes legend: ``T`` query tokens, ``H`` query heads, ``D`` query/key dim, ``d_v`` value
dim (the first ``d_v`` channels of kv), ``N_c`` kv rows, ``K`` entries per row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpkv.backends.base import AttentionResult, unflatten_rows
from cpkv.backends.reference.common import (
    DEFAULT_BLOCK_SIZE,
    NEG_INF,
    acc_dtype,
    padded_rows,
    probs,
    scale_or_default,
)
from cpkv.checks import check_positive_int, check_same, check_sinks, check_tensor_form

__all__ = ["sparse_attention", "sparse_attention_head_probs"]


# --------------------------------------------------------------------------- kernels


def _sparse_scores(qb: Tensor, kv_ext: Tensor, idx: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Masked scaled scores [Bt, H, K] and gathered rows [Bt, K, D] of one query block.

    ``kv_ext``: kv with a zero row appended; ``idx``: [Bt, K] rows of it (padding = last row).
    """
    rows = kv_ext[idx]
    s = torch.einsum("thd,tkd->thk", qb, rows) * scale
    return s.masked_fill((idx == kv_ext.shape[0] - 1).unsqueeze(1), NEG_INF), rows


def _extended(kv: Tensor, dtype: torch.dtype) -> Tensor:
    """kv [N_c, D] in ``dtype`` with one zero row appended (the padding row)."""
    return torch.cat([kv.to(dtype), kv.new_zeros((1, kv.shape[1]), dtype=dtype)])


@torch.library.custom_op("cpkv::sparse_attention", mutates_args=())
def sparse_attention_op(
    q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, scale: float, d_v: int, block_size: int
) -> tuple[Tensor, Tensor]:
    """Shared-KV sparse attention over the listed rows; the op behind :func:`sparse_attention`.

    Args:
        q: [T, H, D] float. kv: [N_c, D], dtype of q. indices: [T, K] int32/int64 in ``[-1, N_c)``.
        sinks: [H] float or None. scale: score scale. d_v: value channels. block_size: rows per block.

    Returns:
        ``(out [T, H, d_v] dtype of q, lse [T, H] fp32/fp64)``; differentiable w.r.t. q, kv,
        sinks, also through lse.

    Raises:
        Nothing is validated (no host sync); malformed input gives torch's indexing errors.
    """
    qa, kv_ext = q.to(acc_dtype(q.dtype)), _extended(kv, acc_dtype(q.dtype))
    idx = padded_rows(indices, kv.shape[0])
    out, lse = qa.new_zeros((*q.shape[:2], d_v)), qa.new_zeros(q.shape[:2])
    for t0 in range(0, q.shape[0], block_size):
        rows_t = slice(t0, t0 + block_size)
        s, rows = _sparse_scores(qa[rows_t], kv_ext, idx[rows_t], scale)
        lse_b = torch.logsumexp(s, -1)
        if sinks is not None:
            lse_b = torch.logaddexp(lse_b, sinks.to(qa.dtype))
        out[rows_t] = torch.einsum("thk,tkd->thd", probs(s, lse_b), rows[..., :d_v])
        lse[rows_t] = lse_b
    return out.to(q.dtype), lse


@sparse_attention_op.register_fake
def _(q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, scale: float, d_v: int,
      block_size: int) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:2], d_v)), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("cpkv::sparse_attention_backward", mutates_args=())
def sparse_attention_backward_op(
    d_out: Tensor, d_lse: Tensor, q: Tensor, kv: Tensor, flat_indices: Tensor, out: Tensor, lse: Tensor,
    sinks: Tensor | None, scale: float, d_v: int, block_size: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``cpkv::sparse_attention``, recomputing P per block; padding adds nothing to any kv row.

    Args:
        d_out: [T, H, d_v], d_lse: [T, H]: upstream gradients. out, lse: the forward's outputs.
        flat_indices: the forward's ``[T, K]`` indices flattened to ``[T * K]``.
        q, kv, sinks, scale, d_v, block_size: the forward's inputs.

    Returns:
        ``(dq, dkv, dsinks)`` in the dtypes of q, kv, sinks; dsinks is ``[H]``, or ``[0]`` without sinks.
    """
    acc = acc_dtype(q.dtype)
    qa, kv_ext, do, lse_a = q.to(acc), _extended(kv, acc), d_out.to(acc), lse.to(acc)
    idx = padded_rows(unflatten_rows(flat_indices, q.shape[0]), kv.shape[0])
    delta = (do * out.to(acc)).sum(-1) - d_lse.to(acc)
    dq, dkv = torch.zeros_like(qa), torch.zeros_like(kv_ext)
    for t0 in range(0, q.shape[0], block_size):
        rows_t = slice(t0, t0 + block_size)
        s, rows = _sparse_scores(qa[rows_t], kv_ext, idx[rows_t], scale)
        p = probs(s, lse_a[rows_t])
        dp = torch.einsum("thd,tkd->thk", do[rows_t], rows[..., :d_v])
        ds = p * (dp - delta[rows_t].unsqueeze(-1)) * scale
        dq[rows_t] = torch.einsum("thk,tkd->thd", ds, rows)
        d_rows = torch.einsum("thk,thd->tkd", ds, qa[rows_t])
        d_rows[..., :d_v] += torch.einsum("thk,thd->tkd", p, do[rows_t])
        dkv.index_add_(0, idx[rows_t].flatten(), d_rows.flatten(0, 1))
    dsinks = q.new_zeros(0)
    if sinks is not None:
        dsinks = -(torch.exp(sinks.to(acc) - lse_a) * delta).sum(0).to(sinks.dtype)
    return dq.to(q.dtype), dkv[:-1].to(kv.dtype), dsinks


@sparse_attention_backward_op.register_fake
def _(d_out: Tensor, d_lse: Tensor, q: Tensor, kv: Tensor, flat_indices: Tensor, out: Tensor, lse: Tensor,
      sinks: Tensor | None, scale: float, d_v: int, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(kv), dsinks


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, kv, indices, sinks, scale, d_v, block_size = inputs
    # indices saved flat (a compiled backward's saved [T, K] would have a symbolic stride): unflatten_rows
    ctx.save_for_backward(q, kv, indices.reshape(-1), *output, sinks)
    ctx.scale, ctx.d_v, ctx.block_size = scale, d_v, block_size


def _backward(ctx: Any, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor | None, ...]:
    q, kv, flat_indices, out, lse, sinks = ctx.saved_tensors
    dq, dkv, dsinks = sparse_attention_backward_op(
        d_out, d_lse, q, kv, flat_indices, out, lse, sinks, ctx.scale, ctx.d_v, ctx.block_size
    )
    return dq, dkv, None, None if sinks is None else dsinks, None, None, None


sparse_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cpkv::selected_probs", mutates_args=())
def selected_probs_op(q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, scale: float, block_size: int) -> Tensor:
    """Head-summed probabilities ``P[t, k] = sum_h exp(scale * q[t, h] . kv[indices[t, k]] - lse[t, h])``.

    Args:
        q: [T, H, D] float. kv: [N_c, D]. indices: [T, K] int, -1 padded. lse: [T, H] float.
        scale: score scale. block_size: rows per block.

    Returns:
        [T, K] fp32 (fp64 for fp64 q), 0 at padding. No autograd: pass detached inputs.

    Raises:
        Nothing is validated (no host sync).
    """
    acc = acc_dtype(q.dtype)
    qa, kv_ext, lse_a = q.to(acc), _extended(kv, acc), lse.to(acc)
    idx = padded_rows(indices, kv.shape[0])
    out = qa.new_zeros(indices.shape)
    for t0 in range(0, q.shape[0], block_size):
        rows_t = slice(t0, t0 + block_size)
        s, _ = _sparse_scores(qa[rows_t], kv_ext, idx[rows_t], scale)
        out[rows_t] = probs(s, lse_a[rows_t]).sum(1)
    return out


@selected_probs_op.register_fake
def _(q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, scale: float, block_size: int) -> Tensor:
    return q.new_empty(indices.shape, dtype=acc_dtype(q.dtype))


# --------------------------------------------------------------------------- validated entry points


def _check_sparse(q: Tensor, kv: Tensor, indices: Tensor, d_v: int | None) -> None:
    check_tensor_form("q", q, 3)
    check_tensor_form("kv", kv, 2)
    check_tensor_form("indices", indices, 2, floating=False)
    check_same("kv.dtype must match q", kv.dtype, q.dtype)
    check_same("kv.device, indices.device must match q", (kv.device, indices.device), (q.device,) * 2)
    check_same("kv.shape[1] must match q (D)", kv.shape[1], q.shape[2])
    check_same("indices.shape[0] must match q (T)", indices.shape[0], q.shape[0])
    if d_v is not None:
        check_positive_int("d_v", d_v)
        if d_v > kv.shape[1]:
            raise ValueError(f"d_v must be <= kv.shape[1]={kv.shape[1]}, got {d_v}")
    if indices.numel() > 0 and (int(indices.min()) < -1 or int(indices.max()) >= kv.shape[0]):
        raise ValueError(f"indices must lie in [-1, N_c={kv.shape[0]}), got "
                         f"[{int(indices.min())}, {int(indices.max())}]")


def sparse_attention(
    q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float | None = None,
    sinks: Tensor | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
) -> AttentionResult:
    """Shared-KV (MQA) sparse attention: each query attends to exactly its listed kv rows.

    Row ``t`` attends in one softmax (plus the sink) to keys ``kv[indices[t, k]]`` with values
    ``kv[indices[t, k], :d_v]``. ``-1`` entries are padding, anywhere in the row; a row with no
    valid entry and no sink gives out 0 and lse -inf. Duplicate valid indices count as separate
    keys (callers avoid them). Validates (host-syncing on ``indices``), then calls the custom op
    ``cpkv::sparse_attention``, whose backward recomputes P per block; memory is
    O(block_size * K * (D + H)) beyond the inputs.

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
    check_positive_int("block_size", block_size)
    check_sinks(sinks, q)
    out, lse = sparse_attention_op(q, kv, indices, sinks, scale_or_default(scale, q), d_v, block_size)
    return AttentionResult(out, lse)


def sparse_attention_head_probs(
    q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, scale: float | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Tensor:
    """Head-summed attention probability of every listed entry (the indexer KL target).

    ``P[t, k] = sum_h exp(score[t, h, k] - lse[t, h])``, 0 at ``-1`` padding, with ``lse`` (and
    ``scale``) those of ``sparse_attention``, so the sink and all listed keys are in the
    denominator. No gradient (inputs are detached). Calls the custom op ``cpkv::selected_probs``.

    Args:
        q, kv, indices, scale, block_size: as :func:`sparse_attention`. lse: [T, H] float.

    Returns:
        [T, K] fp32 (fp64 for fp64 q).

    Raises:
        TypeError, ValueError: as ``sparse_attention``; ValueError if ``lse`` is not [T, H].
    """
    _check_sparse(q, kv, indices, None)
    check_tensor_form("lse", lse, 2)
    check_same("lse.shape must match q ([T, H])", tuple(lse.shape), tuple(q.shape[:2]))
    check_positive_int("block_size", block_size)
    result: Tensor = selected_probs_op(
        q.detach(), kv.detach(), indices, lse.detach(), scale_or_default(scale, q), block_size
    )
    return result
