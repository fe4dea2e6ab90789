"""Rotary position embedding on the trailing channels (the "rope part" of a head)."""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rope(x: Tensor, positions: Tensor, *, rope_dim: int, base: float) -> Tensor:
    """Rotate the last ``rope_dim`` channels of ``x`` by ``positions`` (half-split pairs).

    Args:
        x: ``[T, D]`` or ``[T, H, D]``, any float dtype; ``rope_dim`` even and ``<= D``.
        positions: ``[T]`` int document positions of the tokens.
        rope_dim: number of trailing channels rotated (the rest pass through).
        base: RoPE base (theta).

    Returns:
        A tensor like ``x``; computed in fp32 (fp64 for fp64 input) and cast back.
    """
    if rope_dim % 2 != 0 or not 0 < rope_dim <= x.shape[-1]:
        raise ValueError(f"rope_dim must be even and in (0, {x.shape[-1]}], got {rope_dim}")
    dtype = torch.promote_types(x.dtype, torch.float32)
    half = rope_dim // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=dtype) / half)
    angles = positions.to(dtype)[:, None] * freqs
    cos, sin = angles.cos(), angles.sin()
    if x.ndim == 3:
        cos, sin = cos[:, None], sin[:, None]
    keep, rot = x[..., :-rope_dim], x[..., -rope_dim:].to(dtype)
    r1, r2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1)
    return torch.cat([keep, rotated.to(x.dtype)], dim=-1)
