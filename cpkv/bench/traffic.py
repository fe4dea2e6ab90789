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
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cpkv.comm import gather_from_sp_cp
from cpkv.commstats import count_bytes
from cpkv.exchange import exchange_rows
from cpkv.index_keys import exchange_index_keys
from cpkv.plan.attention import AttentionPlan, plan_attention
from cpkv.plan.prefix import rearrange_prefix_kv


KEY_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float8": torch.float8_e4m3fn}
"""``Dims.key_dtype`` -> the layer's ``AttentionSpec.index_key_dtype``."""


@dataclass(frozen=True)
class Dims:
    """Layer dimensions (defaults: DeepSeek-V4-Flash) and the element size on the wire."""

    hidden: int = 4096
    kv_dim: int = 512
    index_dim: int = 128
    window: int = 128
    element_bytes: int = 2  # bf16
    key_dtype: str = "float32"  # the indexer keys on the wire: "float32", "bfloat16" or "float8" (+ an fp32 scale)

    def key_row_bytes(self) -> int:
        """Bytes of one indexer key on the wire."""
        return {"float32": 4 * self.index_dim, "bfloat16": 2 * self.index_dim, "float8": self.index_dim + 4}[self.key_dtype]


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


def need_plan(cu: Tensor, cp: int, rank: int, ratios: list[int], dims: Dims) -> AttentionPlan:
    """The need-exchange plan the traffic model uses (one per rank, shared by every layer kind)."""
    return plan_attention(cu, cp, rank, exchange="need", compress_ratios=ratios, windows=[dims.window])


def _need(cu: Tensor, cp: int, rank: int, ratio: int, dims: Dims, plan: AttentionPlan | None = None) -> tuple[list[Tensor], int]:
    plan = plan or need_plan(cu, cp, rank, [ratio] if ratio > 1 else [], dims)
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
        if ratio == 4:  # the indexer's compressed keys travel the same routes, in the layer's key dtype
            keys = _meta(owned, dims.index_dim, dims, torch.float32)
            outs.append(exchange_index_keys(keys, routes.entries, None, KEY_DTYPES[dims.key_dtype]))
    return outs, counter.bytes


class Traffic(NamedTuple):
    """Bytes of one rank and layer: received forward + backward, received forward, copied forming the prefix."""

    received: int
    forward: int
    copied: int


def layer_traffic(
    cu: Tensor, cp: int, rank: int, ratio: int, strategy: str, dims: Dims, *, plan: AttentionPlan | None = None
) -> Traffic:
    """What one rank moves for one layer (``plan``: a :func:`need_plan` with this ratio, to reuse)."""
    with fake_group(rank, cp), count_bytes() as counter:
        if strategy == "need":
            outs, copied = _need(cu, cp, rank, ratio, dims, plan)
        else:
            outs, copied = _allgather(cu, cp, rank, ratio, dims)
        forward = counter.total
        used = [o for o in outs if o.requires_grad]
        torch.autograd.backward(used, [torch.empty_like(o) for o in used])
    return Traffic(counter.total, forward, copied)


def physical_limit(cu: Tensor, cp: int, rank: int, ratio: int, dims: Dims, *, prev_blocks: int | None = None) -> int:
    """The fewest bytes ``rank`` must receive in the forward of one layer, from the document lengths alone.

    Independent of the exchange code: only the rank's first document can start on an earlier
    rank (contiguous sharding), at ``s < a`` (``a``: the rank's first token). Every layer's
    sliding window needs the ``min(W - 1, a - s)`` kv rows before ``a``. A compressed layer
    (ratio ``m``) also needs the ``(a - s) // m`` entries of that document whose blocks end
    before ``a`` (computed once, by the rank holding their last token), the indexer keys of
    those entries at ratio 4 (in ``dims.key_dtype``), and the hidden rows before ``a`` that
    the block straddling ``a`` reads when this rank holds its last token: from
    ``max(s, s + (j0 - prev_blocks) * m)`` to ``a``, ``j0 = (a - s) // m`` (at most
    ``(prev_blocks + 1) * m - 1`` rows).
    """
    bounds = cu.tolist()
    local = bounds[-1] // cp
    a, b = rank * local, (rank + 1) * local
    docs = [(s, e) for s, e in zip(bounds, bounds[1:]) if s < a < e]
    if not docs:
        return 0
    s, e = docs[0]
    total = min(dims.window - 1, a - s) * dims.kv_dim * dims.element_bytes
    if ratio > 1:
        prev = (1 if ratio == 4 else 0) if prev_blocks is None else prev_blocks
        entries = (a - s) // ratio
        total += entries * dims.kv_dim * dims.element_bytes
        if ratio == 4:
            total += entries * dims.key_row_bytes()
        j0 = (a - s) // ratio
        if s + (j0 + 1) * ratio <= min(e, b):  # this rank holds the last token of the block at a
            total += (a - max(s, s + (j0 - prev) * ratio)) * dims.hidden * dims.element_bytes
    return int(total)


def lognormal_cu_seqlens(total: int, mean: int, seed: int) -> Tensor:
    """Packed documents with log-normal lengths (sigma 1, mean ``mean``) filling ``total`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    mu = float(torch.log(torch.tensor(float(mean)))) - 0.5
    lengths: list[int] = []
    while sum(lengths) < total:
        draw = torch.empty(1).log_normal_(mu, 1.0, generator=gen).item()
        lengths.append(max(1, min(int(draw), total - sum(lengths))))
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
