"""``layout="balanced"``: documents cut into ranges so that the busiest rank's modeled cost is least, under a token cap.

The cost of a token is :class:`~cpkv.plan.cost.CostModel`'s: the whole model's step work at its
document position (dense work plus attention). A rank's activation memory follows its tokens,
so a rank may hold at most ``cap = max(ceil(T / cp), floor(max_tokens_ratio * T / cp))`` tokens
(``max_tokens_ratio`` 1.10 by default; ``None``: no cap).

:func:`balanced_layout` lays the documents, in packed order, end to end on a line of cost (each
as long as its modeled cost) and cuts the line into ``cp`` equal parts, rank ``r`` owning part
``r``; a document inside one part stays whole on that rank. It tries two ways of cutting a
document that crosses part boundaries:

* **contiguous cuts**: at the token where the boundary falls (as the contiguous layout cuts at
  ``T / cp``, but on the cost line): each rank holds one run of tokens, so its exchange reads
  what the contiguous layout's does;
* **head-tail cuts**: a document spanning ranks ``r0..r1`` with shares ``s_k`` of its cost, each
  rank holding a head chunk and a tail chunk (outermost pair on ``r0``, innermost on ``r1``,
  which joins them); the head chunks have tokens in proportion to the shares (``n/2`` in all)
  and each tail cut is placed, by bisection on the closed-form cumulative cost, so that every
  rank's pair costs its share. A pair takes cheap tokens from the head and dear ones from the
  tail, so its tokens follow the shares too (a contiguous cut at equal cost gives a long
  document's first rank several times its share of tokens: cost per token grows with ``p``).
  A tail cut always exists: the per-token cost is non-decreasing in ``p``, so a head chunk
  (positions ``< n/2``) never costs more than its share.

Contiguous cuts are also tried **placed** (:func:`_placed_cuts`), to move fewer bytes: a rank
holding a piece of a cut document that starts at depth ``p`` receives rows of the ``p`` tokens
before it (window rows, compressed entries and their indexer keys, compressor rows), so within
:data:`COST_SLACK` of each rank's share a cut moves to a document edge or a multiple of the
largest compress ratio (no straddled compressor block), a document cut by one boundary may be
cut reversed (the earlier rank takes its tail, the later its head; :func:`_orient` picks each
boundary's way, exact minimax over the ranks), and a document cut by several boundaries ends
with a whole rank's share (its deepest piece, the longest one can be at equal costs).

When a cut breaks the cap, the line is drawn in a blended cost, ``cost + lam * mean_cost *
tokens``, with about the least ``lam`` that keeps every rank within the cap
(head-tail cuts; found by doubling then bisection, :data:`BLEND_START`; ``lam = inf``: tokens
alone, which always does). Of the candidates within the cap, those within :data:`COST_SLACK`
of the least busiest-rank cost compete on the busiest rank's remote rows (:func:`_remote`):
the fewest wins. The contiguous layout itself (``T % cp == 0``) is a candidate, so balanced is
never costlier than contiguous; when it is within :data:`COST_SLACK` of the best, only the
contiguous and placed cuts compete. At most ``cp - 1`` documents are cut (one per boundary at most crosses it), and a
rank holds whole documents plus one range (contiguous cuts) or two (head-tail) of each cut
document it spans.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from cpkv.checks import check_int
from cpkv.plan.conventions import validate_cu_seqlens
from cpkv.plan.cost import CostModel
from cpkv.plan.layouts import ShardLayout, contiguous_layout, layout_from_ranges

__all__ = ["DEFAULT_MAX_TOKENS_RATIO", "CostModel", "balanced_layout", "rank_costs", "token_cap"]

DEFAULT_MAX_TOKENS_RATIO = 1.10
"""The default cap on a rank's tokens, in units of ``T / cp`` (docs/semantics.md, "Balanced layout": on 30 log-normal
1M-token packs at cp 8-64, V4-Flash, 12 miss the 1.02 cost target at 1.05 (worst 1.27x the mean), 4 at 1.10 (worst 1.18x)."""
BLEND_START, BLEND_STOP, BLEND_STEPS = 0.25, 64.0, 6
"""The token weight ``lam`` search: from ``BLEND_START``, times 4 until the cap holds (or past
``BLEND_STOP``: tokens alone), then ``BLEND_STEPS`` bisection steps towards the least that holds."""
COST_SLACK = 1e-3
"""Of the candidates within the cap, those whose busiest rank costs at most this much more (relative) than the
least compete on the busiest rank's remote rows (:func:`_remote`; fewest wins, then least cost); placed cuts move
within it. 0.1% of a step's compute is about the time of the bytes at stake (docs/semantics.md, "Balanced layout")."""

Prefix = Callable[[Tensor], Tensor]
Ranges = tuple[Tensor, Tensor, Tensor]


def _invert(prefix: Prefix, lengths: Tensor, targets: Tensor) -> Tensor:
    """``[K]`` int64 prefix lengths ``P`` in ``[0, lengths]`` whose ``prefix(P)`` is nearest each target.

    Bisection on the (non-decreasing) closed form, vectorised over the targets.
    """
    lo, hi = torch.zeros_like(lengths), lengths.clone()
    for _ in range(max(int(lengths.max()).bit_length(), 1) if lengths.numel() else 0):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        below = prefix(mid) < targets
        lo, hi = torch.where(below, mid + 1, lo), torch.where(below, hi, mid)
    # lo: the smallest P with F(P) >= target (or the length); the one before may be nearer.
    before = (lo - 1).clamp(min=0)
    nearer = (lo > 0) & (targets - prefix(before) < prefix(lo) - targets)
    return torch.where(nearer, before, lo)


def _check_cost(cost: object) -> CostModel:
    if cost is None:
        return CostModel()
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel or None, got {type(cost).__name__}")
    return cost


def token_cap(num_tokens: int, cp_size: int, max_tokens_ratio: float | None) -> int:
    """Most tokens a rank may hold: ``max(ceil(T / cp), floor(max_tokens_ratio * T / cp))`` (``None``: ``T``).

    Raises:
        TypeError: ``max_tokens_ratio`` not a float or ``None``. ValueError: ``max_tokens_ratio < 1``.
    """
    if max_tokens_ratio is None:
        return num_tokens
    if isinstance(max_tokens_ratio, bool) or not isinstance(max_tokens_ratio, (int, float)):
        raise TypeError(f"max_tokens_ratio must be a float >= 1 or None, got {type(max_tokens_ratio).__name__}")
    if not max_tokens_ratio >= 1.0:
        raise ValueError(f"max_tokens_ratio must be >= 1 (a cap in units of T / cp) or None, got {max_tokens_ratio}")
    if math.isinf(max_tokens_ratio):
        return num_tokens
    return max(-(-num_tokens // cp_size), math.floor(max_tokens_ratio * num_tokens / cp_size))


def _line(prefix: Prefix, lengths: Tensor, cp: int) -> tuple[Tensor, Tensor, float]:
    """Each document's cost and where it starts on the cost line, and one rank's share of the line."""
    doc_costs = prefix(lengths)
    return doc_costs, torch.cumsum(doc_costs, 0) - doc_costs, float(doc_costs.sum()) / cp


def _orient(forward: list[int], reverse: list[float]) -> list[bool]:
    """Which boundaries to reverse so that the busiest rank receives the fewest rows (then the fewest in all).

    Boundary ``j`` (between ranks ``j`` and ``j + 1``) cut forward sends ``forward[j]`` rows to
    rank ``j + 1``, reversed ``reverse[j]`` to rank ``j`` (``inf``: not allowed); rank ``j``
    receives from boundary ``j - 1`` (forward) and boundary ``j`` (reversed), never from both
    (each cut also sends a rank about ``W`` window rows and up to a block of compressor rows
    per layer, whatever its depth, so a rank receiving two cuts would be the busiest). Exact
    minimax over the chain by dynamic programming on the ``cp - 1`` boundaries (two states
    each), on ``(worst, total)`` compared lexicographically; ties keep the forward cut. Host
    floats: a loop over boundaries, not over tokens or documents.
    """
    if not forward:
        return []
    inf = math.inf
    # values[o]: (worst, total) rows of ranks 0..j given boundary j's orientation o (0 forward, 1 reversed).
    values = [(0.0, 0.0), (reverse[0], reverse[0])]
    picks: list[tuple[int, int]] = []
    for j in range(1, len(forward)):
        step, pick = [], []
        for o, into in ((0, 0.0), (1, reverse[j])):
            # A rank takes a reversed cut's tail only when it receives from no other cut (forward[j - 1] == 0).
            alone = inf if o and forward[j - 1] else forward[j - 1] + into
            options = [(max(values[q][0], received), values[q][1] + received) for q, received in ((0, alone), (1, into))]
            q = 0 if options[0] <= options[1] else 1
            step.append(options[q])
            pick.append(q)
        values = step
        picks.append((pick[0], pick[1]))
    final = [(max(values[0][0], forward[-1]), values[0][1] + forward[-1]), values[1]]
    o = 0 if final[0] <= final[1] else 1
    flips = [bool(o)]
    for back in reversed(picks):
        o = back[o]
        flips.append(bool(o))
    return flips[::-1]


def _placed(prefix: Prefix, n: Tensor, share: Tensor, slack: float, block: int) -> Tensor:
    """``[K]`` int64 head lengths of cost about ``share`` in documents of ``n`` tokens, placed to move fewest rows.

    The head nearest ``share`` (:func:`_invert`), moved within the heads costing ``share +- slack``
    to the document's start or end when either is in reach (the cut moves nothing), else to the
    nearest multiple of ``block`` when one is (the rank after the cut then reads no hidden rows
    of a straddled compressor block), else kept.
    """
    if slack <= 0:
        return _invert(prefix, n, share)
    exact, lo, hi = _invert(prefix, n.repeat(3), torch.cat([share, share - slack, share + slack])).view(3, -1)
    aligned = torch.div(exact + block // 2, block, rounding_mode="floor") * block
    placed = torch.where((aligned >= lo) & (aligned <= hi) & (aligned <= n), aligned, exact)
    placed = torch.where(hi >= n, n, placed)
    return torch.where(lo <= 0, 0, placed)


def _contiguous_cuts(prefix: Prefix, cu: Tensor, cp: int) -> Ranges:
    """Rank boundaries where the cost line's ``cp - 1`` cuts fall, each at its nearest token; then cut at documents."""
    lengths, firsts = cu.diff(), cu[:-1]
    doc_costs, begin, target = _line(prefix, lengths, cp)
    bounds = torch.arange(1, cp, dtype=torch.float64) * target
    doc = torch.searchsorted(begin + doc_costs, bounds, right=True).clamp(max=lengths.numel() - 1)
    cuts = firsts[doc] + _invert(prefix, lengths[doc], (bounds - begin[doc]).clamp(min=0.0))
    rank_start = torch.cat([cu[:1], torch.cummax(cuts, 0).values if cuts.numel() else cuts, cu[-1:]])
    points = torch.unique(torch.cat([cu, rank_start]))
    starts, ends = points[:-1], points[1:]
    return starts, ends, (torch.searchsorted(rank_start, starts, right=True) - 1).clamp(0, cp - 1)


def _placed_cuts(prefix: Prefix, cu: Tensor, cp: int, slack: float, block: int, rows: Callable[[Tensor], Tensor]) -> Ranges:
    """The cost line's cuts placed and each cut document's pieces ordered so that the busiest rank receives least.

    A rank holding a piece of a cut document that starts at depth ``p`` receives rows of the
    ``p`` tokens before it (window rows, compressed entries and their indexer keys, compressor
    rows). So, with every rank's cost its share within ``slack`` (a fraction of one rank's cost):

    * each cut moves to where it moves fewer rows (:func:`_placed`: a document edge, or a
      multiple of ``block``) when that is within ``slack / 2`` of a rank's cost;
    * a document cut by one boundary (ranks ``j``, ``j + 1``) may be cut **reversed**: rank
      ``j`` takes a tail of the cost the forward cut gives it, rank ``j + 1`` the head; each
      boundary's orientation by :func:`_orient`;
    * a document cut by ``k >= 2`` boundaries (ranks ``j0..j0+k``) keeps its head on ``j0`` and
      ends with the piece of ``j0 + k - 1``, a whole rank's share: the deepest piece, whose
      holder receives the most, is the longest one can be at equal costs. The pieces run ``j0,
      j0 + k, j0 + 1, ..., j0 + k - 1``, so rank ``j0 + k`` receives only the head.

    Costs are those of positions, so a rank's cost is its share whichever piece it holds.
    """
    lengths, firsts = cu.diff(), cu[:-1]
    doc_costs, begin, target = _line(prefix, lengths, cp)
    bounds = torch.arange(1, cp, dtype=torch.float64) * target
    doc = torch.searchsorted(begin + doc_costs, bounds, right=True).clamp(max=lengths.numel() - 1)
    n, c = lengths[doc], doc_costs[doc]
    reach = 0.5 * slack * target
    cuts = firsts[doc] + _placed(prefix, n, (bounds - begin[doc]).clamp(min=0.0), reach, block)
    cuts = torch.cummax(cuts, 0).values if cuts.numel() else cuts
    depth = cuts - firsts[doc]
    inside = (depth > 0) & (depth < n)
    # Whole documents: the rank whose run of the line holds their start.
    rank_start = torch.cat([cu[:1], cuts, cu[-1:]])
    crossed = torch.zeros_like(lengths).index_add_(0, doc[inside], torch.ones_like(doc[inside]))
    whole = (crossed == 0) & (lengths > 0)
    whole_rank = (torch.searchsorted(rank_start, firsts[whole], right=True) - 1).clamp(0, cp - 1)
    # Cut documents: one row per inside boundary, grouped by document (consecutive boundaries).
    j = inside.nonzero().flatten()
    d, dep, nd, cd = doc[j], depth[j], n[j], c[j]
    _, counts = torch.unique_consecutive(d, return_counts=True)
    start = torch.cumsum(counts, 0) - counts
    k = counts.repeat_interleave(counts)
    i = torch.arange(j.numel()) - start.repeat_interleave(counts)
    j0 = j[start].repeat_interleave(counts)
    last_share = (cd - prefix(dep[start + counts - 1]).repeat_interleave(counts))  # rank j0 + k's cost in the document
    # k >= 2: piece i >= 1 ends where the line reaches the forward cut i - 1 plus rank j0 + k's share.
    # k == 1, reversed: the head costs the later rank's share (the document's cost minus the earlier rank's).
    rotated, heads = _placed(prefix, nd.repeat(2), torch.cat([prefix(dep.roll(1)) + last_share, cd - prefix(dep)]),
                             reach, block).view(2, -1)
    pos = torch.where((k >= 2) & (i >= 1), rotated, dep)
    pos = torch.cummax(firsts[d] + pos, 0).values - firsts[d] if pos.numel() else pos
    owner = torch.where(i == 0, j0, torch.where(i == 1, j0 + k, j0 + i - 1))  # the rank of the piece ending at pos
    # k == 1: forward (rank j0 + 1 receives dep) or reversed (rank j0 receives the head).
    can_flip = (k == 1) & (heads > 0) & (heads < nd)
    forward = torch.zeros(cp - 1, dtype=torch.int64)
    forward[j] = rows(torch.where(k == 1, dep, pos.roll(-1)))  # rotated: rank j0 + k receives piece 0's end
    forward[j[(k >= 2) & (i == k - 1)]] = rows(pos[start[counts >= 2]])
    reverse = torch.full((cp - 1,), math.inf, dtype=torch.float64)
    reverse[j[can_flip]] = rows(heads[can_flip]).double()
    flip = torch.tensor(_orient(forward.tolist(), reverse.tolist()), dtype=torch.bool)[j] if j.numel() else can_flip
    pos = torch.where(flip, heads, pos)
    owner = torch.where(flip, j0 + 1, owner)
    final = torch.where(k == 1, torch.where(flip, j0, j0 + 1), j0 + k - 1)  # the rank of the document's last piece
    is_last = i == k - 1
    lo = torch.where(i == 0, 0, pos.roll(1))
    starts = torch.cat([firsts[whole], firsts[d] + lo, (firsts[d] + pos)[is_last]])
    ends = torch.cat([firsts[whole] + lengths[whole], firsts[d] + pos, (firsts[d] + nd)[is_last]])
    return starts, ends, torch.cat([whole_rank, owner, final[is_last]])


def _head_tail_cuts(prefix: Prefix, cu: Tensor, cp: int) -> Ranges:
    """Documents inside a part whole; a document crossing parts cut head-tail among the ranks it spans."""
    lengths, firsts = cu.diff(), cu[:-1]
    doc_costs, begin, target = _line(prefix, lengths, cp)
    first_rank = torch.div(begin, target, rounding_mode="floor").long().clamp(0, cp - 1)
    last_rank = torch.maximum(torch.ceil((begin + doc_costs) / target).long() - 1, first_rank).clamp(max=cp - 1)
    present = lengths > 0
    whole = present & (first_rank == last_rank)
    split = (present & (first_rank < last_rank)).nonzero().flatten()
    # A split document of n tokens spanning ranks r0..r1: rank k's head chunk ends at
    # h_k = (n // 2) * B_k / c (B_k: the document's cost on ranks r0..k, c: its cost), so heads
    # have tokens in proportion to the shares; its tail chunk starts at t_k, placed (by
    # bisection on the closed form) so that ranks r0..k hold B_k: F(h_k) + c - F(t_k) = B_k.
    spans = last_rank[split] - first_rank[split] + 1
    doc = split.repeat_interleave(spans)  # one row per (split document, rank it spans)
    group_start = torch.cumsum(spans, 0) - spans
    offset = torch.arange(doc.numel()) - group_start.repeat_interleave(spans)
    rank = first_rank[doc] + offset
    n, c = lengths[doc], doc_costs[doc]
    last = offset == (spans - 1).repeat_interleave(spans)
    reached = torch.where(last, c, ((rank + 1).double() * target - begin[doc]).clamp(min=0.0).minimum(c))
    mid = torch.div(n, 2, rounding_mode="floor")
    heads = torch.where(last, mid, torch.floor(mid.double() * (reached / c)).long().clamp(max=mid))
    tails = _invert(prefix, n, c + prefix(heads) - reached)
    tails = torch.where(last, mid, tails.clamp(min=mid))
    # Non-increasing within each document despite rounding: cummin, each document offset below the previous.
    shift = torch.arange(split.numel()).repeat_interleave(spans) * (int(lengths.max()) + 1)
    tails = (tails - shift).cummin(0).values + shift
    is_first = offset == 0
    prev_heads = torch.where(is_first, 0, heads.roll(1))
    prev_tails = torch.where(is_first, n, tails.roll(1))
    base = firsts[doc]
    starts = torch.cat([firsts[whole], base + prev_heads, base + tails])
    ends = torch.cat([firsts[whole] + lengths[whole], base + heads, base + prev_tails])
    return starts, ends, torch.cat([first_rank[whole], rank, rank])


def _blended(model: CostModel, mean: float, lam: float) -> Prefix:
    """The cost prefix with ``lam * mean`` added per token (``inf``: the token count alone)."""
    if math.isinf(lam):
        return lambda n: n.double()
    return lambda n: model.prefix(n) + (lam * mean) * n.double()


def _ranks_of(cu: Tensor, cp: int, ranges: Ranges, model: CostModel) -> tuple[Tensor, Tensor]:
    """``([cp]`` float64 cost, ``[cp]`` int64 tokens``)`` of every rank under ``ranges``."""
    starts, ends, ranks = ranges
    first = cu[torch.searchsorted(cu[1:], starts, right=True)]
    costs = torch.zeros(cp, dtype=torch.float64).index_add_(0, ranks, model.prefix(ends - first) - model.prefix(starts - first))
    return costs, torch.zeros(cp, dtype=torch.int64).index_add_(0, ranks, ends - starts)


def _cut_rows(model: CostModel, g: Tensor) -> Tensor:
    """Rows over the layer stack that ``g`` remote tokens before a range cost its rank (int64, ``g`` int64)."""
    rows = (model.swa_layers + model.csa_layers + model.hca_layers) * g.clamp(max=model.window - 1)
    for m, layers in ((model.csa_ratio, model.csa_layers), (model.hca_ratio, model.hca_layers)):
        rows = rows + layers * (torch.div(g, m, rounding_mode="floor") + g % m)
    return rows


def _remote(cu: Tensor, cp: int, starts: Tensor, ends: Tensor, ranks: Tensor, model: CostModel) -> Tensor:
    """``[cp]`` int64 remote rows: per rank, over the documents it holds, the tokens before its last one there that it does not hold.

    The need exchange sends a rank rows of exactly those tokens (window rows, compressed
    entries and their indexer keys, compressor rows: about ``1/m`` entries per such token
    at compress ratio ``m``, at most ``W - 1`` window rows per range), so its bytes grow
    with this count. A rank holding whole documents and heads of cut ones has 0.
    """
    docs = cu.numel() - 1
    pair, slot = torch.unique(ranks * docs + torch.searchsorted(cu[1:], starts, right=True), return_inverse=True)
    last = torch.zeros_like(pair).scatter_reduce_(0, slot, ends, "amax", include_self=False)
    held = torch.zeros_like(pair).index_add_(0, slot, ends - starts)
    remote = _cut_rows(model, last - cu[pair % docs] - held)
    return torch.zeros(cp, dtype=torch.int64).index_add_(0, torch.div(pair, docs, rounding_mode="floor"), remote)


def balanced_layout(
    cu_seqlens: Tensor, cp_size: int, cost: CostModel | None = None, *,
    max_tokens_ratio: float | None = DEFAULT_MAX_TOKENS_RATIO,
) -> ShardLayout:
    """Every rank's ranges: the least busiest-rank cost (:class:`CostModel`) with every rank within the token cap.

    See the module docstring: the cost line cut into ``cp_size`` equal parts, documents crossing
    parts cut contiguously or head-tail, the line blended with tokens when the cap needs it, the
    contiguous layout as a floor. No padding: any document lengths (empty ones included) and
    any ``T``; ranks may hold different token counts (a rank may hold none when there are fewer
    tokens than ranks). Vectorised over tokens and documents (bisections of ``log2(max
    length)`` steps over the cut positions, for each blend tried).

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64, leading zero (any device; the layout is CPU).
        cp_size: ranks, ``>= 1``.
        cost: the cost model; ``None``: :class:`CostModel` ``()`` (the whole V4-Flash model).
        max_tokens_ratio: a rank holds at most ``max(ceil(T/cp), floor(max_tokens_ratio * T/cp))``
            tokens (:func:`token_cap`; default 1.10); ``None``: no cap.

    Returns:
        A :class:`~cpkv.plan.layouts.ShardLayout` (CPU int64).

    Raises:
        TypeError: ``cu_seqlens`` not an integer tensor, ``cp_size`` not an int, ``cost`` not a
            :class:`CostModel`, ``max_tokens_ratio`` not a float. ValueError: malformed
            ``cu_seqlens``, ``cp_size < 1``, ``max_tokens_ratio < 1``.
    """
    validate_cu_seqlens(cu_seqlens)
    check_int("cp_size", cp_size, minimum=1)
    model = _check_cost(cost)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    total = int(cu[-1])
    cap = token_cap(total, cp_size, max_tokens_ratio)
    if total == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return layout_from_ranges(cu, cp_size, empty, empty, empty)
    mean = float(model.prefix(cu.diff()).sum()) / total

    def attempt(cut: Callable[[Prefix, Tensor, int], Ranges], lam: float) -> tuple[float, Ranges] | None:
        ranges = cut(_blended(model, mean, lam), cu, cp_size)
        costs, tokens = _ranks_of(cu, cp_size, ranges, model)
        return (float(costs.max()), ranges) if int(tokens.max()) <= cap else None

    lam = 0.0
    tail = attempt(_head_tail_cuts, lam)
    if tail is None:  # the cap binds: the least token weight that keeps it, by doubling then bisection
        lo, lam = 0.0, BLEND_START
        while (tail := attempt(_head_tail_cuts, lam)) is None and lam < BLEND_STOP:
            lo, lam = lam, lam * 4
        if tail is None:
            lam, tail = math.inf, attempt(_contiguous_cuts, math.inf)  # tokens alone: within ceil(T / cp)
        for _ in range(BLEND_STEPS if math.isfinite(lam) else 0):
            mid = 0.5 * (lo + lam) if lo > 0 else lam / 4
            found = attempt(_head_tail_cuts, mid)
            lo, lam, tail = (lo, mid, found) if found is not None else (mid, lam, tail)
    assert tail is not None
    block = math.lcm(*(m for m, layers in ((model.csa_ratio, model.csa_layers), (model.hca_ratio, model.hca_layers)) if layers))

    def placed(prefix: Prefix, cu: Tensor, cp: int) -> Ranges:  # every rank within COST_SLACK of its share
        return _placed_cuts(prefix, cu, cp, 0.9 * COST_SLACK, block, lambda g: _cut_rows(model, g))

    # The placed cuts improve on the exact ones (fewer rows at the same cuts within COST_SLACK): those only if they break the cap.
    tried = [tail, attempt(placed, 0.0) or attempt(_contiguous_cuts, 0.0), attempt(placed, lam) if lam > 0 else None]
    candidates = [c for c in tried if c is not None]
    ceiling = min(c[0] for c in candidates) * (1.0 + COST_SLACK)
    if total % cp_size == 0:
        plain = contiguous_layout(cu, cp_size)
        ranges = (plain.starts, plain.ends, plain.ranks)
        busiest = float(_ranks_of(cu, cp_size, ranges, model)[0].max())
        if busiest <= ceiling:  # contiguous is balanced within COST_SLACK: no head-tail cuts (they cut long documents twice)
            candidates = [c for c in candidates if c is not tail]
        candidates.append((busiest, ranges))
        ceiling = min(ceiling, busiest)  # never costlier than contiguous
    # Of those within the ceiling: the fewest remote rows on the busiest rank, then the least cost.
    def remote(ranges: Ranges) -> int:
        return int(_remote(cu, cp_size, ranges[0], ranges[1], ranges[2], model).max())

    best = min((c for c in candidates if c[0] <= ceiling), key=lambda c: (remote(c[1]), c[0]))
    return layout_from_ranges(cu, cp_size, *best[1])


def rank_costs(layout: ShardLayout, cost: CostModel | None = None) -> Tensor:
    """``[cp]`` float64 modeled cost of each rank's queries under ``layout`` (closed form per range).

    Raises:
        TypeError: ``layout`` not a :class:`~cpkv.plan.layouts.ShardLayout`, ``cost`` not a
            :class:`CostModel`.
    """
    if not isinstance(layout, ShardLayout):
        raise TypeError(f"layout must be a ShardLayout, got {type(layout).__name__}")
    model = _check_cost(cost)
    first = layout.cu_seqlens.index_select(0, layout.documents)
    costs = model.prefix(layout.ends - first) - model.prefix(layout.starts - first)
    return torch.zeros(layout.cp_size, dtype=torch.float64).index_add_(0, layout.ranks, costs)
