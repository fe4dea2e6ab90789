"""The need-based exchange's data movement: rows along planned routes (contiguous TND).

The routes are plan data (:mod:`cpkv.plan.routes`, built once per micro-batch by
:func:`cpkv.plan.plan_attention`); this module only moves rows. One
``all_to_all_single`` per call (uneven splits); its backward sends the gradients back along
the same routes (summed at the owner). When no rank sends anything the collective is
skipped on every rank alike (the decision comes from the global plan); under ``torch.compile``
it always runs (moving zero rows), so that the compiled graph does not branch on the packing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpkv.checks import check_tensor
from cpkv.collectives import BackwardOrder, Group, check_group, exchange
from cpkv.plan.routes import Routes


def exchange_rows(x: Tensor, routes: Routes, group: Group, *, order: BackwardOrder | None = None) -> Tensor:
    """Send rows of ``x`` along ``routes``; return the received rows (differentiable).

    Args:
        x: ``[n, ...]`` this rank's rows (tokens or compressed entries), on the group's device.
        routes: from the plan; identical structure on every rank.
        group: the CP group.
        order: chain this exchange's backward into a :class:`~cpkv.collectives.BackwardOrder`.

    Returns:
        ``[routes.num_recv, ...]`` received rows in natural order. Backward: the gradient
        goes back along the same routes and is summed into ``x``'s rows.

    Raises:
        TypeError: ``x`` not a tensor, ``routes`` not :class:`Routes`, ``group`` not a process group.
    """
    check_tensor("x", x)
    group = check_group("group", group)
    if not isinstance(routes, Routes):
        raise TypeError(f"routes must be Routes from an AttentionPlan, got {type(routes).__name__}")
    if x.ndim == 0 and routes.num_send:
        raise ValueError("x must be [n, ...] rows to send, got a 0-d tensor")
    if not torch.compiler.is_compiling() and not routes.any_traffic:  # compiled: no branch on the packing
        return x.new_zeros((0, *x.shape[1:]))
    sized = None if routes.host_splits is None or routes.recv_shape is None else (routes.host_splits, routes.recv_shape)
    return exchange(x, routes.send_rows.to(x.device), routes.send_splits, routes.recv_splits, group, order, sized)
