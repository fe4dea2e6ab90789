"""Routes of the need-based exchange and the plan data built from them (any layout).

A :class:`Routes` says which local rows a rank sends to which rank and how many it receives
from which; :class:`KVSource`, :class:`RingRound` and :class:`CompressedRoutes` say how a
rank's kv buffer, ring rounds and compressed entries are assembled from what it holds and
what it receives. :mod:`cpkv.plan.need` plans them for any layout from the global
``cu_seqlens`` without communication; :mod:`cpkv.exchange` moves the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cpkv.plan.segments import CompressedPlan, EntryVisibility, KeyRanges, SegmentPlan


@dataclass(frozen=True, eq=False)
class Routes:
    """Which local rows go to which rank, and how many rows come from which rank.

    Attributes:
        send_rows: ``[n_send]`` int64 local rows to send, grouped by destination rank.
        send_splits: rows sent to each rank (``cp`` entries).
        recv_splits: rows received from each rank (``cp`` entries); received rows are
            concatenated in source-rank order, which is natural packed order.
        any_traffic: whether any rank sends anything (identical on every rank).
        host_splits: ``[2, cp]`` int64 on the host: ``send_splits`` and ``recv_splits`` as a
            tensor (made from them when not given). A compiled layer passes them so, with
            ``recv_shape``, and its graph does not specialise on the packing's counts.
        recv_shape: ``[num_recv, 0]`` (no storage): the received row count as a tensor size
            (made when not given), dynamic under ``torch.compile``
            (:func:`cpkv.plan.attention.mark_sizes_dynamic`).
    """

    send_rows: Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    any_traffic: bool
    host_splits: Tensor | None = None
    recv_shape: Tensor | None = None

    host_fields = ("host_splits",)  # stay on the host when the plan moves to a device (AttentionPlan.to)

    def __post_init__(self) -> None:
        if self.host_splits is None:
            splits = torch.tensor([list(self.send_splits), list(self.recv_splits)], dtype=torch.int64)
            object.__setattr__(self, "host_splits", splits.reshape(2, len(self.send_splits)))
        if self.recv_shape is None:
            object.__setattr__(self, "recv_shape", torch.empty((self.num_recv, 0), device=self.send_rows.device))

    @property
    def num_recv(self) -> int:
        """Rows this rank receives."""
        return sum(self.recv_splits)

    @property
    def num_send(self) -> int:
        """Rows this rank sends."""
        return sum(self.send_splits)


def plan_routes(needed: Tensor, owned: Tensor, rank: int, *, device: torch.device | None = None) -> Routes:
    """Routes from every rank's needed range and every rank's owned range of one index space.

    Args:
        needed: ``[cp, 2]`` int64 ``[lo, hi)`` each rank needs from the others.
        owned: ``[cp, 2]`` int64 ``[lo, hi)`` each rank holds (ascending, disjoint).
        rank: this rank.
        device: where ``send_rows`` lives (the data's device).

    Returns:
        :class:`Routes`; local rows are relative to ``owned[rank, 0]``.
    """
    lo = torch.maximum(needed[:, None, 0], owned[None, :, 0])  # [dst, src]
    hi = torch.minimum(needed[:, None, 1], owned[None, :, 1])
    counts = (hi - lo).clamp(min=0)
    send = counts[:, rank]
    rows = [torch.arange(int(lo[d, rank]), int(lo[d, rank]) + int(send[d])) for d in range(counts.shape[0])]
    send_rows = (torch.cat(rows) - int(owned[rank, 0])) if rows else torch.zeros(0, dtype=torch.int64)
    return Routes(
        send_rows=send_rows.to(device) if device is not None else send_rows,
        send_splits=tuple(int(v) for v in send.tolist()),
        recv_splits=tuple(int(v) for v in counts[rank].tolist()),
        any_traffic=bool(counts.sum() > 0),
    )


@dataclass(frozen=True, eq=False)
class CompressedRoutes:
    """Need-based plan of one compress ratio for one rank.

    The rank owns the blocks whose last token it holds. The few that also read rows outside the
    range holding their last token (a block straddling the range's start and, with
    ``prev_blocks``, the next ones) are compressed from a small buffer built from the received
    halo and own rows; all the others from the rank's own rows directly, without a copy.

    Attributes:
        hidden: routes of the compressor-input halo (rows the rank's straddling blocks read and
            it does not hold).
        straddle: the straddling blocks, over their buffer (see ``straddle_order``).
        straddle_rows: own rows the straddling blocks read.
        own: the other owned blocks, over the rank's own rows (local rows).
        entries: routes of compressed entries (global entry ids; owned = ``[straddle ; own]``) to
            the ranks that see them.
        straddle_own: ``[straddle_rows]`` int64 local rows of those own rows, or ``None``: the
            first ``straddle_rows`` (contiguous layout).
        straddle_order: ``[n]`` int64 rows of ``[halo ; own rows read]`` forming the straddle
            buffer, or ``None``: that concatenation is the buffer.
        entry_rows: ``[N_c]`` int64 rows of ``[received ; owned]`` forming the entry buffer (per
            document of the rank, its entries in order), or ``None``: that concatenation is it.
        visible: which entries of the entry buffer each local query sees.
        straddle_own_index, straddle_index, entry_index: ``straddle_own``, ``straddle_order`` and
            ``entry_rows``, each a tensor also where that is ``None`` (the identity rows; made
            when not given): what a compiled layer reads, so that its graph does not depend
            on whether a packing needs a reorder.
    """

    hidden: Routes
    straddle: CompressedPlan
    straddle_rows: int
    own: CompressedPlan
    entries: Routes
    straddle_own: Tensor | None = None
    straddle_order: Tensor | None = None
    entry_rows: Tensor | None = None
    visible: EntryVisibility | None = None
    straddle_own_index: Tensor | None = None
    straddle_index: Tensor | None = None
    entry_index: Tensor | None = None

    def __post_init__(self) -> None:
        device = self.straddle.block_starts.device
        for name, given, size in (
            ("straddle_own_index", self.straddle_own, self.straddle_rows),
            ("straddle_index", self.straddle_order, self.hidden.num_recv + self.straddle_rows),
            ("entry_index", self.entry_rows, self.entries.num_recv + self.num_owned),
        ):
            if getattr(self, name) is None:
                object.__setattr__(self, name, given if given is not None else torch.arange(size, device=device))

    @property
    def num_owned(self) -> int:
        """Entries this rank computes."""
        return self.straddle.num_entries + self.own.num_entries


@dataclass(frozen=True, eq=False)
class RingRound:
    """One round of the ring exchange: the rows that move and what each query sees of them.

    Attributes:
        routes: the rows of this round (a rank's own rows travel to itself when another of its
            ranges reads them).
        ranges: per query, the visible keys among the round's rows in index order.
        rows: ``[n]`` int64 rows of the received buffer in index order, or ``None``: already so.
        index: ``rows``, or the identity rows where that is ``None`` (made when not given; what a
            compiled layer reads).
    """

    routes: Routes
    ranges: KeyRanges
    rows: Tensor | None = None
    index: Tensor | None = None

    def __post_init__(self) -> None:
        if self.index is None:
            identity = torch.arange(self.routes.num_recv, device=self.routes.send_rows.device)
            object.__setattr__(self, "index", self.rows if self.rows is not None else identity)


@dataclass(frozen=True, eq=False)
class KVSource:
    """How this rank's kv buffer for one layer kind (window) is built, and the segments over it.

    Attributes:
        halo: need exchange: the kv rows received from other ranks (``None``: the buffer comes
            from the all-gather, or, with ring rounds, is the rank's own rows only).
        offset: rows of the first document missing at the buffer's front.
        segments: the segments over the buffer, for varlen kernels (positions and window rows
            account for the rows each segment lacks at its front).
        rounds: ring rounds carrying the remote rows (``ring_degree > 1``), else empty.
        rows: need exchange: ``[n]`` int64 rows of ``[received ; own]`` forming the buffer, or
            ``None``: that concatenation is the buffer (the contiguous layout).
        index: need exchange: ``rows``, or the identity rows where that is ``None`` (made when not
            given; what a compiled layer reads); ``None`` without a halo.
    """

    halo: Routes | None
    offset: int
    segments: SegmentPlan
    rounds: tuple[RingRound, ...]
    rows: Tensor | None = None
    index: Tensor | None = None

    def __post_init__(self) -> None:
        if self.index is None and self.halo is not None:
            size = self.halo.num_recv + self.segments.num_queries  # [received ; own]: every own row
            identity = torch.arange(size, device=self.segments.q_positions.device)
            object.__setattr__(self, "index", self.rows if self.rows is not None else identity)
