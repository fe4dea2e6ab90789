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
from cpkv.attention_plan import AttentionPlan, BSNDPlan, CompressedPlan, SegmentPlan, plan_attention, plan_attention_bsnd
from cpkv.backends import AttentionBackend, get_backend
from cpkv.comm import Group, gather_from_sp_cp
from cpkv.compress_mode import LayerCompressMode
from cpkv.indexer_loss import IndexerLossConfig
from cpkv.layout import validate_cu_seqlens
from cpkv.plan import rearrange_prefix_kv


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


def attend_prefix(
    q: Tensor, kv_prefix: Tensor, segments: SegmentPlan, *, spec: AttentionSpec, backend: AttentionBackend,
    sinks: Tensor | None = None, hidden: Tensor | None = None, hidden_prefix: Tensor | None = None,
    compressor: CompressorFn | None = None, indexer: IndexerFn | None = None,
    grad_scale: float = 1.0, num_global_queries: int = 1,
) -> AttentionOutput:
    """Attention of queries over their causal kv prefix, with compression and indexer.

    Args:
        q: ``[T_q, H, D]`` queries (RoPE applied). kv_prefix: ``[T_kv, D]`` shared kv of
            the prefix segments of ``segments``.
        segments: the :class:`SegmentPlan` pairing queries with prefixes (planned with
            ``spec.compress_ratio`` for compressed layers).
        hidden: ``[T_q, hidden]`` indexer inputs of the queries (INDEXER).
        hidden_prefix: ``[T_kv, hidden]`` compressor inputs of the prefix (compressed modes).
        compressor, indexer: the layer's modules (compressed modes / INDEXER).
        grad_scale, num_global_queries: the indexer-loss gradient factor ``grad_scale / N``.
    """
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    mode = spec.mode
    compressed = cmp_plan = None
    if mode.compresses:
        if compressor is None or hidden_prefix is None:
            raise ValueError(f"{mode.name} layers need compressor and hidden inputs")
        cmp_plan = segments.compressed_for(spec.compress_ratio)
        compressed = compressor(hidden_prefix, cmp_plan)
    if compressed is None or cmp_plan is None or hidden_prefix is None or spec.window is None:
        # NO_COMPRESS, or no full block in the prefix: the effective ratio is 1.
        result = backend.varlen_attention(
            q, kv_prefix[:, None], kv_prefix[:, None, : spec.d_v], segments, scale=scale, window=spec.window, sinks=sinks
        )
        return AttentionOutput(result.out, None, 1)
    kv_all = torch.cat([kv_prefix, compressed.to(kv_prefix.dtype)])
    window_rows = segments.window_indices(spec.window)
    if mode is LayerCompressMode.COMPRESSOR_ONLY:
        indices = torch.cat([window_rows, cmp_plan.visible_indices(offset=kv_prefix.shape[0])], dim=1)
        result = backend.sparse_attention(q, kv_all, indices, segments, d_v=spec.d_v, scale=scale, sinks=sinks)
        return AttentionOutput(result.out, None, spec.compress_ratio)
    if indexer is None or hidden is None:
        raise ValueError("INDEXER layers need an indexer and the queries' hidden inputs")
    q_index, weights = indexer.queries(hidden.detach(), segments.q_positions)
    k_index = indexer.keys(hidden_prefix.detach(), segments.compressed_for(indexer.ratio))
    if k_index is None:
        raise ValueError("the indexer's compressor returned None while the main compressor did not")
    with torch.no_grad():
        selected = backend.indexer_topk(q_index, k_index, weights, segments, cmp_plan, topk=spec.topk)
    indices = torch.cat([window_rows, torch.where(selected >= 0, selected + kv_prefix.shape[0], -1)], dim=1)
    config = IndexerLossConfig(
        d_v=spec.d_v, scale=scale, num_window=spec.window, grad_scale=grad_scale, num_global_queries=num_global_queries
    )
    res = backend.sparse_attention_with_indexer_loss(
        q, kv_all, indices, selected, q_index, k_index, weights, segments, sinks=sinks, config=config
    )
    return AttentionOutput(res.out, res.loss, spec.compress_ratio)


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
) -> AttentionOutput:
    """Prefix attention of this rank's contiguous TND shard (all-gather exchange).

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
            ``compress_ratios`` covering this layer; built here when ``None``.
        backend: ``"reference"`` or an :class:`AttentionBackend`.
        ring_degree: 1 (all-gather in one round); larger values are not implemented yet.
        grad_scale: multiplies the indexer-loss gradients (kept per call in autograd ctx).

    Returns:
        :class:`AttentionOutput` with ``out`` ``[T/cp, H, d_v]``. Backward flows to ``q``,
        ``kv``, ``sinks``, ``hidden`` and the modules' parameters (the main compressor is
        not detached; the indexer sees detached inputs and learns from its KL loss).

    Raises:
        ValueError, TypeError: bad shapes, inconsistent spec/modules/plan, ``T % cp != 0``,
            ``ring_degree != 1``; raised on every rank before any collective.
    """
    if check_int("ring_degree", ring_degree, minimum=1) != 1:
        raise ValueError(f"ring_degree={ring_degree}: only 1 (one all-gather round) is implemented so far")
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    validate_cu_seqlens(cu_seqlens)
    if plan is None:
        ratios = [spec.compress_ratio] if spec.mode.compresses else []
        plan = plan_attention(cu_seqlens, cp_size, cp_rank, compress_ratios=ratios)
    elif (plan.cp_size, plan.cp_rank, plan.prefix.num_tokens) != (cp_size, cp_rank, int(cu_seqlens[-1])):
        raise ValueError(
            f"plan was made for cp_size={plan.cp_size}, cp_rank={plan.cp_rank}, T={plan.prefix.num_tokens};"
            f" this call has cp_size={cp_size}, cp_rank={cp_rank}, T={int(cu_seqlens[-1])}"
        )
    _check_inputs(q, kv, hidden, spec, plan.prefix.local_len, compressor, indexer)
    kv_prefix = rearrange_prefix_kv(gather_from_sp_cp(kv, group, tnd=True), plan.prefix)
    hidden_prefix = None
    if spec.mode.compresses and hidden is not None:
        hidden_prefix = rearrange_prefix_kv(gather_from_sp_cp(hidden, group, tnd=True), plan.prefix)
    return attend_prefix(
        q, kv_prefix, plan.segments, spec=spec, backend=get_backend(backend), sinks=sinks, hidden=hidden,
        hidden_prefix=hidden_prefix, compressor=compressor, indexer=indexer, grad_scale=grad_scale,
        num_global_queries=plan.num_global_queries,
    )


def attention_forward_bsnd(
    q: Tensor, kv: Tensor, group: Group, *, spec: AttentionSpec, sinks: Tensor | None = None,
    hidden: Tensor | None = None, compressor: CompressorFn | None = None, indexer: IndexerFn | None = None,
    plan: BSNDPlan | None = None, backend: str | AttentionBackend = "reference", ring_degree: int = 1,
    grad_scale: float = 1.0,
) -> AttentionOutput:
    """Prefix attention of this rank's zigzag BSND shard (two steps, see :class:`BSNDPlan`).

    The same functions as the TND path: the kv (and compressor inputs) are gathered with
    ``gather_from_sp_cp(..., tnd=False, dim=1)`` (zigzag -> natural order), then each
    local chunk runs :func:`attend_prefix` against its causal prefix.

    Args:
        q: ``[B, S/cp, H, D]`` this rank's queries (chunks ``r``, ``2cp-1-r``), RoPE applied at
            ``plan.positions``.
        kv: ``[B, S/cp, D]`` shared kv; hidden: ``[B, S/cp, hidden]`` (compressed modes).
        group, spec, sinks, compressor, indexer, backend, ring_degree, grad_scale: as
            :func:`attention_forward`.
        plan: from :func:`~cpkv.attention_plan.plan_attention_bsnd`; built here when ``None``.

    Returns:
        :class:`AttentionOutput` with ``out`` ``[B, S/cp, H, d_v]``; ``indexer_loss`` sums both steps.

    Raises:
        ValueError, TypeError: bad shapes or options, on every rank before any collective.
    """
    if check_int("ring_degree", ring_degree, minimum=1) != 1:
        raise ValueError(f"ring_degree={ring_degree}: only 1 (one all-gather round) is implemented so far")
    check_ndim("q", check_tensor("q", q), 4, "[B, S/cp, H, D]")
    check_ndim("kv", check_tensor("kv", kv), 3, "[B, S/cp, D]")
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    batch, local = q.shape[0], q.shape[1]
    if plan is None:
        ratios = [spec.compress_ratio] if spec.mode.compresses else []
        plan = plan_attention_bsnd(batch, local * cp_size, cp_size, cp_rank, compress_ratios=ratios, device=q.device)
    if (plan.batch, plan.seq_len, plan.cp_size, plan.cp_rank) != (batch, local * cp_size, cp_size, cp_rank):
        raise ValueError(f"plan (B={plan.batch}, S={plan.seq_len}, cp={plan.cp_size}, rank={plan.cp_rank}) does not match this call")
    flat_hidden = hidden.flatten(0, 1) if hidden is not None else None
    _check_inputs(q.flatten(0, 1), kv.flatten(0, 1), flat_hidden, spec, batch * local, compressor, indexer)
    kv_full = gather_from_sp_cp(kv, group, tnd=False, dim=1)
    hidden_full = gather_from_sp_cp(hidden, group, tnd=False, dim=1) if spec.mode.compresses and hidden is not None else None
    c, outs, losses, ratio = plan.chunk_len, [], [], 1
    for k, (segments, prefix_len) in enumerate(zip(plan.steps, plan.prefix_lens)):
        local_rows = slice(k * c, (k + 1) * c)
        result = attend_prefix(
            q[:, local_rows].flatten(0, 1), kv_full[:, :prefix_len].flatten(0, 1), segments, spec=spec,
            backend=get_backend(backend), sinks=sinks,
            hidden=hidden[:, local_rows].flatten(0, 1) if hidden is not None else None,
            hidden_prefix=hidden_full[:, :prefix_len].flatten(0, 1) if hidden_full is not None else None,
            compressor=compressor, indexer=indexer, grad_scale=grad_scale, num_global_queries=plan.num_global_queries,
        )
        outs.append(result.out.reshape(batch, c, *result.out.shape[1:]))
        losses += [result.indexer_loss] if result.indexer_loss is not None else []
        ratio = max(ratio, result.effective_ratio)
    loss = torch.stack(losses).sum() if losses else None
    return AttentionOutput(torch.cat(outs, dim=1), loss, ratio)
