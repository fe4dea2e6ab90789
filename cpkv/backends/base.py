"""The narrow interface between the attention pipeline and the fused-op backends.

A backend implements seven primitives over packed (TND) tensors; the pipeline calls
nothing else (docs/semantics.md, "Backends"). Index plans arrive as plan objects built
once per micro-batch (:class:`~cpkv.plan.segments.SegmentPlan`,
:class:`~cpkv.plan.segments.EntryVisibility`, :class:`~cpkv.plan.segments.KeyRanges`), so a backend reads
whatever convention its kernel wants (leading-zero int32 ``cu_seqlens_*`` for
flash/varlen kernels, the Ascend host tuples ``actual_seq_*``, per-row key ranges)
without a host sync. The indexer KL loss is attached once by the pipeline
(:mod:`cpkv.indexer_loss`) from :meth:`AttentionBackend.selected_probs`, computed (and its
gradients injected) by :meth:`AttentionBackend.indexer_kl`.

A backend that cannot serve a call with a kernel falls back to the reference op with one
``UserWarning`` per backend instance and reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol, runtime_checkable

from torch import Tensor

from cpkv.plan.segments import EntryVisibility, KeyRanges, SegmentPlan

__all__ = [
    "AttentionBackend", "AttentionResult", "BackendName", "CompressedLayer", "CompressedLayerBackend", "CompressedResult",
    "KeyRanges", "unflatten_rows",
]

BackendName = Literal["reference", "cuda", "npu", "auto"]
"""A backend by name: ``"auto"`` picks by the tensors' device (npu, cuda, else reference)."""


class AttentionResult(NamedTuple):
    """Attention output and its natural-log logsumexp (both differentiable where the backend says so).

    Attributes:
        out: ``[T_q, H, D_v]`` in q's dtype.
        lse: ``[T_q, H]`` fp32 (fp64 for fp64 input): logsumexp of the scaled scores of the
            visible keys, including ``exp(sink_h)`` when sinks are given; ``-inf`` for a
            fully masked row without sink.
    """

    out: Tensor
    lse: Tensor


class AttentionBackend(Protocol):
    """The primitives the pipeline calls. Masks are bottom-right causal within segments."""

    name: str

    def varlen_attention(
        self, q: Tensor, k: Tensor, v: Tensor, segments: SegmentPlan, *,
        scale: float, window: int | None, sinks: Tensor | None,
    ) -> AttentionResult:
        """q ``[T_q, H, D]``, k ``[T_kv, H_kv, D]``, v ``[T_kv, H_kv, D_v]`` paired by ``segments``
        (causal, or a sliding window of ``window`` keys), with LSE."""
        ...

    def range_attention(
        self, q: Tensor, k: Tensor, v: Tensor, ranges: KeyRanges, *, scale: float,
    ) -> AttentionResult:
        """q ``[T_q, H, D]`` over k ``[n, H_kv, D]``, v ``[n, H_kv, D_v]``, row ``t`` seeing keys
        ``ranges.lo[t] <= j < ranges.hi[t]`` (a ring round; no sinks: they join in the merge)."""
        ...

    def sparse_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None,
    ) -> AttentionResult:
        """Shared-KV attention of q ``[T_q, H, D]`` over rows ``indices`` ``[T_q, K]`` (-1 padded) of kv ``[N, D]``."""
        ...

    def sparse_attention_probs(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None, probs_from: int,
    ) -> tuple[AttentionResult, Tensor]:
        """:meth:`sparse_attention`, and ``[T_q, K - probs_from]`` fp32 :meth:`selected_probs` of the columns
        ``>= probs_from`` under that call's LSE (no gradient): the KL target when no ring round follows."""
        ...

    def selected_probs(self, q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, scale: float) -> Tensor:
        """``[T_q, K]`` head-summed probabilities ``sum_h exp(q_h . kv[indices] * scale - lse_h)``, 0 at -1 (no grad)."""
        ...

    def indexer_topk(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, segments: SegmentPlan,
        visible: EntryVisibility, *, topk: int, fp8: bool = False,
    ) -> Tensor:
        """``[T_q, topk]`` int64 rows of ``k_index`` ``[N_c, D_I]`` with the highest visible scores, -1 padded.

        ``fp8``: q_index's ``(t, h)`` rows and k_index's rows are fp8-e4m3-rounded
        (``AttentionSpec.scores_in_fp8``), so a backend may score their payloads on fp8 tensor
        cores; the selection's meaning is unchanged."""
        ...

    def indexer_kl(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
    ) -> tuple[Tensor, Tensor]:
        """``(loss, anchor)`` of ``cpkv::indexer_kl`` (:func:`cpkv.indexer_loss.indexer_kl_op`): the KL over the
        selected entries ``[T_q, K]``, whose backward injects ``grad_factor`` times its gradients into
        q_index, k_index and weights."""
        ...


@dataclass(frozen=True, eq=False)
class CompressedLayer:
    """The structure of one compressed layer's attention call, for kernels that take a layer whole.

    The call's kv buffer ``[N, D]`` is the window kv (rows ``[0, num_kv)``, described by
    ``segments``) followed by the layer's compressed entries (rows ``num_kv + j``, laid out
    as ``visible`` says: per segment under the all-gather, per document under the need
    exchange). ``segments`` and ``prefix`` describe the same query segments (the rank's
    ranges, in order).

    Attributes:
        segments: the queries' segments over the window kv (bottom-right aligned, possibly
            lacking rows at a document's front under the need exchange).
        prefix: the same queries over their full causal prefixes (``AttentionPlan.segments``):
            its kv lengths are the lengths the compressed entries count from.
        visible: the entries each query may see in the entry buffer at the layer's ratio
            (``AttentionPlan.visible_for``).
        window: ``W``: a query sees its own token and the ``W - 1`` before it.
        num_kv: rows of window kv before the entries.
        selected: ``[T, K]`` int64 entry rows (``0 <= j < N_c``) the indexer chose, -1 padded;
            ``None``: every visible entry (COMPRESSOR_ONLY).
    """

    segments: SegmentPlan
    prefix: SegmentPlan
    visible: EntryVisibility
    window: int
    num_kv: int
    selected: Tensor | None


class CompressedResult(NamedTuple):
    """:meth:`CompressedLayerBackend.compressed_attention`'s result.

    Attributes:
        result: the layer's :class:`AttentionResult` (``out [T, H, d_v]``, ``lse [T, H]``).
        probs: ``[T, K]`` fp32 head-summed probabilities of the selected entries under
            ``result.lse`` (the indexer KL target, no gradient) when asked for, else ``None``.
    """

    result: AttentionResult
    probs: Tensor | None


@runtime_checkable
class CompressedLayerBackend(Protocol):
    """An optional capability: one kernel call per compressed layer, given the layer's structure.

    The pipeline calls :meth:`compressed_attention` instead of ``sparse_attention`` /
    ``sparse_attention_probs`` when its backend has it (the NPU backend's fused
    ``sparse_flash_mla`` path); the result must equal theirs on the same ``indices``.
    """

    def compressed_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, layer: CompressedLayer, *,
        d_v: int, scale: float, sinks: Tensor | None, probs_from: int | None,
    ) -> CompressedResult:
        """Attention of q ``[T, H, D]`` over rows ``indices`` ``[T, K]`` of kv ``[N, D]`` (window rows, then
        entry rows; ``layer`` says the same in segment form), with the KL target of the columns
        ``>= probs_from`` when it is not ``None``."""
        ...


def unflatten_rows(flat_indices: Tensor, num_rows: int) -> Tensor:
    """``[T * K]`` indices (a sparse op's saved ``[T, K]``, flattened) back to ``[T, K]`` (``[0, 0]`` for ``T = 0``).

    The sparse ops save their indices flat: a compiled backward's saved ``[T, K]`` with a dynamic
    ``K`` has a symbolic stride, which AOTAutograd fixes to its first value under PyTorch's
    ``backed_size_oblivious`` (the next width then fails the compiled backward's stride check).
    Called inside the ops (opaque to the compiler), so ``K`` is recovered from the sizes.
    """
    return flat_indices.view(num_rows, -1) if num_rows else flat_indices.view(0, 0)
