"""The value-free backward dependency (:mod:`cpkv.ties`): no copy, the addition's gradients, and the tied graph runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.bench.step_memory import MemoryCounter
from cpkv.ties import tie


class _Recorded(torch.autograd.Function):
    """Identity on a 0-d tensor that records the gradient its backward receives."""

    calls: list[float] = []

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _Recorded.calls.append(grad.item())
        return grad


def test_tie_aliases_out_and_has_the_gradients_of_the_addition() -> None:
    _Recorded.calls.clear()
    w = torch.randn(4, 3, requires_grad=True)
    out = w * 2
    token = _Recorded.apply(w.flatten()[:0].sum())
    tied = tie(out, token)
    assert tied.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and torch.equal(tied, out)
    grad = torch.arange(12.0).reshape(4, 3)
    tied.backward(grad)
    assert _Recorded.calls == [grad.sum().item()]  # the token's graph ran, with d(out + token)/d token = sum(grad)
    assert w.grad is not None and torch.equal(w.grad, 2 * grad)


def test_tie_without_a_token_graph_returns_out_and_rejects_non_scalar_tokens() -> None:
    out = torch.randn(3)
    assert tie(out, torch.zeros(())) is out
    with pytest.raises(ValueError, match=r"token must be a 0-d tensor, got shape \(1,\)"):
        tie(out, torch.zeros(1))


def test_tie_copies_nothing_forward_or_backward() -> None:
    """On meta tensors: ``out + token`` wrote a copy of ``out`` in forward; the tie writes none, and its backward only the 0-d sum."""
    q = torch.empty(1024, 64, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
    token = torch.zeros((), device="meta", requires_grad=True)
    out = q * 2
    with MemoryCounter() as forward:
        tied = tie(out, token)
    assert forward.peak == 0
    grad = torch.ones_like(tied)
    size = q.numel() * q.element_size()
    with MemoryCounter() as backward:
        tied.backward(grad)
    assert backward.peak <= size + 16  # q's gradient (mul's backward) and the token's 0-d gradient
