"""The unweighted RMSNorm of DeepSeek-V4's queries, as one autograd function.

``x * rsqrt(mean(x_f32^2) + eps)`` (the reduction in float32, the scaling in ``x``'s dtype, as
Hugging Face's ``DeepseekV4UnweightedRMSNorm``) written as a composite saves the float32 copy
of ``x`` for backward: for the queries, ``[T/cp, heads, head_dim]``, 2.1 GB per layer at
``T/cp`` 16K and 64 heads of 512, twice the queries themselves. :func:`unweighted_rms_norm`
saves ``x`` and the per-row ``rsqrt`` only, and computes the backward from them.

In eager mode the float32 work (the upcast copy and its square in forward, the correction term
in backward) runs over :data:`ROW_CHUNK_ELEMENTS` elements of rows at a time, so its transients
stay at 64 MiB whatever the length (they were 2 and 4 float32 copies of ``x``: at 131K tokens a
rank, 17 GB each). Rows are independent, so the values are those of the one-shot computation
bit for bit. Under ``torch.compile`` the computation is one chunk (Inductor fuses the upcast
into the reduction, and a length-dependent chunk count would specialise the graph).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["ROW_CHUNK_ELEMENTS", "unweighted_rms_norm"]

ROW_CHUNK_ELEMENTS = 1 << 24
"""Elements of ``x`` whose float32 work runs at once in eager mode (64 MiB of float32)."""


def _row_chunks(*tensors: Tensor) -> list[tuple[Tensor, ...]]:
    """Equal ``[R, ...]`` tensors split along rows into chunks of about :data:`ROW_CHUNK_ELEMENTS` elements of the first.

    One chunk when compiling.
    """
    if torch.compiler.is_compiling():
        return [tensors]
    rows = max(1, ROW_CHUNK_ELEMENTS // max(1, tensors[0].shape[-1]))
    return list(zip(*[torch.split(t, rows) for t in tensors], strict=True))


class _UnweightedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, eps: float) -> Tensor:
        compute = torch.promote_types(x.dtype, torch.float32)
        rows = x.reshape(-1, x.shape[-1])
        parts = [torch.rsqrt(c.to(compute).square().mean(-1, keepdim=True) + eps) for (c,) in _row_chunks(rows)]
        rstd = parts[0] if len(parts) == 1 else torch.cat(parts)
        ctx.save_for_backward(x, rstd)
        return (rows * rstd.to(x.dtype)).view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        x, rstd = ctx.saved_tensors
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        # y = x * r with r = (mean(x^2) + eps)^-1/2: dx = g r - x r^3 sum(g x) / D
        dx = grad_rows * rstd.to(x.dtype)
        for xc, gc, rc, dxc in _row_chunks(rows, grad_rows, rstd, dx):
            dot = (gc * xc).sum(-1, keepdim=True, dtype=rstd.dtype)
            correction = xc * (dot * rc.pow(3) / x.shape[-1])  # in the compute dtype
            dxc.sub_(correction.to(x.dtype))  # a view of dx
        return dx.view_as(x), None


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps)``, the mean in float32 (float64 for float64 ``x``), the product in ``x``'s dtype.

    Args:
        x: ``[..., D]``, any float dtype and device.
        eps: added to the mean square (e.g. ``1e-6``).

    Returns:
        A new tensor like ``x`` (Hugging Face's ``DeepseekV4UnweightedRMSNorm``'s values bit for
        bit). Saves ``x`` and ``[rows, 1]`` float32 factors for backward; the float32
        temporaries of forward and backward are bounded by :data:`ROW_CHUNK_ELEMENTS` in eager mode.

    Raises:
        ValueError: ``x`` has no elements along its last dim.
    """
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., D] with D > 0, got shape {tuple(x.shape)}")
    normed: Tensor = _UnweightedRMSNorm.apply(x, eps)  # type: ignore[no-untyped-call]
    return normed
