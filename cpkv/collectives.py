"""The collectives as ``torch.library`` custom ops: traceable, differentiable, ordered.

Three ops move tokens between the ranks of a process group: ``cpkv::all_gather``
(backward: ``cpkv::reduce_scatter`` of the gradient, its adjoint) and ``cpkv::exchange``
(one ``all_to_all_single`` of selected rows along planned routes; backward: the gradient
goes back along the same routes and is summed into the sent rows). Each takes and returns
a 0-d *order token* (see :class:`BackwardOrder`). They are custom ops so that
``torch.compile`` treats them as opaque calls (no graph break); the group travels by name.

The ops call the ``torch.distributed`` functions at run time (``all_gather_single`` /
``reduce_scatter_single`` where this torch has them, else the ``*_into_tensor`` /
``*_tensor`` names), so :func:`cpkv.commstats.count_bytes` sees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

# Before any init_process_group, on purpose: the first call of a custom op (ours below)
# imports torch._dynamo, which imports torch.distributed.nn, whose functions bind
# ``group=group.WORLD`` as default arguments when defined. Imported after init, they would
# keep the default group alive past destroy_process_group, and its gloo worker threads can
# then abort the process at exit ("terminate called without an active exception"; see
# docs/troubleshooting.md, "A finished job aborts at exit").
import torch.distributed.nn  # noqa: F401
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from cpkv.checks import check_tensor
from cpkv.ties import tie

Group = ProcessGroup | DeviceMesh | None
"""What a public function takes as its CP group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (e.g.
``mesh["cp"]``, resolved to its group by :func:`check_group`), or ``None`` (the default group)."""

ProcessGroupOrNone = ProcessGroup | None
"""A resolved group (what :func:`check_group` returns): a process group, ``None`` the default group."""


def group_name(group: Group) -> str:
    """The registered name of ``group`` (``None``: the default group; a 1-D mesh: its group)."""
    checked = check_group("group", group)
    resolved = checked if checked is not None else dist.group.WORLD
    if resolved is None:
        raise RuntimeError("torch.distributed is not initialised: call init_process_group first")
    return resolved.group_name


def resolve_group(name: str) -> ProcessGroup:
    """The process group registered under ``name`` (how torch's functional collectives resolve theirs)."""
    from torch.distributed import distributed_c10d

    group: ProcessGroup = distributed_c10d._resolve_process_group(name)  # type: ignore[attr-defined, arg-type]
    return group


def _gather_into(output: Tensor, tensor: Tensor, group: ProcessGroup) -> None:
    gather: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def _scatter_into(output: Tensor, tensor: Tensor, group: ProcessGroup) -> None:
    scatter: Any = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor, op=dist.ReduceOp.SUM, group=group)


# ------------------------------------------------------------------ all-gather / reduce-scatter


@torch.library.custom_op("cpkv::all_gather", mutates_args=())
def _all_gather(x: Tensor, token: Tensor, group: str, world: int) -> tuple[Tensor, Tensor]:
    out = x.new_empty((world * x.shape[0], *x.shape[1:]))
    _gather_into(out, x.contiguous(), resolve_group(group))
    return out, token.new_zeros(())


@_all_gather.register_fake
def _(x: Tensor, token: Tensor, group: str, world: int) -> tuple[Tensor, Tensor]:
    return x.new_empty((world * x.shape[0], *x.shape[1:])), token.new_empty(())


@torch.library.custom_op("cpkv::reduce_scatter", mutates_args=())
def _reduce_scatter(x: Tensor, token: Tensor, group: str, world: int) -> tuple[Tensor, Tensor]:
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    _scatter_into(out, x.contiguous(), resolve_group(group))
    return out, token.new_zeros(())


@_reduce_scatter.register_fake
def _(x: Tensor, token: Tensor, group: str, world: int) -> tuple[Tensor, Tensor]:
    return x.new_empty((x.shape[0] // world, *x.shape[1:])), token.new_empty(())


def _gather_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.group, ctx.world = inputs[2], inputs[3]


def _gather_backward(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor, Tensor, None, None]:
    # The backward collective consumes the token's gradient and produces the previous one's:
    # a data dependency, so a compiled backward graph keeps the collectives in order too.
    grad_x, grad_token = _reduce_scatter(grad, grad_token, ctx.group, ctx.world)
    return grad_x, grad_token, None, None


_all_gather.register_autograd(_gather_backward, setup_context=_gather_setup)


# ------------------------------------------------------------------ routed all-to-all


@torch.library.custom_op("cpkv::exchange", mutates_args=())
def _exchange(
    x: Tensor, token: Tensor, send_rows: Tensor, send_splits: list[int], recv_splits: list[int], group: str
) -> tuple[Tensor, Tensor]:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    send = x.index_select(0, send_rows).contiguous()
    dist.all_to_all_single(out, send, list(recv_splits), list(send_splits), group=resolve_group(group))
    return out, token.new_zeros(())


@_exchange.register_fake
def _(
    x: Tensor, token: Tensor, send_rows: Tensor, send_splits: list[int], recv_splits: list[int], group: str
) -> tuple[Tensor, Tensor]:
    return x.new_empty((sum(recv_splits), *x.shape[1:])), token.new_empty(())


@torch.library.custom_op("cpkv::exchange_backward", mutates_args=())
def exchange_backward_op(
    grad: Tensor, token: Tensor, send_rows: Tensor, num_rows: int, send_splits: list[int], recv_splits: list[int],
    group: str,
) -> tuple[Tensor, Tensor]:
    back = grad.new_empty((sum(send_splits), *grad.shape[1:]))
    dist.all_to_all_single(back, grad.contiguous(), list(send_splits), list(recv_splits), group=resolve_group(group))
    return grad.new_zeros((num_rows, *grad.shape[1:])).index_add_(0, send_rows, back), token.new_zeros(())


@exchange_backward_op.register_fake
def _(
    grad: Tensor, token: Tensor, send_rows: Tensor, num_rows: int, send_splits: list[int], recv_splits: list[int],
    group: str,
) -> tuple[Tensor, Tensor]:
    return grad.new_empty((num_rows, *grad.shape[1:])), token.new_empty(())


def _exchange_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, _token, send_rows, ctx.send_splits, ctx.recv_splits, ctx.group = inputs
    ctx.num_rows = x.shape[0]
    ctx.save_for_backward(send_rows)


def _exchange_grad(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor | None, ...]:
    (send_rows,) = ctx.saved_tensors
    grad_x, grad_token = exchange_backward_op(
        grad, grad_token, send_rows, ctx.num_rows, ctx.send_splits, ctx.recv_splits, ctx.group
    )
    return grad_x, grad_token, None, None, None, None


_exchange.register_autograd(_exchange_grad, setup_context=_exchange_setup)


# The compiled form: the splits as a host tensor and the received count as a tensor's size, so
# that a compiled graph has no int of the packing in it (nothing to specialise or guard on).


@torch.library.custom_op("cpkv::exchange_sized", mutates_args=())
def _exchange_sized(
    x: Tensor, token: Tensor, send_rows: Tensor, host_splits: Tensor, recv_shape: Tensor, group: str
) -> tuple[Tensor, Tensor]:
    send_splits, recv_splits = host_splits.tolist()  # host data of the plan: no device sync
    return _exchange(x, token, send_rows, send_splits, recv_splits, group)  # type: ignore[no-any-return]


@_exchange_sized.register_fake
def _(
    x: Tensor, token: Tensor, send_rows: Tensor, host_splits: Tensor, recv_shape: Tensor, group: str
) -> tuple[Tensor, Tensor]:
    return x.new_empty((recv_shape.shape[0], *x.shape[1:])), token.new_empty(())


@torch.library.custom_op("cpkv::exchange_sized_backward", mutates_args=())
def exchange_sized_backward_op(
    grad: Tensor, token: Tensor, send_rows: Tensor, num_rows: int, host_splits: Tensor, group: str
) -> tuple[Tensor, Tensor]:
    """:func:`exchange_backward_op` with the splits as a ``[2, cp]`` host tensor."""
    send_splits, recv_splits = host_splits.tolist()
    return exchange_backward_op(grad, token, send_rows, num_rows, send_splits, recv_splits, group)  # type: ignore[no-any-return]


@exchange_sized_backward_op.register_fake
def _(grad: Tensor, token: Tensor, send_rows: Tensor, num_rows: int, host_splits: Tensor, group: str) -> tuple[Tensor, Tensor]:
    return grad.new_empty((num_rows, *grad.shape[1:])), token.new_empty(())


def _exchange_sized_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, _token, send_rows, host_splits, _shape, ctx.group = inputs
    ctx.num_rows = x.shape[0]
    ctx.save_for_backward(send_rows, host_splits)


def _exchange_sized_grad(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor | None, ...]:
    send_rows, host_splits = ctx.saved_tensors
    grad_x, grad_token = exchange_sized_backward_op(grad, grad_token, send_rows, ctx.num_rows, host_splits, ctx.group)
    return grad_x, grad_token, None, None, None, None


_exchange_sized.register_autograd(_exchange_sized_grad, setup_context=_exchange_sized_setup)


# ------------------------------------------------------------------ public wrappers


class BackwardOrder:
    """Makes the backward collectives of one computation run in one order on every rank.

    A differentiable collective issues its backward collective when autograd reaches it,
    and autograd's order depends on the graph, which can differ between ranks (one rank's
    compressor returns ``None``, another's does not). Ranks would then issue different
    collectives and hang or exchange garbage. Threading a 0-d token through every
    collective of the computation makes collective ``k-1``'s backward wait for collective
    ``k``'s, and :meth:`attach` ties the last token to the output, so every rank runs every
    backward collective, in the reverse of the forward order. One instance per layer call.

    Args:
        *anchors: the computation's differentiable inputs (e.g. ``q`` and ``kv``): the token
            is derived from them (value 0), so it requires grad exactly when they do, and
            creating it adds no graph break under ``torch.compile``.
    """

    def __init__(self, *anchors: Tensor) -> None:
        if not anchors:
            raise ValueError("BackwardOrder needs at least one anchor tensor (e.g. the layer's q)")
        token = anchors[0].new_zeros((), dtype=torch.float32)
        for anchor in anchors:
            if anchor.requires_grad:
                token = token + anchor.flatten()[:0].sum().float()
        self.token = token

    def attach(self, out: Tensor) -> Tensor:
        """``out`` unchanged in value; its backward first runs the chain of collectives."""
        return tie(out, self.token)


def all_gather(x: Tensor, group: Group, order: BackwardOrder | None = None) -> Tensor:
    """Differentiable all-gather along dim 0, ``[n, ...] -> [world * n, ...]`` rank-major.

    Backward: reduce-scatter (sum) of the gradient. With ``order``, the call joins its
    :class:`BackwardOrder` chain. No checks here (callers validate first).
    """
    token = order.token if order is not None else x.new_zeros((), dtype=torch.float32)
    resolved = check_group("group", group)
    out, token = _all_gather(x, token, group_name(resolved), dist.get_world_size(resolved))
    if order is not None:
        order.token = token
    gathered: Tensor = out
    return gathered


def reduce_scatter(x: Tensor, group: Group) -> Tensor:
    """Non-differentiable reduce-scatter (sum) along dim 0, ``[world * n, ...] -> [n, ...]``."""
    resolved = check_group("group", group)
    result, _token = _reduce_scatter(x, x.new_zeros((), dtype=torch.float32), group_name(resolved), dist.get_world_size(resolved))
    out: Tensor = result
    return out


def exchange(
    x: Tensor, send_rows: Tensor, send_splits: tuple[int, ...], recv_splits: tuple[int, ...], group: Group,
    order: BackwardOrder | None = None, sized: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Differentiable routed all-to-all: send ``x[send_rows]`` split by ``send_splits``.

    ``sized``: the same splits as a ``[2, cp]`` host tensor and a ``[sum(recv_splits), 0]``
    tensor (:class:`~cpkv.plan.routes.Routes`' ``host_splits`` and ``recv_shape``); under
    ``torch.compile`` the call then passes them instead of ints (one graph for every packing).

    Returns ``[sum(recv_splits), ...]`` received rows in source-rank order. Backward: the
    gradient goes back along the same routes and is summed into ``x``'s sent rows.
    """
    token = order.token if order is not None else x.new_zeros((), dtype=torch.float32)
    if sized is not None and torch.compiler.is_compiling():  # compiled: no int of the packing in the graph
        out, token = _exchange_sized(x, token, send_rows, sized[0], sized[1], group_name(group))
    else:
        out, token = _exchange(x, token, send_rows, list(send_splits), list(recv_splits), group_name(group))
    if order is not None:
        order.token = token
    received: Tensor = out
    return received


# ------------------------------------------------------------------ group checks


def check_group(name: str, group: object) -> ProcessGroupOrNone:
    """The process group ``group`` names: itself, a 1-D ``DeviceMesh``'s group, or ``None`` (the default group).

    Every public function that takes a group calls it once, at entry, and uses what it returns.

    Args:
        name: the argument's name, for the message.
        group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (``mesh["cp"]``), or ``None``.

    Returns:
        The ``ProcessGroup`` (``None`` stays ``None``).

    Raises:
        ValueError: a ``DeviceMesh`` of more than one dimension (pass its CP slice, ``mesh["cp"]``).
        TypeError: anything else.
    """
    if group is None or isinstance(group, ProcessGroup):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"{name} must be a 1-D DeviceMesh (e.g. mesh[\"cp\"]), got a {group.ndim}-D mesh with dimensions"
                f" {group.mesh_dim_names}"
            )
        resolved: ProcessGroup = group.get_group()
        return resolved
    raise TypeError(
        f"{name} must be a torch.distributed ProcessGroup, a 1-D DeviceMesh or None (the default group), got {type(group).__name__}"
    )


def check_group_position(group: Group, cp_size: int, cp_rank: int) -> None:
    """Raise ``ValueError`` unless this process is rank ``cp_rank`` of a group of ``cp_size`` ranks."""
    group = check_group("group", group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (size, rank) != (cp_size, cp_rank):
        raise ValueError(f"cp_size={cp_size}, cp_rank={cp_rank} do not match the group (size {size}, this rank {rank})")


def check_fingerprint(fingerprint: object) -> None:
    """Raise ``TypeError`` unless ``fingerprint`` is ``None`` or a 1-D int64 tensor (:func:`check_same_on_all_ranks`)."""
    if fingerprint is not None and (not isinstance(fingerprint, Tensor) or fingerprint.dtype != torch.int64 or fingerprint.ndim != 1):
        got = f"{fingerprint.dtype} {tuple(fingerprint.shape)}" if isinstance(fingerprint, Tensor) else type(fingerprint).__name__
        raise TypeError(f"fingerprint must be a 1-D int64 tensor (e.g. batch_fingerprint(ids, labels)), got {got}")


def check_same_on_all_ranks(
    cu_seqlens: Tensor, group: Group, *, options: Sequence[int] = (), device: torch.device | str | None = None,
    fingerprint: Tensor | None = None,
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
        fingerprint: ``[n]`` int64 further values that must agree, compared in the same
            all-reduces without a host read of their own (e.g.
            :func:`cpkv.integrations.causal_lm.batch_fingerprint` of the batch's token ids and
            labels); a difference is reported as the batch's token ids or labels.

    Raises:
        TypeError: ``cu_seqlens`` is not an integer tensor, ``group`` not a process group.
        ValueError: some rank holds other values; the message gives the first differing entry.

    Example:
        >>> check_same_on_all_ranks(cu_seqlens, cp_group)  # doctest: +SKIP
    """
    check_tensor("cu_seqlens", cu_seqlens)
    group = check_group("group", group)
    if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must be an integer tensor, got dtype {cu_seqlens.dtype}")
    where = device or cu_seqlens.device
    check_fingerprint(fingerprint)
    extra = [] if fingerprint is None else [fingerprint.detach().to(where)]
    values = torch.cat([
        cu_seqlens.detach().to(where, torch.int64).flatten(), torch.tensor(list(options), dtype=torch.int64, device=where),
        *extra,
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
        compared = cu_seqlens.numel() + len(options)
        if first >= compared:
            raise ValueError(
                f"the batch's token ids or labels differ between the ranks of the group (fingerprint entry"
                f" {first - compared} differs): every rank must pass the same whole packed batch"
            )
        what = f"cu_seqlens[{first}]" if first < cu_seqlens.numel() else f"plan option {first - cu_seqlens.numel()}"
        raise ValueError(
            f"cu_seqlens (and plan options) differ between the ranks of the group: {what} ranges over"
            f" [{int(low[first])}, {int(high[first])}] (this rank: {int(values[first])});"
            " every rank must pass the same global cu_seqlens and plan options"
        )
