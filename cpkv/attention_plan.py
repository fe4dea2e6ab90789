"""Per-query index plans of prefix attention, built once per micro-batch.

A :class:`SegmentPlan` describes queries paired with causal kv prefixes
(``cu_seqlens_q`` / ``cu_seqlens_kv``, every kv segment starting at its document's
first token, queries bottom-right aligned). From it follow, per query, its position in
its document, the kv row of its own token and of its document's first token, and,
per compress ratio, which compressed entries it may see (SEMANTICS sections 3 and 5).
Layers only do cheap vectorised arithmetic on these tensors; nothing here is
recomputed per layer, and nothing is cached behind the caller's back.

:class:`AttentionPlan` adds the contiguous TND prefix plan and the global query count
(the indexer-loss normaliser) for one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from cpkv._checks import check_int
from cpkv.layout import compress_cu_seqlens, validate_cu_seqlens
from cpkv.plan import PrefixKVPlan, compute_prefix_kv_cu_seqlens
from cpkv.sharding import check_zigzag_tnd_lengths, contiguous_shard_range, zigzag_chunks, zigzag_tnd_gather_index

if TYPE_CHECKING:
    from cpkv.exchange import NeedPlan


@dataclass(frozen=True, eq=False)
class CompressedPlan:
    """Compressed entries of the kv prefix at one ratio, and what each query sees.

    Attributes:
        ratio: compress ratio ``m``.
        cu_seqlens: ``[B + 1]`` leading-zero compressed cu_seqlens, from the **kv** lengths.
        block_starts: ``[N_c]`` int64 kv row of the first token of each entry's block.
        entry_positions: ``[N_c]`` int64 document position of each entry, ``j * m`` (RoPE).
        visible_start: ``[T_q]`` int64 row of the query's document's first entry.
        visible_count: ``[T_q]`` int64 number of visible entries, ``floor((t + 1) / m)``.
        num_entries: ``N_c``.
        max_visible: ``max(visible_count)`` (0 if no query).
    """

    ratio: int
    cu_seqlens: Tensor
    block_starts: Tensor
    entry_positions: Tensor
    visible_start: Tensor
    visible_count: Tensor
    num_entries: int
    max_visible: int

    def visible_indices(self, offset: int = 0) -> Tensor:
        """``[T_q, max_visible]`` int64: ``offset +`` rows of every visible entry, -1 padded."""
        slots = torch.arange(self.max_visible, device=self.visible_start.device)
        rows = self.visible_start[:, None] + slots + offset
        return torch.where(slots < self.visible_count[:, None], rows, -1)


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Queries paired with their causal kv prefixes, and per-query index tensors.

    Attributes:
        cu_seqlens_q: ``[B + 1]`` int32, leading 0.
        cu_seqlens_kv: ``[B + 1]`` int32, leading 0; every kv segment starts at its
            document's first token and is at least as long as its query segment.
        max_seqlen_q, max_seqlen_kv: longest segments.
        actual_seq_qlen, actual_seq_kvlen: host tuples without the leading 0 (Ascend).
        q_positions: ``[T_q]`` int64 document position of each query (RoPE, causality).
        q_kv_rows: ``[T_q]`` int64 kv row holding the query's own token.
        q_doc_rows: ``[T_q]`` int64 kv row of the query's document's first token.
        compressed: one :class:`CompressedPlan` per requested ratio.
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
    compressed: tuple[CompressedPlan, ...]

    @property
    def num_queries(self) -> int:
        """``T_q``."""
        return int(self.q_positions.shape[0])

    def compressed_for(self, ratio: int) -> CompressedPlan:
        """The :class:`CompressedPlan` of ``ratio``; raises ``ValueError`` if it was not planned."""
        for plan in self.compressed:
            if plan.ratio == ratio:
                return plan
        planned = [p.ratio for p in self.compressed]
        raise ValueError(f"compress ratio {ratio} was not planned (planned: {planned}); pass it in compress_ratios")

    def window_indices(self, window: int) -> Tensor:
        """``[T_q, window]`` int64 kv rows of each query's sliding window, -1 padded.

        The window is the query's own token plus the ``window - 1`` tokens before it,
        clipped at the document start.
        """
        check_int("window", window, minimum=1)
        offsets = torch.arange(window - 1, -1, -1, device=self.q_kv_rows.device)
        rows = self.q_kv_rows[:, None] - offsets
        return torch.where(rows >= self.q_doc_rows[:, None], rows, -1)


def _compressed_plan(cu_kv: Tensor, seg_of_query: Tensor, q_positions: Tensor, ratio: int) -> CompressedPlan:
    cmp = compress_cu_seqlens(cu_kv, ratio)
    cu_cmp = cmp.cu_seqlens.long()
    counts = cu_cmp.diff()
    num_entries = int(cu_cmp[-1])
    seg_of_entry = torch.repeat_interleave(torch.arange(counts.numel(), device=cu_kv.device), counts, output_size=num_entries)
    j = torch.arange(num_entries, device=cu_kv.device) - cu_cmp[seg_of_entry]
    visible = torch.div(q_positions + 1, ratio, rounding_mode="floor")
    return CompressedPlan(
        ratio=ratio,
        cu_seqlens=cmp.cu_seqlens,
        block_starts=cu_kv.long()[seg_of_entry] + j * ratio,
        entry_positions=j * ratio,
        visible_start=cu_cmp[seg_of_query],
        visible_count=visible,
        num_entries=num_entries,
        max_visible=int(visible.max()) if visible.numel() else 0,
    )


def plan_segments(
    cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor, *, compress_ratios: Sequence[int] = ()
) -> SegmentPlan:
    """Per-query index plan of bottom-right aligned prefix segments.

    Args:
        cu_seqlens_q: ``[B + 1]`` int, leading 0: query segments.
        cu_seqlens_kv: ``[B + 1]`` int, leading 0: kv segments, each starting at its
            document's first token, ``Lkv_b >= Lq_b``.
        compress_ratios: ratios ``> 1`` to plan compressed entries for.

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
    num_q = int(cu_seqlens_q[-1])
    seg = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens, output_size=num_q)
    i = torch.arange(num_q, device=q_lens.device) - cu_seqlens_q.long()[seg]
    positions = (kv_lens - q_lens)[seg] + i
    doc_rows = cu_seqlens_kv.long()[seg]
    host = torch.stack([cu_seqlens_q.long(), cu_seqlens_kv.long()]).cpu()
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
        compressed=tuple(_compressed_plan(cu_seqlens_kv, seg, positions, r) for r in dict.fromkeys(compress_ratios)),
    )


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """Everything one rank needs to run prefix attention on a contiguous TND shard.

    Attributes:
        prefix: where the rank's prefix lies in the gathered kv (:class:`PrefixKVPlan`).
        segments: the per-query plan of that prefix (:class:`SegmentPlan`).
        num_global_queries: ``N``, query tokens of the whole CP group (indexer loss).
        cp_size, cp_rank: the sharding this plan is for.
        need: routes of the need-based exchange (:mod:`cpkv.exchange`), if planned.
        num_documents: ``B``, documents of the micro-batch (``cu_seqlens`` has ``B + 1``
            entries): a layer given this plan checks its ``cu_seqlens`` against it without a
            host sync.
    """

    prefix: PrefixKVPlan
    segments: SegmentPlan
    num_global_queries: int
    cp_size: int
    cp_rank: int
    need: NeedPlan | None = None
    num_documents: int = 0


def plan_attention(
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, compress_ratios: Sequence[int] = (),
    need_windows: Sequence[int | None] | None = None, ring_degree: int = 1,
) -> AttentionPlan:
    """Pure per-rank plan for contiguous TND sharding (no communication).

    ``num_global_queries`` is ``cu_seqlens[-1]``: with contiguous sharding every packed
    token is a query of exactly one rank, which is what ``global_num_seqs`` sums to.

    Args:
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens, ``T % cp_size == 0``.
        cp_size, cp_rank: CP group size and this rank.
        compress_ratios: ratios ``> 1`` the layers of this micro-batch use.
        need_windows: to also plan the need-based exchange (``exchange="need"``), the
            sliding windows of the layers (``None`` in the list: dense causal layers).
        ring_degree: rounds of the kv exchange (``R > 1`` needs ``need_windows``).

    Example:
        >>> plan = plan_attention(torch.tensor([0, 5, 12, 16]), 2, 1, compress_ratios=[4])
        >>> plan.segments.q_positions.tolist()
        [3, 4, 5, 6, 0, 1, 2, 3]
    """
    validate_cu_seqlens(cu_seqlens)
    offset, local_len = contiguous_shard_range(int(cu_seqlens[-1]), cp_size, cp_rank)
    prefix = compute_prefix_kv_cu_seqlens(cu_seqlens, offset, local_len)
    segments = plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv, compress_ratios=compress_ratios)
    need = None
    if need_windows is not None:
        from cpkv.exchange import plan_need_exchange  # exchange builds on this module

        need = plan_need_exchange(
            cu_seqlens, cp_size, cp_rank, windows=need_windows, compress_ratios=compress_ratios, ring_degree=ring_degree
        )
    elif ring_degree != 1:
        raise ValueError(f"ring_degree={ring_degree} needs the need-based plan: pass need_windows=[...]")
    return AttentionPlan(prefix, segments, int(cu_seqlens[-1]), cp_size, cp_rank, need, cu_seqlens.numel() - 1)


@dataclass(frozen=True, eq=False)
class BSNDPlan:
    """One rank's plan for zigzag fixed-length (BSND) sharding: two steps, two prefixes.

    Rank ``r`` holds sequence chunks ``r`` and ``2cp-1-r`` (chunk length ``c = S / (2cp)``).
    Their causal prefixes ``[0, (r+1)c)`` and ``[0, (2cp-r)c)`` overlap, so attention runs
    in two steps (TransformerEngine's kv-all-gather CP does the same): step ``k`` pairs
    local chunk ``k`` of every batch element with its prefix, as a TND problem of ``B``
    equal segments. The shorter prefix's kv is read twice (and, in compressed layers,
    compressed twice): ``(r+1)/(2cp-r)`` extra work over a single step.

    Attributes:
        steps: the two :class:`SegmentPlan` (local chunk 0, local chunk 1).
        prefix_lens: ``((r+1)c, (2cp-r)c)``, the prefix length of each step.
        chunk_len: ``c``.
        positions: ``[S / cp]`` int64 sequence positions of the local tokens (RoPE).
        num_global_queries: ``B * S``.
    """

    steps: tuple[SegmentPlan, SegmentPlan]
    prefix_lens: tuple[int, int]
    chunk_len: int
    positions: Tensor
    batch: int
    seq_len: int
    cp_size: int
    cp_rank: int
    num_global_queries: int


def plan_attention_bsnd(
    batch: int, seq_len: int, cp_size: int, cp_rank: int, *,
    compress_ratios: Sequence[int] = (), device: torch.device | str | None = None,
) -> BSNDPlan:
    """Pure per-rank plan for zigzag BSND sharding (no communication).

    Args:
        batch: ``B``. seq_len: the global sequence length ``S``, ``S % (2 * cp_size) == 0``.
        cp_size, cp_rank: CP group size and this rank.
        compress_ratios: ratios ``> 1`` the layers use.
        device: where the plan's tensors live.

    Raises:
        ValueError: ``S`` not divisible by ``2 * cp_size``, rank out of range.

    Example:
        >>> plan = plan_attention_bsnd(1, 8, 2, 0)
        >>> plan.prefix_lens, plan.positions.tolist()
        ((2, 8), [0, 1, 6, 7])
    """
    check_int("batch", batch, minimum=1)
    check_int("seq_len", seq_len, minimum=0)
    chunks = zigzag_chunks(cp_size, cp_rank)
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"seq_len={seq_len} must be divisible by 2*cp_size = {2 * cp_size} (zigzag chunks); pad the sequence")
    c = seq_len // (2 * cp_size)
    segments = []
    for chunk in chunks:
        cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * c
        segments.append(plan_segments(cu_q, cu_q * (chunk + 1), compress_ratios=compress_ratios))
    positions = torch.cat([torch.arange(ch * c, (ch + 1) * c, device=device) for ch in chunks])
    return BSNDPlan(
        steps=(segments[0], segments[1]), prefix_lens=((chunks[0] + 1) * c, (chunks[1] + 1) * c), chunk_len=c,
        positions=positions, batch=batch, seq_len=seq_len, cp_size=cp_size, cp_rank=cp_rank,
        num_global_queries=batch * seq_len,
    )


@dataclass(frozen=True, eq=False)
class ZigzagTNDPlan:
    """One rank's plan for per-document zigzag TND sharding (load-balanced causal work).

    Every non-empty document (length ``n``, chunk ``c = n / (2cp)``) gives two query
    segments, chunks ``r`` and ``2cp-1-r``, with causal prefixes ``(r+1)c`` and
    ``(2cp-r)c``. The prefixes overlap; cpkv duplicates them into one kv buffer (one kernel
    call over ``2 * B`` segment pairs), read from the rank-major all-gather with ``kv_rows``.
    Cost: ``(2cp+1)/(2cp)`` of the micro-batch's kv rows copied per layer (and, in compressed
    layers, the shorter prefix compressed twice).

    Attributes:
        segments: the :class:`SegmentPlan` of the duplicated buffer (local queries in shard order).
        kv_rows: ``[sum Lkv]`` int64 rows of the rank-major gathered buffer forming the kv buffer.
        num_global_queries: ``T``. cp_size, cp_rank, num_tokens, num_documents: what the plan
            is for (``num_documents`` = ``B``).
    """

    segments: SegmentPlan
    kv_rows: Tensor
    num_global_queries: int
    cp_size: int
    cp_rank: int
    num_tokens: int
    num_documents: int


def plan_attention_zigzag_tnd(
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, compress_ratios: Sequence[int] = ()
) -> ZigzagTNDPlan:
    """Pure per-rank plan for per-document zigzag TND sharding (no communication).

    Args:
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens; every document length divisible
            by ``2 * cp_size`` (pad with :func:`cpkv.layout.pad_documents`).
        cp_size, cp_rank: CP group size and this rank.
        compress_ratios: ratios ``> 1`` the layers use.

    Raises:
        ValueError: invalid cu_seqlens; a document length not divisible by ``2 * cp_size``
            (the first one is named); rank out of range.

    Example:
        >>> plan = plan_attention_zigzag_tnd(torch.tensor([0, 8]), 2, 0)
        >>> plan.segments.cu_seqlens_q.tolist(), plan.segments.cu_seqlens_kv.tolist()
        ([0, 2, 4], [0, 2, 10])
    """
    validate_cu_seqlens(cu_seqlens)
    first, second = zigzag_chunks(cp_size, cp_rank)
    check_zigzag_tnd_lengths(cu_seqlens, cp_size)
    starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.long().diff()
    keep = lengths > 0
    starts, chunk = starts[keep], lengths[keep] // (2 * cp_size)
    q_lens = chunk.repeat_interleave(2)
    kv_lens = torch.stack([(first + 1) * chunk, (second + 1) * chunk], 1).flatten()
    zero = q_lens.new_zeros(1)
    cu_q, cu_kv = torch.cat([zero, q_lens.cumsum(0)]), torch.cat([zero, kv_lens.cumsum(0)])
    total = int(cu_kv[-1])
    seg = torch.repeat_interleave(torch.arange(kv_lens.numel(), device=cu_kv.device), kv_lens, output_size=total)
    natural = starts.repeat_interleave(2)[seg] + torch.arange(total, device=cu_kv.device) - cu_kv[seg]
    gathered_pos = zigzag_tnd_gather_index(cu_seqlens, cp_size)
    return ZigzagTNDPlan(
        segments=plan_segments(cu_q, cu_kv, compress_ratios=compress_ratios),
        kv_rows=gathered_pos[natural],
        num_global_queries=int(cu_seqlens[-1]),
        cp_size=cp_size,
        cp_rank=cp_rank,
        num_tokens=int(cu_seqlens[-1]),
        num_documents=cu_seqlens.numel() - 1,
    )
