"""The reference backend: the pure-torch custom ops of :mod:`cpkv.backends.reference`, any device.

Every method turns the plan tensors into what the op needs with plain vectorised torch (no
host sync, no validation) and calls one ``cpkv::`` custom op, so a layer using this backend
compiles with ``torch.compile(fullgraph=True)``. The plans were validated when built.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpkv.backends.base import AttentionResult, KeyRanges
from cpkv.backends.reference.common import DEFAULT_BLOCK_SIZE
from cpkv.backends.reference.indexer import indexer_topk_op
from cpkv.backends.reference.sparse import selected_probs_op, sparse_attention_op
from cpkv.backends.reference.varlen import range_attention_op
from cpkv.checks import check_positive_int
from cpkv.indexer_loss import indexer_kl_op
from cpkv.plan.segments import EntryVisibility, SegmentPlan

__all__ = ["ReferenceBackend"]


class ReferenceBackend:
    """Exact, chunked, differentiable pure-torch ops (fp32 accumulation, fp64 for fp64): the oracle.

    The methods validate nothing (the plans were validated when built, and checks would
    host-sync inside a compiled layer); malformed tensors give torch's indexing errors.

    Args:
        block_size: query rows (and keys) per tile of every op; memory grows with its square.

    Raises:
        TypeError, ValueError: ``block_size`` is not an int ``>= 1``.

    Example:
        >>> from cpkv.plan.segments import plan_segments
        >>> plan = plan_segments(torch.tensor([0, 2, 5]), torch.tensor([0, 3, 7]))
        >>> q, k, v = torch.randn(5, 2, 8), torch.randn(7, 1, 8), torch.randn(7, 1, 4)
        >>> ReferenceBackend().varlen_attention(q, k, v, plan, scale=0.3, window=None, sinks=None).out.shape
        torch.Size([5, 2, 4])
    """

    name = "reference"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.block_size = check_positive_int("block_size", block_size)

    def varlen_attention(
        self, q: Tensor, k: Tensor, v: Tensor, segments: SegmentPlan, *,
        scale: float, window: int | None, sinks: Tensor | None,
    ) -> AttentionResult:
        """Segment attention: q ``[T_q, H, D]``, k ``[T_kv, H_kv, D]``, v ``[T_kv, H_kv, D_v]``.

        Row ``t`` sees kv rows ``[max(doc_row, own_row + 1 - window), own_row]`` of its
        segment (``segments.q_first_rows``, ``segments.q_kv_rows``).

        Returns:
            ``AttentionResult(out [T_q, H, D_v] dtype of q, lse [T_q, H] fp32/fp64)``.
        """
        hi = segments.q_kv_rows.to(q.device, torch.int64) + 1
        lo = segments.q_first_rows.to(q.device, torch.int64)
        if window is not None:
            lo = torch.maximum(lo, hi - window)
        out, lse = range_attention_op(q, k, v, lo, hi, sinks, scale, self.block_size)
        return AttentionResult(out, lse)

    def range_attention(
        self, q: Tensor, k: Tensor, v: Tensor, ranges: KeyRanges, *, scale: float,
    ) -> AttentionResult:
        """Ring-round attention: row ``t`` of q ``[T_q, H, D]`` sees keys ``ranges.lo[t] <= j < ranges.hi[t]``.

        Returns:
            ``AttentionResult(out [T_q, H, D_v], lse [T_q, H])``; lse is -inf on rows that see nothing.
        """
        lo, hi = ranges.lo.to(q.device, torch.int64), ranges.hi.to(q.device, torch.int64)
        out, lse = range_attention_op(q, k, v, lo, hi, None, scale, self.block_size)
        return AttentionResult(out, lse)

    def sparse_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None,
    ) -> AttentionResult:
        """Shared-KV attention of q ``[T, H, D]`` over rows ``indices`` ``[T, K]`` (-1 padded) of kv ``[N, D]``.

        Returns:
            ``AttentionResult(out [T, H, d_v] dtype of q, lse [T, H] fp32/fp64)``.
        """
        out, lse = sparse_attention_op(q, kv, indices, sinks, scale, d_v, self.block_size)
        return AttentionResult(out, lse)

    def sparse_attention_probs(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None, probs_from: int,
    ) -> tuple[AttentionResult, Tensor]:
        """:meth:`sparse_attention`, then :meth:`selected_probs` of ``indices[:, probs_from:]`` under its LSE.

        Returns:
            ``(AttentionResult, probs [T, K - probs_from] fp32/fp64)``; probs without gradient.
        """
        result = self.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks)
        return result, self.selected_probs(q, kv, indices[:, probs_from:], result.lse, scale=scale)

    def selected_probs(self, q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, scale: float) -> Tensor:
        """``[T, K]`` fp32/fp64 head-summed probabilities ``sum_h exp(q_h . kv[indices] * scale - lse_h)``.

        0 at -1 padding; no gradient (inputs are detached).
        """
        result: Tensor = selected_probs_op(q.detach(), kv.detach(), indices, lse.detach(), scale, self.block_size)
        return result

    def indexer_topk(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, segments: SegmentPlan,
        visible: EntryVisibility, *, topk: int, fp8: bool = False,
    ) -> Tensor:
        """``[T, topk]`` int64 rows of ``k_index`` ``[N_c, D_I]`` with the highest visible scores, -1 padded.

        Query ``t`` picks among rows ``[visible_start[t], visible_start[t] + visible_count[t])``;
        ties go to the earlier row. No gradient. ``fp8`` (the inputs are fp8-rounded) changes
        nothing here: the scores are computed from the rounded values in fp32.
        """
        start = visible.visible_start.to(q_index.device, torch.int64)
        end = start + visible.visible_count.to(q_index.device, torch.int64)
        indices, _ = indexer_topk_op(
            q_index.detach(), k_index.detach(), weights.detach(), start, end, topk, self.block_size
        )
        result: Tensor = indices
        return result

    def indexer_kl(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
    ) -> tuple[Tensor, Tensor]:
        """``(loss, anchor)`` of the pure-torch ``cpkv::indexer_kl`` (:func:`cpkv.indexer_loss.indexer_kl_op`).

        q_index ``[T, H_I, D_I]``, k_index ``[N_c, D_I]``, weights ``[T, H_I]`` float;
        selected ``[T, K]`` int, -1 padded; target ``[T, K]`` float (0 at padding). The loss is
        0-d fp32; the backward injects the gradients of ``grad_factor * sum_t KL_t``.
        """
        loss, anchor = indexer_kl_op(q_index, k_index, weights, selected, target, grad_factor)
        return loss, anchor
