"""Prefix attention for the two zigzag shardings: fixed-length BSND and per-document TND.

Both all-gather the kv (and compressor inputs), read each rank's overlapping causal
prefixes, and run :func:`~cpkv.attention.attend_prefix` with the same compressor,
indexer and backend plumbing as the contiguous path (:mod:`cpkv.attention`). The
need-based exchange and ring rounds exist for contiguous TND only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv._checks import check_int, check_ndim, check_tensor
from cpkv.attention import (
    AttentionOutput,
    AttentionSpec,
    CompressorFn,
    IndexerFn,
    _check_inputs,
    _check_plan_matches,
    _compress_gathered,
    attend_prefix,
)
from cpkv.attention_plan import BSNDPlan, ZigzagTNDPlan, plan_attention_bsnd, plan_attention_zigzag_tnd
from cpkv.backends import AttentionBackend, get_backend
from cpkv.comm import BackwardOrder, Group, gather_from_sp_cp
from cpkv.layout import validate_cu_seqlens


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
    order = BackwardOrder(q.device)
    kv_full = gather_from_sp_cp(kv, group, tnd=False, dim=1, order=order)
    hidden_full = None
    if spec.mode.compresses and hidden is not None:
        hidden_full = gather_from_sp_cp(hidden, group, tnd=False, dim=1, order=order)
    c, outs, losses, ratio = plan.chunk_len, [], [], 1
    ops = get_backend(backend, q.device)
    for k, (segments, prefix_len) in enumerate(zip(plan.steps, plan.prefix_lens)):
        local_rows = slice(k * c, (k + 1) * c)
        compressed, tensors = _compress_gathered(
            segments, spec, hidden[:, local_rows].flatten(0, 1) if hidden is not None else None,
            hidden_full[:, :prefix_len].flatten(0, 1) if hidden_full is not None else None, compressor, indexer,
        )
        result = attend_prefix(
            q[:, local_rows].flatten(0, 1), kv_full[:, :prefix_len].flatten(0, 1), segments, spec=spec,
            backend=ops, sinks=sinks, compressed=compressed, indexer_tensors=tensors,
            grad_scale=grad_scale, num_global_queries=plan.num_global_queries,
        )
        outs.append(result.out.reshape(batch, c, *result.out.shape[1:]))
        losses += [result.indexer_loss] if result.indexer_loss is not None else []
        ratio = max(ratio, result.effective_ratio)
    loss = torch.stack(losses).sum() if losses else None
    return AttentionOutput(order.attach(torch.cat(outs, dim=1)), loss, ratio)


def attention_forward_zigzag_tnd(
    q: Tensor, kv: Tensor, cu_seqlens: Tensor, group: Group, *, spec: AttentionSpec, sinks: Tensor | None = None,
    hidden: Tensor | None = None, compressor: CompressorFn | None = None, indexer: IndexerFn | None = None,
    plan: ZigzagTNDPlan | None = None, backend: str | AttentionBackend = "reference", ring_degree: int = 1,
    grad_scale: float = 1.0,
) -> AttentionOutput:
    """Prefix attention of this rank's per-document zigzag TND shard (load-balanced).

    Same contract as :func:`attention_forward`, for shards made with
    :func:`cpkv.sharding.shard_zigzag_tnd` (chunks ``r`` and ``2cp-1-r`` of every document).
    The kv (and compressor inputs) are all-gathered and the two overlapping prefixes of every
    document are read into one buffer (see :class:`~cpkv.attention_plan.ZigzagTNDPlan`).
    Only the all-gather exchange exists for this sharding.

    Args:
        q: ``[T/cp, H, D]`` queries in shard order, RoPE at ``plan.segments.q_positions``.
        kv: ``[T/cp, D]``; hidden: ``[T/cp, hidden]`` (compressed modes); the rest as
            :func:`attention_forward`.

    Returns:
        :class:`AttentionOutput` with ``out`` ``[T/cp, H, d_v]`` in shard order.

    Raises:
        ValueError, TypeError: bad shapes or options, a document length not divisible by
            ``2 * cp``, on every rank before any collective.
    """
    if check_int("ring_degree", ring_degree, minimum=1) != 1:
        raise ValueError(f"ring_degree={ring_degree}: only 1 (one all-gather round) is implemented so far")
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    if plan is None:
        validate_cu_seqlens(cu_seqlens)
        ratios = [spec.compress_ratio] if spec.mode.compresses else []
        plan = plan_attention_zigzag_tnd(cu_seqlens, cp_size, cp_rank, compress_ratios=ratios)
    else:  # no host sync per layer: the plan holds the validated values
        _check_plan_matches(plan.cp_size, plan.cp_rank, plan.num_documents, cp_size, cp_rank, cu_seqlens)
    _check_inputs(q, kv, hidden, spec, plan.num_tokens // cp_size, compressor, indexer)
    rows = plan.kv_rows.to(kv.device)
    order = BackwardOrder(q.device)
    kv_buffer = gather_from_sp_cp(kv, group, tnd=True, order=order).index_select(0, rows)
    hidden_buffer = None
    if spec.mode.compresses and hidden is not None:
        hidden_buffer = gather_from_sp_cp(hidden, group, tnd=True, order=order).index_select(0, rows)
    compressed, tensors = _compress_gathered(plan.segments, spec, hidden, hidden_buffer, compressor, indexer)
    result = attend_prefix(
        q, kv_buffer, plan.segments, spec=spec, backend=get_backend(backend, q.device), sinks=sinks,
        compressed=compressed, indexer_tensors=tensors, grad_scale=grad_scale, num_global_queries=plan.num_global_queries,
    )
    return result._replace(out=order.attach(result.out))
