"""The unweighted RMSNorm of DeepSeek-V4's queries, as one autograd function.

``x * rsqrt(mean(x_f32^2) + eps)`` (the reduction in float32, the scaling in ``x``'s dtype, as
Hugging Face's ``DeepseekV4UnweightedRMSNorm``) written as a composite saves the float32 copy
of ``x`` for backward: for the queries, ``[T/cp, heads, head_dim]``, 2.1 GB per layer at
``T/cp`` 16K and 64 heads of 512, twice the queries themselves. :func:`unweighted_rms_norm`
saves ``x`` and the per-row ``rsqrt`` only, and computes the backward from them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["unweighted_rms_norm"]


class _UnweightedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, eps: float) -> Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        rstd = torch.rsqrt(x.to(compute).square().mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd)
        return x * rstd.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        x, rstd = ctx.saved_tensors
        # y = x * r with r = (mean(x^2) + eps)^-1/2: dx = g r - x r^3 sum(g x) / D
        dot = (grad * x).sum(-1, keepdim=True, dtype=rstd.dtype)
        correction = x * (dot * rstd.pow(3) / x.shape[-1])  # in the compute dtype
        return (grad * rstd.to(x.dtype)).sub_(correction.to(x.dtype)), None


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps)``, the mean in float32 (float64 for float64 ``x``), the product in ``x``'s dtype.

    Args:
        x: ``[..., D]``, any float dtype and device.
        eps: added to the mean square (e.g. ``1e-6``).

    Returns:
        A new tensor like ``x``. Saves ``x`` and ``[..., 1]`` float32 factors for backward.

    Raises:
        ValueError: ``x`` has no elements along its last dim.
    """
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., D] with D > 0, got shape {tuple(x.shape)}")
    normed: Tensor = _UnweightedRMSNorm.apply(x, eps)  # type: ignore[no-untyped-call]
    return normed
