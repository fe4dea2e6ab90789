"""Exact merge of attentions over disjoint key sets by their logsumexp (ring rounds)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cpkv.backends.base import AttentionResult


def merge_partials(parts: Sequence[AttentionResult], sinks: Tensor | None = None) -> AttentionResult:
    """Exact merge of attentions over disjoint key sets (numerically stable, differentiable).

    ``lse = logsumexp_i(lse_i [, sink])``, ``out = sum_i exp(lse_i - lse) * out_i``. Rows that
    see no key in any part (and have no sink) get ``out = 0`` and ``lse = -inf``, with finite
    gradients (the logsumexp is written out: ``torch.logsumexp``'s gradient is NaN on rows
    that are ``-inf`` everywhere). A non-finite partial LSE or sink (NaN, ``+inf``) makes the
    row's ``out`` and ``lse`` NaN, as a single attention over all keys would.

    Args:
        parts: partial results, ``out`` ``[T, H, D_v]``, ``lse`` ``[T, H]`` (natural log, no sink).
        sinks: ``[H]`` sink logits added once to the merged denominator.

    Returns:
        :class:`AttentionResult`: ``out`` in the first part's dtype, ``lse`` fp32 (fp64 for fp64).

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("parts must hold at least one partial attention result")
    lses = [p.lse.float() if p.lse.dtype != torch.float64 else p.lse for p in parts]
    if sinks is not None:
        lses.append(sinks.to(lses[0].dtype)[None, :].expand_as(lses[0]))
    stacked = torch.stack(lses)
    peak = stacked.detach().amax(0)
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    total = torch.exp(stacked - peak).sum(0)
    seen = total != 0  # NaN (a NaN partial or sink) counts as seen, so it propagates to out and lse
    lse = torch.where(seen, peak + torch.log(torch.where(seen, total, torch.ones_like(total))), float("-inf"))
    safe = torch.where(seen, lse, torch.zeros_like(lse))
    weights = torch.exp(stacked - safe)  # exp(-inf) = 0 for empty parts
    out = weights[0].unsqueeze(-1) * parts[0].out.to(weights.dtype)
    for w, p in zip(weights[1:], parts[1:]):
        out = out + w.unsqueeze(-1) * p.out.to(w.dtype)
    return AttentionResult(out.to(parts[0].out.dtype), lse)
