"""Count the bytes a rank receives through cpkv's collectives.

:func:`count_bytes` watches the collective ops of :mod:`cpkv.collectives` (``cpkv::all_gather``,
``cpkv::reduce_scatter``, ``cpkv::exchange`` and its backward) with a dispatch mode for the
duration of a ``with`` block, so the numbers come from the actual calls cpkv makes (also on
meta tensors in a fake process group), not from a formula. "Received" is the payload that
comes from other ranks: ``(world - 1)`` shares of an all-gather's output and of a
reduce-scatter's output, and the receive splits of a routed exchange (routes never send a
rank's rows to itself). Collectives issued directly through ``torch.distributed`` (for
example :func:`cpkv.global_num_seqs`) are not counted. For demos and benchmarks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass
class ByteCounter:
    """Bytes received by this rank, and calls, per collective name, while :func:`count_bytes` was active."""

    by_op: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """All bytes received."""
        return sum(self.by_op.values())

    @property
    def num_calls(self) -> int:
        """All collective calls (forward and backward)."""
        return sum(self.calls.values())

    def add(self, op: str, num_bytes: int) -> None:
        """Record one call of ``op`` that received ``num_bytes``."""
        self.by_op[op] = self.by_op.get(op, 0) + num_bytes
        self.calls[op] = self.calls.get(op, 0) + 1


def _row_bytes(t: Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "exchange", "exchange_backward", "exchange_index_keys")

_KEY_ROW = {0: None, 1: 4, 2: 2}  # bytes per key channel on the wire by key-dtype code (3: fp8, D + 4 per row)


def received_bytes(op: str, args: tuple[Any, ...]) -> int:
    """Bytes this rank receives in one call of the cpkv collective ``op`` with ``args``."""
    if op == "all_gather":
        x, _token, _group, world = args
        return int(x.numel() * x.element_size() * (world - 1))
    if op == "reduce_scatter":
        x, _token, _group, world = args
        return int(x.numel() * x.element_size() // world * (world - 1))
    if op == "exchange":
        x, _token, _rows, _send, recv, _group = args
        return int(sum(recv)) * _row_bytes(x)
    if op == "exchange_index_keys":
        keys, _token, _rows, _send, recv, _group, code = args
        width = keys.shape[-1]
        row = width + 4 if code == 3 else width * (_KEY_ROW[code] or keys.element_size())
        return int(sum(recv)) * int(row)
    if op == "exchange_backward":
        grad, _token, _rows, _num, send, _recv, _group = args
        return int(sum(send)) * _row_bytes(grad)
    return 0


class _CountCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, counter: ByteCounter) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if func.namespace == "cpkv" and name in COLLECTIVE_OPS:
            self.counter.add(name, received_bytes(name, tuple(args)))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Count bytes received by cpkv's collectives issued inside the block (forward and backward).

    Example:
        >>> with count_bytes() as counter:  # doctest: +SKIP
        ...     gather_from_sp_cp(x, group, tnd=True)
        >>> counter.total  # doctest: +SKIP
    """
    counter = ByteCounter()
    with _CountCollectives(counter):
        yield counter
