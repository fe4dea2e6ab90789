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

import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any, Generic, Literal, TypeVar, get_args

import torch
from torch import Tensor

from cpkv.checks import check_int, check_int_dtype, check_rank, check_tensor
from cpkv.agreement import agree
from cpkv.collectives import Group, check_fingerprint, check_group, check_group_position, check_same_on_all_ranks
from cpkv.plan.balance import DEFAULT_MAX_TOKENS_RATIO, balanced_layout, rank_costs, token_cap
from cpkv.plan.cost import CostModel
from cpkv.plan.conventions import document_real_lengths, validate_cu_seqlens
from cpkv.plan.layouts import ShardLayout, contiguous_layout, expand_ranges, zigzag_layout
from cpkv.plan.need import compressed_need, cut_at_parts, kv_need, token_partition
from cpkv.plan.prefix import PrefixKVPlan, compute_prefix_kv_cu_seqlens
from cpkv.plan.routes import CompressedRoutes, KVSource, RingRound
from cpkv.plan.segments import EntryVisibility, SegmentPlan, plan_segments
from cpkv.plan.sharding import check_zigzag_tnd_lengths

Layout = Literal["contiguous", "zigzag", "balanced"]
"""``"contiguous"``: rank ``r`` holds packed tokens ``[r*T/cp, (r+1)*T/cp)``; ``"zigzag"``: chunks
``r`` and ``2cp-1-r`` of every document (documents padded to multiples of ``2*cp``); ``"balanced"``:
ranges cut so that a V4 layer stack's modeled cost is equal on every rank (:mod:`cpkv.plan.balance`).
A :class:`~cpkv.plan.layouts.ShardLayout` gives any other layout (``plan.layout == "custom"``)."""
Exchange = Literal["allgather", "need"]
"""``"allgather"``: gather all kv (and compressor inputs); ``"need"``: move only the rows each rank needs."""
LayoutName = Literal["contiguous", "zigzag", "balanced", "custom"]
"""A plan's :attr:`AttentionPlan.layout`: the layout's name, ``"custom"`` for a given ``ShardLayout``."""
LAYOUTS: tuple[str, ...] = get_args(Layout)
EXCHANGES: tuple[str, ...] = get_args(Exchange)

_K = TypeVar("_K")
_V = TypeVar("_V")


class ReadOnlyMap(Mapping[_K, _V], Generic[_K, _V]):
    """A read-only mapping over a private dict: what an :class:`AttentionPlan` holds per window and per ratio.

    ``plan.kv[window]``, ``ratio in plan.compressed``, ``plan.prev_blocks.values()``: a
    ``Mapping`` with no method that changes it. Not a ``types.MappingProxyType``, which
    ``torch.compile`` does not trace (Dynamo stops at a proxy read: "mappingproxy affected by
    dictionary mutation"); Dynamo inlines these methods as reads of a plain dict. Pickles as
    its items (a plan made in a data-loader worker travels to the main process); equal to any
    mapping with the same items.

    Args:
        items: the entries (copied: a later change to ``items`` does not reach the map).
    """

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[_K, _V] | None = None) -> None:
        self._items: dict[_K, _V] = dict(items) if items is not None else {}

    def __getitem__(self, key: _K) -> _V:
        return self._items[key]

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[_K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"ReadOnlyMap({self._items!r})"

    def __reduce__(self) -> tuple[Any, tuple[dict[_K, _V]]]:
        return ReadOnlyMap, (self._items,)


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """Everything one rank needs to run prefix attention on its shard of one micro-batch.

    Attributes:
        layout, exchange, ring_degree: the options the plan was built with (``layout`` is
            ``"custom"`` for a :class:`~cpkv.plan.layouts.ShardLayout`).
        cp_size, cp_rank: the sharding.
        num_tokens: ``T``, packed tokens of the micro-batch (all ranks).
        local_len: tokens of this rank (``T / cp`` in the contiguous and zigzag layouts).
        num_documents: ``B`` (``cu_seqlens`` had ``B + 1`` entries).
        num_global_queries: ``N``, real (not padding) query tokens of the CP group, at least 1
            (the indexer-loss normaliser).
        segments: the rank's queries (in shard order) paired with their full causal prefixes,
            with blocks and visibility of every planned compress ratio. RoPE positions of the
            local tokens: ``segments.q_positions``.
        prefix: contiguous layout: where the prefix lies in the gathered kv, else ``None``.
        gather_rows: all-gather in the other layouts: ``[sum Lkv]`` int64 rows of the rank-major
            all-gather (``gather_len`` rows per rank) forming the prefix buffer (a prefix shared by
            two ranges of one document appears once per range), else ``None``.
        kv: need exchange: one :class:`KVSource` per planned window; all-gather: one source
            (key ``None``) that serves every window.
        compressed: need exchange: the :class:`~cpkv.plan.routes.CompressedRoutes` of each ratio.
        windows, compress_ratios: what was planned.
        prev_blocks: per planned ratio, how many earlier blocks of the same document each
            entry's compressor may read (the need exchange's compressor-input halo covers them).
            ``kv``, ``compressed`` and ``prev_blocks`` are read-only mappings (:class:`ReadOnlyMap`,
            which ``torch.compile`` traces).
        check_modules: whether compressed layer calls agree across ranks on their modules'
            outputs (:func:`plan_attention`).
        valid_queries: ``[T/cp]`` bool, ``True`` at the local rows that are real tokens, when
            ``plan_attention`` was given ``padding``; ``None`` when every token is real. Padding
            queries are attended as usual (mask their loss) but take no part in the indexer
            loss: neither in its value, its gradients nor ``N``.
        shards: every rank's token ranges (:class:`~cpkv.plan.layouts.ShardLayout`): cut
            per-token tensors with :meth:`shard`, put them back with :meth:`unshard`.
        gather_len: rows every rank contributes to an all-gather: the longest shard (shorter
            shards are padded; ``local_len`` in the contiguous and zigzag layouts).
        cost_model: the :class:`~cpkv.plan.cost.CostModel` of :attr:`rank_costs` (the one
            ``layout="balanced"`` balanced).
    """

    layout: LayoutName
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
    shards: ShardLayout | None = None
    gather_len: int = 0
    cost_model: CostModel = CostModel()

    @property
    def local_lens(self) -> tuple[int, ...]:
        """Tokens every rank holds (``local_lens[cp_rank] == local_len``), host ints, for logging."""
        return self.layout_ranges.local_lens

    @property
    def rank_costs(self) -> tuple[float, ...]:
        """Every rank's modeled step cost under :attr:`cost_model` (MACs, closed form per range), host floats."""
        return tuple(rank_costs(self.layout_ranges, self.cost_model).tolist())

    def comparison_options(self) -> list[int]:
        """The plan's options as integers, which every rank's plan of one batch shares (the cross-rank comparison).

        Layout, exchange, ring degree, ``check_modules``, ratios, earlier blocks, windows, the
        real-query count and, for balanced and custom layouts, every rank's ranges.
        """
        windows = [-1 if w is None else w for w in self.windows]
        ranges: list[int] = []
        if self.layout in ("custom", "balanced"):  # every rank must hold the same ranges (and cost model)
            shards = self.layout_ranges
            ranges = [-7, *shards.starts.tolist(), -7, *shards.ranks.tolist()]
        return [(*LAYOUTS, "custom").index(self.layout), EXCHANGES.index(self.exchange), self.ring_degree,
                int(self.check_modules), self.num_global_queries, *self.compress_ratios, -7, *self.prev_blocks.values(),
                -7, *windows, *ranges]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> AttentionPlan:
        """The plan with every tensor on ``device`` (the :attr:`shards` layout stays on the CPU).

        A plan made on the CPU in a data-loader worker moves to the GPU without a host sync
        with ``non_blocking=True`` once pinned (:meth:`pin_memory`, or ``DataLoader(...,
        pin_memory=True)``, which calls it); host ints and tuples are unchanged. Equal, field by
        field, to the plan :func:`plan_attention` makes from ``cu_seqlens`` on ``device``.
        """
        target = torch.device(device)
        moved: AttentionPlan = _map_tensors(self, lambda t: t.to(target, non_blocking=non_blocking))
        return mark_sizes_dynamic(moved)

    def pin_memory(self) -> AttentionPlan:
        """The plan with every CPU tensor in pinned (page-locked) memory (needs CUDA; the :attr:`shards` stay as they are)."""
        pinned: AttentionPlan = _map_tensors(self, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
        return pinned

    @property
    def q_positions(self) -> Tensor:
        """``[T/cp]`` int64 document position of each local token (for RoPE)."""
        return self.segments.q_positions

    @property
    def layout_ranges(self) -> ShardLayout:
        """:attr:`shards`, which :func:`plan_attention` always sets."""
        if self.shards is None:
            raise ValueError("plan has no shards (ShardLayout): build it with plan_attention")
        return self.shards

    def shard(self, x: Tensor, *, dim: int = 0) -> Tensor:
        """This rank's rows of a per-token tensor of the whole micro-batch, in shard order.

        Args:
            x: ``[..., T, ...]`` (tokens at ``dim``, natural packed order): token ids, labels,
                positions, embeddings; any dtype and device.

        Returns:
            ``[..., local_len, ...]`` on ``x``'s device (differentiable, an ``index_select``).

        Raises:
            TypeError: ``x`` not a tensor. ValueError: ``x.shape[dim] != T``.
        """
        return self.layout_ranges.shard(x, self.cp_rank, dim=dim)

    def unshard(self, shards: Sequence[Tensor], *, dim: int = 0) -> Tensor:
        """The whole micro-batch's per-token tensor in natural order from every rank's shard.

        Args:
            shards: a list of ``cp_size`` tensors, ``shards[r]`` rank ``r``'s rows
                ``[..., L_r, ...]`` (e.g. from ``torch.distributed.all_gather_object`` or a
                per-rank loop in a data loader).

        Returns:
            ``[..., T, ...]``.

        Raises:
            ValueError: not ``cp_size`` shards, or a shard without its rank's row count.
        """
        return self.layout_ranges.unshard(shards, dim=dim)

    def visible_for(self, ratio: int) -> EntryVisibility:
        """Which entries of the rank's entry buffer each query sees at ``ratio`` (this exchange's buffer)."""
        if self.exchange == "need" and ratio in self.compressed:
            visible = self.compressed[ratio].visible
            if visible is not None:
                return visible
        return self.segments.visible_for(ratio)

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


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor of its (nested) dataclasses, tuples and mappings; layouts and cost
    models kept, and the fields a dataclass names in ``host_fields`` (host data)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (ShardLayout, CostModel)):
        return obj
    if isinstance(obj, tuple):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, Mapping):
        return ReadOnlyMap({k: _map_tensors(v, fn) for k, v in obj.items()})
    if is_dataclass(obj) and not isinstance(obj, type):
        kept = getattr(obj, "host_fields", ())
        return replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn) for f in fields(obj) if f.name not in kept})
    return obj


def _tensors(obj: Any) -> Iterator[Tensor]:
    """Every tensor of ``obj``'s (nested) dataclasses, tuples and mappings, host fields included (read only)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for value in obj:
            yield from _tensors(value)
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from _tensors(value)
    elif is_dataclass(obj) and not isinstance(obj, (type, ShardLayout, CostModel)):
        for f in fields(obj):
            yield from _tensors(getattr(obj, f.name))


def mark_sizes_dynamic(plan: AttentionPlan) -> AttentionPlan:
    """``plan`` with every size of every tensor marked dynamic for ``torch.compile`` (returned as is).

    A compiled layer then traces the plan's tensors with symbolic sizes from its first graph, and
    a new packing (other sizes) reuses that graph instead of recompiling once per tensor whose
    size changes for the first time (``torch._dynamo.maybe_mark_dynamic``: only a hint, no error
    where a size stays static). Only when Dynamo is loaded (``torch.compile`` was called in this
    process): eager runs neither import it nor pay for it. :func:`plan_attention` and
    :meth:`AttentionPlan.to` call it.
    """
    if "torch._dynamo" not in sys.modules:
        return plan
    import torch._dynamo

    for t in _tensors(plan):
        if t.ndim:
            torch._dynamo.maybe_mark_dynamic(t, list(range(t.ndim)))
    return plan


def _full_prefix(layout: ShardLayout, rank: int, ratios: Sequence[int]) -> SegmentPlan:
    """Segments of the rank's ranges over their documents' full prefixes (the all-gather's buffer)."""
    starts, ends = layout.ranges_of(rank)
    doc_start = layout.cu_seqlens.index_select(0, layout.documents[int(layout.offsets[rank]):int(layout.offsets[rank + 1])])
    zero = torch.zeros(1, dtype=torch.int64)
    cu_q, cu_kv = torch.cat([zero, torch.cumsum(ends - starts, 0)]), torch.cat([zero, torch.cumsum(ends - doc_start, 0)])
    return plan_segments(cu_q, cu_kv, compress_ratios=ratios)


def _gather_rows(layout: ShardLayout, rank: int, gather_len: int) -> Tensor:
    """``[sum Lkv]`` int64: each full-prefix buffer row's row in the rank-major all-gather (``gather_len`` rows per rank).

    A prefix that two ranges of one document share appears once per range.
    """
    starts, ends = layout.ranges_of(rank)
    doc_start = layout.cu_seqlens.index_select(0, layout.documents[int(layout.offsets[rank]):int(layout.offsets[rank + 1])])
    pieces = cut_at_parts(doc_start, ends, token_partition(layout))  # runs of one holder's consecutive rows
    first = pieces.src * gather_len + pieces.row
    return expand_ranges(first, first + (pieces.hi - pieces.lo))


def shard_layout(
    cu_seqlens: Tensor, cp_size: int, layout: Layout | ShardLayout, cost_model: CostModel | None = None,
    max_tokens_ratio: float | None = DEFAULT_MAX_TOKENS_RATIO,
) -> ShardLayout:
    """Every rank's token ranges for ``layout`` (validated against ``cu_seqlens`` and ``cp_size``).

    Raises:
        ValueError: an unknown layout, ``T % cp_size != 0`` (contiguous, zigzag), a zigzag document
            length not divisible by ``2 * cp_size``, a ``ShardLayout`` for other documents or ranks.
    """
    if isinstance(layout, ShardLayout):
        if layout.cp_size != cp_size or not torch.equal(layout.cu_seqlens, cu_seqlens.detach().to("cpu", torch.int64)):
            raise ValueError("layout (a ShardLayout) must be made for these cu_seqlens and cp_size")
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS} or a ShardLayout, got {layout!r}")
    if layout == "balanced":
        return balanced_layout(cu_seqlens, cp_size, cost_model, max_tokens_ratio=max_tokens_ratio)
    num_tokens = int(cu_seqlens[-1])
    if num_tokens % cp_size:
        raise ValueError(
            f"T = {num_tokens} tokens must be divisible by cp_size = {cp_size} for layout={layout!r}"
            " (pad the batch, or use layout='balanced')"
        )
    if layout == "zigzag":
        check_zigzag_tnd_lengths(cu_seqlens, cp_size)
        return zigzag_layout(cu_seqlens, cp_size)
    return contiguous_layout(cu_seqlens, cp_size)


def plan_attention(
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, layout: Layout | ShardLayout = "contiguous", exchange: Exchange = "allgather",
    ring_degree: int = 1, compress_ratios: Sequence[int] = (), windows: Sequence[int | None] = (),
    prev_blocks: Mapping[int, int] | None = None, check_modules: bool = True, group: Group = None,
    check_ranks: bool = True, padding: Tensor | None = None, cost_model: CostModel | None = None,
    max_tokens_ratio: float | None = DEFAULT_MAX_TOKENS_RATIO,
    fingerprint: Tensor | None = None,
) -> AttentionPlan:
    """Pure per-rank plan of one micro-batch (no communication; identical structure on every rank).

    Defaults to ``layout="contiguous", exchange="allgather"``, not the recommended balanced +
    need: the planner sees no model, so it knows neither the cost to balance nor the layers' windows.

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64 **global** leading-zero cu_seqlens of the micro-batch
            (all ranks' tokens, padding included), any device; the plan's tensors live there.
            ``T % cp_size == 0`` for the contiguous and zigzag layouts; with ``layout="zigzag"``
            every document length is a multiple of ``2 * cp_size`` (pad with
            :func:`cpkv.plan.conventions.pad_documents`). ``"balanced"`` takes any lengths.
        cp_size, cp_rank: CP group size and this rank.
        layout: ``"contiguous"``, ``"zigzag"`` (per-document zigzag TND; zigzag BSND is this
            layout with equal-length documents, see :func:`bsnd_cu_seqlens`), ``"balanced"``
            (ranges cut so that the busiest rank's ``cost_model`` cost is least with every rank
            within ``max_tokens_ratio * T / cp`` tokens, :func:`cpkv.plan.balance.balanced_layout`), or any
            :class:`~cpkv.plan.layouts.ShardLayout` (the same on every rank). Cut the batch's
            per-token tensors with ``plan.shard(x)``.
        exchange: ``"allgather"`` or ``"need"`` (any layout).
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
            returned (entry count and width, key width, query shapes) before any entry moves,
            so a module that fails on one rank raises on every rank: at the step's
            ``StepStatus.check()`` when the call has a status (no host sync in the call,
            :mod:`cpkv.status`), else at once, agreed with one all-reduce of two integers and a
            host read per call (:mod:`cpkv.agreement`). ``False`` drops both: a failing module
            then raises on its own rank only and the others wait until the collective timeout.
        group: the CP process group (``torch.distributed.group.WORLD`` for the default group;
            a 1-D ``DeviceMesh`` such as ``mesh["cp"]`` stands for its group), or ``None`` (default) to plan without communication. With a group, every rank
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
        cost_model: the :class:`~cpkv.plan.cost.CostModel` of the model: ``layout="balanced"``
            balances it and requires it (a model's cost is never guessed); every layout reports
            it per rank (``plan.rank_costs``, with ``plan.local_lens``; without one the other
            layouts report DeepSeek-V4-Flash's, :class:`CostModel` ``()``).
        max_tokens_ratio: ``layout="balanced"``: the cap on a rank's tokens in units of ``T / cp``
            (default 1.10; ``None``: no cap); ignored by the other layouts.
        fingerprint: with ``group`` and ``check_ranks``: ``[n]`` int64 values every rank must
            hold too, compared in the same all-reduces as ``cu_seqlens`` (e.g.
            :func:`cpkv.integrations.causal_lm.batch_fingerprint` of the batch's token ids and
            labels, so a rank with another token raises on every rank). Ignored without a group.

    Returns:
        :class:`AttentionPlan`.

    Raises:
        TypeError, ValueError: invalid ``cu_seqlens``, ``T % cp_size != 0`` (contiguous, zigzag),
            rank out of range, an unknown layout or exchange, a ``ShardLayout`` made for other
            ``cu_seqlens`` or ``cp_size``, ``cost_model`` not a ``CostModel`` (or ``None`` with
            ``layout="balanced"``), ``max_tokens_ratio < 1``, ``ring_degree > 1``
            without ``exchange="need"``, a zigzag document
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
        return mark_sizes_dynamic(_build_plan(cu_seqlens, cp_size, cp_rank, layout, exchange, ring_degree, compress_ratios,
                                              windows, prev_blocks, check_modules, padding, cost_model, max_tokens_ratio))

    if group is None:
        return build()
    group = check_group("group", group)
    try:
        check_group_position(group, cp_size, cp_rank)
        check_fingerprint(fingerprint)
        plan = build()
    except Exception as error:  # noqa: BLE001 - every rank learns of it, then raises
        agree(error, group)
        raise
    agree(None, group)
    if check_ranks:
        padded = [] if padding is None else [-7, *padding.detach().to("cpu", torch.int64).tolist()]
        check_same_on_all_ranks(cu_seqlens, group, options=[*plan.comparison_options(), *padded], fingerprint=fingerprint)
    return plan


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
    cu_seqlens: Tensor, cp_size: int, cp_rank: int, layout: Layout | ShardLayout, exchange: Exchange, ring_degree: int,
    compress_ratios: Sequence[int], windows: Sequence[int | None], prev_blocks: Mapping[int, int] | None,
    check_modules: bool, padding: Tensor | None, cost_model: CostModel | None = None,
    max_tokens_ratio: float | None = DEFAULT_MAX_TOKENS_RATIO,
) -> AttentionPlan:
    """:func:`plan_attention` without the group: validate, then plan."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    check_int("ring_degree", ring_degree, minimum=1)
    check_int("cp_size", cp_size, minimum=1)
    check_rank("cp_rank", cp_rank, cp_size)
    if not isinstance(check_modules, bool):
        raise TypeError(f"check_modules must be a bool, got {type(check_modules).__name__}")
    if ring_degree > 1 and exchange != "need":
        raise ValueError(f"ring_degree={ring_degree} splits the need-based exchange: pass exchange='need'")
    validate_cu_seqlens(cu_seqlens)
    token_cap(int(cu_seqlens[-1]), cp_size, max_tokens_ratio)  # validated for every layout
    ratios = tuple(r for r in _int_sequence("compress_ratios", compress_ratios, minimum=2) if r is not None)
    planned_windows = _int_sequence("windows", windows, minimum=1, allow_none=True)
    reach = _prev_blocks(ratios, prev_blocks)
    real_lengths = None if padding is None else document_real_lengths(cu_seqlens, padding)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise TypeError(f"cost_model must be a CostModel or None, got {type(cost_model).__name__}")
    if cost_model is None and layout == "balanced":
        raise ValueError(
            "layout='balanced' needs the model's cost: pass cost_model=CostModel.from_hf_config(config) (Llama, Qwen,"
            " DeepSeek-V3), .from_deepseek_v4(config), .from_megatron(config) or .from_v4(configs); the integrations"
            " pass it (deepseek_v4_plan_options(config), plan_from_packed_seq_params(..., config=))"
        )
    model = CostModel() if cost_model is None else cost_model
    shards = shard_layout(cu_seqlens, cp_size, layout, model, max_tokens_ratio)
    name: LayoutName = "custom" if isinstance(layout, ShardLayout) else layout
    num_tokens, local_len, gather_len = int(cu_seqlens[-1]), shards.local_lens[cp_rank], max(shards.local_lens)
    device = cu_seqlens.device
    prefix, rows, compressed = None, None, {}
    if name == "contiguous":
        prefix = compute_prefix_kv_cu_seqlens(cu_seqlens, cp_rank * local_len, local_len)
        segments = plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv, compress_ratios=ratios)
    else:
        segments = _to_device(_full_prefix(shards, cp_rank, ratios), device)
        rows = _gather_rows(shards, cp_rank, gather_len).to(device) if exchange == "allgather" else None
    kv: dict[int | None, KVSource] = {None: KVSource(None, 0, segments, ())}
    if exchange == "need":
        parts = token_partition(shards)
        kv = {w: _on(kv_need(shards, parts, cp_rank, w, ring_degree, device), device) for w in planned_windows or (None,)}
        positions = segments.q_positions.cpu()
        compressed = {r: compressed_need(shards, parts, cp_rank, r, reach[r], positions, device) for r in ratios}
    valid, num_real = None, num_tokens
    if real_lengths is not None:
        valid = _valid_rows(shards, real_lengths, cp_rank).to(device)
        num_real = int(real_lengths.sum())
    return AttentionPlan(
        layout=name, exchange=exchange, ring_degree=ring_degree, cp_size=cp_size, cp_rank=cp_rank,
        num_tokens=num_tokens, local_len=local_len, num_documents=cu_seqlens.numel() - 1,
        num_global_queries=max(num_real, 1), segments=segments, prefix=prefix, gather_rows=rows,
        kv=ReadOnlyMap(kv), compressed=ReadOnlyMap(compressed),
        windows=planned_windows, compress_ratios=ratios, prev_blocks=ReadOnlyMap(reach),
        check_modules=check_modules, valid_queries=valid, shards=shards, gather_len=gather_len, cost_model=model,
    )


def _to_device(segments: SegmentPlan, device: torch.device) -> SegmentPlan:
    """``segments`` with its tensors on ``device`` (planned on the CPU)."""
    if device.type == "cpu":
        return segments
    moved = {f.name: getattr(segments, f.name) for f in fields(segments)}
    for key, value in moved.items():
        if isinstance(value, Tensor):
            moved[key] = value.to(device)
    moved["compressed"] = tuple(replace(c, block_starts=c.block_starts.to(device), entry_positions=c.entry_positions.to(device))
                                for c in segments.compressed)
    moved["visible"] = tuple(replace(v, cu_seqlens=v.cu_seqlens.to(device), visible_start=v.visible_start.to(device),
                                     visible_count=v.visible_count.to(device)) for v in segments.visible)
    return SegmentPlan(**moved)


def _on(source: KVSource, device: torch.device) -> KVSource:
    """``source`` with its segments and key ranges on ``device``."""
    if device.type == "cpu":
        return source
    rounds = tuple(replace(r, ranges=replace(r.ranges, lo=r.ranges.lo.to(device), hi=r.ranges.hi.to(device)))
                   for r in source.rounds)
    return replace(source, segments=_to_device(source.segments, device), rounds=rounds)


def _valid_rows(shards: ShardLayout, real_lengths: Tensor, cp_rank: int) -> Tensor:
    """``[local_len]`` bool (CPU): the local rows whose token lies within its document's real length."""
    natural = shards.local_tokens(cp_rank)
    cu = shards.cu_seqlens
    doc = torch.searchsorted(cu[1:], natural, right=True)
    return natural - cu[doc] < real_lengths[doc]


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
