"""The narrow interface between the attention pipeline and the fused-op backends.

A backend implements four ops over packed (TND) tensors; the pipeline calls nothing
else. Each op receives the :class:`~cpkv.attention_plan.SegmentPlan` of the call so a
backend can read whatever convention its kernel wants from it (leading-zero int32
``cu_seqlens_*`` for flash/varlen kernels, the Ascend host tuples ``actual_seq_*``),
built once per micro-batch rather than per layer.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from cpkv.attention_plan import CompressedPlan, SegmentPlan
from cpkv.backends.reference import AttentionResult
from cpkv.indexer_loss import IndexerLossConfig, SparseAttentionWithLoss


class AttentionBackend(Protocol):
    """The ops the pipeline calls. Shapes use SEMANTICS letters; all masks are bottom-right causal."""

    name: str

    def varlen_attention(
        self, q: Tensor, k: Tensor, v: Tensor, segments: SegmentPlan, *,
        scale: float, window: int | None, sinks: Tensor | None,
    ) -> AttentionResult:
        """q ``[T_q, H, D]``, k ``[T_kv, H_kv, D]``, v ``[T_kv, H_kv, D_v]`` paired by ``segments``."""
        ...

    def sparse_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, segments: SegmentPlan, *,
        d_v: int, scale: float, sinks: Tensor | None,
    ) -> AttentionResult:
        """Shared-KV attention of q ``[T_q, H, D]`` over rows ``indices`` ``[T_q, K]`` (-1 padded) of kv ``[N, D]``."""
        ...

    def indexer_topk(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, segments: SegmentPlan,
        compressed: CompressedPlan, *, topk: int,
    ) -> Tensor:
        """``[T_q, topk]`` int64 rows of ``k_index`` ``[N_c, D_I]`` with the highest visible scores, -1 padded."""
        ...

    def sparse_attention_with_indexer_loss(
        self, q: Tensor, kv: Tensor, indices: Tensor, selected: Tensor, q_index: Tensor, k_index: Tensor,
        weights: Tensor, segments: SegmentPlan, *, sinks: Tensor | None, config: IndexerLossConfig,
    ) -> SparseAttentionWithLoss:
        """Sparse attention whose backward also yields the indexer's KL gradients (``grad_scale / N``)."""
        ...
