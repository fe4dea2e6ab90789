"""Rotary position embedding on the trailing channels (the "rope part" of a head).

:func:`rotate_tail` is the one rotation both RoPE conventions use (half-split pairs here,
interleaved pairs in Hugging Face's DeepSeek-V4): an autograd function that writes one new
tensor in forward and one in backward and saves only ``cos`` and ``sin``. The composite
``cat([x[..., :-r], rotated])`` it replaces saved nothing more, but its backward allocated a
zero-filled full-size gradient per slice and added them (three full copies of ``q`` per call:
3.2 GB per layer at ``T/cp`` 16K and 64 heads of 512).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["apply_rope", "rotate_tail"]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    half = cos.shape[-1]
    if x.ndim == 3:
        cos, sin = cos[:, None], sin[:, None]
    out = x.clone()
    tail = x[..., -2 * half:].to(cos.dtype)
    r1, r2 = (tail[..., 0::2], tail[..., 1::2]) if interleaved else (tail[..., :half], tail[..., half:])
    y1 = (r1 * cos).sub_(r2 * sin)
    y2 = (r1 * sin).addcmul_(r2, cos)
    if torch.compiler.is_compiling():  # out of place: no copy_, whose broadcast check guards on N >= 2
        rotated = torch.stack([y1, y2], dim=-1).flatten(-2) if interleaved else torch.cat([y1, y2], dim=-1)
        return torch.cat([x[..., : x.shape[-1] - 2 * half], rotated.to(x.dtype)], dim=-1)
    dest = out[..., -2 * half:]
    o1, o2 = (dest[..., 0::2], dest[..., 1::2]) if interleaved else (dest[..., :half], dest[..., half:])
    o1.copy_(y1)  # cast back to x's dtype
    o2.copy_(y2)
    return out


class _RotateTail(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rotate(x, cos, sin, interleaved)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin, ctx.interleaved), None, None, None  # the inverse rotation


def rotate_tail(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool = False) -> Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of ``x`` by the angles whose cosines and sines are given.

    Pair ``i`` is ``(tail[i], tail[i + r/2])`` (half-split) or ``(tail[2i], tail[2i + 1])``
    (``interleaved``); each becomes ``(a cos - b sin, a sin + b cos)``, computed in ``cos``'s
    dtype and cast back to ``x``'s; the other channels pass through. The backward applies the
    inverse rotation to the gradient (no gradient to ``cos`` or ``sin``).

    Args:
        x: ``[N, D]`` or ``[N, H, D]``, any float dtype, any device.
        cos, sin: ``[N, r/2]`` on ``x``'s device, the compute dtype (fp32, or fp64); ``r <= D``.
        interleaved: the pairing (see above).

    Returns:
        A new tensor like ``x``.

    Raises:
        ValueError: ``cos``/``sin`` not ``[N, r/2]`` with ``r <= D``.
    """
    n, width = x.shape[0], x.shape[-1]
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != n or not 0 < 2 * cos.shape[1] <= width:
        raise ValueError(
            f"cos and sin must both be [N, r/2] with N = {n} and 0 < r <= {width}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    rotated: Tensor = _RotateTail.apply(x, cos, sin, interleaved)  # type: ignore[no-untyped-call]
    return rotated


def apply_rope(x: Tensor, positions: Tensor, *, rope_dim: int, base: float) -> Tensor:
    """Rotate the last ``rope_dim`` channels of ``x`` by ``positions`` (half-split pairs).

    Args:
        x: ``[T, D]`` or ``[T, H, D]``, any float dtype; ``rope_dim`` even and ``<= D``.
        positions: ``[T]`` int document positions of the tokens.
        rope_dim: number of trailing channels rotated (the rest pass through).
        base: RoPE base (theta).

    Returns:
        A tensor like ``x``; computed in fp32 (fp64 for fp64 input) and cast back.

    Raises:
        ValueError: ``rope_dim`` odd or not in ``(0, D]``.
    """
    if rope_dim % 2 != 0 or not 0 < rope_dim <= x.shape[-1]:
        raise ValueError(f"rope_dim must be even and in (0, {x.shape[-1]}], got {rope_dim}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    half = rope_dim // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=dtype) / half)
    angles = positions.to(dtype)[:, None] * freqs
    return rotate_tail(x, angles.cos(), angles.sin())
