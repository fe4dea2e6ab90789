"""Bytes each rank receives per layer (forward + backward), counted on the real collective calls.

The exchange functions the pipeline calls (``gather_from_sp_cp`` + ``rearrange_prefix_kv``
for ``"allgather"``; ``exchange_rows`` along the routes of :func:`cpkv.plan_attention`'s plan
for ``"need"``: ``plan.kv[window].halo``, ``plan.compressed[ratio].hidden`` and ``.entries``)
run on **meta** tensors of the true sizes inside a *fake* process group
(``torch.testing._internal.distributed.fake_pg``: collectives are accepted and do
nothing). :func:`cpkv.commstats.count_bytes` wraps those collective calls and counts what
each rank would receive; the attention math itself is not run (it does not change the
traffic). ``tests/bench/test_bench.py`` checks that this model counts the same bytes as
a real gloo run of ``attention_forward`` at small sizes.

Copies are counted with a dispatch mode (bytes written by ``cat``, ``index_select``,
``clone`` and ``copy_``) while the prefix kv is formed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cpkv.comm import gather_from_sp_cp
from cpkv.commstats import count_bytes
from cpkv.exchange import exchange_rows
from cpkv.plan.attention import plan_attention
from cpkv.plan.prefix import rearrange_prefix_kv


@dataclass(frozen=True)
class Dims:
    """Layer dimensions (defaults: DeepSeek-V4-Flash) and the element size on the wire."""

    hidden: int = 4096
    kv_dim: int = 512
    index_dim: int = 128
    window: int = 128
    element_bytes: int = 2  # bf16


_COPY_OPS = {"cat", "index_select", "clone", "copy_", "_to_copy"}


class CopyCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts bytes written by copying aten ops while active (views count zero)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in _COPY_OPS and isinstance(out, Tensor):
            self.bytes += out.numel() * out.element_size()
        return out


@contextlib.contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    """A fake process group of ``world`` ranks in which this process is ``rank``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta(rows: int, cols: int, dims: Dims, dtype: torch.dtype | None = None) -> Tensor:
    dtype = dtype or (torch.bfloat16 if dims.element_bytes == 2 else torch.float32)
    return torch.empty(rows, cols, device="meta", dtype=dtype, requires_grad=True)


def _allgather(cu: Tensor, cp: int, rank: int, ratio: int, dims: Dims) -> tuple[list[Tensor], int]:
    attention_plan = plan_attention(cu, cp, rank)
    plan, local = attention_plan.prefix, attention_plan.local_len
    assert plan is not None  # contiguous layout
    counter = CopyCounter()
    gathered = [gather_from_sp_cp(_meta(local, dims.kv_dim, dims), None, tnd=True)]
    if ratio > 1:  # MindSpeed gathers the hidden states and recompresses the prefix
        gathered.append(gather_from_sp_cp(_meta(local, dims.hidden, dims), None, tnd=True))
    with counter:
        outs = [rearrange_prefix_kv(g, plan) for g in gathered]
    return outs, counter.bytes


def _need(cu: Tensor, cp: int, rank: int, ratio: int, dims: Dims) -> tuple[list[Tensor], int]:
    ratios = [ratio] if ratio > 1 else []
    plan = plan_attention(cu, cp, rank, exchange="need", compress_ratios=ratios, windows=[dims.window])
    local, halo = plan.local_len, plan.kv[dims.window].halo
    assert halo is not None  # ring_degree 1: the whole halo in one exchange
    kv = _meta(local, dims.kv_dim, dims)
    counter = CopyCounter()
    with counter:
        outs = [torch.cat([exchange_rows(kv, halo, None), kv])]
    if ratio > 1:
        routes = plan.compressed[ratio]
        outs.append(exchange_rows(_meta(local, dims.hidden, dims), routes.hidden, None))
        owned = routes.num_owned
        outs.append(exchange_rows(_meta(owned, dims.kv_dim, dims), routes.entries, None))
        if ratio == 4:  # the indexer's compressed keys travel the same routes, in the fp32 compute dtype
            key_dtype = torch.promote_types(kv.dtype, torch.float32)
            outs.append(exchange_rows(_meta(owned, dims.index_dim, dims, key_dtype), routes.entries, None))
    return outs, counter.bytes


def layer_traffic(cu: Tensor, cp: int, rank: int, ratio: int, strategy: str, dims: Dims) -> tuple[int, int]:
    """``(bytes received forward + backward, bytes copied forming the prefix)`` of one rank and layer."""
    with fake_group(rank, cp), count_bytes() as counter:
        outs, copied = (_need if strategy == "need" else _allgather)(cu, cp, rank, ratio, dims)
        used = [o for o in outs if o.requires_grad]
        torch.autograd.backward(used, [torch.empty_like(o) for o in used])
    return counter.total, copied


def lognormal_cu_seqlens(total: int, mean: int, seed: int) -> Tensor:
    """Packed documents with log-normal lengths (sigma 1, mean ``mean``) filling ``total`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    mu = float(torch.log(torch.tensor(float(mean)))) - 0.5
    lengths: list[int] = []
    while sum(lengths) < total:
        draw = torch.empty(1).log_normal_(mu, 1.0, generator=gen).item()
        lengths.append(max(1, min(int(draw), total - sum(lengths))))
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
