"""``ring_degree``: the rank's remote prefix kv in ``R`` rounds, merged exactly by LSE.

With the need-based exchange (contiguous TND) a rank receives one contiguous range of kv
rows before its own tokens. With ``R > 1`` that range is split into ``R`` parts: round
``i``'s all-to-all is started before round ``i - 1``'s attention runs (async, so
communication overlaps computation), each round attends every query to the keys of its part
that it may see (:func:`~cpkv.backends.reference.range_attention`: a contiguous range per
query), the rank's own rows (and compressed entries) form one more partial, and
:func:`merge_partials` combines the partial outputs and LSEs exactly. The merge is plain
differentiable torch, so the same function serves the backward.

The received parts in flight are about ``1/R`` of the remote prefix plus one prefetch
buffer. Autograd keeps each round's part for the backward (as any attention keeps its kv);
backward communication is not overlapped. Rounds that receive nothing (``R`` larger than the
rows to receive) are empty and contribute ``lse = -inf``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cpkv.attention_plan import AttentionPlan
from cpkv.backends.reference import AttentionResult, range_attention, sparse_attention_head_probs
from cpkv.comm import BackwardOrder, Group
from cpkv.exchange import NeedPlan, PendingRows, RingPart, start_exchange


def merge_partials(parts: Sequence[AttentionResult], sinks: Tensor | None = None) -> AttentionResult:
    """Exact merge of attentions over disjoint key sets (numerically stable, differentiable).

    ``lse = logsumexp_i(lse_i [, sink])``, ``out = sum_i exp(lse_i - lse) * out_i``. Rows that
    see no key in any part (and have no sink) get ``out = 0`` and ``lse = -inf``, with finite
    gradients.

    Args:
        parts: partial results, ``out`` ``[T, H, D_v]``, ``lse`` ``[T, H]`` (natural log, no sink).
        sinks: ``[H]`` sink logits added once to the merged denominator.
    """
    if not parts:
        raise ValueError("parts must hold at least one partial attention result")
    lses = [p.lse.float() if p.lse.dtype != torch.float64 else p.lse for p in parts]
    if sinks is not None:
        lses.append(sinks.to(lses[0].dtype)[None, :].expand_as(lses[0]))
    stacked = torch.stack(lses)
    # logsumexp by hand: torch.logsumexp's gradient is NaN on rows that are -inf everywhere.
    peak = stacked.detach().amax(0)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    total = torch.exp(stacked - peak).sum(0)
    seen = total > 0
    lse = torch.where(seen, peak + torch.log(torch.where(seen, total, torch.ones_like(total))), float("-inf"))
    safe = torch.where(seen, lse, torch.zeros_like(lse))
    weights = torch.exp(stacked - safe)  # exp(-inf) = 0 for empty parts
    out = weights[0].unsqueeze(-1) * parts[0].out.to(weights.dtype)
    for w, p in zip(weights[1:], parts[1:]):
        out = out + w.unsqueeze(-1) * p.out.to(w.dtype)
    return AttentionResult(out.to(parts[0].out.dtype), lse)


def peak_received_rows(need: NeedPlan, window: int | None) -> int:
    """Rows of received kv the ring loop holds at once: the current round's part plus the prefetched next.

    Without rounds (``ring_degree`` 1) it is every exchanged row.
    """
    rounds = need.kv_rounds[window]
    if not rounds:
        return need.kv[window].num_recv
    sizes = [p.routes.num_recv for p in rounds] + [0]
    return max(a + b for a, b in zip(sizes[:-1], sizes[1:]))


def _round_ranges(plan: AttentionPlan, part: RingPart, window: int | None) -> tuple[Tensor, Tensor]:
    """Per query, the keys of this part it may see, as ``[lo, hi)`` rows of the part."""
    seg, prefix = plan.segments, plan.prefix
    position = prefix.rank_offset + torch.arange(seg.num_queries, device=seg.q_positions.device)
    doc_start = prefix.kv_start + seg.q_doc_rows
    lo = doc_start if window is None else torch.maximum(doc_start, position - window + 1)
    size = part.stop - part.start
    lo = (lo - part.start).clamp(0, size)
    hi = (position + 1 - part.start).clamp(0, size)
    return lo, torch.maximum(lo, hi)


def ring_rounds(
    q: Tensor, kv: Tensor, plan: AttentionPlan, need: NeedPlan, group: Group, order: BackwardOrder,
    pending: PendingRows, *, window: int | None, d_v: int, scale: float,
) -> tuple[list[AttentionResult], int]:
    """The remote partials, one per round; round ``i + 1``'s exchange starts before round ``i``'s attention.

    Args:
        pending: round 0's exchange, started by the caller (before its local work).

    Returns the partials and the peak bytes of received kv held by the loop (current + prefetched).
    """
    rounds = need.kv_rounds[window]
    partials, peak = [], 0
    for i, part in enumerate(rounds):
        upcoming = start_exchange(kv, rounds[i + 1].routes, group) if i + 1 < len(rounds) else None
        peak = max(peak, (pending.buffer.numel() + (upcoming.buffer.numel() if upcoming else 0)) * kv.element_size())
        rows = pending.wait(order=order)
        lo, hi = _round_ranges(plan, part, window)
        partials.append(range_attention(q, rows[:, None], rows[:, None, :d_v], lo, hi, scale=scale))
        if upcoming is not None:
            pending = upcoming
    return partials, peak


def selected_probs(q: Tensor, kv_all: Tensor, selected_rows: Tensor, lse: Tensor, scale: float) -> Tensor:
    """``[T, K]`` head-summed probabilities of ``selected_rows`` of ``kv_all`` under the merged ``lse``."""
    with torch.no_grad():
        return sparse_attention_head_probs(q, kv_all, selected_rows, lse, scale=scale)
