"""The reference backend: the pure-torch ops of :mod:`cpkv.backends.reference`, any device."""

from __future__ import annotations

from torch import Tensor

from cpkv.attention_plan import CompressedPlan, SegmentPlan
from cpkv.backends import reference
from cpkv.indexer_loss import IndexerLossConfig, SparseAttentionWithLoss, sparse_attention_with_indexer_loss


class ReferenceBackend:
    """Exact, chunked, differentiable pure-torch ops (fp32 accumulation): the oracle."""

    name = "reference"

    def __init__(self, block_size: int = 1024) -> None:
        self.block_size = block_size

    def varlen_attention(
        self, q: Tensor, k: Tensor, v: Tensor, segments: SegmentPlan, *,
        scale: float, window: int | None, sinks: Tensor | None,
    ) -> reference.AttentionResult:
        return reference.varlen_attention(
            q, k, v, segments.cu_seqlens_q, segments.cu_seqlens_kv,
            scale=scale, window=window, sinks=sinks, block_size=self.block_size,
        )

    def sparse_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, segments: SegmentPlan, *,
        d_v: int, scale: float, sinks: Tensor | None,
    ) -> reference.AttentionResult:
        return reference.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks, block_size=self.block_size)

    def indexer_topk(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, segments: SegmentPlan,
        compressed: CompressedPlan, *, topk: int,
    ) -> Tensor:
        return reference.indexer_topk(
            q_index, k_index, weights, compressed.visible_start, compressed.visible_count,
            topk=topk, block_size=self.block_size,
        ).indices

    def sparse_attention_with_indexer_loss(
        self, q: Tensor, kv: Tensor, indices: Tensor, selected: Tensor, q_index: Tensor, k_index: Tensor,
        weights: Tensor, segments: SegmentPlan, *, sinks: Tensor | None, config: IndexerLossConfig,
    ) -> SparseAttentionWithLoss:
        return sparse_attention_with_indexer_loss(q, kv, indices, selected, q_index, k_index, weights, sinks=sinks, config=config)
