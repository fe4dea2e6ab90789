"""Agreed failure: when a check fails on one rank of a group, every rank raises.

A rank that raises alone leaves the others waiting in their next collective until the
timeout. Wherever a check can fail on some ranks only (a rank's own arguments to
:func:`cpkv.plan_attention`, a step's layer-call failures at :meth:`cpkv.StepStatus.check`,
or, in a layer call without a status, what a rank's compressor and indexer returned), every
rank calls :func:`agree` at the same point instead: one all-reduce (MAX) of two
integers says whether any rank failed and which one failed first; if one did, that rank's
message is broadcast and every rank raises. The failing rank raises its own exception; the
others raise the same kind (``ValueError`` or ``TypeError``, else ``RuntimeError``) with a
message that names the failing rank and quotes it. When no rank fails it costs the one
all-reduce and a host read of its result.

:func:`agree_in_order` is the same agreement as a ``torch.library`` custom op inside a layer
call, chained through the call's :class:`~cpkv.collectives.BackwardOrder` token so that a
compiled graph keeps it in place between the collectives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.collectives import BackwardOrder, Group, check_group, group_name, resolve_group

_KINDS: tuple[tuple[str, type[Exception]], ...] = (("ValueError", ValueError), ("TypeError", TypeError))


def group_device(group: Group) -> torch.device:
    """Where a small collective of ``group`` runs: the CPU for gloo, else the current accelerator."""
    backend = str(dist.get_backend(check_group("group", group)))
    accelerator = torch.accelerator.current_accelerator()
    if "gloo" in backend or accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def describe(error: BaseException) -> str:
    """``"<kind>: <message>"`` of an exception, the form :func:`agree` broadcasts."""
    kind = next((name for name, cls in _KINDS if isinstance(error, cls)), "RuntimeError")
    return f"{kind}: {type(error).__name__}: {error}"


def _agree(message: str, group: Any) -> None:
    """The collective: raise on every rank if any rank passed a non-empty ``message``."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = group_device(group)
    flags = torch.tensor([int(bool(message)), world - rank if message else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if not int(flags[0]):
        return
    first = world - int(flags[1])
    box: list[Any] = [message]
    dist.broadcast_object_list(box, group=group, device=device, group_src=first)
    kind, _, text = str(box[0]).partition(": ")
    raise dict(_KINDS).get(kind, RuntimeError)(f"rank {first} of the group failed, so every rank raises: {text}")


def agree(error: BaseException | None, group: Group) -> None:
    """Collective: every rank of ``group`` raises if any rank passes an ``error``.

    Every rank of the group must call it at the same point. Costs one all-reduce of two
    int64 (on :func:`group_device`) and a host read; a broadcast of the message follows
    only on failure.

    Args:
        error: this rank's failure, or ``None``.
        group: the process group (``None``: the default group).

    Raises:
        The rank's own ``error`` on the failing rank; on the others ``ValueError`` /
        ``TypeError`` (the failing rank's kind) or ``RuntimeError``, naming the first failing
        rank and quoting its message.
    """
    try:
        _agree(describe(error) if error is not None else "", check_group("group", group))
    except (ValueError, TypeError, RuntimeError):
        if error is not None:
            raise error from None
        raise


@torch.library.custom_op("cpkv::agree", mutates_args=())
def _agree_op(token: Tensor, message: str, group: str) -> Tensor:
    _agree(message, resolve_group(group))
    return token.new_zeros(())


@_agree_op.register_fake
def _(token: Tensor, message: str, group: str) -> Tensor:
    return token.new_empty(())


def _agree_backward(ctx: Any, grad_token: Tensor) -> tuple[Tensor, None, None]:
    return grad_token, None, None


_agree_op.register_autograd(_agree_backward)


def agree_in_order(error: BaseException | None, group: Group, order: BackwardOrder) -> None:
    """:func:`agree` as a custom op chained through ``order``'s token (inside a layer call).

    Under ``torch.compile`` a rank whose check fails while tracing raises at trace time
    (compilation is local to a rank); eager calls agree as :func:`agree` does.
    """
    if error is not None and torch.compiler.is_compiling():
        raise error
    try:
        order.token = _agree_op(order.token, describe(error) if error is not None else "", group_name(group))
    except (ValueError, TypeError, RuntimeError):
        if error is not None:
            raise error from None
        raise
