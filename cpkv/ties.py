"""A value-free backward dependency: a 0-d token's graph runs with a tensor's, and nothing is copied.

``out + token`` (``token`` a 0-d zero carrying a graph) ties ``token``'s backward to
``out``'s, but it writes a full copy of ``out`` (at 1M tokens, ``T/cp`` 16K and 64 heads of
448 value channels, 0.94 GB per layer, and the copy, not ``out``, is then what the next
projection saves). :func:`tie` returns ``out`` itself (an alias, no new storage) and, in
backward, passes ``out``'s gradient through unchanged and gives ``token`` the addition's
gradient, ``sum(grad)`` (a reduction, no copy): the token's graph (the ordered backward
collectives, the indexer's injected gradients) runs when ``out``'s gradient arrives, with the
gradient the addition gave it. The tokens' values are never read (zero forward; their
gradients feed only empty slices of the anchors), so a zero would do as well in eager; the
sum keeps the addition's exact gradients at the cost of one read of ``out``'s gradient.

Under ``torch.compile`` the tie stays the addition: a compiled forward is also scheduled by
data dependencies, and only a consumer of the token's value keeps the token's chain of
collectives (each returns the next token) ahead of the output on every rank; an alias that
ignores the token let Inductor schedule the chain's last collective differently on two ranks
whose graphs differ, and gloo hung. Eager runs ops in program order, so the alias is safe there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["tie"]


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: Tensor, token: Tensor) -> Tensor:
        ctx.token_dtype = token.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        return grad, grad.sum().to(ctx.token_dtype)  # the addition's gradient (see the module docstring)


def tie(out: Tensor, token: Tensor) -> Tensor:
    """``out`` unchanged in value and storage; its backward also runs ``token``'s.

    Args:
        out: any tensor (any shape, dtype, device).
        token: a 0-d tensor (any float dtype) whose graph must run in ``out``'s backward;
            its value is not used; its gradient is ``out``'s summed, as for ``out + token``.

    Returns:
        ``out`` as a view of itself (no copy), differentiable to ``out`` and ``token``; ``out``
        itself when ``token`` needs no gradient; ``out + token`` under ``torch.compile``.

    Raises:
        ValueError: ``token`` is not 0-d.
    """
    if token.dim() != 0:
        raise ValueError(f"token must be a 0-d tensor, got shape {tuple(token.shape)}")
    if not token.requires_grad:
        return out
    if torch.compiler.is_compiling():  # a data dependency on the token's forward chain (see the module docstring)
        return out + token.to(out.dtype)
    tied: Tensor = _Tie.apply(out, token)  # type: ignore[no-untyped-call]
    return tied
