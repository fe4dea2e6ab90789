"""Rank-side helpers of the example notebooks (``examples/02_cp_attention_end_to_end.ipynb``).

Not part of the cpkv wheel: this module sits next to the notebooks (``examples/``), which run
with ``examples/`` as their working directory. Functions that :func:`cpkv.launch.spawn` runs
on fresh processes must be importable (a function defined in a notebook is not); spawned
ranks inherit the notebook's ``sys.path``, so they import this module too. Everything is
built from cpkv's public API: :class:`cpkv.v4.V4Attention` under CP, :func:`cpkv.plan_attention`,
:func:`cpkv.gather_from_sp_cp` and :func:`cpkv.commstats.count_bytes`.

Typical use (what notebook 02 does)::

    from cpkv.launch import spawn
    from cp_helpers import run_layer_modes
    per_rank = spawn(run_layer_modes, 4, configs, x, grad_out, cu_seqlens, 0, 1.0, ("allgather", "need"))
    # per_rank[r][exchange][mode] is a RankResult of rank r

(the notebook runs :func:`run_examples`, which adds :func:`run_ring_degrees` on the same ranks),

and :func:`indexer_selection` with a ``cp_size = 1`` plan gives the single-process
top-k selection to compare the ranks' selections with.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv import (
    AttentionPlan,
    Exchange,
    LayerCompressMode,
    compress_cu_seqlens,
    gather_from_sp_cp,
    plan_attention,
    rearrange_prefix_kv,
    shard_contiguous,
)
from cpkv.backends import get_backend
from cpkv.commstats import count_bytes
from cpkv.v4 import V4Attention, V4Config


COLLECTIVES = ("all_gather", "reduce_scatter", "exchange", "exchange_backward")
"""The ops of :mod:`cpkv.collectives` that :func:`cpkv.commstats.count_bytes` counts bytes for."""


class RankResult(NamedTuple):
    """What one rank computed for one layer configuration (all tensors on CPU).

    Attributes:
        out: ``[T/cp, hidden]`` the layer output of the rank's tokens.
        grad_x: ``[T/cp, hidden]`` gradient of ``sum(out * grad_out)`` w.r.t. the rank's inputs.
        param_grads: name -> this rank's share of each parameter gradient (sum them over
            ranks for the CP result, as the data-parallel/CP gradient all-reduce does).
        bytes_by_op: bytes this rank received per cpkv collective (``all_gather``, ``reduce_scatter``,
            ``exchange``, ``exchange_backward``) during forward + backward.
        indexer_loss: ``sum_t KL_t`` over the rank's queries (INDEXER layers), else ``None``.
        selected: ``[T/cp, topk]`` int64 **global** compressed-entry ids the indexer chose
            for each query (numbered over the whole batch, see :func:`indexer_selection`),
            -1 padded; ``None`` outside INDEXER layers.
        seconds: wall time of forward + backward on this rank.
    """

    out: Tensor
    grad_x: Tensor
    param_grads: dict[str, Tensor]
    bytes_by_op: dict[str, int]
    indexer_loss: float | None
    selected: Tensor | None
    seconds: float


def compress_ratios(config: V4Config) -> list[int]:
    """The ratios :func:`cpkv.plan_attention` must plan for a layer with ``config``."""
    return [config.compress_ratio] if config.mode.compresses else []


def indexer_selection(
    layer: V4Attention, hidden: Tensor, hidden_prefix: Tensor, plan: AttentionPlan, cu_seqlens: Tensor
) -> Tensor:
    """The lightning indexer's top-k choice for the plan's queries, as global entry ids.

    Recomputes what :func:`cpkv.attention_forward` selects inside an INDEXER layer
    (indexer queries from the queries' inputs, indexer keys compressed from the prefix
    inputs, the backend's top-k over the causally visible entries, ties to the earlier
    entry) and renumbers the chosen rows from the rank's prefix to the whole batch.

    Args:
        layer: an INDEXER layer (``compress_ratio == 4``).
        hidden: ``[T_q, hidden]`` inputs of the plan's queries (the rank's shard).
        hidden_prefix: ``[T_kv, hidden]`` inputs of the plan's kv prefix
            (``rearrange_prefix_kv(gathered_inputs, plan.prefix)``; the whole batch when
            ``plan`` is a ``cp_size = 1`` plan).
        plan: the rank's contiguous-layout plan, made with ``compress_ratios`` containing 4.
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens of the batch.

    Returns:
        ``[T_q, topk]`` int64: entry ``e`` is the ``e``-th compressed entry of the whole
        batch, numbered by ``compress_cu_seqlens(cu_seqlens, 4).cu_seqlens`` (document by
        document); -1 where fewer than ``topk`` entries are visible.

    Raises:
        ValueError: ``layer`` is not an INDEXER layer, or ``plan`` is not a contiguous-layout plan.
    """
    if layer.indexer is None or layer.config.mode is not LayerCompressMode.INDEXER:
        raise ValueError(f"indexer_selection needs an INDEXER layer, got compress_ratio={layer.config.compress_ratio}")
    if plan.prefix is None:
        raise ValueError("indexer_selection needs a contiguous-layout plan (plan.prefix)")
    segments = plan.segments
    ratio = layer.indexer.ratio
    visible = segments.visible_for(ratio)
    with torch.no_grad():
        q_index, weights = layer.indexer.queries(hidden, segments.q_positions)
        k_index = layer.indexer.keys(hidden_prefix, segments.compressed_for(ratio))
        if k_index is None:  # no full block in the prefix: nothing to select
            return torch.full((hidden.shape[0], layer.config.topk), -1, dtype=torch.int64)
        local = get_backend("reference").indexer_topk(q_index, k_index, weights, segments, visible, topk=layer.config.topk)
    # Local row -> (segment b, entry j of its document) -> global entry id.
    local_cu = visible.cu_seqlens.long()
    segment = torch.searchsorted(local_cu[1:], local.clamp(min=0), right=True)
    entry_in_doc = local.clamp(min=0) - local_cu[segment]
    global_cu = compress_cu_seqlens(cu_seqlens, ratio).cu_seqlens.long()
    global_ids = global_cu[plan.prefix.doc_ids.long()[segment]] + entry_in_doc
    return torch.where(local >= 0, global_ids, -1)


def _run_one(
    config: V4Config, x: Tensor, grad_out: Tensor, cu_seqlens: Tensor, rank: int, world_size: int,
    seed: int, grad_scale: float, exchange: Exchange, ring_degree: int = 1,
) -> RankResult:
    """Forward + backward of one layer on this rank's contiguous TND shard."""
    layer = V4Attention(config, seed=seed).to(x.dtype)
    plan = plan_attention(
        cu_seqlens, world_size, rank, exchange=exchange, ring_degree=ring_degree,
        compress_ratios=compress_ratios(config), windows=[config.window],
    )
    x_local = shard_contiguous(x, world_size, rank).clone().requires_grad_(True)
    with count_bytes() as counter:
        start = time.perf_counter()
        result = layer(x_local, plan, None, grad_scale=grad_scale)  # group None: the default (gloo) group
        torch.autograd.backward(result.out, shard_contiguous(grad_out, world_size, rank))
        seconds = time.perf_counter() - start
    selected = None
    if config.mode is LayerCompressMode.INDEXER:  # outside the counter: not part of the layer's traffic
        assert plan.prefix is not None  # contiguous layout
        hidden_prefix = rearrange_prefix_kv(gather_from_sp_cp(x_local.detach(), None, tnd=True), plan.prefix)
        selected = indexer_selection(layer, x_local.detach(), hidden_prefix, plan, cu_seqlens)
    by_op = {op: n for op, n in counter.by_op.items() if op in COLLECTIVES}
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in layer.named_parameters()
    }
    grad_x = x_local.grad if x_local.grad is not None else torch.zeros_like(x_local)
    loss = float(result.indexer_loss) if result.indexer_loss is not None else None
    return RankResult(result.out.detach(), grad_x.detach(), grads, by_op, loss, selected, seconds)


def run_layer_modes(
    rank: int, world_size: int, configs: Mapping[str, V4Config], x: Tensor, grad_out: Tensor,
    cu_seqlens: Tensor, seed: int, grad_scale: float, exchanges: Sequence[Exchange] = ("allgather",),
) -> dict[str, dict[str, RankResult]]:
    """Run the V4-style layer under CP on this rank, once per exchange strategy and configuration.

    Meant for :func:`cpkv.launch.spawn` (which passes ``rank`` and ``world_size`` and
    has already initialised the default gloo group, used as the CP group). Every rank
    receives the whole batch and takes its own contiguous shard, so the notebook can
    compare the concatenated shards with the single-process layer.

    Args:
        rank, world_size: this rank and the CP group size (``T % world_size == 0``).
        configs: mode name -> :class:`~cpkv.v4.V4Config` (e.g. window / compressor / indexer).
        x: ``[T, hidden]`` the whole packed batch's layer inputs.
        grad_out: ``[T, hidden]`` upstream gradient of the layer output.
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens, ``cu_seqlens[-1] == T``.
        seed: initialisation seed of :class:`~cpkv.v4.V4Attention` (same on every rank and
            in the single-process comparison).
        grad_scale: passed to the layer (scales the indexer-loss gradient).
        exchanges: how the prefix reaches each rank, each one run in turn: ``"allgather"``
            (every rank gathers the whole batch, MindSpeed's scheme) and/or ``"need"`` (each
            rank receives only the rows it needs; the plan is made with ``exchange="need"`` and the
            layer's window in ``windows``).

    Returns:
        exchange -> mode name -> :class:`RankResult` of this rank.
    """
    results: dict[str, dict[str, RankResult]] = {}
    for exchange in exchanges:
        results[exchange] = {}
        for name, config in configs.items():
            results[exchange][name] = _run_one(config, x, grad_out, cu_seqlens, rank, world_size, seed, grad_scale, exchange)
            dist.barrier()  # keep the ranks' per-mode timings aligned
    return results


def run_ring_degrees(
    rank: int, world_size: int, config: V4Config, x: Tensor, grad_out: Tensor, cu_seqlens: Tensor,
    seed: int, grad_scale: float, ring_degrees: Sequence[int] = (1, 3),
) -> dict[int, RankResult]:
    """Run the V4-style layer with the need-based exchange once per ``ring_degree`` on this rank.

    Meant for :func:`cpkv.launch.spawn`, like :func:`run_layer_modes`. For each ``R`` the plan
    is made with ``plan_attention(..., exchange="need", windows=[config.window], ring_degree=R)``
    and the layer runs with that plan (``R > 1``: the remote prefix kv arrives in ``R`` rounds
    and the partial results are merged exactly by LSE, :func:`cpkv.merge_partials`).

    Args:
        rank, world_size, x, grad_out, cu_seqlens, seed, grad_scale: as :func:`run_layer_modes`.
        config: the layer's :class:`~cpkv.v4.V4Config` (any compress mode).
        ring_degrees: the ``R`` values to run, in turn.

    Returns:
        ``R`` -> :class:`RankResult` of this rank.
    """
    results: dict[int, RankResult] = {}
    for ring_degree in ring_degrees:
        results[ring_degree] = _run_one(
            config, x, grad_out, cu_seqlens, rank, world_size, seed, grad_scale, "need", ring_degree
        )
        dist.barrier()
    return results


def run_examples(
    rank: int, world_size: int, configs: Mapping[str, V4Config], ring_config: V4Config, x: Tensor, grad_out: Tensor,
    cu_seqlens: Tensor, seed: int, grad_scale: float, exchanges: Sequence[Exchange] = ("allgather",),
    ring_degrees: Sequence[int] = (1, 3),
) -> tuple[dict[str, dict[str, RankResult]], dict[int, RankResult]]:
    """:func:`run_layer_modes`, then :func:`run_ring_degrees` with ``ring_config``, on the same ranks.

    Meant for :func:`cpkv.launch.spawn`: starting a rank (importing torch, and torch's compiler
    stack on the first custom-op call) costs more than the small layers it runs, so notebook 02
    starts its ranks once for both experiments.

    Returns:
        ``(run_layer_modes(...), run_ring_degrees(...))`` of this rank.
    """
    modes = run_layer_modes(rank, world_size, configs, x, grad_out, cu_seqlens, seed, grad_scale, exchanges)
    rings = run_ring_degrees(rank, world_size, ring_config, x, grad_out, cu_seqlens, seed, grad_scale, ring_degrees)
    return modes, rings
