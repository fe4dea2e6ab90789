"""Per-query index plans of prefix attention (docs/semantics.md, "Segments" and "Compression").

A :class:`SegmentPlan` describes queries paired with causal kv prefixes
(``cu_seqlens_q`` / ``cu_seqlens_kv``, every kv segment starting at its document's
first token, queries bottom-right aligned). From it follow, per query, its position in
its document, the kv row of its own token and of its document's first token, and,
per compress ratio, the blocks a compressor pools (:class:`CompressedPlan`) and which
entries each query may see (:class:`EntryVisibility`). Layers only do cheap vectorised
arithmetic on these tensors; nothing here is recomputed per layer, and nothing is cached
behind the caller's back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cpkv.checks import check_int
from cpkv.plan.conventions import compress_cu_seqlens, validate_cu_seqlens


@dataclass(frozen=True, eq=False)
class CompressedPlan:
    """What a compressor computes: the blocks it pools, over *its own input buffer*.

    Every field is valid under every exchange strategy: with ``"allgather"`` the input
    buffer is the rank's kv prefix, with ``"need"`` it is the compressor-input halo followed
    by the rank's own tokens, and the plan lists only the blocks this rank owns.

    Attributes:
        ratio: compress ratio ``m``.
        block_starts: ``[N_c]`` int64 row of the input buffer holding the first token of each
            entry's block; block ``j`` covers rows ``block_starts[j] .. block_starts[j] + m - 1``.
            With the ratio-4 overlap, entry ``j > 0`` also reads the ``m`` rows before (they
            are in the buffer; entry ``j = 0`` of a document has no previous block).
        entry_positions: ``[N_c]`` int64 document position of each entry's block, ``j * m``
            (RoPE; 0 marks a document's first entry).
        num_entries: ``N_c``.
    """

    ratio: int
    block_starts: Tensor
    entry_positions: Tensor
    num_entries: int


@dataclass(frozen=True, eq=False)
class EntryVisibility:
    """Which compressed entries each query may see (causality ``j < floor((t + 1) / m)``).

    Attributes:
        ratio: compress ratio ``m``.
        cu_seqlens: ``[B + 1]`` leading-zero compressed cu_seqlens of the prefix segments,
            from the **kv** lengths.
        visible_start: ``[T_q]`` int64 row (in the prefix's entry buffer) of the query's
            document's first entry.
        visible_count: ``[T_q]`` int64 number of visible entries, ``floor((t + 1) / m)``.
        num_entries: ``N_c`` entries of the prefix.
        max_visible: ``max(visible_count)`` (0 if no query), a host int.
        slots: ``[max_visible]`` int64 ``0, 1, ...`` on ``visible_start``'s device (made when not
            given): ``max_visible`` as a tensor size, so that a compiled call has no int of the
            packing in its graph.
    """

    ratio: int
    cu_seqlens: Tensor
    visible_start: Tensor
    visible_count: Tensor
    num_entries: int
    max_visible: int
    slots: Tensor | None = None

    def __post_init__(self) -> None:
        if self.slots is None:
            object.__setattr__(self, "slots", torch.arange(self.max_visible, device=self.visible_start.device))

    def visible_indices(self, offset: int = 0) -> Tensor:
        """``[T_q, max_visible]`` int64: ``offset +`` rows of every visible entry, -1 padded."""
        slots = self.slots
        assert slots is not None  # made by __post_init__
        rows = self.visible_start[:, None] + slots + offset
        return torch.where(slots < self.visible_count[:, None], rows, -1)


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Queries paired with their causal kv prefixes, and per-query index tensors.

    Attributes:
        cu_seqlens_q: ``[B + 1]`` int32, leading 0.
        cu_seqlens_kv: ``[B + 1]`` int32, leading 0; every kv segment ends at its query
            segment's end (bottom-right aligned) and is at least as long.
        max_seqlen_q, max_seqlen_kv: longest segments (host ints).
        actual_seq_qlen, actual_seq_kvlen: host tuples without the leading 0 (Ascend).
        q_positions: ``[T_q]`` int64 document position of each query (RoPE, causality).
        q_kv_rows: ``[T_q]`` int64 kv row holding the query's own token.
        q_doc_rows: ``[T_q]`` int64 kv row of the query's document's first token (may be
            negative, or inside an earlier segment, when a segment lacks its document's front).
        q_first_rows: ``[T_q]`` int64 first kv row of the query's segment: the first row it may see.
        compressed: one :class:`CompressedPlan` per planned ratio (blocks of the prefix).
        visible: one :class:`EntryVisibility` per planned ratio.
    """

    cu_seqlens_q: Tensor
    cu_seqlens_kv: Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    actual_seq_qlen: tuple[int, ...]
    actual_seq_kvlen: tuple[int, ...]
    q_positions: Tensor
    q_kv_rows: Tensor
    q_doc_rows: Tensor
    q_first_rows: Tensor
    compressed: tuple[CompressedPlan, ...]
    visible: tuple[EntryVisibility, ...]

    @property
    def num_queries(self) -> int:
        """``T_q``."""
        return int(self.q_positions.shape[0])

    @property
    def num_kv(self) -> int:
        """``T_kv``, rows of the kv buffer these segments describe."""
        return self.actual_seq_kvlen[-1] if self.actual_seq_kvlen else 0

    def compressed_for(self, ratio: int) -> CompressedPlan:
        """The :class:`CompressedPlan` of ``ratio``; raises ``ValueError`` if it was not planned."""
        for plan in self.compressed:
            if plan.ratio == ratio:
                return plan
        raise ValueError(f"compress ratio {ratio} was not planned (planned: {self.ratios}); pass it in compress_ratios")

    def visible_for(self, ratio: int) -> EntryVisibility:
        """The :class:`EntryVisibility` of ``ratio``; raises ``ValueError`` if it was not planned."""
        for plan in self.visible:
            if plan.ratio == ratio:
                return plan
        raise ValueError(f"compress ratio {ratio} was not planned (planned: {self.ratios}); pass it in compress_ratios")

    @property
    def ratios(self) -> tuple[int, ...]:
        """The planned compress ratios."""
        return tuple(p.ratio for p in self.compressed)

    def window_indices(self, window: int, offset: int = 0) -> Tensor:
        """``[T_q, window]`` int64 kv rows of each query's sliding window, -1 padded.

        The window is the query's own token plus the ``window - 1`` tokens before it,
        clipped at the document start and at the segment's first row. ``offset`` is subtracted from every row (rows of a
        buffer that starts ``offset`` rows into the prefix); rows that fall before the
        buffer become -1.
        """
        check_int("window", window, minimum=1)
        offsets = torch.arange(window - 1, -1, -1, device=self.q_kv_rows.device)
        rows = self.q_kv_rows[:, None] - offsets
        visible = (rows >= self.q_doc_rows[:, None]) & (rows >= self.q_first_rows[:, None]) & (rows >= offset)
        return torch.where(visible, rows - offset, -1)


def _segment_of_rows(counts: Tensor, total: int) -> Tensor:
    """``[total]`` int64 segment of each row, segments of ``counts`` rows in order.

    Per-row values are then gathered with ``index_select`` (several times cheaper on CPU than
    advanced indexing ``values[seg]`` or ``repeat_interleave`` of the values).
    """
    return torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts, output_size=total)


def _compressed(
    cu_kv: Tensor, seg_of_query: Tensor, q_positions: Tensor, ratio: int
) -> tuple[CompressedPlan, EntryVisibility]:
    cmp = compress_cu_seqlens(cu_kv, ratio)
    cu_cmp = cmp.cu_seqlens.long()
    num_entries = int(cu_cmp[-1])
    # Entry k of segment b, j = k - cu_cmp[b]: block start cu_kv[b] + j*m, position j*m.
    # (In-place steps: every fresh large tensor costs page faults, a good part of planning time.)
    seg = _segment_of_rows(cu_cmp.diff(), num_entries)
    positions = torch.arange(0, num_entries * ratio, ratio, device=cu_kv.device)  # k * m, then j * m
    positions -= (cu_cmp[:-1] * ratio).index_select(0, seg)
    block_starts = cu_kv.long()[:-1].index_select(0, seg).add_(positions)
    visible = torch.add(q_positions, 1).div_(ratio, rounding_mode="floor")
    blocks = CompressedPlan(ratio=ratio, block_starts=block_starts, entry_positions=positions, num_entries=num_entries)
    return blocks, EntryVisibility(
        ratio=ratio,
        cu_seqlens=cmp.cu_seqlens,
        visible_start=cu_cmp[:-1].index_select(0, seg_of_query),
        visible_count=visible,
        num_entries=num_entries,
        max_visible=int(visible.max()) if visible.numel() else 0,
    )


def plan_segments(
    cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, *, compress_ratios: Sequence[int] = (), kv_offset: int | Tensor = 0
) -> SegmentPlan:
    """Per-query index plan of bottom-right aligned prefix segments.

    Args:
        cu_seqlens_q: ``[B + 1]`` int, leading 0: query segments.
        cu_seqlens_kv: ``[B + 1]`` int, leading 0: kv segments, ``Lkv_b >= Lq_b``, each ending
            with its query segment (bottom-right aligned).
        compress_ratios: ratios ``> 1`` to plan compressed entries for.
        kv_offset: the first kv segment lacks this many rows at its front (a buffer that starts
            inside the first document, as the need-based exchange builds), or a ``[B]`` int
            tensor of the rows each segment lacks: positions, window rows and ``q_doc_rows``
            account for them. Only valid without compress ratios.

    Raises:
        ValueError: invalid cu_seqlens, different lengths, a kv segment shorter than its
            query segment, a ratio ``<= 1``.
    """
    validate_cu_seqlens(cu_seqlens_q, name="cu_seqlens_q")
    validate_cu_seqlens(cu_seqlens_kv, name="cu_seqlens_kv")
    if cu_seqlens_q.shape != cu_seqlens_kv.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_kv must have the same length, got {cu_seqlens_q.numel()} and {cu_seqlens_kv.numel()}"
        )
    q_lens, kv_lens = cu_seqlens_q.long().diff(), cu_seqlens_kv.long().diff()
    if bool((kv_lens < q_lens).any()):
        raise ValueError("cu_seqlens_kv: every kv segment must be at least as long as its query segment")
    for ratio in compress_ratios:
        check_int("compress_ratios[i]", ratio, minimum=2)
    host = torch.stack([cu_seqlens_q.long(), cu_seqlens_kv.long()]).cpu()
    num_q = int(host[0, -1])
    cu_q, cu_kv = cu_seqlens_q.long()[:-1], cu_seqlens_kv.long()[:-1]
    seg = _segment_of_rows(q_lens, num_q)
    # Query i of segment b: document row cu_kv[b] (less kv_offset in the first segment) and
    # position (Lkv_b - Lq_b) + i (plus kv_offset in the first segment), i = t - cu_q[b].
    first = torch.zeros_like(cu_kv)
    if isinstance(kv_offset, Tensor):
        first = first + kv_offset.to(first)
    else:
        first[:1] = kv_offset
    doc_rows = (cu_kv - first).index_select(0, seg)
    positions = (kv_lens - q_lens - cu_q + first).index_select(0, seg).add_(torch.arange(num_q, device=q_lens.device))
    pairs = [_compressed(cu_seqlens_kv, seg, positions, r) for r in dict.fromkeys(compress_ratios)]
    return SegmentPlan(
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        cu_seqlens_kv=cu_seqlens_kv.to(torch.int32),
        max_seqlen_q=int(q_lens.max()) if q_lens.numel() else 0,
        max_seqlen_kv=int(kv_lens.max()) if kv_lens.numel() else 0,
        actual_seq_qlen=tuple(host[0, 1:].tolist()),
        actual_seq_kvlen=tuple(host[1, 1:].tolist()),
        q_positions=positions,
        q_kv_rows=doc_rows + positions,
        q_doc_rows=doc_rows,
        q_first_rows=cu_kv.index_select(0, seg),
        compressed=tuple(b for b, _ in pairs),
        visible=tuple(v for _, v in pairs),
    )


@dataclass(frozen=True, eq=False)
class KeyRanges:
    """Per-query visible key ranges of one ring round, planned once per micro-batch.

    Row ``t`` of q sees keys ``lo[t] <= j < hi[t]`` of the round's ``num_keys`` rows. The
    same set in the form a varlen kernel takes: only rows ``[0, num_rows)`` see any key,
    and within them, bottom-right aligned (offset ``d = num_keys - num_rows``), row ``i``
    sees key ``j`` iff ``j >= i + d - left`` (``left = -1``: no lower bound); every
    visible range runs to the round's last key.

    Attributes:
        lo, hi: ``[T_q]`` int64, non-decreasing over the rows.
        num_keys: rows of the round's kv.
        num_rows: leading query rows that see at least one key.
        left: the kernel form's left window (``-1`` = unbounded).
        bottom_right: whether the kernel form describes exactly ``lo``/``hi`` (always in the
            contiguous layout); when ``False``, only ``lo``/``hi`` do.
    """

    lo: Tensor
    hi: Tensor
    num_keys: int
    num_rows: int
    left: int
    bottom_right: bool = True
