"""The queries' unweighted RMSNorm: Hugging Face's values, float64 gradients, and what it keeps for backward."""

from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4UnweightedRMSNorm

from cpkv.bench.step_memory import MemoryCounter, saved_bytes
from cpkv.v4 import norms
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


def test_chunked_rows_give_the_one_shot_values_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 3, 40, generator=gen) * 3).bfloat16()
    grad = torch.randn(7, 3, 40, generator=gen).bfloat16()

    def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
        leaf = x.clone().requires_grad_()
        out = unweighted_rms_norm(leaf, 1e-6)
        out.backward(grad)
        assert leaf.grad is not None
        return out.detach(), leaf.grad

    one_shot = forward_backward()  # 21 rows of 40: one chunk at the default size
    monkeypatch.setattr(norms, "ROW_CHUNK_ELEMENTS", 4 * 40)  # chunks of 4 rows, the last of 1
    chunked = forward_backward()
    assert torch.equal(chunked[0], one_shot[0]) and torch.equal(chunked[1], one_shot[1])
    assert torch.equal(chunked[0], DeepseekV4UnweightedRMSNorm(eps=1e-6)(x))


def test_float32_temporaries_stay_within_one_chunk_at_any_length() -> None:
    # 65,536 rows of 512 bf16 (the queries of 1,024 tokens, 64 heads): the float32 copy of x alone would be 128 MiB
    x = torch.empty(1024, 64, 512, device="meta", dtype=torch.bfloat16, requires_grad=True)
    counter = MemoryCounter()
    with counter:
        out = unweighted_rms_norm(x, 1e-6)
        out.backward(torch.empty_like(out))
    chunk = norms.ROW_CHUNK_ELEMENTS * 4
    assert counter.largest == x.numel() * 2  # the output and the gradient, bf16; no float32 tensor the size of x
    rows = x.numel() // x.shape[-1]
    # out, dx and the incoming gradient (bf16), one chunk's work (x * g and the correction in bf16, the correction
    # in float32: two chunks' worth of float32 bytes), the float32 factors per row and one derived from them
    assert counter.peak <= 3 * x.numel() * 2 + 2 * chunk + 2 * rows * 4
