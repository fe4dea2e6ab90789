"""Collectives over explicit process groups, differentiable where needed (docs/semantics.md, "Collectives").

Every function takes its process group as an argument; nothing here keeps state.
The differentiable gather's backward is its adjoint, a reduce-scatter (sum) of the
gradient back to the owners.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.checks import check_dim, check_int, check_tensor
from cpkv.collectives import BackwardOrder, Group, all_gather, check_group, check_group_position, check_same_on_all_ranks
from cpkv.plan.sharding import permute_cp_shard

__all__ = [
    "BackwardOrder", "Group", "IndexerInputs", "all_gather_qk_weight_kvallgather", "check_group", "check_group_position",
    "check_same_on_all_ranks",
    "gather_from_sp_cp", "global_num_seqs",
]


def gather_from_sp_cp(
    x: Tensor, group: Group, *, tnd: bool, dim: int = 0, tp_size: int = 1, order: BackwardOrder | None = None
) -> Tensor:
    """All-gather ``x`` along ``dim`` over ``group``, differentiably.

    Args:
        x: ``[n, ...]`` with this rank's tokens at ``dim`` (any dtype, the group's device).
        group: the gather group (MindSpeed: the tensor-and-context-parallel group).
        tnd: ``True``: contiguous TND shards, the gather is already in natural packed
            order and is returned as is. ``False``: zigzag shards (each CP rank holds
            chunks ``r`` and ``2cp-1-r``); the result is reordered to natural order with
            ``permute_cp_shard(..., reorder=True)``.
        dim: the token dimension.
        tp_size: when ``group`` is TP x CP with the TP rank varying fastest (Megatron's
            order), the TP size; the zigzag reorder then uses ``cp = world / tp_size``.
        order: chain this gather's backward into a :class:`BackwardOrder` (needed when
            several differentiable collectives feed one output and ranks may use them
            differently).

    Returns:
        ``[world * n, ...]`` along ``dim``. Backward: the gradient is reduce-scattered
        (summed) back to the owning ranks (after undoing the reorder).

    Raises:
        ValueError: bad ``dim``; ``tp_size`` not dividing the group size; with
            ``tnd=False`` a gathered length not divisible by ``2 * cp``.
    """
    check_tensor("x", x)
    group = check_group("group", group)
    dim = check_dim("dim", dim, x.ndim)
    check_int("tp_size", tp_size, minimum=1)
    world = dist.get_world_size(group)
    if world % tp_size != 0:
        raise ValueError(f"tp_size={tp_size} must divide the group size {world}")
    cp_size = world // tp_size
    if not tnd and (world * x.shape[dim]) % (2 * cp_size) != 0:
        raise ValueError(
            f"gather_from_sp_cp(tnd=False): the gathered length {world * x.shape[dim]} must be"
            f" divisible by 2*cp = {2 * cp_size} (zigzag chunks)"
        )
    gathered = all_gather(x.movedim(dim, 0), group, order)
    if not tnd:  # differentiable reorder: its backward undoes the permutation before the reduce-scatter
        gathered = permute_cp_shard(gathered, cp_size, reorder=True)
    result: Tensor = gathered.movedim(0, dim)
    return result


def global_num_seqs(
    local_num_tokens: int | Tensor, group: Group, *, device: torch.device | str | None = None
) -> int:
    """Total query tokens over the CP group (each rank passes its ``cu_seqlens_q[-1]``).

    Despite the (MindSpeed) name this counts tokens: it is the ``N`` that normalises
    the indexer loss so that CP > 1 equals CP = 1. Implemented as an int64
    ``all_reduce(SUM)``, equivalent to all-gather + sum and supported by every backend
    and world size (HCCL's all-gather has no int64 and no world sizes 3, 5, 6, 7).
    Non-differentiable; a host sync (call it once per micro-batch).

    Args:
        local_num_tokens: this rank's query token count, an int or a 0-d/1-element int tensor.
        group: the CP group.
        device: where the collective runs (NCCL needs ``"cuda"``); default: the tensor's
            device, or CPU for an int.

    Returns:
        The sum over the group, as a Python int.

    Raises:
        TypeError: not an int / int tensor. ValueError: negative count.
    """
    if isinstance(local_num_tokens, Tensor):
        if local_num_tokens.numel() != 1 or local_num_tokens.is_floating_point() or local_num_tokens.dtype == torch.bool:
            raise TypeError(
                f"local_num_tokens must be an int or a one-element integer tensor, got dtype {local_num_tokens.dtype},"
                f" shape {tuple(local_num_tokens.shape)}"
            )
        device = local_num_tokens.device if device is None else device
        count = int(local_num_tokens.item())
    else:
        count = check_int("local_num_tokens", local_num_tokens)
    if count < 0:
        raise ValueError(f"local_num_tokens must be >= 0, got {count}")
    total = torch.tensor([count], dtype=torch.int64, device=device)
    group = check_group("group", group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


class IndexerInputs(NamedTuple):
    """Gathered indexer inputs of the BSND DSA path: ``q`` and ``weights`` over TP, ``k`` over TP x CP."""

    q: Tensor
    k: Tensor
    weights: Tensor


def all_gather_qk_weight_kvallgather(
    q: Tensor, k: Tensor, weights: Tensor, *, tp_group: Group, cp_group: Group, tnd: bool, dim: int = 0
) -> IndexerInputs:
    """Gather the lightning indexer's inputs for kv-all-gather CP.

    Queries stay CP-local: ``q`` and ``weights`` are gathered over TP only (sequence
    parallel pieces of this CP rank's shard, natural order). The key is gathered over
    TP then CP (the TP x CP gather with the TP rank fastest) and reordered from zigzag
    to natural order; with ``tnd=True`` ``k`` is returned untouched, because in the TND
    path the indexer key is computed on the already-gathered prefix.

    Args:
        q: ``[s, ..., H_I, D_I]`` indexer queries, sequence at ``dim``.
        k: ``[s, ..., D_I]`` indexer keys, sequence at ``dim``.
        weights: ``[s, ..., H_I]`` per-head indexer weights, sequence at ``dim``.
        tp_group, cp_group: the tensor-parallel and context-parallel groups.
        tnd: see above.
        dim: the sequence dimension of all three (Megatron ``[s, b, ...]``: 0).

    Returns:
        :class:`IndexerInputs`, all differentiable (backward reduce-scatters).
    """
    q_full = gather_from_sp_cp(q, tp_group, tnd=True, dim=dim)
    w_full = gather_from_sp_cp(weights, tp_group, tnd=True, dim=dim)
    if tnd:
        return IndexerInputs(q_full, k, w_full)
    k_cp = gather_from_sp_cp(k, tp_group, tnd=True, dim=dim)
    return IndexerInputs(q_full, gather_from_sp_cp(k_cp, cp_group, tnd=False, dim=dim), w_full)
