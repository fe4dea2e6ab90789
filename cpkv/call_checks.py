"""Per-rank checks of an :func:`cpkv.attention.attention_forward` call, and the NaN stand-ins
of a rank whose own tensors or modules fail them.

:func:`check_call` checks what fixes the call's collectives (the plan, the spec, the group,
the modules' declarations, the form of q and kv): it fails on every rank alike and raises at
once. :func:`check_tensors` checks what can differ on one rank only; with a deferring
:class:`~cpkv.status.StepStatus` such a failure is recorded (:class:`CallReport`) and the rank
runs the call's collectives with :func:`stand_ins` of the planned shapes, then returns
:func:`poisoned` output. No check makes a host sync.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.attention_spec import AttentionSpec, BlockReader, CompressorFn, IndexerFn
from cpkv.backends.base import AttentionBackend
from cpkv.checks import check_finite, check_ndim, check_tensor
from cpkv.collectives import Group, check_group
from cpkv.compress_mode import LayerCompressMode
from cpkv.plan.attention import AttentionPlan
from cpkv.plan.segments import CompressedPlan
from cpkv.status import StepStatus


def checked_rows(name: str, rows: Tensor | None, blocks: CompressedPlan, width: int) -> Tensor:
    """What a compressor or ``indexer.keys`` returned for ``blocks``: a float ``[N_c, width]``.

    ``N_c`` is read off the plan's tensors (``blocks.block_starts``), so that a compiled call
    checks it without a guard on the packing (``torch._check``: a runtime assert)."""
    num_entries = blocks.block_starts.shape[0]
    if isinstance(rows, Tensor) and torch.compiler.is_compiling() and rows.ndim == 2 and rows.shape[1] == width:
        if rows.is_floating_point():
            torch._check(rows.shape[0] == num_entries, lambda: f"{name} must return the plan's N_c entries")  # type: ignore[no-untyped-call]
            return rows
    if not isinstance(rows, Tensor) or tuple(rows.shape) != (num_entries, width) or not rows.is_floating_point():
        got = f"{rows.dtype} {tuple(rows.shape)}" if isinstance(rows, Tensor) else type(rows).__name__
        raise ValueError(
            f"{name} must return a float [N_c, {width}] tensor with the plan's N_c = {num_entries} entries"
            " (CompressedPlan.num_entries), got " + got
        )
    return rows


def checked_queries(indexer: IndexerFn, q_index: object, weights: object, num_queries: int) -> tuple[Tensor, Tensor]:
    """``indexer.queries``' result: ``[T/cp, H_I, key_dim]`` queries and ``[T/cp, H_I]`` weights."""
    if isinstance(q_index, Tensor) and isinstance(weights, Tensor) and q_index.ndim == 3 and weights.ndim == 2:
        if q_index.shape[0] == num_queries and q_index.shape[2] == indexer.key_dim and weights.shape == q_index.shape[:2]:
            return q_index, weights
    shapes = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in (q_index, weights)]
    raise ValueError(
        f"indexer.queries must return q_index [T/cp, H_I, indexer.key_dim] = [{num_queries}, H_I, {indexer.key_dim}]"
        f" and weights [T/cp, H_I], got {shapes[0]} and {shapes[1]}"
    )


class CallReport:
    """A deferred layer call's failures: recorded in the step's :class:`~cpkv.status.StepStatus`, named by the call."""

    def __init__(self, status: StepStatus, spec: AttentionSpec) -> None:
        ratio = f", compress_ratio={spec.compress_ratio}" if spec.mode.compresses else ""
        self.call = f"layer call {status.start_call()} of the step ({spec.mode.name}{ratio}, window={spec.window})"
        self.status, self.failed = status, False

    def __call__(self, error: Exception) -> None:
        self.failed = True
        self.status.report(error, self.call)


def stand_in(x: Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """NaN ``shape`` in place of ``x``, tied to ``x`` when it is a differentiable float tensor there: ``x``'s gradient is NaN too."""
    where = x.device if device is None else device
    filler = torch.full(shape, math.nan, dtype=dtype, device=where)
    if x.requires_grad and x.is_floating_point() and x.device == where:
        filler = filler + x.sum().to(dtype) * 0
    return filler


def poisoned(out: Tensor, shape: tuple[int, ...]) -> Tensor:
    """NaN ``shape`` that depends on ``out`` with a NaN derivative (whatever gradient arrives, ``out``'s is NaN)."""
    return out.new_full(shape, math.nan) + out.sum() * math.nan


def stand_ins(
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
    new_q = stand_in(q, (rows, heads, kv.shape[-1]), dtype, device)
    new_kv = stand_in(kv, (rows, *kv.shape[1:]), dtype, device)
    new_v = None if v is None else stand_in(v, (rows, kv.shape[1], spec.d_v), dtype, device)
    new_sinks = None if sinks is None else stand_in(sinks, (heads,), dtype, device)
    new_hidden, new_features = hidden, index_features
    if hidden is not None and compressor is not None:
        floating = hidden.dtype if hidden.is_floating_point() else dtype
        new_hidden = stand_in(hidden, (rows, compressor.input_dim), floating, device)
        if index_features is not None and indexer is not None:
            new_features = stand_in(index_features, (rows, indexer.feature_dim), floating, device)
    return new_q, new_kv, new_v, new_sinks, new_hidden, new_features


class ModuleOutputs(NamedTuple):
    """The modules' outputs on this rank, before any entry moves."""

    entries: list[Tensor]
    keys: Tensor | None
    queries: tuple[Tensor, Tensor] | None


def module_stand_ins(
    plan: AttentionPlan, spec: AttentionSpec, inputs: Tensor, halo: Tensor | None, indexer: IndexerFn | None, width: int,
) -> ModuleOutputs:
    """NaN module outputs of the planned shapes, for a rank whose compressor or indexer failed (the call's collectives stay)."""
    ratio = spec.compress_ratio
    if halo is None:
        num = plan.segments.compressed_for(ratio).num_entries
    else:
        num = plan.compressed[ratio].straddle.num_entries + plan.compressed[ratio].own.num_entries
    entries = [stand_in(inputs, (num, width), inputs.dtype)] if num else []
    if spec.mode is not LayerCompressMode.INDEXER or indexer is None or (halo is None and not entries):
        return ModuleOutputs(entries, None, None)
    key_dtype = torch.promote_types(inputs.dtype, torch.float32)
    keys = stand_in(inputs.detach(), (num, indexer.key_dim), key_dtype)
    queries = None
    if entries or (halo is not None and plan.compressed[ratio].entries.num_recv > 0):
        nan = math.nan
        queries = (keys.new_full((plan.local_len, 1, indexer.key_dim), nan), keys.new_full((plan.local_len, 1), nan))
    return ModuleOutputs(entries, keys, queries)


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


def check_call(
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
    check_finite("grad_scale", grad_scale)
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


def check_tensors(
    q: Tensor, kv: Tensor, v: Tensor | None, plan: AttentionPlan, spec: AttentionSpec, sinks: Tensor | None,
    hidden: Tensor | None, compressor: CompressorFn | None, indexer: IndexerFn | None, index_features: Tensor | None,
) -> None:
    """The rank's tensors against the plan and each other (rows, heads, widths, dtypes, devices): what can
    differ on one rank only (after :func:`check_call`; no host sync)."""
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
