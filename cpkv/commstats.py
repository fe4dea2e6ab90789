"""Count the bytes a rank receives through ``torch.distributed`` collectives.

:func:`count_bytes` wraps the collective functions of ``torch.distributed`` for the
duration of a ``with`` block (and restores them after), so the numbers come from the
actual calls cpkv makes, not from a formula. "Received" is the payload that comes
from other ranks: ``(world - 1)`` shares of an all-gather's output, of a
reduce-scatter's output and of an all-reduce, and the uneven receive splits of an
all-to-all. For demos and benchmarks; not thread-safe, not for production.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor


@dataclass
class ByteCounter:
    """Bytes received by this rank, per collective name, while :func:`count_bytes` was active."""

    by_op: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """All bytes received."""
        return sum(self.by_op.values())

    def add(self, op: str, num_bytes: int) -> None:
        """Record ``num_bytes`` received by ``op``."""
        self.by_op[op] = self.by_op.get(op, 0) + num_bytes


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _received(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    group = kwargs.get("group")
    world = dist.get_world_size(group)
    if op in ("all_gather_single", "all_gather_into_tensor"):
        return _nbytes(args[0]) * (world - 1) // world
    if op in ("reduce_scatter_single", "reduce_scatter_tensor"):
        return _nbytes(args[0]) * (world - 1)
    if op == "all_reduce":
        return _nbytes(args[0]) * (world - 1)
    if op == "all_to_all_single":
        output, splits = args[0], kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        rank = dist.get_rank(group)
        rows = output.shape[0] if output.ndim else 1
        row_bytes = _nbytes(output) // max(rows, 1)
        own = splits[rank] if splits else rows // world
        return (rows - own) * row_bytes
    return 0


_COUNTED = (
    "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
    "all_reduce", "all_to_all_single",
)


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Count bytes received by collectives issued inside the block.

    Example:
        >>> with count_bytes() as counter:  # doctest: +SKIP
        ...     gather_from_sp_cp(x, group, tnd=True)
        >>> counter.total  # doctest: +SKIP
    """
    counter = ByteCounter()
    originals: dict[str, Callable[..., Any]] = {}

    def wrap(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counter.add(op, _received(op, args, kwargs))
            return fn(*args, **kwargs)

        return counted

    for op in _COUNTED:
        fn = getattr(dist, op, None)
        if fn is not None:
            originals[op] = fn
            setattr(dist, op, wrap(op, fn))
    try:
        yield counter
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
