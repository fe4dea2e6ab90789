"""The queries' unweighted RMSNorm: Hugging Face's values, float64 gradients, and what it keeps for backward."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4UnweightedRMSNorm

from cpkv.bench.step_memory import saved_bytes
from cpkv.v4.norms import unweighted_rms_norm


def test_forward_equals_hugging_face_bit_for_bit_in_bf16_and_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(6, 3, 40, generator=gen) * 3).to(dtype)
        assert torch.equal(unweighted_rms_norm(x, 1e-6), DeepseekV4UnweightedRMSNorm(eps=1e-6)(x))


def test_gradient_matches_float64_autograd_of_the_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(5, 2, 16, generator=gen, dtype=torch.float64)
    (expected,) = torch.autograd.grad(x * (x.square().mean(-1, keepdim=True) + 1e-6).rsqrt(), x, grad)
    unweighted_rms_norm(x, 1e-6).backward(grad)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-12)  # the same math in float64: round-off only
    assert torch.autograd.gradcheck(lambda t: unweighted_rms_norm(t, 1e-6), (x.detach().requires_grad_(),))


def test_bf16_gradient_is_within_bf16_rounding_of_the_float64_one() -> None:
    gen = torch.Generator().manual_seed(2)
    x64 = torch.randn(64, 4, 32, generator=gen, dtype=torch.float64)
    g64 = torch.randn(64, 4, 32, generator=gen, dtype=torch.float64)
    (expected,) = torch.autograd.grad(x64.requires_grad_() * (x64.square().mean(-1, keepdim=True) + 1e-6).rsqrt(), x64, g64)
    x = x64.detach().bfloat16().requires_grad_()
    unweighted_rms_norm(x, 1e-6).backward(g64.bfloat16())
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    # inputs rounded to bf16 (2^-9 relative each), products and the result rounded once more: a few bf16 ulps
    torch.testing.assert_close(x.grad.double(), expected, rtol=2**-6, atol=2**-6)


def test_keeps_the_input_and_one_factor_per_row_not_a_float32_copy() -> None:
    x = torch.empty(128, 8, 512, device="meta", dtype=torch.bfloat16, requires_grad=True)
    with saved_bytes(exclude=set()) as saved:
        unweighted_rms_norm(x, 1e-6)
    assert sorted(saved.values()) == [128 * 8 * 4, x.numel() * 2]  # float32 rsqrt per row, x itself
    with saved_bytes(exclude=set()) as composite:  # Hugging Face's composite keeps the float32 copy as well
        DeepseekV4UnweightedRMSNorm(eps=1e-6)(x)
    assert sum(composite.values()) >= x.numel() * (2 + 4)


def test_rejects_an_empty_last_dim() -> None:
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., D\] with D > 0"):
        unweighted_rms_norm(torch.zeros(3, 0), 1e-6)
