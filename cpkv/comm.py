"""Collectives over explicit process groups, differentiable where needed (docs/semantics.md, "Collectives").

Every function takes its process group as an argument; nothing here keeps state.
The differentiable gather's backward is its adjoint, a reduce-scatter (sum) of the
gradient back to the owners.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from cpkv.checks import check_dim, check_int, check_tensor
from cpkv.collectives import BackwardOrder, Group, all_gather
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
    check_group("group", group)
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
    check_group("group", group)
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



def check_group(name: str, group: object) -> Group:
    """Return ``group`` if it is a process group or ``None`` (the default group), else raise ``TypeError``."""
    if group is not None and not isinstance(group, ProcessGroup):
        raise TypeError(f"{name} must be a torch.distributed ProcessGroup or None (the default group), got {type(group).__name__}")
    return group


def check_group_position(group: Group, cp_size: int, cp_rank: int) -> None:
    """Raise ``ValueError`` unless this process is rank ``cp_rank`` of a group of ``cp_size`` ranks."""
    check_group("group", group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (cp_size, cp_rank):
        raise ValueError(f"cp_size={cp_size}, cp_rank={cp_rank} do not match the group (size {size}, this rank {rank})")


def check_same_on_all_ranks(
    cu_seqlens: Tensor, group: Group, *, options: Sequence[int] = (), device: torch.device | str | None = None
) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` hold the same ``cu_seqlens`` and ``options``.

    Different ``cu_seqlens`` on different ranks make the plans, and so the collectives,
    disagree: a hang, a gloo size error, or (same ``T``, other boundaries) silently wrong
    attention. The comparison is exact: one all-reduce (MAX) of the lengths and their
    negations, then, when the lengths agree, one all-reduce (MAX) of the values and their
    negations; a rank differs from another iff some MAX differs from the negated MIN. Every
    rank raises alike, so none is left in a collective. :func:`cpkv.plan_attention` runs it
    when given a ``group``.

    Args:
        cu_seqlens: ``[B + 1]`` int tensor (any convention: it is compared, not interpreted).
        group: the CP group.
        options: further integers that must agree (the plan's options).
        device: where the all-reduces run (NCCL needs ``"cuda"``); default ``cu_seqlens.device``.

    Raises:
        TypeError: ``cu_seqlens`` is not an integer tensor, ``group`` not a process group.
        ValueError: some rank holds other values; the message gives the first differing entry.

    Example:
        >>> check_same_on_all_ranks(cu_seqlens, cp_group)  # doctest: +SKIP
    """
    check_tensor("cu_seqlens", cu_seqlens)
    check_group("group", group)
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got dtype {cu_seqlens.dtype}")
    where = device or cu_seqlens.device
    values = torch.cat([
        cu_seqlens.detach().to(where, torch.int64).flatten(), torch.tensor(list(options), dtype=torch.int64, device=where)
    ])
    sizes = torch.tensor([values.numel(), -values.numel()], dtype=torch.int64, device=where)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != -int(sizes[1]):
        raise ValueError(
            f"cu_seqlens (and plan options) differ between the ranks of the group: lengths range over"
            f" [{-int(sizes[1])}, {int(sizes[0])}] entries (this rank: {values.numel()});"
            " every rank must pass the same global cu_seqlens and plan options"
        )
    both = torch.cat([values, -values])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    high, low = both[: values.numel()], -both[values.numel():]
    differ = torch.nonzero(high != low).flatten()
    if differ.numel():
        first = int(differ[0])
        what = f"cu_seqlens[{first}]" if first < cu_seqlens.numel() else f"plan option {first - cu_seqlens.numel()}"
        raise ValueError(
            f"cu_seqlens (and plan options) differ between the ranks of the group: {what} ranges over"
            f" [{int(low[first])}, {int(high[first])}] (this rank: {int(values[first])});"
            " every rank must pass the same global cu_seqlens and plan options"
        )
