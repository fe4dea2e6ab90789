"""``layout="balanced"``: documents cut into ranges so that a DeepSeek-V4 cost model is equal on every rank.

:class:`CostModel` states what one query token costs at document position ``p`` (0-based) in a
V4 layer stack, in multiply-accumulates (MACs), the unit of both kinds of work:

* every layer attends its sliding window: ``min(W, p + 1)`` keys;
* a CSA layer (compress ratio ``m = 4``) also attends its indexer's top-k entries,
  ``min(k, floor((p + 1) / m))``, and its indexer scores every visible entry,
  ``floor((p + 1) / m)``, with ``H_I`` heads of ``D_I``;
* an HCA layer (ratio 128) also attends every visible entry, ``floor((p + 1) / 128)``.

An attended key or entry costs ``H * (D + d_v)`` MACs (the score over ``D`` and the weighted value
over ``d_v``, per head); a scored entry costs ``H_I * D_I``. Softmax, the sink, the compressor and
the projections/MoE are not counted per key: the position-independent work of a token is one
number, :attr:`CostModel.per_token`. The cost grows with ``p`` (the indexer and HCA terms), so a
contiguous layout loads its last rank most (1.875x the mean for the indexer alone, one document).

:func:`balanced_layout` cuts documents so every rank's modeled cost is equal, with no padding
requirement (any lengths, any ``T``; ranks may hold different token counts). The documents, in
packed order, are laid end to end on a line of cost (each as long as its modeled cost), and the
line is cut into ``cp`` equal parts, rank ``r`` owning part ``r``:

* a document inside one part stays whole on that rank (most documents of a pack);
* a document that crosses part boundaries, spanning ranks ``r0..r1`` with shares ``s_k`` of its
  cost, is cut head-tail among those ranks: rank ``k`` holds a head chunk and a tail chunk
  (outermost pair on ``r0``, innermost on ``r1``, which joins them); the head chunks have
  tokens in proportion to the shares (``n/2`` in all) and each tail cut is placed, by bisection
  on the closed-form cumulative cost, so that every rank's pair costs its share. Each pair takes
  cheap tokens from the head and dear ones from the tail, so the tokens also follow the shares
  (a contiguous cut at equal cost would give a long document's first rank several times its
  share of tokens: cost per token grows with ``p``). A tail cut
  always exists: the per-token cost is non-decreasing in ``p``, so a head chunk (positions
  ``< n/2``) never costs more than its share.

At most ``cp - 1`` documents are cut (one per boundary at most crosses it), every rank's cost is
its share within a token or two's cost, and a rank holds a run of consecutive whole documents
plus two ranges of each cut document it spans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from cpkv.checks import check_int, check_int_dtype, check_tensor
from cpkv.plan.conventions import validate_cu_seqlens
from cpkv.plan.layouts import ShardLayout, layout_from_ranges

__all__ = ["CostModel", "balanced_layout", "rank_costs"]

@dataclass(frozen=True)
class CostModel:
    """Modeled cost of one query token at document position ``p`` in a DeepSeek-V4 layer stack (MACs).

    Defaults are DeepSeek-V4-Flash, from transformers' ``DeepseekV4Config`` defaults
    (``models/deepseek_v4/configuration_deepseek_v4.py``): ``num_attention_heads`` 64,
    ``head_dim`` 512 (one shared kv head, so values are the same 512-dim rows: ``value_dim``
    512), ``sliding_window`` 128, ``index_topk`` 512, ``index_n_heads`` 64, ``index_head_dim``
    128, ``compress_rates`` 4 (CSA) and 128 (HCA), and ``num_hidden_layers`` 43 whose default
    ``layer_types`` (two HCA layers, then CSA/HCA interleaved) count 0 sliding-only, 20 CSA
    and 23 HCA layers.

    ``token_costs(p) = H*(D + d_v) * (L * min(W, p+1) + L_csa * min(k, (p+1)//m_csa)
    + L_hca * (p+1)//m_hca) + H_I*D_I * L_csa * (p+1)//m_csa + per_token``, with
    ``L = swa_layers + csa_layers + hca_layers`` (every layer attends its window).

    Attributes:
        heads, head_dim, value_dim: ``H``, ``D``, ``d_v`` of the attention.
        window: ``W``, the sliding window (own token included).
        index_topk: ``k``, entries a CSA query attends. index_heads, index_head_dim: ``H_I``, ``D_I``.
        csa_ratio, hca_ratio: compress ratios of the CSA and HCA layers.
        swa_layers, csa_layers, hca_layers: layers of each kind (sliding-only, CSA, HCA).
        per_token: position-independent cost of a token (projections, compressor, MoE: 0 by
            default, so only attention is balanced); set it to balance tokens too (e.g. the
            MoE's MACs per token in the same unit).

    Raises:
        TypeError: a field of the wrong type. ValueError: a negative count, a zero dimension,
            a ratio below 2, a negative or non-finite ``per_token``, no layers and ``per_token`` 0.
    """

    heads: int = 64
    head_dim: int = 512
    value_dim: int = 512
    window: int = 128
    index_topk: int = 512
    index_heads: int = 64
    index_head_dim: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    swa_layers: int = 0
    csa_layers: int = 20
    hca_layers: int = 23
    per_token: float = 0.0

    def __post_init__(self) -> None:
        minimum = {"csa_ratio": 2, "hca_ratio": 2, "window": 1, "heads": 1, "head_dim": 1, "value_dim": 1,
                   "index_heads": 1, "index_head_dim": 1}
        for field in fields(self):
            if field.name != "per_token":
                check_int(f"CostModel.{field.name}", getattr(self, field.name), minimum=minimum.get(field.name, 0))
        if isinstance(self.per_token, bool) or not isinstance(self.per_token, (int, float)):
            raise TypeError(f"CostModel.per_token must be a float, got {type(self.per_token).__name__}")
        if not math.isfinite(self.per_token) or self.per_token < 0:
            raise ValueError(f"CostModel.per_token must be finite and >= 0, got {self.per_token}")
        if self.swa_layers + self.csa_layers + self.hca_layers == 0 and self.per_token == 0:
            raise ValueError("CostModel must cost something: no layers and per_token 0")

    @property
    def key_cost(self) -> int:
        """MACs of one attended key or entry, ``H * (D + d_v)``."""
        return self.heads * (self.head_dim + self.value_dim)

    @property
    def index_cost(self) -> int:
        """MACs of one entry scored by the indexer, ``H_I * D_I``."""
        return self.index_heads * self.index_head_dim

    def _combine(self, window: Tensor, topk: Tensor, scored: Tensor, hca: Tensor, tokens: Tensor) -> Tensor:
        layers = self.swa_layers + self.csa_layers + self.hca_layers
        attended = layers * window + self.csa_layers * topk + self.hca_layers * hca  # int64, exact
        return (self.key_cost * attended.double() + (self.index_cost * self.csa_layers) * scored.double()
                + self.per_token * tokens.double())

    def token_costs(self, positions: Tensor) -> Tensor:
        """Modeled cost of a query token at each document position.

        Args:
            positions: any shape, integer, ``>= 0``: 0-based positions within their documents
                (any device).

        Returns:
            float64, the shape and device of ``positions``.

        Raises:
            TypeError: not an integer tensor. ValueError: a negative position.
        """
        check_tensor("positions", positions)
        check_int_dtype("positions", positions)
        p1 = positions.to(torch.int64) + 1
        if p1.numel() and int(p1.min()) < 1:
            raise ValueError("positions must be >= 0 (0-based positions within documents)")
        csa = torch.div(p1, self.csa_ratio, rounding_mode="floor")
        return self._combine(p1.clamp(max=self.window), csa.clamp(max=self.index_topk), csa,
                             torch.div(p1, self.hca_ratio, rounding_mode="floor"), torch.ones_like(p1))

    def prefix_costs(self, counts: Tensor) -> Tensor:
        """Modeled cost of the first ``n`` tokens of a document (positions ``0..n-1``), in closed form.

        ``prefix_costs(n) == token_costs(arange(n)).sum()`` (up to float64 rounding), without
        materialising the tokens.

        Args:
            counts: any shape, integer, ``>= 0`` (any device).

        Returns:
            float64, the shape and device of ``counts``.

        Raises:
            TypeError: not an integer tensor. ValueError: a negative count.
        """
        check_tensor("counts", counts)
        check_int_dtype("counts", counts)
        n = counts.to(torch.int64)
        if n.numel() and int(n.min()) < 0:
            raise ValueError("counts must be >= 0 (tokens of a document prefix)")
        return self._prefix(n)

    def _prefix(self, n: Tensor) -> Tensor:
        w = self.window
        window = torch.where(n <= w, n * (n + 1) // 2, w * (w + 1) // 2 + w * (n - w))
        capped = (self.csa_ratio * self.index_topk - 1)  # from j = m*k on, floor(j / m) >= k
        topk = _floor_sum(n.clamp(max=max(capped, 0)), self.csa_ratio) + self.index_topk * (n - capped).clamp(min=0)
        return self._combine(window, topk, _floor_sum(n, self.csa_ratio), _floor_sum(n, self.hca_ratio), n)


def _floor_sum(n: Tensor, m: int) -> Tensor:
    """``sum_{j=1..n} floor(j / m)`` (int64): ``m * a(a-1)/2 + a(n - a*m + 1)``, ``a = n // m``."""
    a = torch.div(n, m, rounding_mode="floor")
    return m * (a * (a - 1) // 2) + a * (n - a * m + 1)


def _invert(cost: CostModel, lengths: Tensor, targets: Tensor) -> Tensor:
    """``[K]`` int64 prefix lengths ``P`` in ``[0, lengths]`` whose ``prefix_costs`` is nearest each target.

    Bisection on the (non-decreasing) closed form, vectorised over the targets.
    """
    lo, hi = torch.zeros_like(lengths), lengths.clone()
    for _ in range(max(int(lengths.max()).bit_length(), 1) if lengths.numel() else 0):
        mid = torch.div(lo + hi, 2, rounding_mode="floor")
        below = cost._prefix(mid) < targets
        lo, hi = torch.where(below, mid + 1, lo), torch.where(below, hi, mid)
    # lo: the smallest P with F(P) >= target (or the length); the one before may be nearer.
    before = (lo - 1).clamp(min=0)
    nearer = (lo > 0) & (targets - cost._prefix(before) < cost._prefix(lo) - targets)
    return torch.where(nearer, before, lo)


def _check_cost(cost: object) -> CostModel:
    if cost is None:
        return CostModel()
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel or None, got {type(cost).__name__}")
    return cost


def balanced_layout(cu_seqlens: Tensor, cp_size: int, cost: CostModel | None = None) -> ShardLayout:
    """Every rank's ranges such that the modeled cost (:class:`CostModel`) is equal on every rank.

    The documents, in packed order, are laid on a line of cost, which is cut into ``cp_size``
    equal parts: a document inside one rank's part stays whole on that rank; one that crosses
    rank boundaries is cut head-tail among the ranks it spans, each rank's head and tail chunk
    together costing its share (see the module docstring). No padding: any document lengths
    (empty ones included) and any ``T``; ranks may hold different token counts (a rank may hold
    none when there are fewer tokens than ranks). Vectorised over tokens and documents (a
    bisection of ``log2(max length)`` steps over the cut positions).

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64, leading zero (any device; the layout is CPU).
        cp_size: ranks, ``>= 1``.
        cost: the cost model; ``None``: :class:`CostModel` ``()`` (V4-Flash).

    Returns:
        A :class:`~cpkv.plan.layouts.ShardLayout` (CPU int64).

    Raises:
        TypeError: ``cu_seqlens`` not an integer tensor, ``cp_size`` not an int, ``cost`` not a
            :class:`CostModel`. ValueError: malformed ``cu_seqlens``, ``cp_size < 1``.
    """
    validate_cu_seqlens(cu_seqlens)
    check_int("cp_size", cp_size, minimum=1)
    model = _check_cost(cost)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lengths, firsts = cu.diff(), cu[:-1]
    doc_costs = model._prefix(lengths)
    total = float(doc_costs.sum())
    if total <= 0:  # no tokens
        empty = torch.zeros(0, dtype=torch.int64)
        return layout_from_ranges(cu, cp_size, empty, empty, empty)
    target = total / cp_size
    begin = torch.cumsum(doc_costs, 0) - doc_costs  # where each document starts on the cost line
    first_rank = torch.div(begin, target, rounding_mode="floor").long().clamp(0, cp_size - 1)
    last_rank = torch.maximum(torch.ceil((begin + doc_costs) / target).long() - 1, first_rank).clamp(max=cp_size - 1)
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
    tails = _invert(model, n, c + model._prefix(heads) - reached)
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
    ranks = torch.cat([first_rank[whole], rank, rank])
    return layout_from_ranges(cu, cp_size, starts, ends, ranks)


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
    costs = model._prefix(layout.ends - first) - model._prefix(layout.starts - first)
    return torch.zeros(layout.cp_size, dtype=torch.float64).index_add_(0, layout.ranks, costs)
