"""Brute-force single-process oracle of :class:`~cpkv.v4.layer.V4Attention`.

Builds explicit masks over ``[original tokens ; compressed entries]`` for the whole
packed batch and runs one dense softmax with sinks. It shares only the learned
modules (projections, compressor, indexer) with the CP pipeline, not its index math.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpkv.compress_mode import LayerCompressMode
from cpkv.index_keys import round_index_keys, round_index_queries
from cpkv.plan.conventions import token_positions, validate_cu_seqlens
from cpkv.plan.segments import CompressedPlan, plan_segments
from cpkv.v4.indexer import Indexer
from cpkv.v4.layer import LayerOutput, V4Attention


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends gradient 1 into ``loss``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, loss: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


def _document_ids(cu_seqlens: Tensor, num: int) -> Tensor:
    return torch.searchsorted(cu_seqlens[1:].long(), torch.arange(num, device=cu_seqlens.device), right=True)


def _dense(q: Tensor, keys: Tensor, mask: Tensor, d_v: int, sinks: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """Dense attention ``[T, H, d_v]`` and probabilities ``[T, H, K]`` (sink in the denominator)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("thd,kd->thk", q.to(dtype), keys.to(dtype)) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(dtype)[None, :, None].expand(scores.shape[0], -1, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    row_max = scores.amax(-1, keepdim=True).clamp(min=-1e30).detach()
    weights = (scores - row_max).exp()
    probs = weights / weights.sum(-1, keepdim=True).clamp(min=1e-30)
    probs = probs[..., : keys.shape[0]]
    return torch.einsum("thk,kd->thd", probs, keys.to(dtype)[:, :d_v]).to(q.dtype), probs


def reference_forward(layer: V4Attention, x: Tensor, cu_seqlens: Tensor, *, grad_scale: float = 1.0) -> LayerOutput:
    """``layer`` on the whole packed batch ``x`` ``[T, hidden]`` in one process, by dense brute force.

    Independent of the CP pipeline: explicit ``[T, T + N_c]`` masks, a dense softmax with
    sinks, and the indexer loss by plain autograd of ``grad_scale * sum_t KL_t / T``. Memory is
    quadratic in ``T``: for tests and the demo.

    Args:
        layer: the :class:`V4Attention` (its parameters are shared with the CP run).
        x: ``[T, hidden]`` the whole packed batch. cu_seqlens: ``[B + 1]`` leading-zero, last = T.
        grad_scale: multiplies the indexer-loss gradient, as in the CP run.

    Returns:
        :class:`LayerOutput` (``out`` ``[T, hidden]``, the indexer loss or ``None``).

    Raises:
        ValueError: invalid ``cu_seqlens``.
    """
    c = layer.config
    validate_cu_seqlens(cu_seqlens, num_tokens=x.shape[0])
    num = x.shape[0]
    positions = token_positions(cu_seqlens, 0, num)
    docs = _document_ids(cu_seqlens, num)
    q, kv = layer.project(x, positions)
    tok = torch.arange(num, device=x.device)
    mask = (docs[:, None] == docs[None, :]) & (tok[None, :] <= tok[:, None])
    if c.window is not None:
        mask &= tok[None, :] > tok[:, None] - c.window
    keys, loss = kv, None
    compressed = None
    if c.mode.compresses and layer.compressor is not None:
        whole = plan_segments(cu_seqlens, cu_seqlens, compress_ratios=[c.compress_ratio])
        cmp_plan, cu_cmp = whole.compressed[0], whole.visible[0].cu_seqlens
        compressed = layer.compressor(x, cmp_plan)
    if compressed is not None:
        entry_doc = _document_ids(cu_cmp, compressed.shape[0])
        entry_j = torch.arange(compressed.shape[0], device=x.device) - cu_cmp.long()[entry_doc]
        visible = (entry_doc[None, :] == docs[:, None]) & (entry_j[None, :] < (positions[:, None] + 1) // c.compress_ratio)
        chosen = visible
        if c.mode is LayerCompressMode.INDEXER and layer.indexer is not None:
            chosen, index_scores = _indexer_selection(
                layer.indexer, c.topk, x, positions, cmp_plan, visible, c.index_key_dtype, c.index_query_dtype,
            )
        keys = torch.cat([kv, compressed.to(kv.dtype)])
        mask = torch.cat([mask, chosen], dim=1)
    scale = c.head_dim**-0.5
    out, probs = _dense(q, keys, mask, c.d_v, layer.sinks, scale)
    if compressed is not None and c.mode is LayerCompressMode.INDEXER:
        kl = _indexer_kl(probs[..., num:].sum(1).detach(), index_scores, chosen)
        loss = kl.detach().float()
        out = _AttachLoss.apply(out, kl * (grad_scale / num))  # type: ignore[no-untyped-call]
    return LayerOutput(layer.wo(out.flatten(1)), loss)


def _indexer_selection(
    indexer: Indexer, topk: int, x: Tensor, positions: Tensor, cmp_plan: CompressedPlan, visible: Tensor,
    key_dtype: torch.dtype | None, query_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:
    """Top-k mask ``[T, N_c]`` over visible entries and the dense indexer scores (keys and queries rounded)."""
    q_index, weights = indexer.queries(x.detach(), positions)
    q_index = round_index_queries(q_index, query_dtype)
    k_index = indexer.keys(x.detach(), cmp_plan)
    if k_index is None:
        raise RuntimeError("the indexer's compressor returned None while the main compressor did not")
    k_index = round_index_keys(k_index, key_dtype)
    dtype = torch.promote_types(q_index.dtype, torch.float32)
    dots = torch.einsum("thd,nd->thn", q_index.to(dtype), k_index.to(dtype)).relu()
    scores = torch.einsum("th,thn->tn", weights.to(dtype), dots)
    masked = scores.detach().masked_fill(~visible, float("-inf"))
    k = min(topk, scores.shape[1])
    # Ties (relu makes exact zeros common) go to the earlier entry: a stable descending sort.
    values, order = masked.sort(dim=1, descending=True, stable=True)
    chosen = torch.zeros_like(visible).scatter(1, order[:, :k], values[:, :k] > float("-inf"))
    return chosen, scores


def _indexer_kl(head_probs: Tensor, scores: Tensor, chosen: Tensor) -> Tensor:
    """``sum_t KL(p_t || softmax(I_t over chosen))``, differentiable in ``scores`` only."""
    picked = head_probs.masked_fill(~chosen, 0.0)
    target = picked / picked.sum(-1, keepdim=True).clamp(min=1e-30)
    has = chosen.any(-1)
    safe = scores.masked_fill(~chosen, float("-inf")).masked_fill(~has[:, None], 0.0)  # no NaN on empty rows
    log_pred = torch.log_softmax(safe, dim=-1)
    terms = torch.where(chosen, target * (target.clamp(min=1e-30).log() - log_pred), torch.zeros_like(target))
    return terms.sum(-1).masked_fill(~has, 0.0).sum()
