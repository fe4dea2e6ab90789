"""RoPE on the trailing channels: :func:`rotate_tail` and :func:`apply_rope` against explicit 2x2 rotations in float64."""

from __future__ import annotations

import pytest
import torch

from cpkv.bench.step_memory import MemoryCounter
from cpkv.v4.rope import apply_rope, rotate_tail


def rotated_by_matrices(x: torch.Tensor, angles: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """Oracle: each pair's 2x2 rotation matrix applied with a loop over pairs, float64."""
    x = x.double()
    out = x.clone()
    half, width = angles.shape[-1], x.shape[-1]
    base = width - 2 * half
    for i in range(half):
        a, b = (base + 2 * i, base + 2 * i + 1) if interleaved else (base + i, base + half + i)
        c, s = angles[:, i].double().cos(), angles[:, i].double().sin()
        if x.ndim == 3:
            c, s = c[:, None], s[:, None]
        rot = torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)  # [N, (H,) 2, 2]
        pair = torch.stack([x[..., a], x[..., b]], -1)[..., None]
        out[..., a], out[..., b] = (rot @ pair)[..., 0].unbind(-1)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(5, 12), (5, 3, 12)])
def test_rotate_tail_matches_rotation_matrices_and_its_gradient_is_the_inverse_rotation(
    interleaved: bool, shape: tuple[int, ...]
) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    angles = torch.rand(shape[0], 4, generator=gen, dtype=torch.float64) * 6
    out = rotate_tail(x, angles.cos(), angles.sin(), interleaved=interleaved)
    torch.testing.assert_close(out, rotated_by_matrices(x.detach(), angles, interleaved=interleaved), rtol=0, atol=1e-12)
    assert torch.equal(out[..., :4], x[..., :4])  # the leading channels pass through untouched
    grad = torch.randn(shape, generator=gen, dtype=torch.float64)
    out.backward(grad)
    assert x.grad is not None  # d(R x)/dx applied to g is R^T g: the rotation by -angle
    torch.testing.assert_close(x.grad, rotated_by_matrices(grad, -angles, interleaved=interleaved), rtol=0, atol=1e-12)
    cos, sin = angles.cos(), angles.sin()
    assert torch.autograd.gradcheck(lambda t: rotate_tail(t, cos, sin, interleaved=interleaved), (x.detach().requires_grad_(),))


def test_apply_rope_rotates_in_fp32_and_casts_back() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 2, 16, generator=gen).bfloat16()
    positions = torch.arange(7) * 3
    out = apply_rope(x, positions, rope_dim=8, base=10000.0)
    freqs = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    expected = rotated_by_matrices(x, positions.double()[:, None] * freqs, interleaved=False)
    assert out.dtype == torch.bfloat16
    # fp32 rotation of bf16 inputs, one rounding to bf16 at the end: within one bf16 ulp (2^-8 relative)
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-6)


def test_rotate_tail_backward_writes_one_gradient_not_a_zero_filled_one_per_slice() -> None:
    x = torch.empty(64, 8, 512, device="meta", dtype=torch.bfloat16, requires_grad=True)
    angles = torch.empty(64, 32, device="meta")
    out = rotate_tail(x, angles.cos(), angles.sin())
    grad = torch.ones_like(out)
    with MemoryCounter() as counter:
        out.backward(grad)
    size = x.numel() * x.element_size()
    tail_fp32 = x[..., -64:].numel() * 4  # the rotation's fp32 temporaries are the tail's size
    # the composite slice + cat wrote three full-size tensors (two zero-filled slice gradients and their sum)
    assert size <= counter.peak <= size + 3 * tail_fp32, (counter.peak, size)


def test_rotate_tail_rejects_cos_sin_of_the_wrong_shape() -> None:
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"cos and sin must both be \[N, r/2\] with N = 3 and 0 < r <= 8"):
        rotate_tail(x, torch.zeros(3, 5), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="cos and sin"):
        rotate_tail(x, torch.zeros(2, 2), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="rope_dim must be even"):
        apply_rope(x, torch.arange(3), rope_dim=3, base=10.0)
