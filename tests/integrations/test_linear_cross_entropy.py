"""The chunked linear cross-entropy equals the whole-logits one, value and gradients, and never holds the logits.

Oracle: ``F.cross_entropy(F.linear(hidden, weight).to(compute), labels, reduction="sum")`` in one
process on the whole ``[N, V]`` logits (torch's own cross-entropy, unchunked). float64 runs
differ from it by summation order only: measured <= 4e-15 relative on the loss and on each
gradient (to its largest entry); bound 1e-12. Dropping the ``-1`` of the target column, the
``ignore_index`` mask or a chunk of the weight's gradient gives errors >= 1e-2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cpkv.bench.step_memory import MemoryCounter
from cpkv.integrations.linear_cross_entropy import linear_cross_entropy

REL = 1e-12
N, H, V, IGNORE = 23, 8, 37, -100


def _inputs(dtype: torch.dtype = torch.float64, n: int = N, ignore: int = IGNORE, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[2::5] = ignore  # padding / no target
    return hidden, weight, labels


def _full(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore: int = IGNORE) -> torch.Tensor:
    compute = torch.promote_types(hidden.dtype, torch.float32)
    return F.cross_entropy(F.linear(hidden, weight).to(compute), labels, ignore_index=ignore, reduction="sum")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-300))


def _loss_and_grads(loss_fn: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, ...]:
    loss = loss_fn(hidden, weight, labels, **kw)
    grads = torch.autograd.grad(loss * 0.37, (hidden, weight))  # an incoming gradient other than 1
    return (loss.detach(), *grads)


@pytest.mark.parametrize("chunk_size", [1, 4, N, N + 5])
@pytest.mark.parametrize("ignore", [IGNORE, 0])
def test_chunked_equals_full_loss_and_gradients(chunk_size: int, ignore: int) -> None:
    """Any chunking (one token, uneven, exactly N, more than N) and ``ignore_index`` (also a real class id, 0)."""
    hidden, weight, labels = _inputs(ignore=ignore)
    got = _loss_and_grads(linear_cross_entropy, hidden, weight, labels, ignore_index=ignore, chunk_size=chunk_size)
    want = _loss_and_grads(lambda h, w, y: _full(h, w, y, ignore), hidden, weight, labels)
    assert got[0].dtype == torch.float64
    for g, w in zip(got, want):
        assert _rel(g, w) <= REL, (_rel(g, w), chunk_size)
    assert float(got[1][2::5].abs().max()) == 0  # ignored tokens get an exact zero gradient


def test_all_ignored_and_empty_give_zero_loss_and_gradients() -> None:
    hidden, weight, labels = _inputs()
    loss, grad_hidden, grad_weight = _loss_and_grads(linear_cross_entropy, hidden, weight, torch.full_like(labels, IGNORE), chunk_size=4)
    assert float(loss) == 0 and float(grad_hidden.abs().max()) == 0 and float(grad_weight.abs().max()) == 0
    hidden, weight, labels = _inputs(n=0)
    loss, grad_hidden, grad_weight = _loss_and_grads(linear_cross_entropy, hidden, weight, labels)
    assert float(loss) == 0 and grad_hidden.shape == (0, H) and float(grad_weight.abs().max()) == 0


def test_frozen_head_or_frozen_hidden() -> None:
    """Only the inputs that require a gradient get one (a frozen head: no [V, H] accumulator)."""
    hidden, weight, labels = _inputs()
    (grad,) = torch.autograd.grad(linear_cross_entropy(hidden, weight.detach(), labels, chunk_size=5), hidden)
    (want,) = torch.autograd.grad(_full(hidden, weight.detach(), labels), hidden)
    assert _rel(grad, want) <= REL
    (grad,) = torch.autograd.grad(linear_cross_entropy(hidden.detach(), weight, labels, chunk_size=5), weight)
    (want,) = torch.autograd.grad(_full(hidden.detach(), weight, labels), weight)
    assert _rel(grad, want) <= REL


def test_bf16_accumulates_in_float32() -> None:
    """A bf16 head: float32 loss, and every error vs float64 no larger than the unchunked bf16 path's (2x + floor).

    The weight's gradient is summed over 64 chunks of 8 tokens in float32; a bf16 accumulator
    (rounding after every chunk) is ~10x worse than the unchunked path here.
    """
    hidden, weight, labels = _inputs(torch.bfloat16, n=512, seed=1)
    exact = _loss_and_grads(_full, hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_(), labels)
    got = _loss_and_grads(linear_cross_entropy, hidden, weight, labels, chunk_size=8)
    full = _loss_and_grads(_full, hidden, weight, labels)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    for g, f, e in zip(got, full, exact):
        assert _rel(g, e) <= 2 * _rel(f, e) + 1e-6, (_rel(g, e), _rel(f, e))


def test_no_op_makes_more_than_one_chunk_of_logits() -> None:
    """Forward and backward: no new tensor larger than a chunk's logits, ``hidden``'s gradient or the weight's (never ``N * V``)."""
    hidden, weight, labels = _inputs(n=64)
    with MemoryCounter() as counter:
        linear_cross_entropy(hidden, weight, labels, chunk_size=8).backward()  # type: ignore[no-untyped-call]
    assert counter.largest == 8 * max(8 * V, 64 * H, V * H) < 8 * 64 * V, counter.largest_op  # float64: 8 bytes
    with MemoryCounter() as counter:
        _full(hidden, weight, labels).backward()  # type: ignore[no-untyped-call]
    assert counter.largest == 8 * 64 * V  # the check sees the whole logits when they exist


def test_bad_arguments_are_named() -> None:
    hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        linear_cross_entropy(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match=r"labels must be \[N\] = \[23\]"):
        linear_cross_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match=r"weight must be \[V, H\] with H = 8"):
        linear_cross_entropy(hidden, weight[:, :-1], labels)
    with pytest.raises(TypeError, match="one dtype and device"):
        linear_cross_entropy(hidden, weight.float(), labels)
    with pytest.raises(TypeError, match="labels"):
        linear_cross_entropy(hidden, weight, labels.double())
