"""The Ascend backend: torch_npu's fused attention, sparse attention and lightning indexer.

``torch_npu`` is imported lazily, in :class:`NPUBackend`'s constructor only (importing it
where CANN is missing breaks ``import torch``); tests inject a stand-in module. One
adapter per kernel converts cpkv's conventions (docs/semantics.md, "Layouts", "The
prefix-KV plan", "Compression modes" and "Fused ops: torch_npu"; docs/backends.md):

* ``npu_fusion_attention`` (:func:`fusion_attention_chunks`): TND, host lists of
  cumulative ends **without** the leading 0 from the plan's ``actual_seq_qlen/kvlen``
  (built once per plan), empty segment pairs dropped, at most 1024 segments per call
  (more are split into several calls over contiguous token ranges, ends rebased).
  ``head_num`` = q heads, explicit ``scale``, ``atten_mask = triu(ones(2048, 2048), 1)``
  (bool, on the device, built once per backend and device), ``sparse_mode=3``
  (bottom-right causal) or, for a window ``W``, ``sparse_mode=4`` with
  ``pre_tockens=W-1, next_tockens=0``; ``softmax_layout="TND"``; sinks as ``sink``
  (fp32 ``[H]``). LSE = ``softmax_max[..., 0] + log(softmax_sum[..., 0])``. v is
  zero-padded to q's head dim when ``D_v < D`` and the output sliced back.
* ``npu_sparse_flash_attention`` (:func:`sparse_kernel_layout`): the pipeline passes a
  kv buffer (``cat([kv_prefix, compressed])``) and absolute rows, -1 padded anywhere. The
  kernel takes rows relative to TND sequences and applies ``sparse_mode=3``
  (rightDownCausal: row ``j`` allowed for query ``i`` iff ``j <= L_kv - L_q + i``). cpkv
  passes **one** sequence, the buffer followed by ``T`` zero rows
  (``actual_seq_lengths_query = [T]``, ``actual_seq_lengths_kv = [N + T]``): relative rows
  are then the absolute rows, and the causal bound ``j <= N + t`` holds for every row of
  the buffer, so the kernel masks nothing and the result is exactly attention over the
  listed rows, whatever the buffer's layout (all-gather or need-based exchange). Indices:
  valid entries first, -1 padded, int32 ``[T, 1, K]``. MLA-absorb (``attention_mode=2``):
  query/key are the first ``d_v`` channels (key is value), ``query_rope``/``key_rope`` the
  rest, so the score is the full-``D`` dot product. LSE = ``softmax_max[0] +
  log(softmax_sum[0])`` (``[1, T, H]`` in TND).
* ``npu_lightning_indexer`` (:func:`indexer_calls`, from the plan's
  :class:`~cpkv.plan.segments.EntryVisibility`): the kernel's ``sparse_mode=3`` is
  bottom-right causal over keys, while a query at document position ``p`` may see the
  first ``floor((p + 1) / m)`` compressed entries. Within a document the queries with
  ``p % m == rho`` see one more entry each, so each residue ``rho`` is one call whose
  batch per document holds those queries and the document's first ``v_last`` entries
  (``v_last`` = the last such query's count): bottom-right causal is then exact.
  Queries seeing no entry are skipped (all -1). Indices come back relative to the
  document's first entry and are made absolute. ``m`` calls per layer.
* ``selected_probs`` (the indexer KL target, no gradient): the reference op on the device
  tensors, from the sparse kernel's (detached) LSE; the pipeline attaches the indexer loss.
* ``range_attention`` (ring rounds, ``ring_degree > 1``) is not supported: the merge of
  rounds differentiates through each round's LSE, and these kernels return none with a
  gradient. It raises ``NotImplementedError`` (the pipeline refuses ring rounds with this
  backend before any collective).

The LSEs these ops return carry no gradient (the kernels' ``softmax_max/sum`` are not
differentiable); the pipeline uses only the outputs. Tie order among equal indexer scores
on the hardware is not documented (the reference takes the lower row).

Fallbacks to the reference (a ``UserWarning`` once per backend instance and reason):
dtypes the kernels do not take (fusion: fp16/bf16/fp32; sparse and indexer: fp16/bf16;
``check_dtypes=False`` skips this), ``D_v > D``, and ``d_v == D`` for sparse attention
(MLA-absorb needs a rope part).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from cpkv.backends.base import AttentionResult, CompressedLayer, CompressedResult, KeyRanges
from cpkv.backends.npu_fused import fused_indexer_kl, fused_limit_reason, indexer_kl_plan, kl_limit_reason, sparse_flash_mla
from cpkv.backends.reference import ReferenceBackend
from cpkv.plan.segments import EntryVisibility, SegmentPlan

__all__ = ["FusionChunk", "IndexerCall", "NPUBackend", "fusion_attention_chunks", "indexer_calls", "sparse_kernel_layout"]

FUSION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPARSE_DTYPES = (torch.float16, torch.bfloat16)
MAX_SEGMENTS_PER_CALL = 1024
MASK_SIZE = 2048
NO_LIMIT = 2147483647


class FusionChunk(NamedTuple):
    """One ``npu_fusion_attention`` call: token ranges and its host lists (no leading 0, rebased)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int
    actual_seq_qlen: list[int]
    actual_seq_kvlen: list[int]


def fusion_attention_chunks(
    actual_seq_qlen: Sequence[int], actual_seq_kvlen: Sequence[int], max_segments: int = MAX_SEGMENTS_PER_CALL
) -> list[FusionChunk]:
    """Split the plan's cumulative ends (no leading 0) into ``npu_fusion_attention`` calls.

    Segment pairs with no query and no key are dropped; each call gets at most
    ``max_segments`` pairs over a contiguous token range, its ends rebased to the range.

    Example:
        >>> chunks = fusion_attention_chunks((5, 5, 8), (5, 5, 11), max_segments=1)
        >>> [(c.q_start, c.kv_start, c.actual_seq_qlen, c.actual_seq_kvlen) for c in chunks]
        [(0, 0, [5], [5]), (5, 5, [3], [6])]
    """
    if len(actual_seq_qlen) != len(actual_seq_kvlen):
        raise ValueError(f"actual_seq_qlen and actual_seq_kvlen differ in length: {len(actual_seq_qlen)} != {len(actual_seq_kvlen)}")
    chunks: list[FusionChunk] = []
    q0 = kv0 = prev_q = prev_kv = 0
    ends_q: list[int] = []
    ends_kv: list[int] = []
    for q_end, kv_end in zip(actual_seq_qlen, actual_seq_kvlen):
        if (q_end, kv_end) != (prev_q, prev_kv):
            ends_q.append(int(q_end) - q0)
            ends_kv.append(int(kv_end) - kv0)
        prev_q, prev_kv = int(q_end), int(kv_end)
        if len(ends_q) == max_segments:
            chunks.append(FusionChunk(q0, prev_q, kv0, prev_kv, ends_q, ends_kv))
            q0, kv0, ends_q, ends_kv = prev_q, prev_kv, [], []
    if ends_q:
        chunks.append(FusionChunk(q0, prev_q, kv0, prev_kv, ends_q, ends_kv))
    return chunks


def sparse_kernel_layout(kv: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's kv buffer and ``sparse_indices`` for the pipeline's buffer and absolute rows.

    Args:
        kv: ``[N, D]`` (the pipeline's ``cat([kv_prefix, compressed])``, any layout).
        indices: ``[T, K]`` int absolute rows of kv, -1 anywhere.

    Returns:
        ``cat([kv, zeros(T, D)])`` ``[N + T, D]`` (one TND sequence; the ``T`` padding rows
        are never listed, they only lift the kernel's causal bound to ``j <= N + t``) and
        int32 ``[T, 1, K]`` rows, unchanged, valid entries first (in their order), -1 padded.
    """
    kv_kernel = torch.cat([kv, kv.new_zeros((indices.shape[0], kv.shape[1]))])
    order = (indices < 0).to(torch.int8).argsort(dim=1, stable=True)
    return kv_kernel, indices.gather(1, order).to(torch.int32).unsqueeze(1).contiguous()


class IndexerCall(NamedTuple):
    """One ``npu_lightning_indexer`` call (one residue class of query positions).

    Attributes:
        rows: ``[n]`` int64 query rows. key_rows: ``[n_k]`` int64 rows of the indexer keys.
        seq_lengths_query, seq_lengths_key: ``[B']`` int32 cumulative ends (no leading 0).
        key_start: ``[n]`` int64 absolute key row of each query's batch start.
    """

    rows: Tensor
    key_rows: Tensor
    seq_lengths_query: Tensor
    seq_lengths_key: Tensor
    key_start: Tensor


def indexer_calls(q_positions: Tensor, q_doc_rows: Tensor, visible: EntryVisibility) -> list[IndexerCall]:
    """Calls whose bottom-right causal masks are exactly the compressed visibility (module doc).

    Args:
        q_positions: ``[T]`` int64 document position of each query (``SegmentPlan.q_positions``).
        q_doc_rows: ``[T]`` int64 kv row of each query's document start (``SegmentPlan.q_doc_rows``).
        visible: the entries each query may see, at the indexer's ratio.
    """
    ratio, count, start = visible.ratio, visible.visible_count, visible.visible_start
    calls = []
    for rho in range(ratio):
        rows = ((q_positions % ratio == rho) & (count > 0)).nonzero().flatten()
        if rows.numel() == 0:
            continue
        _, per_batch = torch.unique_consecutive(q_doc_rows[rows], return_counts=True)
        last = per_batch.cumsum(0) - 1
        key_len, key_first = count[rows][last], start[rows][last]
        ends = key_len.cumsum(0)
        total = int(ends[-1])
        key_rows = torch.repeat_interleave(key_first - (ends - key_len), key_len, output_size=total)
        key_rows = key_rows + torch.arange(total, device=rows.device)
        calls.append(IndexerCall(rows, key_rows, per_batch.cumsum(0).int(), ends.int(), start[rows]))
    return calls


def _import(name: str, need: str) -> Any:
    """``import name``, or a ``RuntimeError`` saying what needs it (importing it where CANN is missing may fail oddly)."""
    try:
        return importlib.import_module(name)
    except Exception as err:  # ImportError, or CANN's own errors while loading
        raise RuntimeError(
            f"{need}; importing {name} failed: {err!r}. Use backend='reference' or 'cuda' elsewhere."
        ) from err


class NPUBackend:
    """torch_npu's fused ops behind the :class:`~cpkv.backends.AttentionBackend` interface.

    Args:
        torch_npu_module: the ``torch_npu`` module, or a stand-in with the same three
            functions; default: ``import torch_npu`` here.
        check_dtypes: fall back to the reference for dtypes the kernels do not take;
            False passes every floating dtype to the kernels (stand-ins, newer CANN).
        block_size: block size of the reference ops used in fallbacks and ``selected_probs``.
        fused_ops_module: ``cann_ops_transformer.ops`` (CANN's custom ops: ``sparse_flash_mla``,
            its grad and metadata calls, ``sparse_lightning_indexer_kl_loss_grad``) or a
            stand-in; default: imported here unless ``fused=False``.
        fused: the attention path (:attr:`attention_path`): ``None`` fused when the custom
            ops import, else composed; ``True`` fused or ``RuntimeError``; ``False`` composed.
        kernel_limits: use the fused ops only within their A2/A3 limits (D=512, window 128,
            ratios 4/128, top-k <= 1024 with several heads, no fused grad under
            ``torch.use_deterministic_algorithms(True)``, ...): with ``fused=None`` a layer
            outside them takes the composed path (one warning per reason), with ``fused=True``
            it raises ``ValueError``; False passes every shape (stand-ins, newer CANN).

    Raises:
        RuntimeError: torch_npu cannot be imported (it needs Ascend's CANN), or ``fused=True``
            without the custom ops. TypeError: ``fused`` not a bool or None.
    """

    name = "npu"

    def __init__(
        self, torch_npu_module: Any | None = None, *, check_dtypes: bool = True, block_size: int = 1024,
        fused_ops_module: Any | None = None, fused: bool | None = None, kernel_limits: bool = True,
    ) -> None:
        if torch_npu_module is None:
            torch_npu_module = _import("torch_npu", "NPUBackend needs torch_npu with Ascend's CANN toolkit installed")
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"fused must be None, True or False, got {type(fused).__name__}")
        if fused_ops_module is None and fused is not False:
            try:
                fused_ops_module = _import("cann_ops_transformer.ops", "NPUBackend(fused=True) needs CANN's custom ops")
            except RuntimeError:
                if fused:
                    raise
        self._npu = torch_npu_module
        self._fused = fused_ops_module if fused is not False else None
        self._require_fused = fused is True
        self._check_dtypes = check_dtypes
        self._kernel_limits = kernel_limits
        self._reference = ReferenceBackend(block_size)
        self._warned: set[str] = set()
        self._masks: dict[str, Tensor] = {}

    @property
    def attention_path(self) -> str:
        """``"fused"`` (``sparse_flash_mla``: one call per compressed layer; the indexer KL on its grad op, in
        batches on which it is exact, rows breaking the index-count invariant on the composed KL with a
        warning) or ``"composed"`` (``npu_sparse_flash_attention``, reference KL), fixed at construction."""
        return "composed" if self._fused is None else "fused"

    def _fallback(self, reason: str | None, to: str = "the reference") -> bool:
        """Warn once per reason; True when ``to`` (the reference, or the composed path) must serve the call."""
        if reason is None:
            return False
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"NPUBackend: falling back to {to} for {reason}", UserWarning, stacklevel=3)
        return True

    def _dtype_reason(self, op: str, dtype: torch.dtype, allowed: tuple[torch.dtype, ...]) -> str | None:
        if self._check_dtypes and dtype not in allowed:
            return f"{op} with dtype {dtype} (the kernel takes {', '.join(str(d) for d in allowed)})"
        return None

    def _causal_mask(self, device: torch.device) -> Tensor:
        """``triu(ones(2048, 2048), 1)`` bool on ``device`` (built once per device)."""
        key = str(device)
        if key not in self._masks:
            self._masks[key] = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu(1)
        return self._masks[key]

    def varlen_attention(
        self, q: Tensor, k: Tensor, v: Tensor, segments: SegmentPlan, *,
        scale: float, window: int | None, sinks: Tensor | None,
    ) -> AttentionResult:
        """``npu_fusion_attention`` over the plan's segment pairs (bottom-right causal, window, sinks).

        Args:
            q: ``[T_q, H, D]``. k: ``[T_kv, H_kv, D]``. v: ``[T_kv, H_kv, D_v <= D]``.
            segments: the plan (its host ``actual_seq_qlen/kvlen`` are used).
            scale: softmax scale. window: ``W`` or None. sinks: ``[H]`` or None.

        Returns:
            ``AttentionResult(out [T_q, H, D_v], lse [T_q, H] fp32, no gradient)``.
        """
        reason = self._dtype_reason("npu_fusion_attention", q.dtype, FUSION_DTYPES)
        if reason is None and v.shape[-1] > q.shape[-1]:
            reason = f"npu_fusion_attention with D_v={v.shape[-1]} > D={q.shape[-1]}"
        if self._fallback(reason) or q.shape[0] == 0:
            return self._reference.varlen_attention(q, k, v, segments, scale=scale, window=window, sinks=sinks)
        d_v = v.shape[-1]
        if d_v < q.shape[-1]:
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - d_v))
        outs, lses = [], []
        for chunk in fusion_attention_chunks(segments.actual_seq_qlen, segments.actual_seq_kvlen):
            out, lse = self._fusion_call(q, k, v, chunk, scale, window, sinks)
            outs.append(out)
            lses.append(lse)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return AttentionResult(out[..., :d_v], lses[0] if len(lses) == 1 else torch.cat(lses))

    def range_attention(self, q: Tensor, k: Tensor, v: Tensor, ranges: KeyRanges, *, scale: float) -> AttentionResult:
        """Not supported: ring rounds need a differentiable LSE, which the NPU kernels do not return.

        Raises:
            NotImplementedError: always (use ``ring_degree=1`` with this backend).
        """
        raise NotImplementedError(
            "NPUBackend has no range_attention: ring rounds (ring_degree > 1) merge through each round's LSE, "
            "and npu_fusion_attention returns no LSE gradient; use ring_degree=1 with backend='npu'"
        )

    def _fusion_call(
        self, q: Tensor, k: Tensor, v: Tensor, chunk: FusionChunk, scale: float, window: int | None, sinks: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """One ``npu_fusion_attention`` call over ``chunk``'s token ranges; out and LSE ``[T_chunk, H]``."""
        sparse_mode, pre, nxt = (3, NO_LIMIT, 0) if window is None else (4, window - 1, 0)
        extra = {} if sinks is None else {"sink": sinks.float()}
        result = self._npu.npu_fusion_attention(
            q[chunk.q_start : chunk.q_end], k[chunk.kv_start : chunk.kv_end], v[chunk.kv_start : chunk.kv_end], q.shape[1],
            input_layout="TND", atten_mask=self._causal_mask(q.device), scale=float(scale), pre_tockens=pre,
            next_tockens=nxt, actual_seq_qlen=chunk.actual_seq_qlen, actual_seq_kvlen=chunk.actual_seq_kvlen,
            sparse_mode=sparse_mode, softmax_layout="TND", **extra,
        )
        out, softmax_max, softmax_sum = result[0], result[1], result[2]
        return out, (softmax_max[..., 0] + torch.log(softmax_sum[..., 0])).detach().float()

    def _sparse_reason(self, q: Tensor, d_v: int) -> str | None:
        reason = self._dtype_reason("npu_sparse_flash_attention", q.dtype, SPARSE_DTYPES)
        if reason is None and d_v >= q.shape[-1]:
            reason = f"npu_sparse_flash_attention with d_v={d_v} = D (attention_mode=2 needs rope channels after d_v)"
        return reason

    def sparse_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None,
    ) -> AttentionResult:
        """``npu_sparse_flash_attention`` over the listed rows of the pipeline's kv buffer.

        Args:
            q: ``[T, H, D]``. kv: ``[N, D]`` (``cat([kv_prefix, compressed])``).
                indices: ``[T, K]`` absolute rows of kv, -1 padded anywhere.
            d_v: value channels (``< D``). scale: softmax scale. sinks: ``[H]`` or None.

        Returns:
            ``AttentionResult(out [T, H, d_v], lse [T, H] fp32, no gradient)``.
        """
        if self._fallback(self._sparse_reason(q, d_v)) or q.shape[0] == 0 or indices.shape[1] == 0:
            return self._reference.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks)
        return self._sparse_call(q, kv, indices, d_v, scale, sinks)

    def _sparse_call(self, q: Tensor, kv: Tensor, indices: Tensor, d_v: int, scale: float, sinks: Tensor | None) -> AttentionResult:
        kv_kernel, sparse_indices = sparse_kernel_layout(kv, indices)
        key = kv_kernel[:, None, :d_v].contiguous()
        lengths = torch.tensor([[q.shape[0]], [kv_kernel.shape[0]]], dtype=torch.int32, device=q.device)
        out, softmax_max, softmax_sum = self._npu.npu_sparse_flash_attention(
            q[..., :d_v].contiguous(), key, key, sparse_indices, float(scale),
            actual_seq_lengths_query=lengths[0], actual_seq_lengths_kv=lengths[1],
            query_rope=q[..., d_v:].contiguous(), key_rope=kv_kernel[:, None, d_v:].contiguous(),
            sparse_block_size=1, layout_query="TND", layout_kv="TND", sparse_mode=3, attention_mode=2,
            return_softmax_lse=True, **({} if sinks is None else {"sinks": sinks.float()}),
        )[:3]
        return AttentionResult(out, (softmax_max[0] + torch.log(softmax_sum[0])).detach().float())

    def sparse_attention_probs(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None, probs_from: int,
    ) -> tuple[AttentionResult, Tensor]:
        """:meth:`sparse_attention` (``npu_sparse_flash_attention``), then :meth:`selected_probs` of the columns
        ``>= probs_from`` under its LSE (the reference's, on the device tensors)."""
        result = self.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks)
        return result, self.selected_probs(q, kv, indices[:, probs_from:], result.lse, scale=scale)

    def selected_probs(self, q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, scale: float) -> Tensor:
        """The reference head-summed probabilities of the listed rows, on the device tensors.

        Args:
            q: ``[T, H, D]``. kv: ``[N, D]``. indices: ``[T, K]`` rows of kv, -1 padded.
            lse: ``[T, H]`` the sparse kernel's (detached) LSE. scale: softmax scale.

        Returns:
            ``[T, K]`` fp32 ``sum_h exp(q_h . kv[indices] * scale - lse_h)``, 0 at -1 (no gradient).
        """
        return self._reference.selected_probs(q, kv, indices, lse, scale=scale)

    def indexer_topk(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, segments: SegmentPlan,
        visible: EntryVisibility, *, topk: int, fp8: bool = False,
    ) -> Tensor:
        """``npu_lightning_indexer`` top-k, one call per residue of the query positions mod ``m``.

        Args:
            q_index: ``[T, H_I, D_I]``. k_index: ``[N_c, D_I]`` (cast to q's dtype, as the
                kernel requires). weights: ``[T, H_I]``. segments: the plan (query
                positions and document rows). visible: the entries each query may see, at
                the indexer's ratio. topk: entries per query. fp8: unused (the kernel takes
                q's dtype).

        Returns:
            ``[T, topk]`` int64 absolute rows of ``k_index``, -1 padded.
        """
        reason = self._dtype_reason("npu_lightning_indexer", q_index.dtype, SPARSE_DTYPES)
        if self._fallback(reason):
            return self._reference.indexer_topk(q_index, k_index, weights, segments, visible, topk=topk, fp8=fp8)
        result = torch.full((q_index.shape[0], topk), -1, dtype=torch.int64, device=q_index.device)
        if q_index.shape[0] == 0 or visible.num_entries == 0:
            return result
        key = k_index.to(q_index.dtype)[:, None, :]
        weights = weights if weights.dtype == torch.float32 else weights.to(q_index.dtype)
        for call in indexer_calls(segments.q_positions, segments.q_doc_rows, visible):
            indices = self._npu.npu_lightning_indexer(
                q_index[call.rows].contiguous(), key[call.key_rows].contiguous(), weights[call.rows].contiguous(),
                actual_seq_lengths_query=call.seq_lengths_query, actual_seq_lengths_key=call.seq_lengths_key,
                layout_query="TND", layout_key="TND", sparse_count=topk, sparse_mode=3, return_value=False,
            )[0]
            relative = indices[:, 0, :].long()
            result[call.rows] = torch.where(relative >= 0, relative + call.key_start[:, None], -1)
        return result

    def indexer_kl(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
    ) -> tuple[Tensor, Tensor]:
        """``(loss, anchor)`` of ``cpkv::indexer_kl`` (contract: :func:`cpkv.indexer_loss.indexer_kl_op`).

        Fused path: ``sparse_lightning_indexer_kl_loss_grad`` (:func:`~cpkv.backends.npu_fused.fused_indexer_kl`,
        ``mask_mode=3`` over the batches of :func:`~cpkv.backends.npu_fused.indexer_kl_plan`), within its
        limits (D_I=128, H_I in 8..64, K in 512..8192, fp16/bf16); rows whose selections break the
        index-count invariant (fewer than K, not one block of a document's first entries) take the
        reference op, with one warning. Outside the limits, and on the composed path, the reference
        op on the device tensors.
        """
        if self._fused is not None and selected.shape[0] > 0:
            reason = kl_limit_reason(q_index, selected, self._check_dtypes) if self._kernel_limits else None
            if not self._fallback(reason):
                plan = indexer_kl_plan(selected, k_index.shape[0])
                loss, anchor = fused_indexer_kl(self._fused, q_index, k_index, weights, target, plan, grad_factor)
                if plan.fallback_rows.numel() and self._fallback(
                        "rows whose selections break the index-count invariant (fewer than K entries that are not a "
                        "document's first ones: sparse_lightning_indexer_kl_loss_grad would read stale rows)",
                        to="the composed KL"):
                    rows = plan.fallback_rows
                    rest = self._reference.indexer_kl(q_index[rows], k_index, weights[rows], selected[rows], target[rows],
                                                      grad_factor)
                    loss, anchor = loss + rest[0], anchor + rest[1]
                return loss, anchor
        return self._reference.indexer_kl(q_index, k_index, weights, selected, target, grad_factor)

    def compressed_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, layer: CompressedLayer, *,
        d_v: int, scale: float, sinks: Tensor | None, probs_from: int | None,
    ) -> CompressedResult:
        """A compressed layer's attention: one ``sparse_flash_mla`` call (fused path) or :meth:`sparse_attention`.

        Args:
            q: ``[T, H, D]``. kv: ``[num_kv + N_c, D]`` window kv, then entries. indices: ``[T, K]``
                the same rows listed (composed path, KL target). layer: the structure
                (:class:`~cpkv.backends.base.CompressedLayer`). d_v: value channels.
            scale: softmax scale. sinks: ``[H]`` or None. probs_from: first column of ``indices``
                whose head-summed probabilities to return (the KL target), or None.

        Returns:
            :class:`~cpkv.backends.base.CompressedResult`: out ``[T, H, d_v]``, lse ``[T, H]`` fp32
            (no gradient) and the target from that LSE (``selected_probs``), when asked for.
        """
        if self._fused is None or q.shape[0] == 0:
            return self._composed(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks, probs_from=probs_from)
        needs_grad = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
        reason = fused_limit_reason(q, layer, self._check_dtypes, needs_grad=needs_grad) if self._kernel_limits else None
        if reason is not None and self._require_fused:
            raise ValueError(f"NPUBackend(fused=True) cannot serve this layer on the fused path: {reason}; "
                             "use fused=None to take the composed path there")
        if self._fallback(reason, to="the composed path"):
            return self._composed(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks, probs_from=probs_from)
        out, lse = sparse_flash_mla(self._fused, q, kv, layer, scale=scale, sinks=sinks)
        result = AttentionResult(out[..., :d_v], lse)
        if probs_from is None:
            return CompressedResult(result, None)
        return CompressedResult(result, self.selected_probs(q, kv, indices[:, probs_from:], lse, scale=scale))

    def _composed(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None, probs_from: int | None,
    ) -> CompressedResult:
        if probs_from is None:
            return CompressedResult(self.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks), None)
        return CompressedResult(*self.sparse_attention_probs(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks,
                                                             probs_from=probs_from))
