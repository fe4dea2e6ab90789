"""Routes of the need-based exchange (contiguous TND): which rows move between which ranks.

With contiguous sharding rank ``r`` holds packed tokens ``[a_r, b_r)``. Only its first
document can start on an earlier rank, so everything ``r`` needs from the others is one
contiguous range just before ``a_r`` (docs/semantics.md, "Exchanges"):

* dense causal layers: the kv of ``[kv_start, a_r)`` (the first document's earlier part);
* window layers: only the halo ``[max(kv_start, a_r - W + 1), a_r)``;
* compressed layers: the halo of *compressor inputs* that the rank's own blocks read (each
  entry reads its block and the ``prev_blocks`` blocks before it, as its compressor declares), and
  the compressed entries of the first document owned by earlier ranks. An entry is owned,
  i.e. computed exactly once, by the rank holding the last token of its block.

Every rank derives every route from the global ``cu_seqlens`` without communication.
:mod:`cpkv.exchange` moves the rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cpkv.plan.conventions import compress_cu_seqlens
from cpkv.plan.segments import CompressedPlan


@dataclass(frozen=True, eq=False)
class Routes:
    """Which local rows go to which rank, and how many rows come from which rank.

    Attributes:
        send_rows: ``[n_send]`` int64 local rows to send, grouped by destination rank.
        send_splits: rows sent to each rank (``cp`` entries).
        recv_splits: rows received from each rank (``cp`` entries); received rows are
            concatenated in source-rank order, which is natural packed order.
        any_traffic: whether any rank sends anything (identical on every rank).
    """

    send_rows: Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    any_traffic: bool

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

    The rank owns the blocks whose last token it holds. The few that also read rows before
    ``a_r`` (the block straddling the boundary and, with ``prev_blocks``, the next ones) are
    compressed from a small buffer ``[halo ; own tokens[:straddle_rows]]``; all the others from
    the rank's own tokens directly, without a copy.

    Attributes:
        hidden: routes of the compressor-input halo (tokens before ``a_r`` that the rank's
            straddling blocks read).
        straddle: the straddling blocks, over ``[halo ; own tokens[:straddle_rows]]``.
        straddle_rows: own tokens the straddling blocks read.
        own: the other owned blocks, over the rank's own tokens (rows relative to ``a_r``).
        entries: routes of compressed entries (global entry ids, owned = ``[straddle ; own]``)
            to the ranks that see them; the prefix's entries are ``[received ; straddle ; own]``.
    """

    hidden: Routes
    straddle: CompressedPlan
    straddle_rows: int
    own: CompressedPlan
    entries: Routes

    @property
    def num_owned(self) -> int:
        """Entries this rank computes."""
        return self.straddle.num_entries + self.own.num_entries


def rank_bounds(local_len: int, cp_size: int) -> Tensor:
    """``[cp, 2]`` int64 token range ``[a_r, b_r)`` of every rank (contiguous TND)."""
    bounds = torch.arange(cp_size + 1, dtype=torch.int64) * local_len
    return torch.stack([bounds[:-1], bounds[1:]], 1)


def first_document_start(cu: Tensor, owned: Tensor) -> Tensor:
    """``[cp]`` first token of the first document overlapping each rank (``a_r`` if it starts there)."""
    first_doc = torch.searchsorted(cu[1:], owned[:, 0].contiguous(), right=True).clamp(max=max(cu.numel() - 2, 0))
    return torch.minimum(cu[first_doc], owned[:, 0]) if cu.numel() > 1 else owned[:, 0].clone()


def kv_routes(cu: Tensor, owned: Tensor, rank: int, window: int | None, device: torch.device) -> tuple[Routes, Tensor]:
    """Routes of the kv rows before ``a_r`` a layer with ``window`` needs, and every rank's needed start."""
    lo = first_document_start(cu, owned)
    if window is not None:
        lo = torch.maximum(lo, owned[:, 0] - window + 1)
    return plan_routes(torch.stack([lo, owned[:, 0]], 1), owned, rank, device=device), lo


def _entries_before(cu: Tensor, bounds: Tensor, ratio: int) -> Tensor:
    """Per bound ``x``: number of compressed entries (all documents) whose block ends before ``x``."""
    starts, ends = cu[:-1], cu[1:]
    span = (torch.minimum(ends[None, :], bounds[:, None]) - starts[None, :]).clamp(min=0)
    return torch.div(span, ratio, rounding_mode="floor").sum(1)


def _halo_start(cu: Tensor, owned: Tensor, ratio: int, prev_blocks: int) -> Tensor:
    """``[cp]`` first compressor-input token each rank's own blocks read (and ``prev_blocks`` earlier blocks each)."""
    a, b = owned[:, 0], owned[:, 1]
    doc = torch.searchsorted(cu[1:], a.contiguous(), right=True).clamp(max=cu.numel() - 2)
    start, end = cu[doc], cu[doc + 1]
    j0 = torch.div((a - start).clamp(min=0), ratio, rounding_mode="floor")  # first block ending at or after a
    block_done = start + (j0 + 1) * ratio <= torch.minimum(end, b)
    lo = torch.minimum(a, start + (j0 - j0.clamp(max=prev_blocks)) * ratio)
    return torch.where((start < a) & block_done, lo, a)


def compressed_routes(
    cu: Tensor, owned: Tensor, rank: int, ratio: int, prev_blocks: int, device: torch.device
) -> CompressedRoutes:
    """The compressor-input halo, owned blocks and entry routes of ``rank`` at ``ratio``.

    Each entry's compressor reads its own block and the ``prev_blocks`` blocks before it in
    the same document; the halo holds every such row before the rank's first token.
    """
    owned_ids = _entries_before(cu, torch.cat([owned[:, 0], owned[-1:, 1]]), ratio)
    entry_owned = torch.stack([owned_ids[:-1], owned_ids[1:]], 1)
    cu_cmp = compress_cu_seqlens(cu, ratio).cu_seqlens.long()
    first_doc = torch.searchsorted(cu[1:], owned[:, 0].contiguous(), right=True).clamp(max=cu.numel() - 2)
    needed = torch.stack([torch.minimum(cu_cmp[first_doc], entry_owned[:, 0]), entry_owned[:, 0]], 1)
    entries = plan_routes(needed, entry_owned, rank, device=device)
    ids = torch.arange(int(entry_owned[rank, 0]), int(entry_owned[rank, 1]))
    doc = torch.searchsorted(cu_cmp[1:], ids, right=True)
    j = ids - cu_cmp[doc]
    halo = _halo_start(cu, owned, ratio, prev_blocks)
    hidden = plan_routes(torch.stack([halo, owned[:, 0]], 1), owned, rank, device=device)
    a_r, halo_lo = int(owned[rank, 0]), int(halo[rank])
    starts = cu[:-1][doc] + j * ratio
    first_read = starts - j.clamp(max=prev_blocks) * ratio
    num_straddle = int((first_read < a_r).sum())  # a prefix: blocks are in order
    straddle_rows = int(starts[num_straddle - 1]) + ratio - a_r if num_straddle else 0

    def blocks(part: slice, base: int) -> CompressedPlan:
        return CompressedPlan(
            ratio=ratio, block_starts=(starts[part] - base).to(device), entry_positions=(j[part] * ratio).to(device),
            num_entries=int(starts[part].numel()),
        )

    return CompressedRoutes(
        hidden=hidden, straddle=blocks(slice(0, num_straddle), halo_lo), straddle_rows=straddle_rows,
        own=blocks(slice(num_straddle, None), a_r), entries=entries,
    )
