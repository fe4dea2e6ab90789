"""``attention_forward``: the one executor of an :class:`~cpkv.plan.attention.AttentionPlan`.

Per layer call, in every layout, exchange and compress mode:

1. check every argument against the plan and the spec (shapes only, no host sync, before
   any collective): what fixes the call's collectives raises at once; with a
   :class:`~cpkv.status.StepStatus`, a rank whose own tensors fail reports it there and runs
   the call with NaN stand-ins (the status is checked once per step, :mod:`cpkv.status`);
2. build the rank's kv buffer as the plan says (a slice or rows of the all-gathered kv, or
   the need-exchange halo in front of the rank's own rows, or only its own rows when ring
   rounds bring the rest); all kv heads, keys and values side by side, in one collective;
3. compressed layers: compress (the prefix under ``"allgather"``; only the rank's own
   blocks under ``"need"``, then entries travel to the ranks that see them) and, for
   INDEXER layers, score and select entries;
4. attend through the backend's primitives, merge ring rounds by LSE, attach the indexer
   loss, and tie the backward-order token to the output.

Everything per-batch (segments, routes, rounds, visibility) is plan data; the kv heads
(one shared head ``[T/cp, D]``, shared heads ``[T/cp, H_kv, D]`` or keys with values ``v``) are
layer data: the plan does not depend on them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from cpkv.agreement import agree_in_order
from cpkv.attention_spec import AttentionSpec as AttentionSpec  # re-exported: cpkv.attention.AttentionSpec
from cpkv.attention_spec import BlockReader as BlockReader
from cpkv.attention_spec import CompressorFn as CompressorFn
from cpkv.attention_spec import IndexerFn as IndexerFn
from cpkv.backends import get_backend
from cpkv.backends.base import AttentionBackend, AttentionResult, BackendName, CompressedLayer, CompressedLayerBackend
from cpkv.call_checks import (
    CallReport,
    ModuleOutputs,
    check_call,
    check_tensors,
    checked_queries,
    checked_rows,
    module_stand_ins,
    poisoned,
    stand_ins,
)
from cpkv.collectives import BackwardOrder, Group
from cpkv.comm import gather_from_sp_cp
from cpkv.compress_mode import LayerCompressMode
from cpkv.exchange import exchange_rows
from cpkv.index_keys import exchange_index_keys, round_index_keys, round_index_queries
from cpkv.indexer_loss import attach_indexer_loss
from cpkv.merge import merge_partials
from cpkv.plan.attention import AttentionPlan
from cpkv.plan.routes import CompressedRoutes, KVSource
from cpkv.plan.segments import CompressedPlan
from cpkv.status import StepStatus

class AttentionOutput(NamedTuple):
    """Result of :func:`attention_forward`.

    Attributes:
        out: ``[T/cp, H, d_v]`` attention output of the rank's queries.
        indexer_loss: ``sum_t KL_t`` over the rank's real queries (padding rows named by
            ``plan.valid_queries`` excluded; 0-d fp32, detached, for logging) in INDEXER layers
            with entries (and grad mode on), else ``None``.
        effective_ratio: the ratio actually used (1 when no entry exists on this rank).
    """

    out: Tensor
    indexer_loss: Tensor | None
    effective_ratio: int


class IndexerTensors(NamedTuple):
    """The indexer's queries ``[T_q, H_I, D_I]``, weights ``[T_q, H_I]`` and keys ``[N_c, D_I]`` (detached inputs)."""

    q_index: Tensor
    weights: Tensor
    k_index: Tensor


def _prefix_rows(gathered: Tensor, plan: AttentionPlan) -> Tensor:
    """The rank's prefix buffer from a natural-order (contiguous) or rank-major (zigzag) all-gather."""
    if plan.gather_rows is not None:
        return gathered.index_select(0, plan.gather_rows.to(gathered.device))
    if plan.prefix is None:  # a plan_attention plan always has one of the two
        raise ValueError("plan has neither gather_rows (zigzag) nor prefix (contiguous): build it with plan_attention")
    return gathered.narrow(0, plan.prefix.kv_start, plan.prefix.kv_len)


def _gathered(x: Tensor, plan: AttentionPlan, group: Group, order: BackwardOrder) -> Tensor:
    """The rank's prefix buffer of ``x`` ``[local_len, ...]`` from an all-gather (shorter shards padded)."""
    if torch.compiler.is_compiling() or x.shape[0] < plan.gather_len:  # compiled: no branch on the packing
        x = torch.cat([x, x.new_zeros((plan.gather_len - x.shape[0], *x.shape[1:]))])
    return _prefix_rows(gather_from_sp_cp(x, group, tnd=True, order=order), plan)


def _kv_parts(kv: Tensor, plan: AttentionPlan, source: KVSource, group: Group, order: BackwardOrder) -> list[Tensor]:
    """The rank's kv buffer as parts to concatenate once (no copy when it is one part)."""
    if plan.exchange == "allgather":
        return [_gathered(kv, plan, group, order)]
    if source.halo is None:
        return [kv]
    halo = exchange_rows(kv, source.halo, group, order=order)
    rows = _row_order(source.rows, source.index)
    if rows is not None:  # ranges read rows in another order than [received ; own]
        return [torch.cat([halo, kv]).index_select(0, rows.to(kv.device))]
    return [halo, kv] if torch.compiler.is_compiling() or source.halo.num_recv else [kv]


def _concat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _row_order(rows: Tensor | None, index: Tensor | None) -> Tensor | None:
    """The rows to ``index_select`` a received buffer by, or ``None`` for none.

    Eager: the plan's ``rows`` (``None`` where the buffer is in order already). Compiled: its
    always-tensor ``index`` (the identity where no reorder is needed), so that the graph makes the
    same ops for every packing.
    """
    return index if index is not None and torch.compiler.is_compiling() else rows


def _exchanged(kv: Tensor, v: Tensor | None) -> Tensor:
    """The one tensor the exchanges move: ``kv`` itself, or keys and values side by side ``[T/cp, H_kv, D + d_v]``."""
    return kv if v is None else torch.cat([kv, v], dim=-1)


def _heads(rows: Tensor, dim: int, d_v: int, separate: bool) -> tuple[Tensor, Tensor]:
    """Keys ``[n, H_kv, D]`` and values ``[n, H_kv, d_v]`` (views) of exchanged rows.

    ``rows`` is ``[n, D]`` (one shared head: the values are its first ``d_v`` channels),
    ``[n, H_kv, D]`` (shared heads) or, when ``separate``, ``[n, H_kv, D + d_v]`` (keys, then values).
    """
    # channels by split, whose backward concatenates: a slice's backward scatters into zeros, and
    # inductor's reinplacing of that scatter guards on n being < 2 (a recompile as packings change)
    if separate and rows.ndim == 3:
        keys, values = torch.split(rows, [dim, rows.shape[-1] - dim], dim=-1)
        return keys, values
    heads = rows[:, None] if rows.ndim == 2 else rows
    return heads, torch.split(heads, [d_v, heads.shape[-1] - d_v], dim=-1)[0]


def _compress_own(
    routes: CompressedRoutes, hidden: Tensor, halo: Tensor, fn: Callable[[Tensor, CompressedPlan], Tensor | None],
    name: str, width: int,
) -> list[Tensor]:
    """``fn`` over the rank's straddling blocks (small buffer with the halo) and its other blocks (own rows, no copy).

    Compiled, both run whatever their number of blocks (none: zero entries), so that the graph
    does not branch on the packing."""
    parts = []
    always = torch.compiler.is_compiling()
    if always and routes.straddle_own_index is not None and routes.straddle_index is not None:
        buffer = torch.cat([halo, hidden.index_select(0, routes.straddle_own_index)]).index_select(0, routes.straddle_index)
        parts.append(checked_rows(name, fn(buffer, routes.straddle), routes.straddle, width))
    elif routes.straddle.num_entries:
        read = hidden[: routes.straddle_rows] if routes.straddle_own is None else hidden.index_select(0, routes.straddle_own)
        buffer = torch.cat([halo, read])
        if routes.straddle_order is not None:
            buffer = buffer.index_select(0, routes.straddle_order)
        straddled = fn(buffer, routes.straddle)
        parts.append(checked_rows(name, straddled, routes.straddle, width))
    if always or routes.own.num_entries:
        own = fn(hidden, routes.own)
        parts.append(checked_rows(name, own, routes.own, width))
    return parts


def _run_modules(
    plan: AttentionPlan, spec: AttentionSpec, inputs: Tensor, halo: Tensor | None, compressor: CompressorFn,
    indexer: IndexerFn | None, features: Tensor, width: int,
) -> ModuleOutputs:
    """The compressor and the indexer over the rank's compressor inputs (no collective).

    ``inputs`` is the all-gathered prefix (``halo`` ``None``) or, under the need exchange, the
    rank's own rows with the received ``halo``. Every output is checked against the plan.
    """
    ratio = spec.compress_ratio
    always = torch.compiler.is_compiling()  # compiled: every part, whatever its number of rows
    wants_index = spec.mode is LayerCompressMode.INDEXER and indexer is not None
    keys: Tensor | None = None
    if halo is None:
        blocks = plan.segments.compressed_for(ratio)
        computed = compressor(inputs, blocks)
        entries = [checked_rows("compressor", computed, blocks, width)] if always or blocks.num_entries else []
        if wants_index and indexer is not None and entries:
            keys = checked_rows("indexer.keys", indexer.keys(inputs.detach(), blocks), blocks, indexer.key_dim)
    else:
        routes = plan.compressed[ratio]
        entries = _compress_own(routes, inputs, halo, compressor, "compressor", width)
        if wants_index and indexer is not None:
            key_parts = _compress_own(routes, inputs.detach(), halo.detach(), indexer.keys, "indexer.keys", indexer.key_dim)
            key_dtype = torch.promote_types(inputs.dtype, torch.float32)
            keys = _concat(key_parts).to(key_dtype) if key_parts else inputs.new_zeros((0, indexer.key_dim), dtype=key_dtype)
    queries = None
    sees_entries = always or bool(entries) or (halo is not None and plan.compressed[ratio].entries.num_recv > 0)
    if keys is not None and indexer is not None and sees_entries:
        q_index, weights = indexer.queries(features.detach(), plan.q_positions)
        queries = checked_queries(indexer, q_index, weights, plan.q_positions.shape[0])
    return ModuleOutputs(entries, keys, queries)


def _entries(
    plan: AttentionPlan, spec: AttentionSpec, hidden: Tensor, compressor: CompressorFn, indexer: IndexerFn | None,
    index_features: Tensor | None, kv: Tensor, group: Group, order: BackwardOrder, report: CallReport | None, agree: bool,
) -> tuple[list[Tensor], IndexerTensors | None]:
    """Compressed entries of the rank's prefix in plan order, as parts (and the indexer's tensors).

    The compressor inputs arrive first (all-gathered, or the need exchange's halo), then the
    compressor and the indexer run, and with ``plan.check_modules`` what they returned is
    checked against the plan before any entry or key moves. A failure is reported to the
    step's status (``report``: NaN outputs of the planned shapes take their place) or, without
    one, the ranks agree on it at once (:func:`cpkv.agreement.agree_in_order`).
    """
    halo = None
    if plan.exchange == "allgather":
        inputs = _gathered(hidden, plan, group, order)
    else:
        inputs, halo = hidden, exchange_rows(hidden, plan.compressed[spec.compress_ratio].hidden, group, order=order)
    features = index_features if index_features is not None else hidden
    error: Exception | None = None
    try:
        computed = _run_modules(plan, spec, inputs, halo, compressor, indexer, features, kv.shape[-1])
    except Exception as exc:  # noqa: BLE001 - user code: every rank learns of it
        if not plan.check_modules:
            raise
        if report is not None:
            report(exc)
            computed = module_stand_ins(plan, spec, inputs, halo, indexer, kv.shape[-1])
        elif not agree:  # tracing under torch.compile with a status: this rank raises
            raise
        else:
            error, computed = exc, ModuleOutputs([], None, None)
    if plan.check_modules and agree:
        agree_in_order(error, group, order)
    # Every rank sends the same dtype: entries in the kv dtype (what attention uses them in).
    parts = [e.to(kv.dtype) for e in computed.entries]
    keys = computed.keys
    if plan.exchange == "need":
        routes = plan.compressed[spec.compress_ratio]
        owned = _concat(parts) if parts else kv.new_zeros((0, kv.shape[-1]))
        received = exchange_rows(owned, routes.entries, group, order=order)
        parts = [t for t in (received, owned) if torch.compiler.is_compiling() or t.shape[0]]
        entry_order = _row_order(routes.entry_rows, routes.entry_index)
        if entry_order is not None and parts:  # documents' entries in another order than [received ; owned]
            parts = [_concat(parts).index_select(0, entry_order)]
        if keys is not None:
            got = exchange_index_keys(keys, routes.entries, group, spec.index_key_dtype, order=order)
            keys = torch.cat([got, round_index_keys(keys, spec.index_key_dtype)])
            if entry_order is not None:
                keys = keys.index_select(0, entry_order)
    elif keys is not None:
        keys = round_index_keys(keys, spec.index_key_dtype)
    if not parts or keys is None or computed.queries is None:
        return parts, None
    q_index, weights = computed.queries
    return parts, IndexerTensors(round_index_queries(q_index, spec.index_query_dtype), weights, keys)


def attention_forward(
    q: Tensor, kv: Tensor, plan: AttentionPlan, group: Group, *, spec: AttentionSpec, v: Tensor | None = None,
    sinks: Tensor | None = None, hidden: Tensor | None = None, compressor: CompressorFn | None = None,
    indexer: IndexerFn | None = None, index_features: Tensor | None = None,
    backend: BackendName | AttentionBackend = "auto", grad_scale: float = 1.0, status: StepStatus | None = None,
) -> AttentionOutput:
    """Prefix attention of this rank's shard, exactly as ``plan`` describes the micro-batch.

    Args:
        q: ``[T/cp, H, D]`` this rank's queries in shard order, RoPE applied at
            ``plan.q_positions``.
        kv: this rank's kv, RoPE applied, q's dtype and device: ``[T/cp, D]`` one shared kv
            head (DeepSeek-V4's MQA; values are its first ``spec.d_v`` channels), or
            ``[T/cp, H_kv, D]`` kv heads with ``H % H_kv == 0`` (query head ``h`` attends with kv
            head ``h // (H / H_kv)``, as Megatron's and torch's GQA): shared (values their first
            ``spec.d_v`` channels) or, with ``v``, the keys. Every exchange moves all heads in
            one collective (keys and values side by side); compressed layers take the 2-D form.
        plan: this rank's :class:`~cpkv.plan.attention.AttentionPlan` (:func:`cpkv.plan_attention`,
            once per micro-batch, with this layer's ratio in ``compress_ratios`` and, for
            ``exchange="need"``, its window in ``windows``). The only description of the batch.
        group: the CP group (``None``: the default group); its size and rank must be the plan's.
        spec: the layer's :class:`AttentionSpec`.
        v: ``[T/cp, H_kv, spec.d_v]`` values of their own (keys and values differ: GQA, MHA,
            MLA's per-head keys and values), with ``kv`` the keys ``[T/cp, H_kv, D]``; ``None``
            (default): the shared-KV forms.
        sinks: ``[H]`` per-head sink logits, or ``None``.
        hidden: ``[T/cp, hidden]`` this rank's compressor / indexer inputs (compressed modes).
        compressor, indexer: the layer's modules (compressed modes / INDEXER), declaring
            ``ratio``, ``prev_blocks`` and ``input_dim`` (:class:`CompressorFn`, :class:`IndexerFn`).
        index_features: ``[T/cp, F]`` the features the indexer's queries come from (for example
            DeepSeek-V4's query low-rank residual); default ``hidden``. Detached by cpkv.
        backend: ``"reference"``, ``"cuda"``, ``"npu"``, ``"auto"`` (by ``q.device``) or an
            :class:`~cpkv.backends.base.AttentionBackend` instance (create it once per model so
            that fallback warnings appear once).
        grad_scale: multiplies the indexer-loss gradients (kept per call in autograd ctx).
        status: the step's :class:`~cpkv.status.StepStatus` (the same object for every layer call
            of the step; check it once per step, before the optimizer steps). With it the call
            makes no host sync, and a check that fails on this rank only (its tensors' rows,
            heads, widths, dtypes or devices; with ``plan.check_modules``, what its compressor
            or indexer returned or raised) is recorded there: the rank runs the call's
            collectives with NaN stand-ins and returns NaN, and ``status.check()`` raises on
            every rank. ``None`` (default): such a check raises at once on the rank where it
            fails, and the ranks agree on the modules' outputs with a host sync per compressed
            call (as ``StepStatus(each_call=True)`` does for every check).

    Returns:
        :class:`AttentionOutput` with ``out`` ``[T/cp, H, d_v]``. Backward flows to ``q``,
        ``kv``, ``v``, ``sinks``, ``hidden`` and the modules' parameters (the main compressor is
        not detached; the indexer sees detached inputs and learns from its KL loss).

    Raises:
        ValueError, TypeError: at once, before any collective: an inconsistent spec, plan,
            group or module declaration (a plan for another group position, a ratio or need
            window the plan lacks, ring rounds with the NPU backend, kv heads in a compressed
            layer, kv not a float ``[T/cp, D]`` / ``[T/cp, H_kv, D]``). Bad tensors of this rank
            (rows other than ``plan.local_len``, ``H % H_kv != 0``, q's ``D`` other than kv's,
            ``v`` not ``[T/cp, H_kv, d_v]``, sinks not ``[H]``, hidden or index features of the
            wrong width, dtypes, devices): with a deferring ``status`` at ``status.check()`` on
            every rank, else at once on this rank.

    Example:
        >>> plan = plan_attention(cu_seqlens, cp_size, cp_rank, compress_ratios=[4])  # doctest: +SKIP
        >>> out = attention_forward(q, kv, plan, group, spec=AttentionSpec(d_v=448, compress_ratio=4, window=128)).out  # doctest: +SKIP
    """
    ops = get_backend(backend, q.device if isinstance(q, Tensor) else None)
    check_call(q, kv, v, plan, group, spec, sinks, hidden, compressor, indexer, index_features, ops, grad_scale)
    if status is not None and not isinstance(status, StepStatus):
        raise TypeError(f"status must be a cpkv.StepStatus or None, got {type(status).__name__}")
    error: Exception | None = None
    try:
        check_tensors(q, kv, v, plan, spec, sinks, hidden, compressor, indexer, index_features)
    except (ValueError, TypeError) as exc:
        error = exc
    compiling = torch.compiler.is_compiling()
    if error is not None and (status is None or compiling):  # no status, or tracing: this rank raises at once
        raise error
    agree = status is None or status.each_call  # the ranks agree on the modules' outputs in the call
    report = None if agree or status is None or compiling else CallReport(status, spec)
    given = q
    if error is not None and report is not None:  # this rank takes part with NaN stand-ins of the planned shapes
        report(error)
        q, kv, v, sinks, hidden, index_features = stand_ins(q, kv, v, sinks, hidden, index_features, plan, spec,
                                                             compressor, indexer)
    order = BackwardOrder(q, kv) if v is None else BackwardOrder(q, kv, v)
    if status is not None and status.each_call:  # debugging: agree on every rank's arguments at once
        agree_in_order(error, group, order)
    source = plan.kv_source(spec.window)
    moved = _exchanged(kv, v)  # what every exchange moves: all kv heads (and values) in one collective
    kv_parts = _kv_parts(moved, plan, source, group, order)
    entry_parts: list[Tensor] = []
    index = None
    if spec.mode.compresses and compressor is not None and hidden is not None:
        entry_parts, index = _entries(plan, spec, hidden, compressor, indexer, index_features, kv, group, order, report,
                                      agree)
    scale = spec.scale if spec.scale is not None else q.shape[-1] ** -0.5
    local_sinks = sinks if not source.rounds else None
    num_kv = sum(t.shape[0] for t in kv_parts)
    selected, probs = None, None
    learn_indexer = spec.indexer_loss and torch.is_grad_enabled()  # forward only (no_grad, inference_mode): no KL work
    if not entry_parts:  # NO_COMPRESS, or no entry on this rank: the effective ratio is 1
        kv_all = kv_buffer = _concat(kv_parts)
        keys, values = _heads(kv_buffer, q.shape[-1], spec.d_v, v is not None)
        local = ops.varlen_attention(q, keys, values, source.segments, scale=scale, window=spec.window, sinks=local_sinks)
        ratio = 1
    else:
        window = spec.window if spec.window is not None else 1  # spec.validate: compressed layers have a window
        kv_all = torch.cat([*kv_parts, *entry_parts])  # the one copy of the rank's kv in this layer
        visible = plan.visible_for(spec.compress_ratio)
        if index is None:
            cmp_rows = visible.visible_indices(offset=num_kv)
        else:
            with torch.no_grad():
                picked = ops.indexer_topk(index.q_index, index.k_index, index.weights, plan.segments, visible,
                                          topk=spec.topk, fp8=spec.scores_in_fp8)
            cmp_rows = torch.where(picked >= 0, picked + num_kv, -1)
            selected = picked
        indices = torch.cat([source.segments.window_indices(window), cmp_rows], dim=1)
        wants_probs = selected is not None and learn_indexer and len(source.rounds) == 0  # the KL target from this call's LSE
        probs_from = indices.shape[1] - cmp_rows.shape[1]
        if isinstance(ops, CompressedLayerBackend):  # one kernel call given the layer's structure (NPU fused)
            layer = CompressedLayer(source.segments, plan.segments, visible, window, num_kv, selected)
            local, probs = ops.compressed_attention(q, kv_all, indices, layer, d_v=spec.d_v, scale=scale, sinks=local_sinks,
                                                    probs_from=probs_from if wants_probs else None)
        elif wants_probs:
            local, probs = ops.sparse_attention_probs(q, kv_all, indices, d_v=spec.d_v, scale=scale, sinks=local_sinks,
                                                      probs_from=probs_from)
        else:
            local = ops.sparse_attention(q, kv_all, indices, d_v=spec.d_v, scale=scale, sinks=local_sinks)
        ratio = spec.compress_ratio
    result = local
    if source.rounds:
        parts = [local]
        for ring_round in source.rounds:
            rows = exchange_rows(moved, ring_round.routes, group, order=order)
            round_order = _row_order(ring_round.rows, ring_round.index)
            if round_order is not None:  # into index order
                rows = rows.index_select(0, round_order.to(rows.device))
            # empty rounds make no call (compiled: every round does, an empty one merging as nothing)
            if torch.compiler.is_compiling() or (ring_round.ranges.num_rows and ring_round.ranges.num_keys):
                keys, values = _heads(rows, q.shape[-1], spec.d_v, v is not None)
                parts.append(ops.range_attention(q, keys, values, ring_round.ranges, scale=scale))
        result = merge_partials(parts, sinks)
    loss = None
    if selected is not None and index is not None and learn_indexer:
        if probs is None:  # ring rounds: the target's denominator is the merged LSE
            with torch.no_grad():
                probs = ops.selected_probs(q.detach(), kv_all.detach(), cmp_rows, result.lse.detach(), scale=scale)
        if plan.valid_queries is not None:  # padding queries select nothing in the KL loss (no value, no gradient)
            selected = torch.where(plan.valid_queries.to(selected.device)[:, None], selected, -1)
        attached = attach_indexer_loss(
            result.out, index.q_index, index.k_index, index.weights, selected, probs,
            grad_scale=grad_scale, num_global_queries=plan.num_global_queries, kl=ops.indexer_kl,
        )
        result, loss = AttentionResult(attached.out, result.lse), attached.loss
    out = result.out
    if report is not None and report.failed:  # poisoned: NaN values, NaN gradients (to this rank's inputs and peers)
        out = poisoned(out, (given.shape[0], given.shape[1], spec.d_v))
        loss = None if loss is None else loss * math.nan
    return AttentionOutput(order.attach(out), loss, ratio)
