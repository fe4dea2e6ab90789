"""Sparse shared-KV attention with the lightning indexer's KL loss (SEMANTICS section 6).

Like the fused NPU op, the attention's backward also produces the indexer gradients:
:func:`attach_indexer_loss` wraps the attention output in an identity autograd Function
whose backward injects ``(softmax(I_t) - p_t) * grad_scale / N`` into the indexer inputs
(``N``: query tokens of the whole CP group, ``global_num_seqs``), whatever the upstream
gradient of the returned loss is, so that summing over CP ranks equals the CP = 1 result.
``grad_scale`` and ``N`` travel in ``ctx`` (no class state), so layers with different
scales, or backward passes on different threads, never mix. Every backend (reference, NPU,
ring rounds) uses this one injection.

Target ``p[t]``: the main attention's probabilities of the selected compressed entries
(window keys, compressed entries and the sink share one denominator), summed over all
query heads and L1-normalised over the selection. Megatron instead renormalises per
head before summing; with a window and a sink in the denominator the two differ and
cpkv uses the definition above. No gradient flows into the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from cpkv.backends.reference import sparse_attention, sparse_attention_head_probs


@dataclass(frozen=True)
class IndexerLossConfig:
    """Per-call options of :func:`sparse_attention_with_indexer_loss`.

    Attributes:
        d_v: value channels (the first ``d_v`` of the shared kv).
        scale: softmax scale of the main attention.
        num_window: leading columns of ``indices`` that are window keys; the remaining
            ``K`` columns are the indexer's selections, in the order of ``selected``.
        grad_scale: multiplies the indexer gradients (loss scale, micro-batch factor).
        num_global_queries: ``N``, query tokens of the whole CP group.
        block_size: query block of the reference computation.
    """

    d_v: int
    scale: float
    num_window: int
    grad_scale: float
    num_global_queries: int
    block_size: int = 1024


class SparseAttentionWithLoss(NamedTuple):
    """``out`` ``[T, H, d_v]`` and ``loss``: ``sum_t KL(p_t || softmax(I_t))`` over local queries (0-d, fp32, for logging)."""

    out: Tensor
    loss: Tensor


def selected_index_scores(q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, block_size: int) -> Tensor:
    """Indexer scores of the selected entries, ``[T, K]`` fp32 (fp64 for fp64), -inf at -1 padding.

    Args:
        q_index: ``[T, H_I, D_I]``; k_index: ``[N_c, D_I]``; weights: ``[T, H_I]``;
        selected: ``[T, K]`` int rows of ``k_index``, -1 padded.
    """
    dtype = torch.promote_types(q_index.dtype, torch.float32)
    blocks = []
    for start in range(0, selected.shape[0], block_size):
        sel = selected[start : start + block_size]
        keys = k_index.to(dtype)[sel.clamp(min=0)]
        dots = torch.einsum("thd,tkd->thk", q_index[start : start + block_size].to(dtype), keys).relu()
        score = torch.einsum("th,thk->tk", weights[start : start + block_size].to(dtype), dots)
        blocks.append(score.masked_fill(sel < 0, float("-inf")))
    if not blocks:
        return q_index.new_zeros(selected.shape, dtype=dtype)
    return torch.cat(blocks)


def kl_terms(scores: Tensor, target: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per-query KL(target || softmax(scores)) and softmax(scores), 0 where nothing is selected."""
    has_any = valid.any(dim=-1, keepdim=True)
    log_pred = torch.log_softmax(scores.masked_fill(~has_any, 0.0), dim=-1)
    log_pred = torch.where(valid, log_pred, torch.zeros_like(log_pred))
    log_target = torch.where(target > 0, target.clamp_min(1e-30).log(), torch.zeros_like(target))
    kl = (target * (log_target - log_pred)).sum(dim=-1)
    return kl, torch.where(valid, log_pred.exp(), torch.zeros_like(log_pred))


def input_grads(output: Tensor, inputs: list[Tensor | None], grad: Tensor) -> list[Tensor | None]:
    """``d output / d inputs`` contracted with ``grad``; ``None`` for inputs without grad."""
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    if not wanted or not output.requires_grad:
        return [None] * len(inputs)
    found = iter(torch.autograd.grad(output, wanted, grad, allow_unused=True))
    return [next(found) if t is not None and t.requires_grad else None for t in inputs]


def sparse_attention_with_indexer_loss(
    q: Tensor, kv: Tensor, indices: Tensor, selected: Tensor, q_index: Tensor, k_index: Tensor,
    weights: Tensor, *, sinks: Tensor | None, config: IndexerLossConfig,
) -> SparseAttentionWithLoss:
    """Sparse shared-KV attention whose backward also trains the indexer.

    Args:
        q: ``[T, H, D]`` queries. kv: ``[N, D]`` shared kv rows (values: first ``d_v``).
        indices: ``[T, W + K]`` int rows of ``kv``, -1 padded: ``num_window`` window keys,
            then the ``K`` selected compressed entries (same order as ``selected``).
        selected: ``[T, K]`` int rows of ``k_index`` chosen by the indexer, -1 padded.
        q_index, k_index, weights: indexer queries ``[T, H_I, D_I]``, keys ``[N_c, D_I]`` and
            weights ``[T, H_I]`` (detached from the main graph by the caller).
        sinks: ``[H]`` per-head sink logits or ``None``.
        config: :class:`IndexerLossConfig` (``grad_scale`` and ``N`` live there, per call).

    Returns:
        :class:`SparseAttentionWithLoss`. Backward: attention gradients for ``q``, ``kv``,
        ``sinks``; indexer gradients ``(softmax(I_t) - p_t) * grad_scale / N`` on the
        selected scores, chained into ``q_index``, ``k_index`` and ``weights``.

    Raises:
        ValueError: ``indices`` not ``num_window + K`` wide.
    """
    if indices.shape[1] != config.num_window + selected.shape[1]:
        raise ValueError(
            f"indices must be [T, num_window + K] = [T, {config.num_window + selected.shape[1]}], got {tuple(indices.shape)}"
        )
    result = sparse_attention(q, kv, indices, d_v=config.d_v, scale=config.scale, sinks=sinks, block_size=config.block_size)
    with torch.no_grad():
        probs = sparse_attention_head_probs(q, kv, indices, result.lse, scale=config.scale, block_size=config.block_size)
    return attach_indexer_loss(result.out, q_index, k_index, weights, selected, probs[:, config.num_window :], config=config)


class _AttachIndexerLoss(torch.autograd.Function):
    """Identity on ``out``; its backward injects the indexer gradients (as the fused op does)."""

    @staticmethod
    def forward(
        ctx: Any, out: Tensor, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor,
        target: Tensor, config: IndexerLossConfig,
    ) -> tuple[Tensor, Tensor]:
        scores = selected_index_scores(q_index, k_index, weights, selected, config.block_size)
        kl, _ = kl_terms(scores, target, selected >= 0)
        ctx.save_for_backward(q_index, k_index, weights, selected, target)
        ctx.config = config
        loss = kl.sum().float()
        ctx.mark_non_differentiable(loss)
        return out.view_as(out), loss

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        q_index, k_index, weights, selected, target = ctx.saved_tensors
        config: IndexerLossConfig = ctx.config
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q_index, k_index, weights)]
        with torch.enable_grad():
            scores = selected_index_scores(inputs[0], inputs[1], inputs[2], selected, config.block_size)
        valid = selected >= 0
        _, pred = kl_terms(scores.detach(), target, valid)
        grad_scores = torch.where(valid, (pred - target) * (config.grad_scale / config.num_global_queries), 0.0)
        return (grad_out, *input_grads(scores, list(inputs), grad_scores), None, None, None)


def attach_indexer_loss(
    out: Tensor, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, selected_probs: Tensor,
    *, config: IndexerLossConfig,
) -> SparseAttentionWithLoss:
    """The indexer KL loss for an attention computed elsewhere (e.g. merged from ring rounds).

    Args:
        out: ``[T, H, d_v]`` the final attention output; returned unchanged, its backward
            injects ``(softmax(I_t) - p_t) * grad_scale / N`` into the indexer inputs.
        q_index, k_index, weights, selected: as :func:`sparse_attention_with_indexer_loss`.
        selected_probs: ``[T, K]`` the attention probabilities of the selected entries summed
            over heads, with the full denominator (window, entries and sink).
        config: ``grad_scale``, ``num_global_queries`` and ``block_size`` are used.

    Returns:
        :class:`SparseAttentionWithLoss` (``out`` unchanged in value, ``loss`` for logging).
    """
    valid = selected >= 0
    picked = torch.where(valid, selected_probs.to(torch.promote_types(q_index.dtype, torch.float32)), 0.0)
    target = picked / picked.sum(-1, keepdim=True).clamp_min(torch.finfo(picked.dtype).tiny)
    attached, loss = _AttachIndexerLoss.apply(  # type: ignore[no-untyped-call]
        out, q_index, k_index, weights, selected, target.detach(), config
    )
    return SparseAttentionWithLoss(attached, loss)
