"""The lightning indexer's KL loss, attached to an attention output (docs/semantics.md, "The indexer and its KL loss").

Like the fused NPU op, the attention's backward also produces the indexer gradients:
:func:`attach_indexer_loss` ties the custom op ``cpkv::indexer_kl`` to the attention output
(:func:`cpkv.ties.tie`: ``out`` itself, no copy, whose backward also runs the op's), and the op's registered backward injects
``(softmax(I_t) - p_t) * grad_scale / N`` into the indexer inputs (``N``: query tokens of the
whole CP group, ``global_num_seqs``), whatever the upstream gradient of the loss is, so that
summing over CP ranks equals the CP = 1 result. ``grad_scale / N`` is an argument of the op
(kept on its autograd ctx, no class state), so layers with different scales, or backward
passes on different threads, never mix. The gradients of the selected scores
``I[t, k] = sum_h w[t, h] * relu(q_I[t, h] . k_I[sel[t, k]])`` are written out by hand (no
``torch.autograd.grad``, no host sync), so the pipeline compiles with ``fullgraph=True``.
Every backend (reference, NPU, ring rounds) uses this one injection.

Target ``p[t]``: the main attention's probabilities of the selected compressed entries
(window keys, compressed entries and the sink share one denominator), summed over all
query heads and L1-normalised over the selection. Megatron instead renormalises per
head before summing; with a window and a sink in the denominator the two differ and
cpkv uses the definition above. No gradient flows into the target.

Shapes legend: ``T`` local query tokens, ``H`` attention heads, ``d_v`` value dim, ``H_I``
indexer heads, ``D_I`` indexer dim, ``N_c`` indexer key rows, ``K`` selected entries per query.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from cpkv.checks import check_positive_int
from cpkv.ties import tie

__all__ = [
    "IndexerKL", "IndexerLoss", "attach_indexer_loss", "indexer_kl_backward_op", "indexer_kl_op", "kl_terms",
    "selected_index_scores",
]

_BLOCK_SIZE = 1024  # query rows per block of the indexer KL op


class IndexerLoss(NamedTuple):
    """Result of :func:`attach_indexer_loss`.

    Attributes:
        out: ``[T, H, d_v]`` the attention output, unchanged in value; its backward injects
            the indexer gradients.
        loss: ``sum_t KL(p_t || softmax(I_t))`` over the local queries, 0-d fp32, detached
            (for logging).
    """

    out: Tensor
    loss: Tensor


class IndexerKL(Protocol):
    """The contract of ``cpkv::indexer_kl`` (:func:`indexer_kl_op`) that a backend's kernels implement.

    Called as ``kl(q_index, k_index, weights, selected, target, grad_factor)`` with the
    arguments of :func:`indexer_kl_op`; returns ``(loss, anchor)`` (0-d fp32 each) whose
    backward injects the gradients of ``grad_factor * sum_t KL_t`` whatever the upstream
    gradients are. :meth:`cpkv.backends.base.AttentionBackend.indexer_kl` is one.
    """

    def __call__(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
    ) -> tuple[Tensor, Tensor]:
        """``(loss, anchor)`` of the indexer KL over the selection."""
        ...


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _selected_block(
    q_index: Tensor, k_ext: Tensor, weights: Tensor, rows: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Gathered keys [B, K, D_I], dots [B, H_I, K] and scores [B, K] (-inf at padding) of one block.

    ``k_ext``: k_index with a zero row appended; ``rows``: [B, K] int64 rows of it, padding = last row.
    """
    keys = k_ext[rows]
    dots = torch.einsum("thd,tkd->thk", q_index, keys)
    scores = torch.einsum("th,thk->tk", weights, dots.relu())
    return keys, dots, scores.masked_fill(rows == k_ext.shape[0] - 1, float("-inf"))


def _extended(q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor) -> tuple[Tensor, ...]:
    """Inputs in the accumulation dtype, k_index with a zero padding row, selected with -1 -> N_c."""
    acc = _acc(q_index.dtype)
    k_ext = torch.cat([k_index.to(acc), k_index.new_zeros((1, k_index.shape[1]), dtype=acc)])
    rows = selected.long()
    rows = torch.where(rows < 0, k_index.shape[0], rows)
    return q_index.to(acc), k_ext, weights.to(acc), rows


def selected_index_scores(
    q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, block_size: int = _BLOCK_SIZE
) -> Tensor:
    """Indexer scores of the selected entries, ``I[t, k] = sum_h w[t, h] * relu(q_I[t, h] . k_I[sel[t, k]])``.

    Args:
        q_index: ``[T, H_I, D_I]`` float; k_index: ``[N_c, D_I]`` float; weights: ``[T, H_I]`` float.
        selected: ``[T, K]`` int rows of ``k_index``, -1 padded (padding never reads a row).
        block_size: query rows per block.

    Returns:
        ``[T, K]`` fp32 (fp64 for fp64 q_index), -inf at padding; not differentiable.
    """
    q_a, k_ext, w_a, rows = _extended(q_index, k_index, weights, selected)
    scores = q_a.new_zeros(selected.shape)
    for t0 in range(0, selected.shape[0], block_size):
        block = slice(t0, t0 + block_size)
        scores[block] = _selected_block(q_a[block], k_ext, w_a[block], rows[block])[2]
    return scores


def kl_terms(scores: Tensor, target: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per-query ``KL(target || softmax(scores))`` and ``softmax(scores)`` over the valid entries.

    Args:
        scores: ``[T, K]`` float (any value at invalid entries). target: ``[T, K]`` float,
            0 at invalid entries. valid: ``[T, K]`` bool.

    Returns:
        ``(kl [T], pred [T, K])``; both 0 where nothing is valid, ``pred`` 0 at invalid entries.
    """
    has_any = valid.any(dim=-1, keepdim=True)
    log_pred = torch.log_softmax(scores.masked_fill(~has_any, 0.0), dim=-1)
    log_pred = torch.where(valid, log_pred, torch.zeros_like(log_pred))
    log_target = torch.where(target > 0, target.clamp_min(1e-30).log(), torch.zeros_like(target))
    kl = (target * (log_target - log_pred)).sum(dim=-1)
    return kl, torch.where(valid, log_pred.exp(), torch.zeros_like(log_pred))


@torch.library.custom_op("cpkv::indexer_kl", mutates_args=())
def indexer_kl_op(
    q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float
) -> tuple[Tensor, Tensor]:
    """The indexer KL of the selected entries, with the injected gradients as its backward.

    Args:
        q_index: [T, H_I, D_I] float. k_index: [N_c, D_I] float. weights: [T, H_I] float.
        selected: [T, K] int rows of k_index, -1 padded. target: [T, K] float ``p_t`` (0 at padding,
            rows sum to 1 or 0). grad_factor: ``grad_scale / N``.

    Returns:
        ``(loss, anchor)``: ``sum_t KL(p_t || softmax(I_t))`` (0-d fp32) and a 0-d fp32 zero. The
        backward ignores the upstream gradients and returns those of ``grad_factor * sum_t KL_t``
        (:func:`indexer_kl_backward_op`).
    """
    scores = selected_index_scores(q_index, k_index, weights, selected)
    kl, _ = kl_terms(scores, target.to(scores.dtype), selected >= 0)
    return kl.sum().float(), q_index.new_zeros((), dtype=torch.float32)


@indexer_kl_op.register_fake
def _(q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor,
      grad_factor: float) -> tuple[Tensor, Tensor]:
    return q_index.new_empty((), dtype=torch.float32), q_index.new_empty((), dtype=torch.float32)


@torch.library.custom_op("cpkv::indexer_kl_backward", mutates_args=())
def indexer_kl_backward_op(
    q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``grad_factor * sum_t KL_t`` w.r.t. q_index, k_index, weights (input dtypes).

    ``dI[t, k] = (softmax(I_t)[k] - target[t, k]) * grad_factor`` on valid entries, chained by
    hand through ``I = sum_h w * relu(q . k)``; -1 padding adds nothing to any k_index row.
    """
    q_a, k_ext, w_a, rows = _extended(q_index, k_index, weights, selected)
    d_q, d_k, d_w = torch.zeros_like(q_a), torch.zeros_like(k_ext), torch.zeros_like(w_a)
    for t0 in range(0, selected.shape[0], _BLOCK_SIZE):
        block = slice(t0, t0 + _BLOCK_SIZE)
        keys, dots, scores = _selected_block(q_a[block], k_ext, w_a[block], rows[block])
        valid = selected[block] >= 0
        tgt = target[block].to(scores.dtype)
        _, pred = kl_terms(scores, tgt, valid)
        d_scores = torch.where(valid, (pred - tgt) * grad_factor, 0.0)  # [B, K]
        d_w[block] = torch.einsum("tk,thk->th", d_scores, dots.relu())
        d_dots = d_scores[:, None, :] * w_a[block, :, None] * (dots > 0)  # [B, H_I, K]
        d_q[block] = torch.einsum("thk,tkd->thd", d_dots, keys)
        d_k.index_add_(0, rows[block].flatten(), torch.einsum("thk,thd->tkd", d_dots, q_a[block]).flatten(0, 1))
    return d_q.to(q_index.dtype), d_k[:-1].to(k_index.dtype), d_w.to(weights.dtype)


@indexer_kl_backward_op.register_fake
def _(q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor,
      grad_factor: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q_index), torch.empty_like(k_index), torch.empty_like(weights)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    *tensors, grad_factor = inputs
    ctx.save_for_backward(*tensors)
    ctx.grad_factor = grad_factor


def _backward(ctx: Any, _grad_loss: Tensor, _grad_anchor: Tensor) -> tuple[Tensor | None, ...]:
    d_q, d_k, d_w = indexer_kl_backward_op(*ctx.saved_tensors, ctx.grad_factor)
    return d_q, d_k, d_w, None, None, None


indexer_kl_op.register_autograd(_backward, setup_context=_setup_context)


def attach_indexer_loss(
    out: Tensor, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, selected_probs: Tensor,
    *, grad_scale: float, num_global_queries: int, kl: IndexerKL | None = None,
) -> IndexerLoss:
    """Attach the indexer KL loss to an attention output (fused, merged from ring rounds, ...).

    The backward of the returned ``out`` injects ``(softmax(I_t) - p_t) * grad_scale / N`` into
    ``q_index``, ``k_index`` and ``weights`` (``N = num_global_queries``), whatever the upstream
    gradient of ``loss`` is; gradients into ``out`` pass through unchanged. No host sync;
    compiles with ``torch.compile(fullgraph=True)``.

    Args:
        out: ``[T, H, d_v]`` the final attention output.
        q_index: ``[T, H_I, D_I]`` float indexer queries; k_index: ``[N_c, D_I]`` float keys;
            weights: ``[T, H_I]`` float head weights (detached from the main graph by the caller).
        selected: ``[T, K]`` int rows of ``k_index`` chosen by the indexer, -1 padded.
        selected_probs: ``[T, K]`` float attention probabilities of the selected entries summed
            over heads, with the full denominator (window, entries and sink); no gradient.
        grad_scale: multiplies the indexer gradients (loss scale, micro-batch factor).
        num_global_queries: ``N``, query tokens of the whole CP group (>= 1).
        kl: the op computing the loss and injecting its gradients (a backend's
            :meth:`~cpkv.backends.base.AttentionBackend.indexer_kl`, e.g. the Triton kernels on
            CUDA); None: :func:`indexer_kl_op` (pure torch).

    Returns:
        :class:`IndexerLoss` ``(out, loss)``: ``out`` equal in value to the input, ``loss`` 0-d
        fp32 detached ``sum_t KL(p_t || softmax(I_t))`` over the local queries.

    Raises:
        ValueError: ``selected_probs`` not shaped like ``selected``, or ``selected`` not ``[T, K]``
            with ``T`` the rows of ``q_index``; ``num_global_queries < 1``.
        TypeError: ``num_global_queries`` is not an int.

    Example:
        >>> out, q_i, k_i, w = torch.randn(3, 2, 4), torch.randn(3, 2, 5), torch.randn(6, 5), torch.randn(3, 2)
        >>> sel, probs = torch.tensor([[0, 1], [2, -1], [-1, -1]]), torch.rand(3, 2)
        >>> attach_indexer_loss(out, q_i, k_i, w, sel, probs, grad_scale=1.0, num_global_queries=3).loss.shape
        torch.Size([])
    """
    check_positive_int("num_global_queries", num_global_queries)
    if selected.dim() != 2 or selected.shape[0] != q_index.shape[0] or selected_probs.shape != selected.shape:
        raise ValueError(
            f"selected and selected_probs must both be [T, K] with T = q_index.shape[0] = {q_index.shape[0]}, "
            f"got {tuple(selected.shape)} and {tuple(selected_probs.shape)}"
        )
    valid = selected >= 0
    picked = torch.where(valid, selected_probs.detach().to(_acc(q_index.dtype)), 0.0)
    target = picked / picked.sum(-1, keepdim=True).clamp_min(torch.finfo(picked.dtype).tiny)
    loss, anchor = (kl or indexer_kl_op)(q_index, k_index, weights, selected, target, grad_scale / num_global_queries)
    return IndexerLoss(tie(out, anchor), loss.detach())
