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
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.agreement import agree_in_order
from cpkv.backends import get_backend
from cpkv.backends.base import AttentionBackend, AttentionResult, BackendName, CompressedLayer, CompressedLayerBackend
from cpkv.checks import check_int, check_ndim, check_tensor
from cpkv.collectives import BackwardOrder, Group, check_group
from cpkv.comm import gather_from_sp_cp
from cpkv.compress_mode import LayerCompressMode
from cpkv.exchange import exchange_rows
from cpkv.index_keys import check_index_key_dtype, exchange_index_keys, round_index_keys, round_index_queries
from cpkv.indexer_loss import attach_indexer_loss
from cpkv.merge import merge_partials
from cpkv.plan.attention import AttentionPlan
from cpkv.plan.routes import CompressedRoutes, KVSource
from cpkv.plan.segments import CompressedPlan
from cpkv.status import StepStatus


@dataclass(frozen=True)
class AttentionSpec:
    """What a layer attends to (the per-layer, not per-batch, options).

    Attributes:
        d_v: value channels: the first ``d_v`` channels of each shared kv head, or the width of
            the separate values ``v`` (:func:`attention_forward`).
        compress_ratio: the layer's ratio; its :class:`LayerCompressMode` follows from it unless
            ``compress_mode`` says otherwise.
        window: sliding window ``W`` (own token plus ``W - 1`` earlier), or ``None`` (the
            default): dense causal, ``NO_COMPRESS`` only. Compressed layers must name their
            window (DeepSeek-V4's is 128); ``validate`` raises otherwise.
        scale: softmax scale; ``None`` means ``1/sqrt(D)``.
        topk: entries the indexer selects per query (INDEXER).
        indexer_loss: INDEXER layers: attach the indexer's KL loss (its only gradient; see
            docs/semantics.md). ``False`` leaves the indexer without gradient (as Hugging Face's
            DeepSeek-V4 attention does). Under ``torch.no_grad()`` / ``torch.inference_mode()`` the
            loss is skipped (no KL target, no KL): nothing could train the indexer.
        index_key_dtype: INDEXER layers: the dtype the indexer keys are rounded to and travel in
            (``None``: the compute dtype; ``torch.float32``, ``torch.bfloat16``, or
            ``torch.float8_e4m3fn`` with one fp32 scale per key, as DeepSeek's indexer);
            :mod:`cpkv.index_keys`.
        index_query_dtype: INDEXER layers: the dtype the indexer queries are rounded to, per
            token and head, for the selection and the KL loss (the same options; gradient
            straight through). With both dtypes ``torch.float8_e4m3fn`` (DeepSeek's
            indexer) a backend may score the fp8 payloads on fp8 tensor cores (CUDA does).
        compress_mode: the layer's mode when it does not follow DeepSeek-V4's rule (an indexer
            only at ratio 4): e.g. ``LayerCompressMode.INDEXER`` at ratio 8 or
            ``COMPRESSOR_ONLY`` at ratio 4 (Hugging Face's config allows both).
    """

    d_v: int
    compress_ratio: int = 0
    window: int | None = None
    scale: float | None = None
    topk: int = 512
    indexer_loss: bool = True
    index_key_dtype: torch.dtype | None = None
    compress_mode: LayerCompressMode | None = None
    index_query_dtype: torch.dtype | None = None

    @property
    def scores_in_fp8(self) -> bool:
        """Whether the indexer's keys and queries are both rounded to fp8 e4m3 (backends may score their payloads)."""
        return self.index_key_dtype is torch.float8_e4m3fn and self.index_query_dtype is torch.float8_e4m3fn

    @property
    def mode(self) -> LayerCompressMode:
        """The layer's :class:`LayerCompressMode`: ``compress_mode``, else from ``compress_ratio`` (4: INDEXER)."""
        if self.compress_mode is not None:
            return self.compress_mode
        return LayerCompressMode.from_compress_ratio(self.compress_ratio)

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for inconsistent options."""
        check_int("spec.d_v", self.d_v, minimum=1)
        check_int("spec.topk", self.topk, minimum=1)
        check_int("spec.compress_ratio", self.compress_ratio, minimum=0)
        check_index_key_dtype("spec.index_key_dtype", self.index_key_dtype)
        check_index_key_dtype("spec.index_query_dtype", self.index_query_dtype)
        if self.compress_mode is not None:
            if not isinstance(self.compress_mode, LayerCompressMode):
                raise TypeError(f"spec.compress_mode must be a LayerCompressMode or None, got {type(self.compress_mode).__name__}")
            if self.compress_mode.compresses != (self.compress_ratio > 1):
                raise ValueError(
                    f"spec.compress_mode={self.compress_mode.name} does not fit spec.compress_ratio={self.compress_ratio}"
                    " (compressed modes need a ratio > 1, NO_COMPRESS a ratio <= 1)"
                )
        if not isinstance(self.indexer_loss, bool):
            raise TypeError(f"spec.indexer_loss must be a bool, got {type(self.indexer_loss).__name__}")
        if self.scale is not None:
            _check_finite("spec.scale", self.scale, positive=True)
        if self.window is not None:
            check_int("spec.window", self.window, minimum=1)
        elif self.mode.compresses:
            raise ValueError(f"spec.window is required for compressed layers ({self.mode.name}), got None")


class BlockReader(Protocol):
    """What a compressor or indexer declares it reads, so that cpkv can plan the rows it needs and
    check every call on every rank before any collective (docs/semantics.md, "Compression"):
    ``ratio`` (tokens per block), ``prev_blocks`` (earlier blocks of the same document each entry
    also reads: 1 for DeepSeek-V4's overlapping ratio-4 compressor, else 0) and ``input_dim``
    (width of its input rows)."""

    @property
    def ratio(self) -> int: ...

    @property
    def prev_blocks(self) -> int: ...

    @property
    def input_dim(self) -> int: ...


class CompressorFn(BlockReader, Protocol):
    """Maps compressor inputs ``[N_in, input_dim]`` and a :class:`CompressedPlan` to entries ``[N_c, D]`` (or ``None``)."""

    def __call__(self, x: Tensor, plan: CompressedPlan, /) -> Tensor | None: ...


class IndexerFn(BlockReader, Protocol):
    """The lightning indexer: queries from local features, keys from a compressor input buffer.

    ``queries(features [T/cp, feature_dim], positions [T/cp]) -> (q_index [T/cp, H_I, key_dim],
    weights [T/cp, H_I])``; ``keys(x [N_in, input_dim], plan) -> [N_c, key_dim] | None``. Besides
    :class:`BlockReader`'s declarations it declares ``key_dim`` (``D_I``, the width of its keys
    and query heads) and ``feature_dim`` (the width of the features its queries come from:
    ``index_features``, or ``hidden`` when that is not given), so that every rank can check them
    and size the key buffers before any collective. Its inputs are detached by cpkv.
    """

    @property
    def key_dim(self) -> int: ...

    @property
    def feature_dim(self) -> int: ...

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]: ...

    def keys(self, x: Tensor, plan: CompressedPlan) -> Tensor | None: ...


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
    if x.shape[0] < plan.gather_len:
        x = torch.cat([x, x.new_zeros((plan.gather_len - x.shape[0], *x.shape[1:]))])
    return _prefix_rows(gather_from_sp_cp(x, group, tnd=True, order=order), plan)


def _kv_parts(kv: Tensor, plan: AttentionPlan, source: KVSource, group: Group, order: BackwardOrder) -> list[Tensor]:
    """The rank's kv buffer as parts to concatenate once (no copy when it is one part)."""
    if plan.exchange == "allgather":
        return [_gathered(kv, plan, group, order)]
    if source.halo is None:
        return [kv]
    halo = exchange_rows(kv, source.halo, group, order=order)
    if source.rows is not None:  # ranges read rows in another order than [received ; own]
        return [torch.cat([halo, kv]).index_select(0, source.rows.to(kv.device))]
    return [halo, kv] if source.halo.num_recv else [kv]


def _concat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _exchanged(kv: Tensor, v: Tensor | None) -> Tensor:
    """The one tensor the exchanges move: ``kv`` itself, or keys and values side by side ``[T/cp, H_kv, D + d_v]``."""
    return kv if v is None else torch.cat([kv, v], dim=-1)


def _heads(rows: Tensor, dim: int, d_v: int, separate: bool) -> tuple[Tensor, Tensor]:
    """Keys ``[n, H_kv, D]`` and values ``[n, H_kv, d_v]`` (views) of exchanged rows.

    ``rows`` is ``[n, D]`` (one shared head: the values are its first ``d_v`` channels),
    ``[n, H_kv, D]`` (shared heads) or, when ``separate``, ``[n, H_kv, D + d_v]`` (keys, then values).
    """
    if rows.ndim == 2:
        return rows[:, None], rows[:, None, :d_v]
    if separate:
        return rows[..., :dim], rows[..., dim:]
    return rows, rows[..., :d_v]


def _compress_own(
    routes: CompressedRoutes, hidden: Tensor, halo: Tensor, fn: Callable[[Tensor, CompressedPlan], Tensor | None],
    name: str, width: int,
) -> list[Tensor]:
    """``fn`` over the rank's straddling blocks (small buffer with the halo) and its other blocks (own rows, no copy)."""
    parts = []
    if routes.straddle.num_entries:
        read = hidden[: routes.straddle_rows] if routes.straddle_own is None else hidden.index_select(0, routes.straddle_own)
        buffer = torch.cat([halo, read])
        if routes.straddle_order is not None:
            buffer = buffer.index_select(0, routes.straddle_order)
        straddled = fn(buffer, routes.straddle)
        parts.append(_checked_rows(name, straddled, routes.straddle.num_entries, width))
    if routes.own.num_entries:
        own = fn(hidden, routes.own)
        parts.append(_checked_rows(name, own, routes.own.num_entries, width))
    return parts


def _checked_rows(name: str, rows: Tensor | None, num_entries: int, width: int) -> Tensor:
    """What a compressor or ``indexer.keys`` returned for blocks with entries: a float ``[num_entries, width]``."""
    if not isinstance(rows, Tensor) or tuple(rows.shape) != (num_entries, width) or not rows.is_floating_point():
        got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, Tensor) else type(rows).__name__
        raise ValueError(
            f"{name} must return a float [N_c, {width}] tensor with the plan's N_c = {num_entries} entries"
            " (CompressedPlan.num_entries), got " + got
        )
    return rows


def _checked_queries(indexer: IndexerFn, q_index: object, weights: object, num_queries: int) -> tuple[Tensor, Tensor]:
    """``indexer.queries``' result: ``[T/cp, H_I, key_dim]`` queries and ``[T/cp, H_I]`` weights."""
    if isinstance(q_index, Tensor) and isinstance(weights, Tensor) and q_index.ndim == 3 and weights.ndim == 2:
        if q_index.shape[0] == num_queries and q_index.shape[2] == indexer.key_dim and weights.shape == q_index.shape[:2]:
            return q_index, weights
    shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (q_index, weights)]
    raise ValueError(
        f"indexer.queries must return q_index [T/cp, H_I, indexer.key_dim] = [{num_queries}, H_I, {indexer.key_dim}]"
        f" and weights [T/cp, H_I], got {shapes[0]} and {shapes[1]}"
    )


class _Report:
    """A deferred layer call's failures: recorded in the step's :class:`~cpkv.status.StepStatus`, named by the call."""

    def __init__(self, status: StepStatus, spec: AttentionSpec) -> None:
        ratio = f", compress_ratio={spec.compress_ratio}" if spec.mode.compresses else ""
        self.call = f"layer call {status.start_call()} of the step ({spec.mode.name}{ratio}, window={spec.window})"
        self.status, self.failed = status, False

    def __call__(self, error: Exception) -> None:
        self.failed = True
        self.status.report(error, self.call)


def _stand_in(x: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """NaN ``shape`` in place of ``x``, tied to ``x`` when it is a differentiable float tensor there: ``x``'s gradient is NaN too."""
    where = x.device if device is None else device
    filler = torch.full(shape, math.nan, dtype=dtype, device=where)
    if x.requires_grad and x.is_floating_point() and x.device == where:
        filler = filler + x.sum().to(dtype) * 0
    return filler


def _poisoned(out: Tensor, shape: tuple[int, ...]) -> Tensor:
    """NaN ``shape`` that depends on ``out`` with a NaN derivative (whatever gradient arrives, ``out``'s is NaN)."""
    return out.new_full(shape, math.nan) + out.sum() * math.nan


def _stand_ins(
    q: Tensor, kv: Tensor, v: Tensor | None, sinks: Tensor | None, hidden: Tensor | None, index_features: Tensor | None,
    plan: AttentionPlan, spec: AttentionSpec, compressor: CompressorFn | None, indexer: IndexerFn | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """NaN tensors of the planned shapes for a rank whose own tensors failed their checks.

    What travels keeps kv's form (``[T/cp, *kv.shape[1:]]``, kv's dtype; hidden ``[T/cp,
    compressor.input_dim]``), so the call's collectives have the sizes every other rank's have;
    q keeps its heads where kv's divide them. Each stand-in depends on the tensor it replaces.
    """
    rows, dtype, device = plan.local_len, kv.dtype, kv.device
    heads = q.shape[1] if q.shape[1] and (kv.ndim == 2 or q.shape[1] % kv.shape[1] == 0) else (kv.shape[1] if kv.ndim == 3 else 1)
    new_q = _stand_in(q, (rows, heads, kv.shape[-1]), dtype, device)
    new_kv = _stand_in(kv, (rows, *kv.shape[1:]), dtype, device)
    new_v = None if v is None else _stand_in(v, (rows, kv.shape[1], spec.d_v), dtype, device)
    new_sinks = None if sinks is None else _stand_in(sinks, (heads,), dtype, device)
    new_hidden, new_features = hidden, index_features
    if hidden is not None and compressor is not None:
        floating = hidden.dtype if hidden.is_floating_point() else dtype
        new_hidden = _stand_in(hidden, (rows, compressor.input_dim), floating, device)
        if index_features is not None and indexer is not None:
            new_features = _stand_in(index_features, (rows, indexer.feature_dim), floating, device)
    return new_q, new_kv, new_v, new_sinks, new_hidden, new_features


class _Computed(NamedTuple):
    """The modules' outputs on this rank, before any entry moves."""

    entries: list[Tensor]
    keys: Tensor | None
    queries: tuple[Tensor, Tensor] | None


def _run_modules(
    plan: AttentionPlan, spec: AttentionSpec, inputs: Tensor, halo: Tensor | None, compressor: CompressorFn,
    indexer: IndexerFn | None, features: Tensor, width: int,
) -> _Computed:
    """The compressor and the indexer over the rank's compressor inputs (no collective).

    ``inputs`` is the all-gathered prefix (``halo`` ``None``) or, under the need exchange, the
    rank's own rows with the received ``halo``. Every output is checked against the plan.
    """
    ratio = spec.compress_ratio
    wants_index = spec.mode is LayerCompressMode.INDEXER and indexer is not None
    keys: Tensor | None = None
    if halo is None:
        blocks = plan.segments.compressed_for(ratio)
        computed = compressor(inputs, blocks)
        entries = [_checked_rows("compressor", computed, blocks.num_entries, width)] if blocks.num_entries else []
        if wants_index and indexer is not None and entries:
            keys = _checked_rows("indexer.keys", indexer.keys(inputs.detach(), blocks), blocks.num_entries, indexer.key_dim)
    else:
        routes = plan.compressed[ratio]
        entries = _compress_own(routes, inputs, halo, compressor, "compressor", width)
        if wants_index and indexer is not None:
            key_parts = _compress_own(routes, inputs.detach(), halo.detach(), indexer.keys, "indexer.keys", indexer.key_dim)
            key_dtype = torch.promote_types(inputs.dtype, torch.float32)
            keys = _concat(key_parts).to(key_dtype) if key_parts else inputs.new_zeros((0, indexer.key_dim), dtype=key_dtype)
    queries = None
    sees_entries = bool(entries) or (halo is not None and plan.compressed[ratio].entries.num_recv > 0)
    if keys is not None and indexer is not None and sees_entries:
        q_index, weights = indexer.queries(features.detach(), plan.q_positions)
        queries = _checked_queries(indexer, q_index, weights, plan.local_len)
    return _Computed(entries, keys, queries)


def _module_stand_ins(
    plan: AttentionPlan, spec: AttentionSpec, inputs: Tensor, halo: Tensor | None, indexer: IndexerFn | None, width: int,
) -> _Computed:
    """NaN module outputs of the planned shapes, for a rank whose compressor or indexer failed (the call's collectives stay)."""
    ratio = spec.compress_ratio
    if halo is None:
        num = plan.segments.compressed_for(ratio).num_entries
    else:
        num = plan.compressed[ratio].straddle.num_entries + plan.compressed[ratio].own.num_entries
    entries = [_stand_in(inputs, (num, width), inputs.dtype)] if num else []
    if spec.mode is not LayerCompressMode.INDEXER or indexer is None or (halo is None and not entries):
        return _Computed(entries, None, None)
    key_dtype = torch.promote_types(inputs.dtype, torch.float32)
    keys = _stand_in(inputs.detach(), (num, indexer.key_dim), key_dtype)
    queries = None
    if entries or (halo is not None and plan.compressed[ratio].entries.num_recv > 0):
        nan = math.nan
        queries = (keys.new_full((plan.local_len, 1, indexer.key_dim), nan), keys.new_full((plan.local_len, 1), nan))
    return _Computed(entries, keys, queries)


def _entries(
    plan: AttentionPlan, spec: AttentionSpec, hidden: Tensor, compressor: CompressorFn, indexer: IndexerFn | None,
    index_features: Tensor | None, kv: Tensor, group: Group, order: BackwardOrder, report: _Report | None, agree: bool,
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
            computed = _module_stand_ins(plan, spec, inputs, halo, indexer, kv.shape[-1])
        elif not agree:  # tracing under torch.compile with a status: this rank raises
            raise
        else:
            error, computed = exc, _Computed([], None, None)
    if plan.check_modules and agree:
        agree_in_order(error, group, order)
    # Every rank sends the same dtype: entries in the kv dtype (what attention uses them in).
    parts = [e.to(kv.dtype) for e in computed.entries]
    keys = computed.keys
    if plan.exchange == "need":
        routes = plan.compressed[spec.compress_ratio]
        owned = _concat(parts) if parts else kv.new_zeros((0, kv.shape[-1]))
        received = exchange_rows(owned, routes.entries, group, order=order)
        parts = [t for t in (received, owned) if t.shape[0]]
        if routes.entry_rows is not None and parts:  # documents' entries in another order than [received ; owned]
            parts = [_concat(parts).index_select(0, routes.entry_rows)]
        if keys is not None:
            got = exchange_index_keys(keys, routes.entries, group, spec.index_key_dtype, order=order)
            keys = torch.cat([got, round_index_keys(keys, spec.index_key_dtype)])
            if routes.entry_rows is not None:
                keys = keys.index_select(0, routes.entry_rows)
    elif keys is not None:
        keys = round_index_keys(keys, spec.index_key_dtype)
    if not parts or keys is None or computed.queries is None:
        return parts, None
    q_index, weights = computed.queries
    return parts, IndexerTensors(round_index_queries(q_index, spec.index_query_dtype), weights, keys)


def _check_module(
    name: str, module: object, spec: AttentionSpec, plan: AttentionPlan,
    declared: tuple[str, ...] = ("ratio", "prev_blocks", "input_dim"), methods: tuple[str, ...] = ("__call__",),
) -> None:
    """A compressor's or indexer's declarations against the spec and the plan."""
    protocol = "CompressorFn" if name == "compressor" else "IndexerFn"
    for attribute in declared:
        value = getattr(module, attribute, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TypeError(f"{name} must declare an int {name}.{attribute} (see cpkv.{protocol}), got {value!r}")
    for method in methods:
        if not callable(getattr(module, method, None)):
            raise TypeError(f"{name} must have a method {name}.{method} (see cpkv.{protocol}); got {type(module).__name__}")
    reader: BlockReader = module  # type: ignore[assignment]  # its declarations were checked above
    if reader.ratio != spec.compress_ratio:
        raise ValueError(f"{name}.ratio ({reader.ratio}) must equal spec.compress_ratio ({spec.compress_ratio})")
    planned = plan.prev_blocks[spec.compress_ratio]
    if reader.prev_blocks > planned:
        raise ValueError(
            f"{name}.prev_blocks={reader.prev_blocks} but the plan covers {planned} earlier block(s) at ratio"
            f" {spec.compress_ratio}: plan_attention(..., prev_blocks={{{spec.compress_ratio}: {reader.prev_blocks}}})"
        )


def _check_finite(name: str, value: object, *, positive: bool = False) -> None:
    """A finite real number (and ``> 0`` when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} float, got {value!r}")


def _check_tensor_arg(name: str, x: Tensor, form: str, ndim: int, rows: int, like: Tensor) -> Tensor:
    """A floating tensor of ``ndim`` dims, ``rows`` rows, on ``like``'s device."""
    check_ndim(name, x, ndim, form)
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.shape[0] != rows:
        raise ValueError(f"{name} must be {form} with {rows} rows (plan.local_len), got shape {tuple(x.shape)}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on q's device {like.device}, got {x.device}")
    return x


def _check_form(kv: Tensor, v: Tensor | None, spec: AttentionSpec) -> None:
    """kv's form (what every exchange moves): float ``[T/cp, D]`` or ``[T/cp, H_kv, D]``, with ``v`` ``[T/cp, H_kv, d_v]``."""
    if check_tensor("kv", kv).ndim not in (2, 3):
        raise ValueError(f"kv must be [T/cp, D] (one shared kv head) or [T/cp, H_kv, D] (kv heads), got shape {tuple(kv.shape)}")
    if not kv.is_floating_point():
        raise TypeError(f"kv must be a floating-point tensor, got dtype {kv.dtype}")
    if kv.ndim == 3 and kv.shape[1] == 0:
        raise ValueError(f"kv must have at least one head, got shape {tuple(kv.shape)}")
    if v is None:
        if spec.d_v > kv.shape[-1]:
            raise ValueError(
                f"spec.d_v ({spec.d_v}) must be <= D = {kv.shape[-1]}: shared kv heads hold the values in their first d_v channels"
            )
        return
    check_ndim("v", check_tensor("v", v), 3, "[T/cp, H_kv, d_v]")
    if kv.ndim != 3:
        raise ValueError(f"with separate values v, kv must hold the keys as [T/cp, H_kv, D], got shape {tuple(kv.shape)}")


def _check_call(
    q: Tensor, kv: Tensor, v: Tensor | None, plan: AttentionPlan, group: Group, spec: AttentionSpec, sinks: Tensor | None,
    hidden: Tensor | None, compressor: CompressorFn | None, indexer: IndexerFn | None, index_features: Tensor | None,
    backend: AttentionBackend, grad_scale: float,
) -> None:
    """The checks that fix which collectives the call makes, and their sizes: the plan, the spec, the group,
    the modules' declarations, and the form of q and kv. A layer's options are the same on every rank, so
    these fail on every rank alike; they raise at once, before any collective."""
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan from cpkv.plan_attention, got {type(plan).__name__}")
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    spec.validate()
    group = check_group("group", group)
    _check_finite("grad_scale", grad_scale)
    check_ndim("q", check_tensor("q", q), 3, "[T/cp, H, D]")
    _check_form(kv, v, spec)
    for name, tensor in (("sinks", sinks), ("hidden", hidden), ("index_features", index_features)):
        if tensor is not None:
            check_tensor(name, tensor)
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    if (plan.cp_size, plan.cp_rank) != (cp_size, cp_rank):
        raise ValueError(f"plan was made for cp_size={plan.cp_size}, cp_rank={plan.cp_rank}; the group has size {cp_size}, rank {cp_rank}")
    plan.kv_source(spec.window)  # raises for a window the need plan lacks
    if plan.ring_degree > 1 and backend.name == "npu":
        raise ValueError("ring_degree > 1 merges partial LSEs, which the NPU backend does not differentiate; plan with 1")
    if not spec.mode.compresses:
        return
    if kv.ndim != 2 or v is not None:
        raise ValueError(
            f"compressed layers ({spec.mode.name}) take one shared kv head: kv [T/cp, D] and v=None, got kv"
            f" {tuple(kv.shape)}" + ("" if v is None else f" and v {tuple(v.shape)}")
        )
    if spec.compress_ratio not in plan.compress_ratios:
        raise ValueError(
            f"spec.compress_ratio={spec.compress_ratio} was not planned (plan.compress_ratios={plan.compress_ratios}):"
            " pass it in plan_attention(..., compress_ratios=[...])"
        )
    if compressor is None or hidden is None:
        raise ValueError(f"compressor and hidden are required for {spec.mode.name} layers (compress_ratio={spec.compress_ratio})")
    _check_module("compressor", compressor, spec, plan)
    if spec.mode is LayerCompressMode.INDEXER:
        if indexer is None:
            raise ValueError(f"indexer is required for INDEXER layers (compress_ratio={spec.compress_ratio})")
        _check_module("indexer", indexer, spec, plan, ("ratio", "prev_blocks", "input_dim", "key_dim", "feature_dim"),
                      ("queries", "keys"))


def _check_heads(q: Tensor, kv: Tensor, v: Tensor | None, spec: AttentionSpec) -> None:
    """q's heads and width against kv's (``H % H_kv == 0``, key width ``D``) and ``v``'s shape (``[T/cp, H_kv, d_v]``)."""
    heads, dim = q.shape[1], q.shape[-1]
    form = "[T/cp, D]" if kv.ndim == 2 else "[T/cp, H_kv, D]"
    if kv.ndim == 3 and heads % kv.shape[1]:
        raise ValueError(f"kv has {kv.shape[1]} heads, which must divide q's {heads} heads (H % H_kv == 0), got shape {tuple(kv.shape)}")
    if kv.shape[-1] != dim:
        raise ValueError(f"q's head dim D must be kv's ({form} = {tuple(kv.shape)}): got q {tuple(q.shape)}")
    if v is None:
        return
    if tuple(v.shape) != (kv.shape[0], kv.shape[1], spec.d_v):
        raise ValueError(
            f"v must be [T/cp, H_kv, spec.d_v] = [{kv.shape[0]}, {kv.shape[1]}, {spec.d_v}] (kv's rows and heads), got {tuple(v.shape)}"
        )
    if not v.is_floating_point():
        raise TypeError(f"v must be a floating-point tensor, got dtype {v.dtype}")


def _check_tensors(
    q: Tensor, kv: Tensor, v: Tensor | None, plan: AttentionPlan, spec: AttentionSpec, sinks: Tensor | None,
    hidden: Tensor | None, compressor: CompressorFn | None, indexer: IndexerFn | None, index_features: Tensor | None,
) -> None:
    """The rank's tensors against the plan and each other (rows, heads, widths, dtypes, devices): what can
    differ on one rank only (after :func:`_check_call`; no host sync)."""
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got dtype {q.dtype}")
    _check_heads(q, kv, v, spec)
    if q.shape[0] != plan.local_len or kv.shape[0] != plan.local_len:
        raise ValueError(f"q and kv must hold this rank's {plan.local_len} tokens (plan.local_len), got {q.shape[0]} and {kv.shape[0]}")
    if kv.dtype != q.dtype or kv.device != q.device:
        raise TypeError(f"kv must have q's dtype and device ({q.dtype}, {q.device}), got {kv.dtype}, {kv.device}")
    if v is not None and (v.dtype != q.dtype or v.device != q.device):
        raise TypeError(f"v must have q's dtype and device ({q.dtype}, {q.device}), got {v.dtype}, {v.device}")
    if sinks is not None:
        check_ndim("sinks", sinks, 1, f"[H] = [{q.shape[1]}]")
        if sinks.shape[0] != q.shape[1] or not sinks.is_floating_point() or sinks.device != q.device:
            raise ValueError(f"sinks must be a float [H] = [{q.shape[1]}] tensor on {q.device}, got {sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")
    if not spec.mode.compresses or hidden is None or compressor is None:
        return
    hidden = _check_tensor_arg("hidden", hidden, "[T/cp, hidden]", 2, plan.local_len, q)
    readers = [("compressor", compressor)] if indexer is None or spec.mode is not LayerCompressMode.INDEXER else [
        ("compressor", compressor), ("indexer", indexer)]
    for name, reader in readers:
        if hidden.shape[-1] != reader.input_dim:
            raise ValueError(f"hidden must be [T/cp, {name}.input_dim] = [{plan.local_len}, {reader.input_dim}], got {tuple(hidden.shape)}")
    if indexer is None or spec.mode is not LayerCompressMode.INDEXER:
        return
    features = hidden
    if index_features is not None:
        features = _check_tensor_arg("index_features", index_features, "[T/cp, F]", 2, plan.local_len, q)
    if features.shape[-1] != indexer.feature_dim:
        which = "index_features" if index_features is not None else "hidden (index_features not given)"
        raise ValueError(
            f"{which} must be [T/cp, indexer.feature_dim] = [{plan.local_len}, {indexer.feature_dim}],"
            f" got {tuple(features.shape)}"
        )


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
    _check_call(q, kv, v, plan, group, spec, sinks, hidden, compressor, indexer, index_features, ops, grad_scale)
    if status is not None and not isinstance(status, StepStatus):
        raise TypeError(f"status must be a cpkv.StepStatus or None, got {type(status).__name__}")
    error: Exception | None = None
    try:
        _check_tensors(q, kv, v, plan, spec, sinks, hidden, compressor, indexer, index_features)
    except (ValueError, TypeError) as exc:
        error = exc
    compiling = torch.compiler.is_compiling()
    if error is not None and (status is None or compiling):  # no status, or tracing: this rank raises at once
        raise error
    agree = status is None or status.each_call  # the ranks agree on the modules' outputs in the call
    report = None if agree or status is None or compiling else _Report(status, spec)
    given = q
    if error is not None and report is not None:  # this rank takes part with NaN stand-ins of the planned shapes
        report(error)
        q, kv, v, sinks, hidden, index_features = _stand_ins(q, kv, v, sinks, hidden, index_features, plan, spec,
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
            if ring_round.rows is not None:  # into index order
                rows = rows.index_select(0, ring_round.rows.to(rows.device))
            if ring_round.ranges.num_rows and ring_round.ranges.num_keys:  # empty rounds make no call
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
        out = _poisoned(out, (given.shape[0], given.shape[1], spec.d_v))
        loss = None if loss is None else loss * math.nan
    return AttentionOutput(order.attach(out), loss, ratio)
