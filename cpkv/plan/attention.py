"""The attention plan: one frozen description of a micro-batch on one rank.

:func:`plan_attention` turns ``(cu_seqlens, cp_size, cp_rank)`` and the options of the
micro-batch (layout, exchange, ring rounds, the layers' compress ratios and windows) into
an :class:`AttentionPlan`, identical in structure on every rank, computed once per
micro-batch without communication. :func:`cpkv.attention.attention_forward` executes it
and takes no knob that could disagree with it. Layouts and exchanges differ only in
plan data: where the rank's kv buffer comes from (a slice of the all-gathered kv, gathered
rows for per-document zigzag, or need routes and rounds), the segments over that buffer,
and, per compress ratio, the compressor's blocks and the entries' routes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from cpkv.checks import check_int, check_int_dtype, check_tensor
from cpkv.agreement import agree
from cpkv.collectives import check_group, check_group_position, check_same_on_all_ranks
from cpkv.plan.conventions import validate_cu_seqlens
from cpkv.plan.prefix import PrefixKVPlan, compute_prefix_kv_cu_seqlens
from cpkv.plan.routes import CompressedRoutes, Routes, compressed_routes, kv_routes, plan_routes, rank_bounds
from cpkv.plan.segments import KeyRanges, SegmentPlan, plan_segments
from cpkv.plan.sharding import (
    check_zigzag_tnd_lengths, contiguous_shard_range, zigzag_chunks, zigzag_tnd_gather_index, zigzag_tnd_index,
)

Layout = Literal["contiguous", "zigzag"]
"""``"contiguous"``: rank ``r`` holds packed tokens ``[r*T/cp, (r+1)*T/cp)``; ``"zigzag"``: chunks
``r`` and ``2cp-1-r`` of every document (documents padded to multiples of ``2*cp``)."""
Exchange = Literal["allgather", "need"]
"""``"allgather"``: gather all kv (and compressor inputs); ``"need"``: move only the rows each rank needs."""
LAYOUTS: tuple[str, ...] = get_args(Layout)
EXCHANGES: tuple[str, ...] = get_args(Exchange)


@dataclass(frozen=True, eq=False)
class RingRound:
    """One round of the ring exchange: the rows that move and what each query sees of them."""

    routes: Routes
    ranges: KeyRanges


@dataclass(frozen=True, eq=False)
class KVSource:
    """How this rank's kv buffer for one layer kind (window) is built, and the segments over it.

    Attributes:
        halo: need exchange: the kv rows received from earlier ranks and placed in front of
            the rank's own rows (``None``: the buffer comes from the all-gather, or, with ring
            rounds, is the rank's own rows only).
        offset: prefix rows (of :attr:`AttentionPlan.segments`) missing at the buffer's front.
        segments: the segments over the buffer, for varlen kernels.
        rounds: ring rounds carrying the remote rows (``ring_degree > 1``), else empty.
    """

    halo: Routes | None
    offset: int
    segments: SegmentPlan
    rounds: tuple[RingRound, ...]


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """Everything one rank needs to run prefix attention on its shard of one micro-batch.

    Attributes:
        layout, exchange, ring_degree: the options the plan was built with.
        cp_size, cp_rank: the sharding.
        num_tokens: ``T``, packed tokens of the micro-batch (all ranks).
        local_len: ``T / cp``, tokens of this rank.
        num_documents: ``B`` (``cu_seqlens`` had ``B + 1`` entries).
        num_global_queries: ``N``, real (not padding) query tokens of the CP group, at least 1
            (the indexer-loss normaliser).
        segments: the rank's queries (in shard order) paired with their full causal prefixes,
            with blocks and visibility of every planned compress ratio. RoPE positions of the
            local tokens: ``segments.q_positions``.
        prefix: contiguous layout: where the prefix lies in the gathered kv, else ``None``.
        gather_rows: zigzag layout: ``[sum Lkv]`` int64 rows of the rank-major all-gather forming
            the prefix buffer (each document's two overlapping prefixes), else ``None``.
        kv: need exchange: one :class:`KVSource` per planned window; all-gather: one source
            (key ``None``) that serves every window.
        compressed: need exchange: the :class:`~cpkv.plan.routes.CompressedRoutes` of each ratio.
        windows, compress_ratios: what was planned.
        prev_blocks: per planned ratio, how many earlier blocks of the same document each
            entry's compressor may read (the need exchange's compressor-input halo covers them).
        check_modules: whether compressed layer calls agree across ranks on their modules'
            outputs (:func:`plan_attention`).
        valid_queries: ``[T/cp]`` bool, ``True`` at the local rows that are real tokens, when
            ``plan_attention`` was given ``padding``; ``None`` when every token is real. Padding
            queries are attended as usual (mask their loss) but take no part in the indexer
            loss: neither in its value, its gradients nor ``N``.
    """

    layout: Layout
    exchange: Exchange
    ring_degree: int
    cp_size: int
    cp_rank: int
    num_tokens: int
    local_len: int
    num_documents: int
    num_global_queries: int
    segments: SegmentPlan
    prefix: PrefixKVPlan | None
    gather_rows: Tensor | None
    kv: Mapping[int | None, KVSource]
    compressed: Mapping[int, CompressedRoutes]
    windows: tuple[int | None, ...]
    compress_ratios: tuple[int, ...]
    prev_blocks: Mapping[int, int]
    check_modules: bool = True
    valid_queries: Tensor | None = None

    @property
    def q_positions(self) -> Tensor:
        """``[T/cp]`` int64 document position of each local token (for RoPE)."""
        return self.segments.q_positions

    def kv_source(self, window: int | None) -> KVSource:
        """The :class:`KVSource` of layers with ``window``; ``ValueError`` if it was not planned."""
        if self.exchange == "allgather":
            return self.kv[None]
        if window not in self.kv:
            raise ValueError(
                f"plan has no need-exchange route for window={window} (planned windows: {list(self.kv)}):"
                " pass it in plan_attention(..., windows=[...])"
            )
        return self.kv[window]


def _zigzag_buffer(cu_seqlens: Tensor, cp_size: int, cp_rank: int, ratios: Sequence[int]) -> tuple[SegmentPlan, Tensor]:
    """Segments of the duplicated two-prefixes-per-document buffer, and its gathered rows."""
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
    rows = zigzag_tnd_gather_index(cu_seqlens, cp_size)[natural]
    return plan_segments(cu_q, cu_kv, compress_ratios=ratios), rows


def _rounds(
    segments: SegmentPlan, prefix: PrefixKVPlan, lo: Tensor, owned: Tensor, rank: int, window: int | None,
    ring_degree: int, device: torch.device,
) -> tuple[RingRound, ...]:
    """Split every rank's needed range ``[lo, a)`` into ``ring_degree`` parts; plan each part's key ranges."""
    a = owned[:, 0]
    cuts = [lo + (a - lo) * i // ring_degree for i in range(ring_degree + 1)]
    position = prefix.rank_offset + torch.arange(segments.num_queries, device=device)
    doc_start = prefix.kv_start + segments.q_doc_rows
    first_lo = doc_start if window is None else torch.maximum(doc_start, position - window + 1)
    rounds = []
    for i in range(ring_degree):
        routes = plan_routes(torch.stack([cuts[i], cuts[i + 1]], 1), owned, rank, device=device)
        start, size = int(cuts[i][rank]), int(cuts[i + 1][rank] - cuts[i][rank])
        key_lo = (first_lo - start).clamp(0, size)
        key_hi = torch.maximum(key_lo, (position + 1 - start).clamp(0, size))
        num_rows = int((key_lo < key_hi).sum())
        # Kernel form: row i < num_rows sees keys j >= i + (size - num_rows) - left, to the end.
        left = -1 if window is None else (size - num_rows) - (prefix.rank_offset - window + 1 - start)
        rounds.append(RingRound(routes, KeyRanges(key_lo, key_hi, size, num_rows, left)))
    return tuple(rounds)


def _need_sources(
    cu: Tensor, segments: SegmentPlan, prefix: PrefixKVPlan, cp_size: int, cp_rank: int, windows: Sequence[int | None],
    ring_degree: int, device: torch.device,
) -> dict[int | None, KVSource]:
    owned = rank_bounds(prefix.local_len, cp_size)
    sources: dict[int | None, KVSource] = {}
    for window in windows:
        halo, lo = kv_routes(cu, owned, cp_rank, window, device)
        if ring_degree > 1:  # the buffer is the rank's own rows; the rest arrives in rounds
            offset, rounds, halo_or_none = prefix.rank_offset - prefix.kv_start, _rounds(
                segments, prefix, lo, owned, cp_rank, window, ring_degree, device
            ), None
        else:
            offset, rounds, halo_or_none = int(lo[cp_rank]) - prefix.kv_start, (), halo
        sources[window] = KVSource(halo_or_none, offset, _buffer_segments(segments, offset), rounds)
    return sources


def _buffer_segments(segments: SegmentPlan, offset: int) -> SegmentPlan:
    """``segments`` over a buffer that lacks the first ``offset`` prefix rows, without compressed entries.

    Equal to ``plan_segments(cu_q, [0, cu_kv[1:] - offset], kv_offset=offset)``, derived by
    arithmetic: only the first kv segment shrinks; every row moves up by ``offset`` and the
    positions stay (tensors that do not change are those of ``segments``, shared).
    """
    cu_kv, kv_ends = segments.cu_seqlens_kv, segments.actual_seq_kvlen
    if kv_ends:
        cu_kv = torch.cat([cu_kv[:1], cu_kv[1:] - offset])
    lengths = [end - start for start, end in zip((0, *kv_ends[:-1]), kv_ends)]
    if lengths:
        lengths[0] -= offset
    return SegmentPlan(
        cu_seqlens_q=segments.cu_seqlens_q, cu_seqlens_kv=cu_kv, max_seqlen_q=segments.max_seqlen_q,
        max_seqlen_kv=max(lengths, default=0), actual_seq_qlen=segments.actual_seq_qlen,
        actual_seq_kvlen=tuple(end - offset for end in kv_ends), q_positions=segments.q_positions,
        q_kv_rows=segments.q_kv_rows - offset if offset else segments.q_kv_rows,
        q_doc_rows=segments.q_doc_rows - offset if offset else segments.q_doc_rows, compressed=(), visible=(),
    )


def plan_attention(
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, layout: Layout = "contiguous", exchange: Exchange = "allgather",
    ring_degree: int = 1, compress_ratios: Sequence[int] = (), windows: Sequence[int | None] = (),
    prev_blocks: Mapping[int, int] | None = None, check_modules: bool = True, group: ProcessGroup | None = None,
    check_ranks: bool = True, padding: Tensor | None = None,
) -> AttentionPlan:
    """Pure per-rank plan of one micro-batch (no communication; identical structure on every rank).

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64 **global** leading-zero cu_seqlens of the micro-batch
            (all ranks' tokens, padding included), any device; the plan's tensors live there.
            ``T % cp_size == 0``; with ``layout="zigzag"`` every document length is a multiple
            of ``2 * cp_size`` (pad with :func:`cpkv.plan.conventions.pad_documents`).
        cp_size, cp_rank: CP group size and this rank.
        layout: ``"contiguous"`` or ``"zigzag"`` (per-document zigzag TND; zigzag BSND is this
            layout with equal-length documents, see :func:`bsnd_cu_seqlens`).
        exchange: ``"allgather"`` or ``"need"`` (contiguous layout only).
        ring_degree: ``R > 1`` receives the remote kv of the need exchange in ``R`` rounds
            merged exactly by LSE (``exchange="need"`` only).
        compress_ratios: a sequence of the ratios ``> 1`` of the compressed layers that will use
            this plan (e.g. ``[4, 128]``).
        windows: a sequence of the sliding windows ``>= 1`` of the layers (``None`` for dense
            causal) that will use this plan with ``exchange="need"`` (each gets its own halo;
            default: dense only). Checked, then ignored, by the all-gather exchange, whose
            prefix serves every window.
        prev_blocks: a mapping ``{ratio: blocks}``: how many earlier blocks of the same document
            each entry's compressor reads (a compressor declares it as
            ``compressor.prev_blocks``); default DeepSeek-V4's: 1 for ratio 4 (the overlapping
            compressor), 0 otherwise. A layer whose compressor or indexer declares more than
            planned raises before any collective; what it actually reads is not checked.
        check_modules: compressed layer calls check what every rank's compressor and indexer
            returned (entry count and width, key width, query shapes) and agree on the outcome
            with one all-reduce of two integers and a host read before any entry moves, so a
            module that fails on one rank raises on every rank (:mod:`cpkv.agreement`).
            ``False`` drops that collective (no host sync in a layer call): a failing module
            then raises on its own rank only and the others wait until the collective timeout.
        group: the CP process group (``torch.distributed.group.WORLD`` for the default group),
            or ``None`` (default) to plan without communication. With a group, every rank
            validates its own arguments and the ranks agree on the outcome (one all-reduce):
            when any rank's arguments are invalid, or ``cp_size``/``cp_rank`` are not its group
            position, every rank raises. Then (``check_ranks=True``, the default) every rank's
            ``cu_seqlens`` and options are compared exactly with two small all-reduces (MAX of
            the values and of their negations): every rank raises the same ``ValueError`` when
            any rank differs. Once per micro-batch; host syncs.
        check_ranks: set ``False`` to skip the cross-rank comparison (the agreement on each
            rank's own validation still runs).
        padding: ``[B]`` int tensor (any device) of the padding tokens at the end of each
            document of ``cu_seqlens`` (e.g. :func:`cpkv.plan.conventions.pad_documents`'
            ``padding``), or ``None`` (default): every token is real. Padding tokens are
            attended like any other (causality keeps them out of real tokens' outputs; mask
            their loss), but they do not count in the indexer loss: ``plan.valid_queries``
            marks the real local rows and ``plan.num_global_queries`` counts real tokens only.

    Returns:
        :class:`AttentionPlan`.

    Raises:
        TypeError, ValueError: invalid ``cu_seqlens``, ``T % cp_size != 0``, rank out of range,
            an unknown layout or exchange, ``exchange="need"`` or ``ring_degree > 1`` with the
            zigzag layout, ``ring_degree > 1`` without ``exchange="need"``, a zigzag document
            length not divisible by ``2 * cp_size`` (the first one is named), ``compress_ratios``
            or ``windows`` not a sequence, ``prev_blocks`` not a mapping or naming an unplanned
            ratio, a ratio ``< 2``, a window ``< 1``, a group position other than
            ``(cp_size, cp_rank)``, ranks that disagree on ``cu_seqlens`` or the options,
            ``padding`` that is not a ``[B]`` integer tensor with ``0 <= padding[b] <=`` the
            length of document ``b`` (ranks that disagree on it raise like for ``cu_seqlens``).
            With a ``group``, raised on every rank when any rank fails.

    Example:
        >>> plan = plan_attention(torch.tensor([0, 5, 12, 16]), 2, 1, compress_ratios=[4])
        >>> plan.q_positions.tolist(), plan.prefix.kv_start
        ([3, 4, 5, 6, 0, 1, 2, 3], 5)
    """
    def build() -> AttentionPlan:
        return _build_plan(cu_seqlens, cp_size, cp_rank, layout, exchange, ring_degree, compress_ratios, windows,
                           prev_blocks, check_modules, padding)

    if group is None:
        return build()
    check_group("group", group)
    try:
        check_group_position(group, cp_size, cp_rank)
        plan = build()
    except Exception as error:  # noqa: BLE001 - every rank learns of it, then raises
        agree(error, group)
        raise
    agree(None, group)
    if check_ranks:
        padded = [] if padding is None else [-7, *padding.detach().to("cpu", torch.int64).tolist()]
        check_same_on_all_ranks(cu_seqlens, group, options=[*_options(plan), *padded])
    return plan


def _options(plan: AttentionPlan) -> list[int]:
    """The plan's options as integers, for the cross-rank comparison."""
    windows = [-1 if w is None else w for w in plan.windows]
    return [LAYOUTS.index(plan.layout), EXCHANGES.index(plan.exchange), plan.ring_degree, int(plan.check_modules),
            *plan.compress_ratios, -7, *plan.prev_blocks.values(), -7, *windows]


def _int_sequence(name: str, value: object, *, minimum: int, allow_none: bool = False) -> tuple[int | None, ...]:
    """``value`` as a tuple of ints ``>= minimum`` (and ``None`` where allowed), duplicates dropped."""
    form = f"a sequence of ints{' or None' if allow_none else ''}"
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be {form} (e.g. [{max(minimum, 4)}]), got {type(value).__name__} {value!r}")
    items: list[int | None] = []
    for i, item in enumerate(value):
        if item is None and allow_none:
            items.append(None)
        else:
            items.append(check_int(f"{name}[{i}]", item, minimum=minimum))
    return tuple(dict.fromkeys(items))


def _build_plan(
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, layout: Layout, exchange: Exchange, ring_degree: int,
    compress_ratios: Sequence[int], windows: Sequence[int | None], prev_blocks: Mapping[int, int] | None,
    check_modules: bool, padding: Tensor | None,
) -> AttentionPlan:
    """:func:`plan_attention` without the group: validate, then plan."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    check_int("ring_degree", ring_degree, minimum=1)
    if not isinstance(check_modules, bool):
        raise TypeError(f"check_modules must be a bool, got {type(check_modules).__name__}")
    if ring_degree > 1 and exchange != "need":
        raise ValueError(f"ring_degree={ring_degree} splits the need-based exchange: pass exchange='need'")
    if layout == "zigzag" and exchange != "allgather":
        raise ValueError("layout='zigzag' supports only exchange='allgather' (the need exchange is contiguous-only)")
    validate_cu_seqlens(cu_seqlens)
    ratios = tuple(r for r in _int_sequence("compress_ratios", compress_ratios, minimum=2) if r is not None)
    planned_windows = _int_sequence("windows", windows, minimum=1, allow_none=True)
    reach = _prev_blocks(ratios, prev_blocks)
    real_lengths = _real_lengths(cu_seqlens, padding)
    num_tokens = int(cu_seqlens[-1])
    offset, local_len = contiguous_shard_range(num_tokens, cp_size, cp_rank)
    device = cu_seqlens.device
    prefix, rows, compressed = None, None, {}
    kv: dict[int | None, KVSource]
    if layout == "zigzag":
        segments, rows = _zigzag_buffer(cu_seqlens, cp_size, cp_rank, ratios)
        kv = {None: KVSource(None, 0, segments, ())}
    else:
        prefix = compute_prefix_kv_cu_seqlens(cu_seqlens, offset, local_len)
        segments = plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv, compress_ratios=ratios)
        kv = {None: KVSource(None, 0, segments, ())}
        if exchange == "need":
            cu = cu_seqlens.detach().to("cpu", torch.int64)
            kv = _need_sources(cu, segments, prefix, cp_size, cp_rank, planned_windows or (None,), ring_degree, device)
            owned = rank_bounds(local_len, cp_size)
            compressed = {r: compressed_routes(cu, owned, cp_rank, r, reach[r], device) for r in ratios}
    valid, num_real = None, num_tokens
    if real_lengths is not None:
        valid = _valid_rows(cu_seqlens, real_lengths, layout, cp_size, cp_rank)
        num_real = int(real_lengths.sum())
    return AttentionPlan(
        layout=layout, exchange=exchange, ring_degree=ring_degree, cp_size=cp_size, cp_rank=cp_rank,
        num_tokens=num_tokens, local_len=local_len, num_documents=cu_seqlens.numel() - 1,
        num_global_queries=max(num_real, 1), segments=segments, prefix=prefix, gather_rows=rows,
        kv=MappingProxyType(kv), compressed=MappingProxyType(compressed),
        windows=planned_windows, compress_ratios=ratios, prev_blocks=MappingProxyType(reach),
        check_modules=check_modules, valid_queries=valid,
    )


def _real_lengths(cu_seqlens: Tensor, padding: Tensor | None) -> Tensor | None:
    """``[B]`` int64 (CPU) real length of every document: its length less ``padding``; ``None`` without padding."""
    if padding is None:
        return None
    check_int_dtype("padding", check_tensor("padding", padding))
    lengths = cu_seqlens.detach().to("cpu", torch.int64).diff()
    if padding.shape != lengths.shape:
        raise ValueError(
            f"padding must be a [B] = [{lengths.numel()}] tensor (one count per document of cu_seqlens), got shape"
            f" {tuple(padding.shape)}"
        )
    pad = padding.detach().to("cpu", torch.int64)
    bad = torch.nonzero((pad < 0) | (pad > lengths)).flatten()
    if bad.numel():
        doc = int(bad[0])
        raise ValueError(
            f"padding[{doc}] = {int(pad[doc])} must be in [0, {int(lengths[doc])}] (document {doc}'s length in"
            " cu_seqlens): padding counts the tokens at a document's end that are not real"
        )
    return lengths - pad


def _valid_rows(cu_seqlens: Tensor, real_lengths: Tensor, layout: Layout, cp_size: int, cp_rank: int) -> Tensor:
    """``[T/cp]`` bool on ``cu_seqlens.device``: the local rows whose token lies within its document's real length."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if layout == "zigzag":
        natural = zigzag_tnd_index(cu, cp_size, cp_rank)
    else:
        offset, local_len = contiguous_shard_range(int(cu[-1]), cp_size, cp_rank)
        natural = torch.arange(offset, offset + local_len)
    doc = torch.searchsorted(cu[1:], natural, right=True)
    return (natural - cu[doc] < real_lengths[doc]).to(cu_seqlens.device)


def _prev_blocks(ratios: Sequence[int], prev_blocks: Mapping[int, int] | None) -> dict[int, int]:
    """Earlier blocks each ratio's compressor reads: the caller's, else DeepSeek-V4's (1 at ratio 4)."""
    if prev_blocks is not None and not isinstance(prev_blocks, Mapping):
        raise TypeError(
            f"prev_blocks must be a mapping {{ratio: earlier blocks}} (e.g. {{4: 1}}) or None,"
            f" got {type(prev_blocks).__name__} {prev_blocks!r}"
        )
    given = dict(prev_blocks or {})
    unknown = [r for r in given if r not in ratios]
    if unknown:
        raise ValueError(f"prev_blocks names ratios {unknown} that are not in compress_ratios={list(ratios)}")
    return {r: check_int(f"prev_blocks[{r}]", given.get(r, 1 if r == 4 else 0), minimum=0) for r in ratios}


def bsnd_cu_seqlens(batch: int, seq_len: int, *, device: torch.device | str | None = None) -> Tensor:
    """cu_seqlens of a fixed-length batch seen as packed documents: ``[0, S, 2S, ..., B*S]``.

    Zigzag BSND sharding (rank ``r`` holds sequence chunks ``r`` and ``2cp-1-r`` of every row)
    is the per-document zigzag layout of these documents once ``[B, S/cp, ...]`` is flattened
    to ``[B*S/cp, ...]``: plan with ``plan_attention(bsnd_cu_seqlens(B, S), cp, r,
    layout="zigzag")``, run ``attention_forward`` on ``q.flatten(0, 1)`` and reshape the output.

    Args:
        batch: ``B >= 1``. seq_len: ``S >= 0``. device: where the tensor lives.

    Returns:
        ``[B + 1]`` int64.

    Example:
        >>> bsnd_cu_seqlens(2, 8).tolist()
        [0, 8, 16]
    """
    check_int("batch", batch, minimum=1)
    check_int("seq_len", seq_len, minimum=0)
    return torch.arange(batch + 1, device=device, dtype=torch.int64) * seq_len
