"""The need exchange for any layout: which rows move between ranks, and how each buffer is assembled.

Every layout is a :class:`~cpkv.plan.layouts.ShardLayout`: rank ``r`` holds a sorted list of
token ranges, each inside one document. The need exchange moves only what the rank's queries
read and the rank does not hold (docs/semantics.md, "Exchanges"):

* a window kind ``W`` (``None``: dense causal): range ``[s, e)`` of document ``d`` reads the kv
  rows ``[lo, e)``, ``lo = start(d)`` (dense) or ``max(start(d), s - W + 1)``; the rows
  ``[lo, s)`` it does not hold arrive once (deduplicated over its ranges);
* a compress ratio ``m``: an entry is computed once, by the rank holding its block's last
  token, from its block and ``prev_blocks`` earlier blocks of its document (those rows it
  does not hold arrive as the compressor-input halo); a rank needs, per document it has
  queries in, that document's entries up to the last one its queries see, and the indexer
  keys of those entries.

Rows travel in one ``all_to_all`` per kind (:mod:`cpkv.exchange`), sorted by source rank, then
by index. Each buffer is then ``[received ; own]``, gathered into the order the kernels read
(``rows``), or used as is when that order is already ``[received ; own]`` (``rows is None``:
the contiguous layout never gathers). With ring rounds the remote part of every segment arrives
in ``R`` rounds instead, in index order (the rank's other ranges travel to itself), so that each
query's visible keys in a round are one contiguous range.

Everything is interval arithmetic on the layout's ranges (no loop over tokens or ranges), the
same on every rank; :mod:`cpkv.plan.attention` builds it into the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cpkv.plan.conventions import compress_cu_seqlens
from cpkv.plan.layouts import ShardLayout, expand_ranges
from cpkv.plan.routes import CompressedRoutes, KVSource, RingRound, Routes
from cpkv.plan.segments import CompressedPlan, EntryVisibility, KeyRanges, SegmentPlan, plan_segments

__all__ = ["Partition", "compressed_need", "cut_at_parts", "kv_need", "token_partition"]


@dataclass(frozen=True, eq=False)
class Partition:
    """An index space ``[0, X)`` cut into sorted parts, each held by one rank at consecutive local rows.

    Attributes:
        starts, ends: ``[P]`` int64 part ``[start, end)`` (sorted, covering ``[0, X)``; empty parts allowed).
        ranks: ``[P]`` int64 holder of each part.
        rows: ``[P]`` int64 the holder's local row of each part's first index.
    """

    starts: Tensor
    ends: Tensor
    ranks: Tensor
    rows: Tensor

    def locate(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """``(rank, local row)`` ``[n]`` int64 of each index (every index inside ``[0, X)``)."""
        part = torch.searchsorted(self.ends, index, right=True)
        return self.ranks.index_select(0, part), self.rows.index_select(0, part) + index - self.starts.index_select(0, part)


def token_partition(layout: ShardLayout) -> Partition:
    """The tokens of ``layout``: every range at its holder's local rows."""
    local = _within_rank(layout.ends - layout.starts, layout)
    order = torch.argsort(layout.starts)
    return Partition(layout.starts[order], layout.ends[order], layout.ranks[order], local[order])


def union(lo: Tensor, hi: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sorted disjoint intervals covering every non-empty ``[lo, hi)`` of each group: ``(lo, hi, group)``."""
    keep = hi > lo
    lo, hi, group = lo[keep], hi[keep], group[keep]
    if lo.numel() == 0:
        return lo, hi, group
    span = int(hi.max()) + 1
    order = torch.argsort(group * span + lo)
    lo, hi, group = lo[order], hi[order], group[order]
    reach = torch.cummax(hi + group * span, 0).values - group * span  # running end within the group
    new = torch.ones(lo.numel(), dtype=torch.bool)
    new[1:] = (group[1:] != group[:-1]) | (lo[1:] > reach[:-1])
    ident = torch.cumsum(new.long(), 0) - 1
    merged_hi = torch.zeros(int(ident[-1]) + 1, dtype=torch.int64).scatter_reduce_(0, ident, hi, "amax", include_self=False)
    return lo[new], merged_hi, group[new]


@dataclass(frozen=True)
class _Pieces:
    """Intersections of needed intervals with a partition: ``[lo, hi)`` needed by ``dst`` from ``src`` (at ``row``)."""

    lo: Tensor
    hi: Tensor
    dst: Tensor
    src: Tensor
    row: Tensor


def _pieces(lo: Tensor, hi: Tensor, dst: Tensor, parts: Partition, *, self_routes: bool) -> _Pieces:
    """Cut every needed ``[lo, hi)`` (non-empty) at the parts' boundaries (sorted disjoint parts; gaps allowed)."""
    first = torch.searchsorted(parts.ends, lo, right=True)  # the first part ending after lo
    last = torch.searchsorted(parts.starts, hi - 1, right=True) - 1  # the last part starting at or before hi - 1
    counts = (last - first + 1).clamp(min=0)  # an empty interval has no piece
    total = int(counts.sum()) if counts.numel() else 0
    seg = torch.repeat_interleave(torch.arange(counts.numel()), counts, output_size=total)
    part = first.index_select(0, seg) + torch.arange(total) - (torch.cumsum(counts, 0) - counts).index_select(0, seg)
    p_lo = torch.maximum(lo.index_select(0, seg), parts.starts.index_select(0, part))
    p_hi = torch.minimum(hi.index_select(0, seg), parts.ends.index_select(0, part))
    src = parts.ranks.index_select(0, part)
    row = parts.rows.index_select(0, part) + p_lo - parts.starts.index_select(0, part)
    d = dst.index_select(0, seg)
    keep = (p_hi > p_lo) & ((src != d) if not self_routes else torch.ones_like(src, dtype=torch.bool))
    return _Pieces(p_lo[keep], p_hi[keep], d[keep], src[keep], row[keep])


def cut_at_parts(lo: Tensor, hi: Tensor, parts: Partition) -> _Pieces:
    """Every ``[lo_i, hi_i)`` cut at the parts' boundaries, in order: runs of one holder's consecutive local rows."""
    return _pieces(lo, hi, torch.zeros_like(lo), parts, self_routes=True)


def _of_rank(parts: Partition, rank: int) -> Partition:
    """The parts ``rank`` holds (sorted, with gaps)."""
    mine = (parts.ranks == rank) & (parts.ends > parts.starts)
    return Partition(parts.starts[mine], parts.ends[mine], parts.ranks[mine], parts.rows[mine])


def _any_traffic(lo: Tensor, hi: Tensor, dst: Tensor, parts: Partition, span: int, *, self_routes: bool) -> bool:
    """Whether any rank receives a row: some needed row (not held by its destination, unless ``self_routes``).

    The same on every rank. Rows a destination holds itself: the intervals cut at its own parts
    only, keyed ``rank * span + index`` so that each interval meets its own rank's parts alone.
    """
    size = (hi - lo).clamp(min=0)
    needed = int(size.sum()) if size.numel() else 0
    if self_routes or needed == 0:
        return needed > 0
    full = (parts.ends > parts.starts).nonzero().flatten()
    order = full.index_select(0, torch.argsort(parts.ranks.index_select(0, full) * span + parts.starts.index_select(0, full)))
    key = parts.ranks.index_select(0, order) * span
    keyed = Partition(key + parts.starts.index_select(0, order), key + parts.ends.index_select(0, order),
                      parts.ranks.index_select(0, order), parts.rows.index_select(0, order))
    held = _pieces(dst * span + lo, dst * span + hi, dst, keyed, self_routes=True)
    return needed > int((held.hi - held.lo).sum())


@dataclass(frozen=True)
class _Received:
    """What one rank receives along routes: pieces in arrival order (by source rank, then index)."""

    routes: Routes
    lo: Tensor
    hi: Tensor
    offset: Tensor  # [n] row of each piece's first index in the received buffer

    def position(self, index: Tensor) -> Tensor:
        """Row in the received buffer of each index (every index inside one received piece)."""
        order = torch.argsort(self.lo)
        piece = order.index_select(0, torch.searchsorted(self.lo.index_select(0, order), index, right=True) - 1)
        return self.offset.index_select(0, piece) + index - self.lo.index_select(0, piece)


def _route(
    lo: Tensor, hi: Tensor, dst: Tensor, parts: Partition, rank: int, cp_size: int, device: torch.device, span: int, *,
    self_routes: bool,
) -> _Received:
    """The :class:`Routes` of ``rank`` (sends to every destination in index order) and its arrival order.

    ``[lo, hi)`` needed by ``dst``: only what ``rank`` sends (the intervals cut at its own parts)
    and receives (its own intervals cut at every part) is cut, not the whole group's routing.
    """
    send_pieces = _pieces(lo, hi, dst, _of_rank(parts, rank), self_routes=self_routes)
    into = dst == rank
    recv_pieces = _pieces(lo[into], hi[into], dst[into], parts, self_routes=self_routes)
    s_size = send_pieces.hi - send_pieces.lo
    send = torch.argsort(send_pieces.dst * span + send_pieces.lo)
    s_row, s_size, s_dst = send_pieces.row[send], s_size[send], send_pieces.dst[send]
    send_rows = expand_ranges(s_row, s_row + s_size)
    send_splits = torch.zeros(cp_size, dtype=torch.int64).index_add_(0, s_dst, s_size)
    recv = torch.argsort(recv_pieces.src * span + recv_pieces.lo)
    r_lo, r_hi, r_src = recv_pieces.lo[recv], recv_pieces.hi[recv], recv_pieces.src[recv]
    recv_splits = torch.zeros(cp_size, dtype=torch.int64).index_add_(0, r_src, r_hi - r_lo)
    routes = Routes(
        send_rows=send_rows.to(device), send_splits=tuple(send_splits.tolist()), recv_splits=tuple(recv_splits.tolist()),
        any_traffic=_any_traffic(lo, hi, dst, parts, span, self_routes=self_routes),
    )
    return _Received(routes, r_lo, r_hi, torch.cumsum(r_hi - r_lo, 0) - (r_hi - r_lo))


def _gather_index(lo: Tensor, hi: Tensor, parts: Partition, received: _Received, rank: int) -> Tensor | None:
    """Rows of ``[received ; own]`` forming the buffer ``[lo_0, hi_0) ++ [lo_1, hi_1) ++ ...``; ``None`` if the identity.

    Planned per piece (an interval cut at the partition's parts), expanded to rows only when the
    buffer is not ``[received ; own]`` itself: a piece the rank holds is a run of its local rows, a
    piece from another rank a run of one received piece.
    """
    pieces = _pieces(lo, hi, torch.zeros_like(lo), parts, self_routes=True)
    size = pieces.hi - pieces.lo
    start = torch.where(pieces.src == rank, pieces.row + received.routes.num_recv, 0)
    remote = pieces.src != rank
    if bool(remote.any()):
        start[remote] = received.position(pieces.lo[remote])
    if bool((start == torch.cumsum(size, 0) - size).all()):
        return None
    return expand_ranges(start, start + size)


def _segments(layout: ShardLayout, rank: int, lo: Tensor) -> SegmentPlan:
    """Segments of the rank's ranges over kv rows ``[lo_i, e_i)`` (``lo_i`` past the document start: missing rows)."""
    starts, ends = layout.ranges_of(rank)
    doc_start = layout.cu_seqlens.index_select(0, layout.documents[int(layout.offsets[rank]):int(layout.offsets[rank + 1])])
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q = torch.cat([zero, torch.cumsum(ends - starts, 0)])
    cu_kv = torch.cat([zero, torch.cumsum(ends - lo, 0)])
    return plan_segments(cu_q, cu_kv, kv_offset=lo - doc_start)


def read_starts(layout: ShardLayout, window: int | None) -> Tensor:
    """``[R]`` int64 first kv row every range reads: its document's start, or ``W - 1`` rows before the range."""
    doc_start = layout.cu_seqlens.index_select(0, layout.documents)
    return doc_start if window is None else torch.maximum(doc_start, layout.starts - window + 1)


def kv_need(
    layout: ShardLayout, parts: Partition, rank: int, window: int | None, ring_degree: int, device: torch.device
) -> KVSource:
    """The kv buffer of layers with ``window`` on ``rank``: halo routes and gather, or ring rounds; its segments."""
    lo = read_starts(layout, window)
    mine = slice(int(layout.offsets[rank]), int(layout.offsets[rank + 1]))
    span = layout.num_tokens + 1
    if ring_degree == 1:
        n_lo, n_hi, n_dst = union(lo, layout.starts, layout.ranks)
        received = _route(n_lo, n_hi, n_dst, parts, rank, layout.cp_size, device, span, self_routes=False)
        rows = _gather_index(lo[mine], layout.ends[mine], parts, received, rank)
        segments = _segments(layout, rank, lo[mine])
        offset = int(lo[mine][0] - layout.cu_seqlens[layout.documents[mine][0]]) if segments.num_queries else 0
        return KVSource(received.routes, offset, segments, (), None if rows is None else rows.to(device))
    segments = _segments(layout, rank, layout.starts[mine])
    offset = int(layout.starts[mine][0] - layout.cu_seqlens[layout.documents[mine][0]]) if segments.num_queries else 0
    return KVSource(None, offset, segments, _rounds(layout, parts, rank, lo, window, ring_degree, device, span))


def _cut(lo: Tensor, hi: Tensor, group: Tensor, cp_size: int, part: int, parts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Part ``part`` of ``parts`` of every group's sorted intervals, cut by count (rows ``floor(k * n / parts)`` on)."""
    size = hi - lo
    total = torch.zeros(cp_size, dtype=torch.int64).index_add_(0, group, size)
    before = torch.cumsum(size, 0) - size
    before = before - before.index_select(0, torch.searchsorted(group, group))  # rows of the group before the interval
    a = (total * part // parts).index_select(0, group) - before
    b = (total * (part + 1) // parts).index_select(0, group) - before
    zero = torch.zeros_like(size)
    c_lo = lo + torch.minimum(torch.maximum(a, zero), size)
    c_hi = lo + torch.minimum(torch.maximum(b, zero), size)
    return c_lo, c_hi, group


def _rank_in(index: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """How many integers of the sorted disjoint intervals ``[lo, hi)`` are below each ``index``."""
    size = hi - lo
    before = torch.cumsum(size, 0) - size
    k = (torch.searchsorted(lo, index, right=True) - 1).clamp(min=0)
    if lo.numel() == 0:
        return torch.zeros_like(index)
    inside = (index - lo.index_select(0, k)).clamp(min=0)
    return torch.where(index < lo[0], 0, before.index_select(0, k) + torch.minimum(inside, size.index_select(0, k)))


def _rounds(
    layout: ShardLayout, parts: Partition, rank: int, lo: Tensor, window: int | None, ring_degree: int,
    device: torch.device, span: int,
) -> tuple[RingRound, ...]:
    """Ring rounds: every range's rows ``[lo_i, s_i)``, deduplicated, split into ``ring_degree`` parts by count."""
    far_lo, far_hi, far_rank = union(lo, layout.starts, layout.ranks)
    starts, ends = layout.ranges_of(rank)
    mine = slice(int(layout.offsets[rank]), int(layout.offsets[rank + 1]))
    tokens = expand_ranges(starts, ends)
    seg = torch.repeat_interleave(torch.arange(starts.numel()), ends - starts, output_size=tokens.numel())
    first = lo[mine].index_select(0, seg)
    if window is not None:
        first = torch.maximum(first, tokens - window + 1)
    last = starts.index_select(0, seg)  # keys before the query's own range
    rounds = []
    for i in range(ring_degree):
        c_lo, c_hi, c_rank = _cut(far_lo, far_hi, far_rank, layout.cp_size, i, ring_degree)
        received = _route(c_lo, c_hi, c_rank, parts, rank, layout.cp_size, device, span, self_routes=True)
        cut_lo = c_lo[c_rank == rank]
        own = (c_rank == rank) & (c_hi > c_lo)
        r_lo, r_hi = c_lo[own], c_hi[own]
        order = received.position(expand_ranges(r_lo, r_hi))
        rows = None if torch.equal(order, torch.arange(order.numel())) else order.to(device)
        key_lo = _rank_in(first, r_lo, r_hi)
        key_hi = torch.maximum(key_lo, _rank_in(last, r_lo, r_hi))
        # At most one interval of keys (the contiguous layout): the window's start before clamping,
        # relative to the round's first row, gives the kernel form's left bound.
        unclamped = None
        if window is not None and cut_lo.numel() <= 1:
            first_token = int(tokens[0]) if tokens.numel() else 0
            start = int(cut_lo[0]) if cut_lo.numel() else first_token
            unclamped = (first_token if tokens.numel() else start) - window + 1 - start
        ranges = _key_ranges(key_lo, key_hi, received.routes.num_recv, window, unclamped)
        rounds.append(RingRound(received.routes, ranges, rows))
    return tuple(rounds)


def _key_ranges(lo: Tensor, hi: Tensor, num_keys: int, window: int | None, first_lo: int | None) -> KeyRanges:
    """:class:`KeyRanges`, flagged ``bottom_right`` when a varlen kernel's form says the same.

    The form: rows ``[0, num_rows)`` see keys ``j >= i + (num_keys - num_rows) - left`` up to the last
    key (``left = -1``: all). ``first_lo``: row 0's window start before clamping, when known.
    """
    seen = lo < hi
    num_rows = int(seen.sum())
    d = num_keys - num_rows
    left = -1
    if window is not None and first_lo is not None:
        left = d - first_lo
    elif window is not None and num_rows:
        left = int(num_rows - 1 + d - lo[num_rows - 1])
    expected = (torch.arange(num_rows) + d - left).clamp(min=0) if left >= 0 else torch.zeros(num_rows, dtype=torch.int64)
    form = bool((~seen[num_rows:]).all()) and bool((hi[:num_rows] == num_keys).all()) and torch.equal(lo[:num_rows], expected)
    return KeyRanges(lo, hi, num_keys, num_rows, left, bottom_right=form)


def compressed_need(
    layout: ShardLayout, parts: Partition, rank: int, ratio: int, prev_blocks: int, positions: Tensor, device: torch.device,
) -> CompressedRoutes:
    """The compressor-input halo, the owned blocks, the entry routes and the entry buffer of ``rank`` at ``ratio``.

    ``positions``: ``[L_r]`` int64 (CPU) document position of each local token.
    """
    cu, m, p = layout.cu_seqlens, ratio, prev_blocks
    doc_start = cu.index_select(0, layout.documents)
    cu_cmp = compress_cu_seqlens(cu, m).cu_seqlens.long()
    first_id = cu_cmp.index_select(0, layout.documents)
    j_lo = torch.div(layout.starts - doc_start, m, rounding_mode="floor")  # first block ending in the range
    j_hi = torch.div(layout.ends - doc_start, m, rounding_mode="floor")  # past the last one
    reach = torch.div(layout.starts - doc_start + m - 1, m, rounding_mode="floor") + p
    n_straddle = torch.where(layout.starts > doc_start, (torch.minimum(j_hi, reach) - j_lo).clamp(min=0), 0)
    # Entry ids owned per range: straddling ones first (over the halo buffer), then the others (over own rows).
    owned = torch.zeros(layout.cp_size, dtype=torch.int64)
    straddle_total = owned.index_add(0, layout.ranks, n_straddle)
    own_count = j_hi - j_lo - n_straddle
    s_off = _within_rank(n_straddle, layout)
    o_off = _within_rank(own_count, layout) + straddle_total.index_select(0, layout.ranks)
    entry_parts = Partition(
        torch.cat([first_id + j_lo, first_id + j_lo + n_straddle]), torch.cat([first_id + j_lo + n_straddle, first_id + j_hi]),
        torch.cat([layout.ranks, layout.ranks]), torch.cat([s_off, o_off]),
    )
    order = torch.argsort(entry_parts.starts * 2 + (entry_parts.ends > entry_parts.starts).long(), stable=True)
    entry_parts = Partition(*(t.index_select(0, order) for t in (entry_parts.starts, entry_parts.ends, entry_parts.ranks, entry_parts.rows)))
    span = int(cu_cmp[-1]) + layout.num_tokens + 1
    # Compressor-input halo: the rows before each range that its straddling blocks read.
    read_lo = doc_start + (j_lo - j_lo.clamp(max=p)) * m
    read_hi = doc_start + (j_lo + n_straddle) * m
    has = n_straddle > 0
    h_lo, h_hi, h_dst = union(read_lo[has], layout.starts[has], layout.ranks[has])
    hidden = _route(h_lo, h_hi, h_dst, parts, rank, layout.cp_size, device, span, self_routes=False)
    # Entries: every document a rank has queries in, up to the last entry its queries see.
    e_lo, e_hi, e_dst = union(first_id, first_id + j_hi, layout.ranks)
    entries = _route(e_lo, e_hi, e_dst, entry_parts, rank, layout.cp_size, device, span, self_routes=False)
    mine = slice(int(layout.offsets[rank]), int(layout.offsets[rank + 1]))
    return _compressed_routes(layout, parts, entry_parts, rank, mine, m, hidden, entries, cu_cmp,
                              (read_lo, read_hi, j_lo, n_straddle, j_hi), positions, device)


def _within_rank(counts: Tensor, layout: ShardLayout) -> Tensor:
    """Exclusive running sum of ``counts`` ``[R]`` within each rank's ranges."""
    before = torch.cumsum(counts, 0) - counts
    if counts.numel() == 0:
        return before
    return before - before.index_select(0, layout.offsets[:-1].clamp(max=counts.numel() - 1)).index_select(0, layout.ranks)


def _compressed_routes(
    layout: ShardLayout, parts: Partition, entry_parts: Partition, rank: int, mine: slice, m: int, hidden: _Received,
    entries: _Received, cu_cmp: Tensor, blocks: tuple[Tensor, Tensor, Tensor, Tensor, Tensor], positions: Tensor,
    device: torch.device,
) -> CompressedRoutes:
    """Assemble one rank's :class:`CompressedRoutes` from the global routing of one ratio."""
    read_lo, read_hi, j_lo, n_straddle, j_hi = (t[mine] for t in blocks)
    starts, ends = layout.starts[mine], layout.ends[mine]
    doc_start = layout.cu_seqlens.index_select(0, layout.documents[mine])
    local = _within_rank(layout.ends - layout.starts, layout)[mine]
    # Straddling blocks: buffer = per range with any, rows [read_lo, read_hi) (halo rows first, then own ones).
    has = n_straddle > 0
    buffer = expand_ranges(read_lo[has], read_hi[has])
    owner, own_row = parts.locate(buffer)
    own = owner == rank
    picks = own_row[own]
    slot = torch.full_like(buffer, -1)
    slot[own] = hidden.routes.num_recv + torch.arange(int(own.sum()))
    if bool((~own).any()):
        slot[~own] = hidden.position(buffer[~own])
    identity = torch.equal(slot, torch.arange(slot.numel()))
    straddle_own = None if identity and torch.equal(picks, torch.arange(picks.numel())) else picks.to(device)
    straddle_order = None if identity else slot.to(device)
    span_off = torch.cumsum(read_hi[has] - read_lo[has], 0) - (read_hi[has] - read_lo[has])
    sj = expand_ranges(j_lo[has], j_lo[has] + n_straddle[has])
    sseg = torch.repeat_interleave(torch.arange(int(has.sum())), n_straddle[has], output_size=sj.numel())
    s_starts = span_off.index_select(0, sseg) + doc_start[has].index_select(0, sseg) + sj * m - read_lo[has].index_select(0, sseg)
    oj = expand_ranges(j_lo + n_straddle, j_hi)
    oseg = torch.repeat_interleave(torch.arange(starts.numel()), j_hi - j_lo - n_straddle, output_size=oj.numel())
    o_starts = local.index_select(0, oseg) + doc_start.index_select(0, oseg) + oj * m - starts.index_select(0, oseg)

    def plan(block_starts: Tensor, j: Tensor) -> CompressedPlan:
        return CompressedPlan(ratio=m, block_starts=block_starts.to(device), entry_positions=(j * m).to(device),
                              num_entries=int(j.numel()))

    # The entry buffer: per document, its entries up to the last one its queries see, from [received ; owned].
    docs, doc_of_range = torch.unique_consecutive(layout.documents[mine], return_inverse=True)
    per_doc = torch.zeros(docs.numel(), dtype=torch.int64).scatter_reduce_(0, doc_of_range, j_hi, "amax", include_self=False)
    first = cu_cmp.index_select(0, docs)
    entry_rows = _gather_index(first, first + per_doc, entry_parts, entries, rank)
    visible = _visibility(layout, rank, m, per_doc, doc_of_range, positions, device)
    return CompressedRoutes(
        hidden=hidden.routes, straddle=plan(s_starts, sj), straddle_rows=int(picks.numel()), own=plan(o_starts, oj),
        entries=entries.routes, straddle_own=straddle_own, straddle_order=straddle_order,
        entry_rows=None if entry_rows is None else entry_rows.to(device), visible=visible,
    )


def _visibility(
    layout: ShardLayout, rank: int, m: int, per_doc: Tensor, doc_of_range: Tensor, positions: Tensor, device: torch.device
) -> EntryVisibility:
    """Entries each local query (document ``positions``) sees in the rank's entry buffer (its documents' entries, in order)."""
    starts, ends = layout.ranges_of(rank)
    first = torch.cumsum(per_doc, 0) - per_doc
    count = torch.div(positions + 1, m, rounding_mode="floor")
    visible_start = torch.repeat_interleave(first.index_select(0, doc_of_range), ends - starts, output_size=positions.numel())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(per_doc, 0)])
    return EntryVisibility(
        ratio=m, cu_seqlens=cu.to(device=device, dtype=torch.int32), visible_start=visible_start.to(device),
        visible_count=count.to(device), num_entries=int(per_doc.sum()), max_visible=int(count.max()) if count.numel() else 0,
    )
