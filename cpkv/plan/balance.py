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

When a cut breaks the cap, the line is drawn in a blended cost, ``cost + lam * mean_cost *
tokens``, with about the least ``lam`` that keeps every rank within the cap
(head-tail cuts; found by doubling then bisection, :data:`BLEND_START`; ``lam = inf``: tokens
alone, which always does). Of the candidates within the cap, the one with the least
busiest-rank cost wins, contiguous cuts when within :data:`PREFER_CONTIGUOUS` of the best (they
move fewer bytes); the contiguous layout itself (``T % cp == 0``) is a candidate too,
so balanced is never costlier than contiguous. At most ``cp - 1`` documents are cut (one per
boundary at most crosses it), and a rank holds a run of consecutive whole documents plus one
range (contiguous cuts) or two (head-tail) of each cut document it spans.
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
"""The default cap on a rank's tokens, in units of ``T / cp`` (docs/semantics.md, "Balanced layout": at
1.05 heavy-tailed packs trade up to 10% of cost balance for the last 5% of tokens)."""
BLEND_START, BLEND_STOP, BLEND_STEPS = 0.25, 64.0, 6
"""The token weight ``lam`` search: from ``BLEND_START``, times 4 until the cap holds (or past
``BLEND_STOP``: tokens alone), then ``BLEND_STEPS`` bisection steps towards the least that holds."""
PREFER_CONTIGUOUS = 1e-3
"""Contiguous cuts win when their busiest rank costs at most this much more (relative) than the best."""

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

    best = attempt(_contiguous_cuts, 0.0)
    tail = attempt(_head_tail_cuts, 0.0)
    if tail is None:  # the cap binds: the least token weight that keeps it, by doubling then bisection
        lo, hi = 0.0, BLEND_START
        while (tail := attempt(_head_tail_cuts, hi)) is None and hi < BLEND_STOP:
            lo, hi = hi, hi * 4
        if tail is None:
            hi, tail = math.inf, attempt(_contiguous_cuts, math.inf)  # tokens alone: within ceil(T / cp)
        for _ in range(BLEND_STEPS if math.isfinite(hi) else 0):
            mid = 0.5 * (lo + hi) if lo > 0 else hi / 4
            found = attempt(_head_tail_cuts, mid)
            lo, hi, tail = (lo, mid, found) if found is not None else (mid, hi, tail)
    assert tail is not None
    if best is None or tail[0] < best[0] * (1.0 - PREFER_CONTIGUOUS):
        best = tail
    if total % cp_size == 0:
        plain = contiguous_layout(cu, cp_size)
        ranges = (plain.starts, plain.ends, plain.ranks)
        busiest = float(_ranks_of(cu, cp_size, ranges, model)[0].max())
        if busiest < best[0]:
            best = (busiest, ranges)
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
