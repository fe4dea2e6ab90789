"""``attention_forward``: prefix attention of one CP rank, in every compress mode.

The pipeline (contiguous TND, ``"allgather"`` exchange as MindSpeed does it):

1. plan once per micro-batch (:func:`~cpkv.attention_plan.plan_attention`), or take the caller's plan;
2. gather the shared kv (and, for compressed layers, the compressor inputs) over the CP
   group with :func:`~cpkv.comm.gather_from_sp_cp` and take the rank's causal prefix
   with :func:`~cpkv.plan.rearrange_prefix_kv` (a view);
3. :func:`attend_prefix`: compress the prefix (compressed cu_seqlens from the **kv**
   lengths), select entries with the indexer (INDEXER), and call the backend op.

Every check runs before the first collective, identically on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv._checks import check_int, check_ndim, check_tensor
from cpkv.attention_plan import (
    AttentionPlan,
    CompressedPlan,
    SegmentPlan,
    plan_attention,
)
from cpkv.backends import AttentionBackend, get_backend
from cpkv.comm import BackwardOrder, Group, gather_from_sp_cp
from cpkv.exchange import NeedPlan, exchange_rows, start_exchange
from cpkv.compress_mode import LayerCompressMode
from cpkv.indexer_loss import IndexerLossConfig, attach_indexer_loss
from cpkv.layout import validate_cu_seqlens
from cpkv.plan import rearrange_prefix_kv
from cpkv.ring import merge_partials, ring_rounds, selected_probs


EXCHANGES = ("allgather", "need")


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer attends to (the per-layer, not per-batch, options).

    Attributes:
        d_v: value channels: the first ``d_v`` channels of the shared kv.
        compress_ratio: the layer's ratio; its :class:`LayerCompressMode` follows from it.
        window: sliding window ``W`` (own token plus ``W - 1`` earlier), ``None`` for dense
            causal (``NO_COMPRESS`` only).
        scale: softmax scale; ``None`` means ``1/sqrt(D)``.
        topk: entries the indexer selects per query (INDEXER).
    """

    d_v: int
    compress_ratio: int = 0
    window: int | None = 128
    scale: float | None = None
    topk: int = 512

    @property
    def mode(self) -> LayerCompressMode:
        """The layer's :class:`LayerCompressMode`."""
        return LayerCompressMode.from_compress_ratio(self.compress_ratio)

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for inconsistent options."""
        check_int("spec.d_v", self.d_v, minimum=1)
        check_int("spec.topk", self.topk, minimum=1)
        if self.window is not None:
            check_int("spec.window", self.window, minimum=1)
        elif self.mode.compresses:
            raise ValueError(f"spec.window is required for compressed layers ({self.mode.name}), got None")


class CompressorFn(Protocol):
    """Maps packed kv-prefix inputs ``[T_kv, hidden]`` to entries ``[N_c, D]`` (or ``None``)."""

    def __call__(self, x: Tensor, plan: CompressedPlan, /) -> Tensor | None: ...


class IndexerFn(Protocol):
    """The lightning indexer: queries from local inputs, keys from the prefix inputs."""

    @property
    def ratio(self) -> int: ...

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]: ...

    def keys(self, x: Tensor, plan: CompressedPlan) -> Tensor | None: ...


class AttentionOutput(NamedTuple):
    """Result of :func:`attention_forward`.

    Attributes:
        out: ``[T_q, H, d_v]`` attention output of the rank's queries.
        indexer_loss: ``sum_t KL_t`` over the rank's queries (0-d fp32, detached, for
            logging) in INDEXER layers, else ``None``.
        effective_ratio: the ratio actually used (1 when the compressor returned ``None``).
    """

    out: Tensor
    indexer_loss: Tensor | None
    effective_ratio: int


class IndexerTensors(NamedTuple):
    """The indexer's inputs for one attention call (all computed from detached inputs).

    Attributes:
        q_index: ``[T_q, H_I, D_I]``; weights: ``[T_q, H_I]``; k_index: ``[N_c, D_I]`` keys of
            the same compressed entries (same order) as the main compressed kv.
    """

    q_index: Tensor
    weights: Tensor
    k_index: Tensor


def attend_prefix(
    q: Tensor, kv: Tensor, segments: SegmentPlan, *, spec: AttentionSpec, backend: AttentionBackend,
    sinks: Tensor | None = None, compressed: Tensor | None = None, indexer_tensors: IndexerTensors | None = None,
    kv_offset: int = 0, varlen_segments: SegmentPlan | None = None,
    grad_scale: float = 1.0, num_global_queries: int = 1,
) -> AttentionOutput:
    """Attention of queries over their causal kv prefix and the prefix's compressed entries.

    Args:
        q: ``[T_q, H, D]`` queries (RoPE applied).
        kv: ``[T_kv - kv_offset, D]`` shared kv of the prefix segments of ``segments``,
            possibly without its first ``kv_offset`` rows (keys no query can see).
        segments: the :class:`SegmentPlan` pairing queries with prefixes (planned with
            ``spec.compress_ratio`` for compressed layers).
        compressed: ``[N_c, D]`` compressed entries of the prefix segments in plan order
            (compressed layers), or ``None``: the layer then runs as NO_COMPRESS (ratio 1).
        indexer_tensors: the indexer's queries, weights and keys (INDEXER layers).
        kv_offset: prefix rows missing at the front of ``kv``.
        varlen_segments: segments over ``kv`` for the varlen kernel when ``kv_offset > 0``.
        grad_scale, num_global_queries: the indexer-loss gradient factor ``grad_scale / N``.
    """
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    mode = spec.mode
    if compressed is None or spec.window is None or not mode.compresses:
        # NO_COMPRESS, or no full block in the prefix: the effective ratio is 1.
        result = backend.varlen_attention(
            q, kv[:, None], kv[:, None, : spec.d_v], varlen_segments or segments,
            scale=scale, window=spec.window, sinks=sinks,
        )
        return AttentionOutput(result.out, None, 1)
    cmp_plan = segments.compressed_for(spec.compress_ratio)
    kv_all = torch.cat([kv, compressed.to(kv.dtype)])
    window_rows = segments.window_indices(spec.window)
    window_rows = torch.where(window_rows >= 0, window_rows - kv_offset, -1)
    if mode is LayerCompressMode.COMPRESSOR_ONLY:
        indices = torch.cat([window_rows, cmp_plan.visible_indices(offset=kv.shape[0])], dim=1)
        result = backend.sparse_attention(q, kv_all, indices, segments, d_v=spec.d_v, scale=scale, sinks=sinks)
        return AttentionOutput(result.out, None, spec.compress_ratio)
    if indexer_tensors is None:
        raise ValueError("INDEXER layers need the indexer's tensors (indexer_tensors)")
    q_index, weights, k_index = indexer_tensors
    with torch.no_grad():
        selected = backend.indexer_topk(q_index, k_index, weights, segments, cmp_plan, topk=spec.topk)
    indices = torch.cat([window_rows, torch.where(selected >= 0, selected + kv.shape[0], -1)], dim=1)
    config = IndexerLossConfig(
        d_v=spec.d_v, scale=scale, num_window=spec.window, grad_scale=grad_scale, num_global_queries=num_global_queries
    )
    res = backend.sparse_attention_with_indexer_loss(
        q, kv_all, indices, selected, q_index, k_index, weights, segments, sinks=sinks, config=config
    )
    return AttentionOutput(res.out, res.loss, spec.compress_ratio)


def _compress_gathered(
    segments: SegmentPlan, spec: AttentionSpec, hidden: Tensor | None, hidden_prefix: Tensor | None,
    compressor: CompressorFn | None, indexer: IndexerFn | None,
) -> tuple[Tensor | None, IndexerTensors | None]:
    """Compressed entries (and indexer tensors) recomputed from the gathered prefix inputs."""
    if not spec.mode.compresses or compressor is None or hidden_prefix is None:
        return None, None
    cmp_plan = segments.compressed_for(spec.compress_ratio)
    compressed = compressor(hidden_prefix, cmp_plan)
    if compressed is None or spec.mode is not LayerCompressMode.INDEXER or indexer is None or hidden is None:
        return compressed, None
    q_index, weights = indexer.queries(hidden.detach(), segments.q_positions)
    k_index = indexer.keys(hidden_prefix.detach(), segments.compressed_for(indexer.ratio))
    if k_index is None:
        raise ValueError("the indexer's compressor returned None while the main compressor did not")
    return compressed, IndexerTensors(q_index, weights, k_index)


def _compress_exchanged(
    need: NeedPlan, segments: SegmentPlan, spec: AttentionSpec, hidden: Tensor | None, width: int,
    kv_dtype: torch.dtype, compressor: CompressorFn | None, indexer: IndexerFn | None, group: Group,
    order: BackwardOrder,
) -> tuple[Tensor | None, IndexerTensors | None]:
    """Compress the rank's own blocks, then exchange entries (never another rank's blocks)."""
    if not spec.mode.compresses or compressor is None or hidden is None:
        return None, None
    plan = need.compressed[spec.compress_ratio]
    halo = exchange_rows(hidden, plan.hidden, group, order=order)
    local_inputs = torch.cat([halo, hidden])
    # Every rank must send the same dtype: entries travel in the kv dtype (what attention
    # uses them in), indexer keys in the compressor's fp32 (fp64) compute dtype.
    owned = compressor(local_inputs, plan.owned)
    owned = owned.to(kv_dtype) if owned is not None else local_inputs.new_zeros((0, width), dtype=kv_dtype)
    compressed = torch.cat([exchange_rows(owned, plan.entries, group, order=order), owned])
    tensors = None
    if spec.mode is LayerCompressMode.INDEXER and indexer is not None:
        q_index, weights = indexer.queries(hidden.detach(), segments.q_positions)
        own_keys = indexer.keys(local_inputs.detach(), plan.owned)
        key_dtype = torch.promote_types(hidden.dtype, torch.float32)
        own_keys = own_keys.to(key_dtype) if own_keys is not None else hidden.new_zeros((0, q_index.shape[-1]), dtype=key_dtype)
        keys = torch.cat([exchange_rows(own_keys, plan.entries, group, order=order), own_keys])
        tensors = IndexerTensors(q_index, weights, keys)
    return (compressed if compressed.shape[0] else None), tensors


def _check_inputs(
    q: Tensor, kv: Tensor, hidden: Tensor | None, spec: AttentionSpec, local_len: int,
    compressor: CompressorFn | None, indexer: IndexerFn | None,
) -> None:
    check_tensor("q", q)
    check_tensor("kv", kv)
    check_ndim("q", q, 3, "[T/cp, H, D]")
    check_ndim("kv", kv, 2, "[T/cp, D] (one shared kv head)")
    spec.validate()
    if q.shape[0] != local_len or kv.shape[0] != local_len:
        raise ValueError(f"q and kv must hold this rank's {local_len} tokens (T / cp), got {q.shape[0]} and {kv.shape[0]}")
    if kv.shape[-1] != q.shape[-1] or spec.d_v > kv.shape[-1]:
        raise ValueError(f"kv must be [T/cp, D] with D = q's {q.shape[-1]} and >= spec.d_v {spec.d_v}, got {tuple(kv.shape)}")
    if spec.mode.compresses:
        if compressor is None or hidden is None:
            raise ValueError(f"compressor and hidden are required for {spec.mode.name} layers (compress_ratio={spec.compress_ratio})")
        check_ndim("hidden", hidden, 2, "[T/cp, hidden]")
        if hidden.shape[0] != local_len:
            raise ValueError(f"hidden must hold this rank's {local_len} tokens, got {hidden.shape[0]}")
    if spec.mode is LayerCompressMode.INDEXER and indexer is None:
        raise ValueError("indexer is required for INDEXER layers (compress_ratio=4)")


def attention_forward(
    q: Tensor, kv: Tensor, cu_seqlens: Tensor, group: Group, *, spec: AttentionSpec,
    sinks: Tensor | None = None, hidden: Tensor | None = None, compressor: CompressorFn | None = None,
    indexer: IndexerFn | None = None, plan: AttentionPlan | None = None,
    backend: str | AttentionBackend = "reference", ring_degree: int = 1, grad_scale: float = 1.0,
    exchange: str = "allgather",
) -> AttentionOutput:
    """Prefix attention of this rank's contiguous TND shard.

    Args:
        q: ``[T/cp, H, D]`` this rank's queries, RoPE applied at document positions
            (``plan.segments.q_positions``).
        kv: ``[T/cp, D]`` this rank's shared kv (one head; values are its first ``spec.d_v``
            channels), RoPE applied.
        cu_seqlens: ``[B + 1]`` **global** leading-zero cu_seqlens of the micro-batch.
        group: the CP group (``None``: the default group).
        spec: the layer's :class:`AttentionSpec`.
        sinks: ``[H]`` per-head sink logits, or ``None``.
        hidden: ``[T/cp, hidden]`` this rank's compressor / indexer inputs (compressed modes).
        compressor, indexer: the layer's modules (compressed modes / INDEXER).
        plan: this rank's :class:`AttentionPlan`, computed once per micro-batch with
            ``compress_ratios`` covering this layer; built here when ``None``. With a plan,
            ``cu_seqlens`` is only checked for its length (no host sync per layer); the
            local token counts of ``q`` and ``kv`` then pin ``T``.
        backend: ``"reference"``, ``"cuda"``, ``"npu"``, ``"auto"`` (by ``q.device``) or an
            :class:`AttentionBackend` instance (create it once per model so that fallback
            warnings appear once).
        ring_degree: ``R > 1`` (with ``exchange="need"`` and a plan made with the same
            ``ring_degree``) receives the remote prefix kv in ``R`` rounds overlapped with
            attention and merges the partial results exactly (:mod:`cpkv.ring`).
        grad_scale: multiplies the indexer-loss gradients (kept per call in autograd ctx).
        exchange: ``"allgather"`` (every rank gathers all kv and compressor inputs and
            recompresses its whole prefix, as MindSpeed does) or ``"need"`` (only the rows
            the rank needs: the window halo or the first document's earlier part, the
            compressor-input halo of its own blocks, and compressed entries owned by earlier
            ranks; see :mod:`cpkv.exchange`). Identical results.

    Returns:
        :class:`AttentionOutput` with ``out`` ``[T/cp, H, d_v]``. Backward flows to ``q``,
        ``kv``, ``sinks``, ``hidden`` and the modules' parameters (the main compressor is
        not detached; the indexer sees detached inputs and learns from its KL loss).

    Raises:
        ValueError, TypeError: bad shapes, inconsistent spec/modules/plan, ``T % cp != 0``,
            ``ring_degree > 1`` without ``exchange="need"``, a plan without the requested routes
            or rounds, the NPU backend with rounds; raised on every rank before any collective.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if check_int("ring_degree", ring_degree, minimum=1) != 1 and exchange != "need":
        raise ValueError(f"ring_degree={ring_degree} splits the need-based exchange: pass exchange='need'")
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    ratios = [spec.compress_ratio] if spec.mode.compresses else []
    if plan is None:
        validate_cu_seqlens(cu_seqlens)
        plan = plan_attention(
            cu_seqlens, cp_size, cp_rank, compress_ratios=ratios,
            need_windows=[spec.window] if exchange == "need" else None, ring_degree=ring_degree,
        )
    else:  # the plan holds the validated values: check against it without a host sync per layer
        _check_plan_matches(plan.cp_size, plan.cp_rank, plan.num_documents, cp_size, cp_rank, cu_seqlens)
    _check_inputs(q, kv, hidden, spec, plan.prefix.local_len, compressor, indexer)
    kv_offset, varlen_segments, order = 0, None, BackwardOrder(q.device)
    ops = get_backend(backend, q.device)
    if ring_degree > 1:
        if ops.name == "npu":
            raise ValueError("ring_degree > 1 merges partial LSEs, which the NPU backend does not differentiate; use 1")
        need = _need_plan(plan, spec, ring_degree)
        compressed, tensors = _compress_exchanged(
            need, plan.segments, spec, hidden, kv.shape[-1], kv.dtype, compressor, indexer, group, order
        )
        result = _ring_forward(q, kv, plan, need, spec, ops, sinks, compressed, tensors, group, order, grad_scale)
        return result._replace(out=order.attach(result.out))
    if exchange == "need":
        need = _need_plan(plan, spec, 1)
        kv_buffer = torch.cat([exchange_rows(kv, need.kv[spec.window], group, order=order), kv])
        kv_offset, varlen_segments = need.kv_offset[spec.window], need.window_segments[spec.window]
        compressed, tensors = _compress_exchanged(
            need, plan.segments, spec, hidden, kv.shape[-1], kv.dtype, compressor, indexer, group, order
        )
    else:
        kv_buffer = rearrange_prefix_kv(gather_from_sp_cp(kv, group, tnd=True, order=order), plan.prefix)
        hidden_prefix = None
        if spec.mode.compresses and hidden is not None:
            hidden_prefix = rearrange_prefix_kv(gather_from_sp_cp(hidden, group, tnd=True, order=order), plan.prefix)
        compressed, tensors = _compress_gathered(plan.segments, spec, hidden, hidden_prefix, compressor, indexer)
    result = attend_prefix(
        q, kv_buffer, plan.segments, spec=spec, backend=ops, sinks=sinks, compressed=compressed,
        indexer_tensors=tensors, kv_offset=kv_offset, varlen_segments=varlen_segments, grad_scale=grad_scale,
        num_global_queries=plan.num_global_queries,
    )
    return result._replace(out=order.attach(result.out))


def _check_plan_matches(
    plan_cp_size: int, plan_cp_rank: int, plan_documents: int, cp_size: int, cp_rank: int, cu_seqlens: Tensor
) -> None:
    """Raise ``ValueError`` if a caller's plan was made for another group position or batch shape."""
    check_ndim("cu_seqlens", check_tensor("cu_seqlens", cu_seqlens), 1, "[B + 1] (1-D, leading 0)")
    if (plan_cp_size, plan_cp_rank, plan_documents) != (cp_size, cp_rank, cu_seqlens.numel() - 1):
        raise ValueError(
            f"plan was made for cp_size={plan_cp_size}, cp_rank={plan_cp_rank}, B={plan_documents} documents;"
            f" this call has cp_size={cp_size}, cp_rank={cp_rank}, B={cu_seqlens.numel() - 1}"
        )


def _need_plan(plan: AttentionPlan, spec: AttentionSpec, ring_degree: int) -> NeedPlan:
    """The plan's need-based routes for this layer, or a ``ValueError`` saying what to plan."""
    need = plan.need
    if need is None or spec.window not in need.kv or (spec.mode.compresses and spec.compress_ratio not in need.compressed):
        ratios = f" and compress_ratios containing {spec.compress_ratio}" if spec.mode.compresses else ""
        raise ValueError(
            f"exchange='need' needs a plan made with need_windows containing {spec.window}{ratios}:"
            " plan_attention(..., need_windows=[...])"
        )
    planned = len(need.kv_rounds[spec.window]) or 1
    if planned != ring_degree:
        raise ValueError(f"ring_degree={ring_degree} but the plan has {planned} round(s): plan_attention(..., ring_degree=...)")
    return need


def _ring_forward(
    q: Tensor, kv: Tensor, plan: AttentionPlan, need: NeedPlan, spec: AttentionSpec, backend: AttentionBackend,
    sinks: Tensor | None, compressed: Tensor | None, tensors: IndexerTensors | None, group: Group,
    order: BackwardOrder, grad_scale: float,
) -> AttentionOutput:
    """Local partial (own rows, compressed entries) + remote rounds, merged by LSE (:mod:`cpkv.ring`)."""
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    pending = start_exchange(kv, need.kv_rounds[spec.window][0].routes, group)  # overlaps the local partial
    segments, mode = plan.segments, spec.mode
    kv_all, selected, indices = kv, None, None
    if compressed is None or spec.window is None or not mode.compresses:
        local = backend.varlen_attention(
            q, kv[:, None], kv[:, None, : spec.d_v], need.local_segments, scale=scale, window=spec.window, sinks=None
        )
        ratio = 1
    else:
        cmp_plan = segments.compressed_for(spec.compress_ratio)
        kv_all = torch.cat([kv, compressed.to(kv.dtype)])
        rows = segments.window_indices(spec.window) - need.local_offset
        rows = torch.where(rows >= 0, rows, -1)  # earlier rows come from the remote rounds
        if mode is LayerCompressMode.INDEXER and tensors is not None:
            with torch.no_grad():
                selected = backend.indexer_topk(
                    tensors.q_index, tensors.k_index, tensors.weights, segments, cmp_plan, topk=spec.topk
                )
            indices = torch.where(selected >= 0, selected + kv.shape[0], -1)
        else:
            indices = cmp_plan.visible_indices(offset=kv.shape[0])
        local = backend.sparse_attention(q, kv_all, torch.cat([rows, indices], 1), segments, d_v=spec.d_v, scale=scale, sinks=None)
        ratio = spec.compress_ratio
    remote, _peak = ring_rounds(q, kv, plan, need, group, order, pending, window=spec.window, d_v=spec.d_v, scale=scale)
    merged = merge_partials([local, *remote], sinks)
    if selected is None or indices is None or tensors is None:
        return AttentionOutput(merged.out, None, ratio)
    config = IndexerLossConfig(
        d_v=spec.d_v, scale=scale, num_window=0, grad_scale=grad_scale, num_global_queries=plan.num_global_queries
    )
    probs = selected_probs(q, kv_all, indices, merged.lse, scale)
    res = attach_indexer_loss(merged.out, tensors.q_index, tensors.k_index, tensors.weights, selected, probs, config=config)
    return AttentionOutput(res.out, res.loss, ratio)
