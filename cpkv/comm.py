"""Collectives over explicit process groups, differentiable where needed (SEMANTICS section 4).

Every function takes its process group as an argument; nothing here keeps state.
The differentiable gather's backward is its adjoint, a reduce-scatter (sum) of the
gradient back to the owners.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from cpkv._checks import check_dim, check_int, check_tensor
from cpkv.sharding import permute_cp_shard, zigzag_gather_index

Group = ProcessGroup | None
"""A process group; ``None`` means the default (world) group."""


def _all_gather_flat(output: Tensor, tensor: Tensor, group: Group) -> None:
    """``all_gather_into_tensor`` under its torch >= 2.13 name when present (no FutureWarning)."""
    gather: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def _reduce_scatter_flat(output: Tensor, tensor: Tensor, group: Group) -> None:
    """``reduce_scatter_tensor`` (sum) under its torch >= 2.13 name when present."""
    scatter: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor, op=dist.ReduceOp.SUM, group=group)


def all_gather_tokens(x: Tensor, group: Group) -> Tensor:
    """Non-differentiable all-gather along dim 0: ``[n, ...] -> [world * n, ...]`` rank-major."""
    world = dist.get_world_size(group)
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _all_gather_flat(out, x.contiguous(), group)
    return out


def reduce_scatter_tokens(x: Tensor, group: Group) -> Tensor:
    """Non-differentiable reduce-scatter (sum) along dim 0: ``[world * n, ...] -> [n, ...]``."""
    world = dist.get_world_size(group)
    if x.shape[0] % world != 0:
        raise ValueError(f"reduce_scatter_tokens: dim 0 ({x.shape[0]}) is not divisible by the group size {world}")
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _reduce_scatter_flat(out, x.contiguous(), group)
    return out


class BackwardOrder:
    """Makes the backward collectives of one computation run in one order on every rank.

    A differentiable collective issues its backward collective when autograd reaches it,
    and autograd's order depends on the graph, which can differ between ranks (one rank's
    compressor returns ``None``, another's does not). Ranks would then issue different
    collectives and hang or exchange garbage. Threading a token through every collective of
    the computation (``order=``) makes collective ``k-1``'s backward wait for collective
    ``k``'s, and :meth:`attach` ties the last token to the output, so every rank runs every
    backward collective, in the reverse of the forward order. One instance per layer call.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        # The first token requires grad, so every chained collective is recorded by autograd
        # even where its own input does not require grad (a rank with nothing to send).
        self.token = torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())

    def attach(self, out: Tensor) -> Tensor:
        """``out`` unchanged; its backward first runs the chain of collectives."""
        if not self.token.requires_grad:
            return out
        attached: Tensor = _Attach.apply(out, self.token)  # type: ignore[no-untyped-call]
        return attached


class _Attach(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: Tensor, token: Tensor) -> Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.new_zeros(())


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (optionally zigzag-reordered); backward: reduce-scatter(sum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, token: Tensor, group: Group, zigzag_cp_size: int) -> tuple[Tensor, Tensor]:
        ctx.group = group
        ctx.zigzag_cp_size = zigzag_cp_size
        gathered = all_gather_tokens(x, group)
        if zigzag_cp_size:
            gathered = permute_cp_shard(gathered, zigzag_cp_size, reorder=True)
        return gathered, token.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor, Tensor, None, None]:
        if ctx.zigzag_cp_size:
            inverse = torch.argsort(torch.tensor(zigzag_gather_index(ctx.zigzag_cp_size)))
            chunks = grad.reshape(2 * ctx.zigzag_cp_size, -1, *grad.shape[1:])
            grad = chunks.index_select(0, inverse.to(grad.device)).flatten(0, 1)
        return reduce_scatter_tokens(grad, ctx.group), grad_token, None, None


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
    moved = x.movedim(dim, 0)
    token = order.token if order is not None else x.new_zeros(())
    gathered, token = _GatherTokens.apply(moved, token, group, 0 if tnd else cp_size)  # type: ignore[no-untyped-call]
    if order is not None:
        order.token = token
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
        if local_num_tokens.numel() != 1 or local_num_tokens.is_floating_point():
            raise TypeError("local_num_tokens must be an int or a one-element integer tensor")
        device = local_num_tokens.device if device is None else device
        count = int(local_num_tokens.item())
    else:
        count = check_int("local_num_tokens", local_num_tokens)
    if count < 0:
        raise ValueError(f"local_num_tokens must be >= 0, got {count}")
    total = torch.tensor([count], dtype=torch.int64, device=device)
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



def check_same_on_all_ranks(cu_seqlens: Tensor, group: Group, *, device: torch.device | str | None = None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks of ``group`` hold the same ``cu_seqlens``.

    Different ``cu_seqlens`` on different ranks make the plans, and so the collectives,
    disagree: a hang, a gloo size error, or (same ``T``, other boundaries) silently wrong
    attention. This opt-in check costs two small all-reduces; call it once per micro-batch
    while debugging or in tests. Every rank raises alike, so none is left in a collective.

    Args:
        cu_seqlens: ``[B + 1]`` int tensor (any convention: it is compared, not interpreted).
        group: the CP group.
        device: where the all-reduces run (NCCL needs ``"cuda"``); default ``cu_seqlens.device``.

    Example:
        >>> check_same_on_all_ranks(cu_seqlens, cp_group)  # doctest: +SKIP
    """
    check_tensor("cu_seqlens", cu_seqlens)
    values = cu_seqlens.detach().to(device or cu_seqlens.device, torch.int64).flatten()
    weights = torch.arange(1, values.numel() + 1, device=values.device, dtype=torch.int64)
    digest = torch.stack([torch.tensor(values.numel(), device=values.device), (values * weights).sum(), values.sum()])
    low, high = digest.clone(), digest.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise ValueError(
            f"cu_seqlens differs between the ranks of the group (this rank: {values.numel()} entries, last"
            f" {int(values[-1]) if values.numel() else 'none'}): every rank must pass the same global cu_seqlens"
        )
