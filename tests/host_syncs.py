"""Count host syncs: the points where the host must wait for a value the device computes.

On an accelerator the host runs ahead of the device, queueing kernels; a host sync is any
read of a tensor's *values* on the host (the device must first finish everything queued).
Counted, forward and backward alike (the mode is thread-local state that the autograd
engine carries into the backward):

* scalar reads from Python: ``item``, ``int``, ``float``, ``bool`` (``if t:``), ``__index__``
  (``t`` as an index), and whole reads: ``tolist``, ``numpy`` (wrappers around the
  ``torch.Tensor`` methods, so the reads inside ``torch.library`` custom ops, such as
  ``cpkv::agree``'s, count too);
* the same scalar read from C++ (``aten::_local_scalar_dense``) when no wrapper above is
  already counting it, and ``aten::is_nonzero`` / ``aten::equal``;
* ops whose output *shape* depends on values (the host reads the size): ``nonzero``,
  ``unique``, boolean-mask indexing and ``masked_select``, ``repeat_interleave`` without
  ``output_size``;
* copies from a device to the host (``_to_copy`` / ``copy_`` from a non-CPU tensor into a CPU one).

Ops named in ``kernels`` (``"namespace::name"``) count as device kernels: nothing inside them
is counted (the reference backend's primitives loop over blocks on the host; on a device the
CUDA backend's Triton kernels stand in their place). Inside ``torch.library`` custom ops the
dispatch mode is off, so only the Python-level reads above are seen there.

Not counted: collectives (``all_reduce`` and friends are queued like kernels on NCCL/HCCL),
host-side arithmetic on plan data that is already on the host, and shape reads (shapes are
host metadata). On the CPU every tensor lives on the host, so this counts what *would* be a
sync on a device; tests/test_step_status.py checks the counter on known reads.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = ("item", "__int__", "__float__", "__bool__", "__index__", "tolist", "numpy")
_SHAPE_OPS = {"nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select", "equal", "is_nonzero"}


class HostSyncs(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode that counts host syncs by kind (:attr:`counts`); see the module docstring."""

    def __init__(self, kernels: Collection[str] = ()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.counts: Counter[str] = Counter()
        self.kernels = frozenset(kernels)
        self._inside = threading.local()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0) == 0:
                self.counts[name] += 1
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return method(tensor, *args, **kwargs)
            finally:
                self._inside.depth -= 1

        return read

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if f"{func.namespace}::{name}" in self.kernels:  # a kernel: what it does inside is the device's
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return func(*args, **kwargs)
            finally:
                self._inside.depth -= 1
        if name == "_local_scalar_dense" and getattr(self._inside, "depth", 0) == 0:
            self.counts["_local_scalar_dense"] += 1
        elif name in _SHAPE_OPS:
            self.counts[name] += 1
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and not isinstance(args[-1], int):
            self.counts[name] += 1
        elif name in ("index", "index_put", "index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in (args[1] or [])
        ):
            self.counts["boolean mask"] += 1
        elif name in ("_to_copy", "copy_") and _device_to_host(name, args, kwargs):
            self.counts["device to host copy"] += 1
        return func(*args, **kwargs)


def _device_to_host(name: str, args: Any, kwargs: Any) -> bool:
    if name == "copy_":
        dst, src = args[0], args[1]
        return bool(dst.device.type == "cpu" and src.device.type != "cpu")
    target = kwargs.get("device")
    return bool(args[0].device.type != "cpu" and target is not None and torch.device(target).type == "cpu")


@contextlib.contextmanager
def count_host_syncs(kernels: Collection[str] = ()) -> Iterator[HostSyncs]:
    """Count the host syncs of the code inside the block (forward and backward); see :class:`HostSyncs`.

    Methods bound before the block (``read = t.item``) escape the count.

    Example:
        >>> with count_host_syncs() as syncs:  # doctest: +SKIP
        ...     loss = f(x); loss.backward()
        >>> syncs.total, dict(syncs.counts)  # doctest: +SKIP
    """
    mode = HostSyncs(kernels)
    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    try:
        for name, method in saved.items():
            setattr(torch.Tensor, name, mode.wrap(name, method))
        with mode:
            yield mode
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
