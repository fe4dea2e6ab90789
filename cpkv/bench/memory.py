"""Bytes copied and peak memory of one V4 layer's forward + backward on CPU, per strategy.

One process plays one rank of a CP group of ``cp`` in a fake process group (collectives are
accepted and move nothing, so received rows hold garbage; sizes, copies and allocations are
those of a real run). Dimensions keep DeepSeek-V4-Flash's proportions at a smaller scale.

* **Copies**: :class:`~cpkv.bench.traffic.CopyCounter`, a dispatch mode summing the bytes
  written by ``cat``, ``index_select``, ``clone``, ``copy_`` and ``_to_copy`` in forward and
  backward (views count zero).
* **Peak memory**: :class:`LiveBytes`, a dispatch mode that registers the storage of every
  tensor an aten op returns (by its data pointer, with a weak reference) and, before each op,
  drops the storages that were freed: the live bytes created inside the layer's forward and
  backward, at op granularity; the peak is their maximum, on top of what existed before
  (parameters, the input and the plan: a view of them counts zero). Like ``tracemalloc``, it sees every allocation made
  through an op, views count zero, and temporaries inside one kernel are not seen.
* The collectives of the fake group would reject uneven all-to-all splits, so
  ``all_to_all_single`` is replaced by a no-op while measuring (its output buffer is still
  allocated by the exchange code, as in a real run).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cpkv.bench.traffic import CopyCounter, fake_group
from cpkv.plan.attention import plan_attention
from cpkv.v4 import V4Attention, V4Config


@dataclass(frozen=True)
class LayerDims:
    """V4-Flash proportions, smaller: hidden 4096 -> 512, kv 512 -> 64, index keys 128 -> 16, window 128 -> 16."""

    hidden: int = 512
    heads: int = 4
    head_dim: int = 64
    index_head_dim: int = 16
    window: int = 16
    topk: int = 16
    cp: int = 4
    tokens_per_rank: int = 1024


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Peak bytes of live storages created by aten ops while active (see the module docstring).

    A storage counts when an op returns it and none of the op's inputs holds it (views and
    in-place results of older tensors count zero); it is keyed by its ``StorageImpl``, held by
    weak reference (so the key is not reused while tracked), and dropped once freed, checked
    before every op. Works on meta tensors too. :meth:`made` sees each new storage.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = 0
        self.peak = 0

    def made(self, func: Any, tensor: Tensor, nbytes: int) -> None:
        """Called once for every new storage (``tensor`` is the op's output holding it)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:  # type: ignore[no-untyped-call]
            self.now -= self.live.pop(key)[1]
        kwargs = kwargs or {}
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, Tensor):
                continue
            key, storage = storage_key(t), t.untyped_storage()
            if key in inputs or key in self.live or storage.nbytes() == 0:
                continue
            self.live[key] = (StorageWeakRef(storage), storage.nbytes())  # type: ignore[no-untyped-call]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            self.made(func, t, storage.nbytes())
        return out


def storage_key(t: Tensor) -> int:
    """The identity of ``t``'s storage (its ``StorageImpl``; meta tensors included)."""
    return int(StorageWeakRef(t.untyped_storage()).cdata)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def no_all_to_all() -> Iterator[None]:
    """``dist.all_to_all_single`` a no-op while active (the fake group rejects uneven splits; buffers are still allocated)."""
    original = dist.all_to_all_single
    dist.all_to_all_single = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dist.all_to_all_single = original


def layer_memory(ratio: int, exchange: str, dims: LayerDims = LayerDims()) -> tuple[int, int]:
    """``(bytes copied, peak bytes allocated)`` of one layer's forward + backward on the last rank (one document)."""
    rank, total = dims.cp - 1, dims.cp * dims.tokens_per_rank
    config = V4Config(hidden=dims.hidden, heads=dims.heads, head_dim=dims.head_dim, window=dims.window,
                      compress_ratio=ratio, topk=dims.topk, index_head_dim=dims.index_head_dim)
    layer = V4Attention(config, seed=0)
    cu = torch.tensor([0, total])
    with fake_group(rank, dims.cp):
        plan = plan_attention(cu, dims.cp, rank, exchange=exchange,  # type: ignore[arg-type]
                              compress_ratios=[ratio] if ratio > 1 else [], windows=[dims.window])
        x = torch.randn(dims.tokens_per_rank, dims.hidden, generator=torch.Generator().manual_seed(0), requires_grad=True)
        grad = torch.ones(dims.tokens_per_rank, dims.hidden)
        counter, live = CopyCounter(), LiveBytes()
        with no_all_to_all(), counter, live:
            out = layer(x, plan, None).out
            torch.autograd.backward(out, grad)
    return counter.bytes, live.peak
