"""``causal_lm_loss_from_hidden`` under CP: the single-process loss of the whole batch, chunked, at cp 1-4.

Oracle: one process, float64, the whole packed batch's logits ``hidden @ weight^T`` and
``F.cross_entropy(..., reduction="sum")`` over the labels shifted within each document (padding
and ``ignore_index`` tokens excluded), divided by the batch's valid count or by a given
accumulation normaliser. One group of 4 ranks (tests/shared_spawn.py's 4-rank spawn, shared
between test modules) runs cp 1-4 (the group of cp ``k`` is ranks ``0..k-1``); each rank holds
its contiguous shard of the hidden states. Compared: the sum of the ranks' losses, every rank's hidden-state gradient (its rows of the oracle's), and the head
weight's gradient summed over the ranks (``grad_reduction="sum"``) or averaged (``"mean"``); and
the same rank's :func:`causal_lm_loss` on the whole local logits (the semantics the chunked loss
keeps). Summation order only: measured <= 3e-15 relative; bound 1e-12. A rank-local normaliser
or a missing ``grad_reduction`` factor gives >= 0.1.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cpkv.integrations.causal_lm import causal_lm_loss, causal_lm_loss_from_hidden, shift_labels
from tests.shared_spawn import shared_spawn

REL, IGNORE = 1e-12, -100
H, V = 6, 29
CU = torch.tensor([0, 7, 7, 17, 20, 24])  # 24 tokens (divisible by cp 1-4), an empty document
PADDING = torch.tensor([2, 0, 3, 0, 1])
CASES = {"own count, sum": (None, "sum"), "given count, sum": (40, "sum"), "given count, mean": (40, "mean"),
         "own count, mean": (None, "mean")}


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 hidden ``[T, H]``, head weight ``[V, H]``, shifted labels ``[T]`` (padding and every 5th token ignored)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(int(CU[-1]), H, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (int(CU[-1]),), generator=gen)
    labels[1::5] = IGNORE
    return hidden, weight, shift_labels(labels, CU, ignore_index=IGNORE, padding=PADDING)


def _ranks(rank: int, world: int) -> dict[tuple[int, str], dict[str, Any]]:
    import torch.distributed as dist

    hidden, weight, labels = _batch()
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for cp in range(1, world + 1):
        group = dist.new_group(list(range(cp)))
        if rank >= cp:
            continue
        rows = slice(rank * len(labels) // cp, (rank + 1) * len(labels) // cp)
        for case, (count, reduction) in CASES.items():
            h, w = hidden[rows].clone().requires_grad_(), weight.clone().requires_grad_()
            loss = causal_lm_loss_from_hidden(h, w, labels[rows], group, num_items_in_batch=count, ignore_index=IGNORE,
                                              grad_reduction=reduction, chunk_size=2)  # type: ignore[arg-type]
            grad_h, grad_w = torch.autograd.grad(loss, (h, w))
            full = causal_lm_loss(F.linear(h, w), labels[rows], group, num_items_in_batch=count, ignore_index=IGNORE,
                                  grad_reduction=reduction)  # type: ignore[arg-type]
            out[(cp, case)] = {"loss": loss.detach(), "grad_h": grad_h, "grad_w": grad_w, "rows": rows,
                               "full": (full.detach(), *torch.autograd.grad(full, (h, w)))}
    return out


RANKS = shared_spawn(_ranks, 4, timeout=120.0)


@pytest.fixture(scope="module")
def ranks(request: pytest.FixtureRequest) -> list[dict[tuple[int, str], dict[str, Any]]]:
    return RANKS.run(request)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_under_cp_is_the_single_process_loss(ranks: list[dict[tuple[int, str], dict[str, Any]]], cp: int, case: str) -> None:
    count, reduction = CASES[case]
    hidden, weight, labels = _batch()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    valid = int((labels != IGNORE).sum())
    assert 0 < valid < 40  # the given normaliser spans more than this micro-batch
    want = F.cross_entropy(h @ w.T, labels, ignore_index=IGNORE, reduction="sum") / (valid if count is None else count)
    want_h, want_w = torch.autograd.grad(want, (h, w))
    got = [ranks[r][(cp, case)] for r in range(cp)]
    factor = cp if reduction == "mean" else 1  # "mean": each rank's loss times cp, the mean of the gradients is the one
    assert _rel(sum(g["loss"] for g in got) / factor, want.detach()) <= REL
    assert _rel(torch.cat([g["grad_h"] for g in got]) / factor, want_h) <= REL
    assert _rel(sum(g["grad_w"] for g in got) / factor, want_w) <= REL
    for g in got:  # the same rank's unchunked causal_lm_loss: same value and gradients
        for chunked, full in zip((g["loss"], g["grad_h"], g["grad_w"]), g["full"]):
            assert _rel(chunked, full) <= REL


def test_bad_hidden_and_labels_are_named() -> None:
    hidden, weight, labels = _batch()
    with pytest.raises(ValueError, match=r"labels must be \[T/cp\] = \[24\] \(hidden's rows\)"):
        causal_lm_loss_from_hidden(hidden, weight, labels[:-1], None)
    with pytest.raises(ValueError, match=r"hidden must have shape \[T/cp, H\]"):
        causal_lm_loss_from_hidden(hidden[None], weight, labels, None)
    with pytest.raises(ValueError, match="grad_reduction"):
        causal_lm_loss_from_hidden(hidden, weight, labels, None, num_items_in_batch=3, grad_reduction="avg")  # type: ignore[arg-type]
