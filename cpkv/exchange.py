"""Need-based prefix exchange: move only the rows each rank needs (contiguous TND).

With contiguous sharding rank ``r`` holds packed tokens ``[a_r, b_r)``. Only its first
document can start on an earlier rank, so everything ``r`` needs from the others is
one contiguous range just before ``a_r``:

* dense causal layers: the kv of ``[kv_start, a_r)`` (the first document's earlier part);
* window layers: only the halo ``[max(kv_start, a_r - W + 1), a_r)``;
* compressed layers: the halo of *compressor inputs* that the rank's first own block
  needs (up to ``m - 1`` tokens, ``2m - 1`` with the ratio-4 overlap), and the compressed
  entries of the first document owned by earlier ranks. An entry is owned, i.e. computed
  exactly once, by the rank holding the last token of its block.

Every rank derives every route from the global ``cu_seqlens`` without communication
(:func:`plan_need_exchange`); :func:`exchange_rows` then moves the rows with one
``all_to_all_single`` (uneven splits), and its backward sends the gradients back along
the same routes (summed at the owner). When no rank sends anything the collective is
skipped on every rank alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv._checks import check_int
from cpkv.attention_plan import CompressedPlan, SegmentPlan, plan_segments
from cpkv.comm import BackwardOrder, Group
from cpkv.layout import compress_cu_seqlens, validate_cu_seqlens
from cpkv.plan import compute_prefix_kv_cu_seqlens
from cpkv.sharding import contiguous_shard_range


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


def plan_routes(needed: Tensor, owned: Tensor, rank: int, *, device: torch.device | None = None) -> Routes:
    """Routes from every rank's needed range and every rank's owned range of one index space.

    Args:
        needed: ``[cp, 2]`` int64 ``[lo, hi)`` each rank needs from the others.
        owned: ``[cp, 2]`` int64 ``[lo, hi)`` each rank holds (ascending, disjoint).
        rank: this rank.

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


class _ExchangeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, token: Tensor, routes: Routes, group: Group) -> tuple[Tensor, Tensor]:
        ctx.routes, ctx.group, ctx.rows = routes, group, x.shape[0]
        rows = routes.send_rows.to(x.device)  # no-op when planned on x's device
        received = _all_to_all(x.index_select(0, rows), routes.send_splits, routes.recv_splits, group)
        return received, token.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor, Tensor, None, None]:
        routes: Routes = ctx.routes
        back = _all_to_all(grad, routes.recv_splits, routes.send_splits, ctx.group)
        grad_x = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return grad_x.index_add_(0, routes.send_rows.to(grad.device), back), grad_token, None, None


def _all_to_all(x: Tensor, send_splits: tuple[int, ...], recv_splits: tuple[int, ...], group: Group) -> Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), list(recv_splits), list(send_splits), group=group)
    return out


def exchange_rows(x: Tensor, routes: Routes, group: Group, *, order: BackwardOrder | None = None) -> Tensor:
    """Send rows of ``x`` along ``routes``; return the received rows (differentiable).

    Args:
        x: ``[n, ...]`` this rank's rows (tokens or compressed entries).
        routes: from :class:`NeedPlan`; identical structure on every rank.
        group: the CP group.
        order: chain this exchange's backward into a :class:`~cpkv.comm.BackwardOrder`.

    Returns:
        ``[routes.num_recv, ...]`` received rows in natural order. Backward: the gradient
        goes back along the same routes and is summed into ``x``'s rows.
    """
    if not routes.any_traffic:  # decided from the global plan: every rank skips alike
        return x.new_zeros((0, *x.shape[1:]))
    token = order.token if order is not None else x.new_zeros(())
    received, token = _ExchangeRows.apply(x, token, routes, group)  # type: ignore[no-untyped-call]
    if order is not None:
        order.token = token
    result: Tensor = received
    return result


class PendingRows:
    """An exchange started with :func:`start_exchange`; :meth:`wait` returns the rows."""

    def __init__(self, x: Tensor, routes: Routes, group: Group) -> None:
        self.x, self.routes, self.group = x, routes, group
        self.buffer = x.new_empty((routes.num_recv, *x.shape[1:]))
        self.work: Any = None
        self.send: Tensor | None = None
        if routes.any_traffic:
            # Keep the send buffer alive until wait(): the async collective reads it later.
            self.send = x.detach().index_select(0, routes.send_rows.to(x.device)).contiguous()
            self.work = dist.all_to_all_single(
                self.buffer, self.send, list(routes.recv_splits), list(routes.send_splits), group=group, async_op=True,
            )

    def wait(self, *, order: BackwardOrder | None = None) -> Tensor:
        """The received rows ``[num_recv, ...]``; differentiable like :func:`exchange_rows`."""
        if self.work is None:
            return self.buffer
        self.work.wait()
        self.send = None
        token = order.token if order is not None else self.x.new_zeros(())
        received, token = _ReceivedRows.apply(self.x, token, self.buffer, self.routes, self.group)  # type: ignore[no-untyped-call]
        if order is not None:
            order.token = token
        result: Tensor = received
        return result


class _ReceivedRows(torch.autograd.Function):
    """Identity on rows already received; backward sends their gradient back (as _ExchangeRows)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, token: Tensor, buffer: Tensor, routes: Routes, group: Group) -> tuple[Tensor, Tensor]:
        ctx.routes, ctx.group, ctx.rows = routes, group, x.shape[0]
        return buffer.view_as(buffer), token.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        grad_x, grad_token, _, _ = _ExchangeRows.backward(ctx, grad, grad_token)
        return grad_x, grad_token, None, None, None


def start_exchange(x: Tensor, routes: Routes, group: Group) -> PendingRows:
    """Start :func:`exchange_rows` asynchronously (to overlap it with computation)."""
    return PendingRows(x, routes, group)


@dataclass(frozen=True, eq=False)
class CompressedExchange:
    """Need-based plan of one compress ratio.

    Attributes:
        hidden: routes of the compressor-input halo (tokens before ``a_r`` the rank's own
            blocks need).
        hidden_lo: first global token of the local compressor-input buffer ``[hidden_lo, b_r)``.
        owned: the entries this rank computes, as a :class:`CompressedPlan` over that buffer.
        entries: routes of compressed entries (global entry ids) to the ranks that see them.
    """

    hidden: Routes
    hidden_lo: int
    owned: CompressedPlan
    entries: Routes


@dataclass(frozen=True, eq=False)
class RingPart:
    """One round of a ring exchange: which rows move, and which global tokens this rank gets.

    Attributes:
        routes: the rows to exchange in this round.
        start, stop: the global token range ``[start, stop)`` this rank receives (may be empty).
    """

    routes: Routes
    start: int
    stop: int


@dataclass(frozen=True, eq=False)
class NeedPlan:
    """Routes of the need-based exchange for one rank (see the module docstring).

    Attributes:
        kv: routes of the kv rows before ``a_r``, per window (``None``: dense causal).
        kv_offset: rows of the full prefix buffer that are not exchanged, per window: the
            exchanged buffer starts at prefix row ``kv_offset``.
        window_segments: per window, the segments over the truncated buffer (kv segment
            lengths shortened by ``kv_offset`` at the front) for varlen kernels.
        compressed: one :class:`CompressedExchange` per compress ratio.
        kv_rounds: per window, the ``ring_degree`` rounds that split the exchanged kv rows
            (empty without a ring); the rounds partition ``[a_r - num_recv, a_r)`` in order.
        local_segments: the segments over the rank's own kv rows only (the first document
            cut at ``a_r``), for the local part of a ring.
        local_offset: prefix rows before the rank's own rows (``a_r - kv_start``).
    """

    kv: Mapping[int | None, Routes]
    kv_offset: Mapping[int | None, int]
    window_segments: Mapping[int | None, SegmentPlan]
    compressed: Mapping[int, CompressedExchange]
    kv_rounds: Mapping[int | None, tuple[RingPart, ...]]
    local_segments: SegmentPlan
    local_offset: int


def _entries_before(cu: Tensor, bounds: Tensor, ratio: int) -> Tensor:
    """Per bound ``x``: number of compressed entries (all documents) whose block ends before ``x``."""
    starts, ends = cu[:-1], cu[1:]
    span = (torch.minimum(ends[None, :], bounds[:, None]) - starts[None, :]).clamp(min=0)
    return torch.div(span, ratio, rounding_mode="floor").sum(1)


def _compressed_exchange(cu: Tensor, local_len: int, cp_size: int, rank: int, ratio: int, device: torch.device) -> CompressedExchange:
    ranks = torch.arange(cp_size + 1, dtype=torch.int64)
    bounds = ranks * local_len
    owned_ids = _entries_before(cu, bounds, ratio)  # entry ids owned by rank r: [owned_ids[r], owned_ids[r+1])
    owned = torch.stack([owned_ids[:-1], owned_ids[1:]], 1)
    cu_cmp = compress_cu_seqlens(cu, ratio).cu_seqlens.long()
    starts = cu[:-1]
    first_doc = (torch.searchsorted(cu[1:], bounds[:-1], right=True)).clamp(max=starts.numel() - 1)
    first_entry = cu_cmp[first_doc]
    needed = torch.stack([torch.minimum(first_entry, owned[:, 0]), owned[:, 0]], 1)
    entries = plan_routes(needed, owned, rank, device=device)
    # The entries this rank computes, and the compressor-input halo they need.
    ids = torch.arange(int(owned[rank, 0]), int(owned[rank, 1]))
    doc = torch.searchsorted(cu_cmp[1:], ids, right=True)
    j = ids - cu_cmp[doc]
    block_start = starts[doc] + j * ratio
    halo_lo = torch.tensor([_halo_lo(cu, local_len, cp_size, r, ratio) for r in range(cp_size)])
    hidden_lo = int(halo_lo[rank])
    tokens_owned = torch.stack([bounds[:-1], bounds[1:]], 1)
    hidden = plan_routes(torch.stack([halo_lo, bounds[:-1]], 1), tokens_owned, rank, device=device)
    plan = CompressedPlan(
        ratio=ratio, cu_seqlens=cu_cmp.new_zeros(1), block_starts=(block_start - hidden_lo).to(device),
        entry_positions=(j * ratio).to(device), visible_start=torch.zeros(0, dtype=torch.int64, device=device),
        visible_count=torch.zeros(0, dtype=torch.int64, device=device), num_entries=int(ids.numel()), max_visible=0,
    )
    return CompressedExchange(hidden=hidden, hidden_lo=hidden_lo, owned=plan, entries=entries)


def _halo_lo(cu: Tensor, local_len: int, cp_size: int, rank: int, ratio: int) -> int:
    """First compressor-input token rank ``rank`` needs (its own blocks, with the overlap's previous block)."""
    a_r, b_r = rank * local_len, (rank + 1) * local_len
    doc = int(torch.searchsorted(cu[1:], torch.tensor(a_r), right=True).clamp(max=cu.numel() - 2))
    start, end = int(cu[doc]), int(cu[doc + 1])
    if start >= a_r:
        return a_r
    j0 = (a_r - start) // ratio  # first block ending at or after a_r
    if start + (j0 + 1) * ratio > min(end, b_r):
        return a_r  # that block does not end inside this rank: nothing to compute here
    prev = 1 if ratio == 4 and j0 > 0 else 0
    return min(a_r, start + (j0 - prev) * ratio)


def _ring_parts(lo: Tensor, owned: Tensor, rank: int, ring_degree: int, device: torch.device) -> tuple[RingPart, ...]:
    """Split every rank's needed range ``[lo, a)`` into ``ring_degree`` consecutive parts."""
    a = owned[:, 0]
    cuts = [lo + (a - lo) * i // ring_degree for i in range(ring_degree + 1)]
    parts = []
    for i in range(ring_degree):
        needed = torch.stack([cuts[i], cuts[i + 1]], 1)
        routes = plan_routes(needed, owned, rank, device=device)
        parts.append(RingPart(routes, int(cuts[i][rank]), int(cuts[i + 1][rank])))
    return tuple(parts)


def plan_need_exchange(
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, windows: Sequence[int | None] = (None,),
    compress_ratios: Sequence[int] = (), ring_degree: int = 1,
) -> NeedPlan:
    """Pure need-based exchange plan of one rank (no communication).

    Args:
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens, ``T % cp_size == 0``.
        cp_size, cp_rank: the CP group size and this rank.
        windows: the sliding windows of the layers (``None``: dense causal).
        compress_ratios: the compress ratios ``> 1`` of the layers (ratio 4 uses the
            overlapping compressor, as in DeepSeek-V4).
        ring_degree: ``R > 1`` also plans ``R`` rounds that split each window's kv exchange
            (:mod:`cpkv.ring`).

    Raises:
        ValueError: invalid cu_seqlens, ``T % cp_size != 0``, rank out of range, window < 1.
    """
    validate_cu_seqlens(cu_seqlens)
    device = cu_seqlens.device
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    a_r, local_len = contiguous_shard_range(int(cu[-1]), cp_size, cp_rank)
    bounds = torch.arange(cp_size + 1, dtype=torch.int64) * local_len
    owned = torch.stack([bounds[:-1], bounds[1:]], 1)
    first_doc = torch.searchsorted(cu[1:], bounds[:-1], right=True).clamp(max=max(cu.numel() - 2, 0))
    kv_start = torch.minimum(cu[first_doc], bounds[:-1]) if cu.numel() > 1 else bounds[:-1]
    check_int("ring_degree", ring_degree, minimum=1)
    kv, offsets, segments, rounds = {}, {}, {}, {}
    prefix = compute_prefix_kv_cu_seqlens(cu, a_r, local_len)
    for window in dict.fromkeys(windows):
        lo = kv_start if window is None else torch.maximum(kv_start, bounds[:-1] - check_int("window", window, minimum=1) + 1)
        kv[window] = plan_routes(torch.stack([lo, bounds[:-1]], 1), owned, cp_rank, device=device)
        rounds[window] = _ring_parts(lo, owned, cp_rank, ring_degree, device) if ring_degree > 1 else ()
        offsets[window] = int(lo[cp_rank]) - prefix.kv_start
        cu_kv = prefix.cu_seqlens_kv.long() - offsets[window]
        cu_kv[0] = 0
        segments[window] = plan_segments(prefix.cu_seqlens_q.to(device), cu_kv.to(device))
    compressed = {r: _compressed_exchange(cu, local_len, cp_size, cp_rank, r, device) for r in dict.fromkeys(compress_ratios)}
    local_offset = a_r - prefix.kv_start
    cu_kv_local = prefix.cu_seqlens_kv.long() - local_offset
    cu_kv_local[0] = 0
    local_segments = plan_segments(prefix.cu_seqlens_q.to(device), cu_kv_local.to(device))
    return NeedPlan(
        MappingProxyType(kv), MappingProxyType(offsets), MappingProxyType(segments), MappingProxyType(compressed),
        MappingProxyType(rounds), local_segments, local_offset,
    )
