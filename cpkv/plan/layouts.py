"""Which token ranges of a packed micro-batch every CP rank holds: a layout as plain data.

A :class:`ShardLayout` lists, for every rank, the ranges ``[start, end)`` of packed tokens it
holds, each inside one document, in the rank's shard order, which is natural (packed) order:
a rank's ranges are sorted and its shard is their tokens concatenated. Every layout is an
instance:

* ``contiguous``: rank ``r`` holds ``[r*T/cp, (r+1)*T/cp)``, cut at document boundaries;
* ``zigzag``: chunks ``r`` and ``2cp-1-r`` of every document (lengths multiples of ``2*cp``);
* ``balanced``: ranges cut by a cost model (:mod:`cpkv.plan.balance`).

The need exchange is planned from a layout alone (:mod:`cpkv.plan.need`), and data loaders cut
per-token tensors with :meth:`ShardLayout.shard` / put them back with :meth:`ShardLayout.unshard`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cpkv.checks import check_int, check_rank, check_tensor

__all__ = ["ShardLayout", "contiguous_layout", "layout_from_ranges", "zigzag_layout"]


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """Every rank's token ranges of one micro-batch (CPU tensors; identical on every rank).

    Attributes:
        cp_size: ranks.
        cu_seqlens: ``[B + 1]`` int64 (CPU) the micro-batch's global leading-zero cu_seqlens.
        starts, ends: ``[R]`` int64 global token range ``[start, end)`` of each range
            (non-empty, inside one document), grouped by rank in rank order, sorted within a rank;
            ranges of one rank never continue each other in one document (they are joined).
        ranks: ``[R]`` int64 the rank holding each range (non-decreasing).
        documents: ``[R]`` int64 the document of each range.
        offsets: ``[cp + 1]`` int64: rank ``r``'s ranges are ``offsets[r]:offsets[r + 1]``.
    """

    cp_size: int
    cu_seqlens: Tensor
    starts: Tensor
    ends: Tensor
    ranks: Tensor
    documents: Tensor
    offsets: Tensor

    @property
    def num_tokens(self) -> int:
        """``T``, tokens of the micro-batch."""
        return int(self.cu_seqlens[-1])

    @property
    def local_lens(self) -> tuple[int, ...]:
        """Tokens held by each rank."""
        lengths = torch.zeros(self.cp_size, dtype=torch.int64).index_add_(0, self.ranks, self.ends - self.starts)
        return tuple(lengths.tolist())

    def ranges_of(self, rank: int) -> tuple[Tensor, Tensor]:
        """``(starts, ends)`` ``[R_r]`` int64 of ``rank``'s ranges, in shard order."""
        check_rank("rank", rank, self.cp_size)
        part = slice(int(self.offsets[rank]), int(self.offsets[rank + 1]))
        return self.starts[part], self.ends[part]

    def local_tokens(self, rank: int) -> Tensor:
        """``[L_r]`` int64 (CPU) global token of each row of ``rank``'s shard."""
        starts, ends = self.ranges_of(rank)
        return expand_ranges(starts, ends)

    def shard(self, x: Tensor, rank: int, *, dim: int = 0) -> Tensor:
        """``rank``'s rows of a per-token tensor: ``x`` ``[..., T, ...]`` (tokens at ``dim``) -> ``[..., L_r, ...]``.

        Raises:
            TypeError: ``x`` not a tensor. ValueError: ``x.shape[dim] != T``, ``rank`` out of range.
        """
        check_tensor("x", x)
        if not -x.ndim <= dim < x.ndim or x.shape[dim] != self.num_tokens:
            raise ValueError(f"x must have the micro-batch's T = {self.num_tokens} tokens at dim {dim}, got shape {tuple(x.shape)}")
        return x.index_select(dim, self.local_tokens(rank).to(x.device))

    def unshard(self, shards: Sequence[Tensor], *, dim: int = 0) -> Tensor:
        """The per-token tensor in natural order from every rank's shard (``shards[r]`` ``[..., L_r, ...]``).

        Raises:
            TypeError: not a sequence of tensors. ValueError: not ``cp_size`` shards, a shard with
                the wrong number of rows at ``dim``, or shards that differ in their other dims.
        """
        if not isinstance(shards, (list, tuple)) or len(shards) != self.cp_size:
            raise ValueError(f"shards must be a sequence of cp_size = {self.cp_size} tensors, one per rank")
        lens = self.local_lens
        for rank, part in enumerate(shards):
            check_tensor(f"shards[{rank}]", part)
            if not -part.ndim <= dim < part.ndim or part.shape[dim] != lens[rank]:
                raise ValueError(
                    f"shards[{rank}] must have rank {rank}'s {lens[rank]} rows at dim {dim}, got shape {tuple(part.shape)}"
                )
        joined = torch.cat(list(shards), dim)
        order = expand_ranges(self.starts, self.ends)  # row of the concatenation -> global token
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        return joined.index_select(dim, inverse.to(joined.device))


def expand_ranges(starts: Tensor, ends: Tensor) -> Tensor:
    """``[sum(ends - starts)]`` int64: the integers of every range ``[starts[i], ends[i])``, in order.

    ``arange(total)`` plus a per-range offset, the offset a running sum of its jumps (written at
    each range's first row): a few passes over the rows, no per-row gather.
    """
    lengths = ends - starts
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    total = int(lengths.sum()) if lengths.numel() else 0
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=starts.device)
    first = torch.cumsum(lengths, 0) - lengths  # the row of each range's first integer
    jump = starts - first  # integer = row + jump within range i
    steps = torch.zeros(total, dtype=torch.int64, device=starts.device)
    steps.index_copy_(0, first, torch.diff(jump, prepend=jump.new_zeros(1)))
    return torch.arange(total, device=starts.device).add_(steps.cumsum_(0))


def layout_from_ranges(cu_seqlens: Tensor, cp_size: int, starts: Tensor, ends: Tensor, ranks: Tensor) -> ShardLayout:
    """A :class:`ShardLayout` from any ranges (dropping empty ones, sorting by rank then start).

    Args:
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens (any device; validated by the caller).
        cp_size: ranks. starts, ends, ranks: ``[R]`` int ranges ``[start, end)`` and holders.

    Raises:
        ValueError: a range that crosses a document boundary or leaves ``[0, T)``, ranges that
            overlap or leave tokens uncovered, a rank outside ``[0, cp_size)``.
    """
    check_int("cp_size", cp_size, minimum=1)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    starts, ends, ranks = (t.detach().to("cpu", torch.int64).flatten() for t in (starts, ends, ranks))
    keep = ends > starts
    starts, ends, ranks = starts[keep], ends[keep], ranks[keep]
    if bool(((ranks < 0) | (ranks >= cp_size)).any()):
        raise ValueError(f"every range's rank must be in [0, {cp_size})")
    documents = torch.searchsorted(cu[1:], starts, right=True)
    if starts.numel() and (bool((starts < 0).any()) or bool((ends > cu[-1]).any())
                           or bool((ends > cu[1:].index_select(0, documents.clamp(max=cu.numel() - 2))).any())):
        raise ValueError("every range must lie inside one document of cu_seqlens")
    natural = torch.argsort(starts)
    if int((ends - starts).sum()) != int(cu[-1]) or bool((starts[natural][1:] != ends[natural][:-1]).any()):
        raise ValueError("the ranges must cover every token of cu_seqlens exactly once")
    order = torch.argsort(ranks * (int(cu[-1]) + 1) + starts)
    starts, ends, ranks, documents = starts[order], ends[order], ranks[order], documents[order]
    # Ranges of one rank that continue each other in one document become one range.
    joins = (ranks[1:] == ranks[:-1]) & (documents[1:] == documents[:-1]) & (starts[1:] == ends[:-1])
    first = torch.cat([torch.ones(min(1, starts.numel()), dtype=torch.bool), ~joins])
    last = torch.cat([~joins, torch.ones(min(1, starts.numel()), dtype=torch.bool)])
    starts, ends, ranks, documents = starts[first], ends[last], ranks[first], documents[first]
    offsets = torch.searchsorted(ranks, torch.arange(cp_size + 1))
    return ShardLayout(cp_size, cu, starts, ends, ranks, documents, offsets)


def contiguous_layout(cu_seqlens: Tensor, cp_size: int) -> ShardLayout:
    """Rank ``r`` holds packed tokens ``[r*T/cp, (r+1)*T/cp)`` (``T % cp == 0``, checked by the caller)."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    local = int(cu[-1]) // cp_size
    cuts = torch.unique(torch.cat([cu, torch.arange(cp_size + 1) * local]))
    starts, ends = cuts[:-1], cuts[1:]
    return layout_from_ranges(cu, cp_size, starts, ends, torch.div(starts, max(local, 1), rounding_mode="floor"))


def zigzag_layout(cu_seqlens: Tensor, cp_size: int) -> ShardLayout:
    """Rank ``r`` holds chunks ``r`` and ``2cp-1-r`` of every document cut into ``2*cp`` equal chunks.

    Document lengths must be multiples of ``2 * cp_size`` (checked by the caller).
    """
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    chunk = cu.diff() // (2 * cp_size)
    i = torch.arange(2 * cp_size)
    starts = (cu[:-1, None] + i[None, :] * chunk[:, None]).flatten()
    ranks = torch.where(i < cp_size, i, 2 * cp_size - 1 - i).repeat(chunk.numel())
    return layout_from_ranges(cu, cp_size, starts, starts + chunk.repeat_interleave(2 * cp_size), ranks)
