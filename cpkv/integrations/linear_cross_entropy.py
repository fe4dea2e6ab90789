"""Cross-entropy of a linear head, chunk by chunk of tokens: the ``[N, V]`` logits never exist whole.

A causal LM's loss is ``sum_t CE(hidden[t] @ weight^T, labels[t])``. Computed as written, the
rank holds the ``[N, V]`` logits, their float32 copy (bf16 models), the log-softmax and the
``[N, V]`` gradients: at ``V = 129,280`` and 128K tokens that is hundreds of GB.
:func:`linear_cross_entropy` computes the same sum and the same gradients from the final
hidden states and the head's weight, ``chunk_size`` tokens at a time (the pattern of Liger's
fused linear cross-entropy and torchtune's chunked loss):

* **forward**: each chunk's logits ``F.linear(hidden_c, weight)`` (the head's dtype, as the
  head computes them), upcast to the compute dtype (``promote_types(dtype, float32)``), their
  log-sum-exp minus the target logit, summed; nothing of the chunk is kept.
* **backward** (``_LinearCrossEntropy``): each chunk's logits are recomputed;
  ``grad_logits = g * (softmax - onehot)`` on the valid rows, in the compute dtype, cast to
  the head's dtype (what autograd of ``F.linear(...).to(compute)`` gives);
  ``grad_hidden_c = grad_logits_c @ weight`` (head's dtype) and ``grad_weight`` accumulated over
  the chunks in the compute dtype (float32 for a bf16 head) from the compute-dtype
  ``grad_logits_c`` and ``hidden_c``, cast to the weight's dtype once at the end.

At most one chunk's logits are alive at a time (in place: max-shift, exp, normalise), so the
loss's memory is ``chunk_size * V`` compute-dtype elements (plus as many of the head's dtype,
briefly, for a bf16 head), ``grad_hidden`` and a compute-dtype ``[V, H]`` accumulator for
``grad_weight``; never ``[N, V]``. The price is one more head matmul per chunk (the
backward recomputes the logits): four instead of three.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from cpkv.checks import check_int, check_int_dtype, check_ndim, check_tensor

__all__ = ["DEFAULT_CHUNK_SIZE", "TokenScores", "linear_cross_entropy", "linear_token_scores"]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per chunk: one chunk's float32 logits are ``1024 * V * 4`` bytes (0.5 GB at V = 129,280)."""


def _chunk_exp(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, compute: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk: ``(exp(logits - max) [C, V], sum of it [C, 1], log-sum-exp minus target logit [C], valid [C])``."""
    return _exp_of(F.linear(hidden, weight).to(compute), labels, ignore_index)


def _exp_of(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`_chunk_exp` of a chunk's compute-dtype logits ``[C, V]``, which the exponentials overwrite (one buffer)."""
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).long()
    target = logits.gather(1, safe[:, None])[:, 0]
    shift = logits.amax(dim=1, keepdim=True)
    exp = logits.sub_(shift).exp_()
    total = exp.sum(dim=1, keepdim=True)
    return exp, total, (shift + total.log())[:, 0] - target, valid


def _check_inputs(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int) -> None:
    check_ndim("hidden", check_tensor("hidden", hidden), 2, "[N, H]")
    check_ndim("weight", check_tensor("weight", weight), 2, "[V, H]")
    check_int_dtype("labels", check_tensor("labels", labels))
    check_int("chunk_size", chunk_size, minimum=1)
    check_int("ignore_index", ignore_index)
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise TypeError(
            f"hidden and weight must be floating tensors of one dtype and device, got {hidden.dtype} on {hidden.device}"
            f" and {weight.dtype} on {weight.device}"
        )
    if weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, H] with H = {hidden.shape[1]} (hidden's), got shape {tuple(weight.shape)}")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be [N] = [{hidden.shape[0]}] (hidden's rows), got shape {tuple(labels.shape)}")


class _LinearCrossEntropy(torch.autograd.Function):
    """Autograd of :func:`linear_cross_entropy`: the backward recomputes each chunk's logits."""

    @staticmethod
    def forward(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int) -> Tensor:
        compute = torch.promote_types(hidden.dtype, torch.float32)
        total = torch.zeros((), dtype=compute, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            ce, valid = _chunk_exp(hidden[rows], weight, labels[rows], ignore_index, compute)[2:]  # the chunk's [C, V] is freed here
            total += torch.where(valid, ce, 0).sum()
        return total

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        hidden, weight, labels, ignore_index, chunk_size = inputs
        ctx.save_for_backward(hidden, weight, labels)
        ctx.ignore_index, ctx.chunk_size = ignore_index, chunk_size

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        hidden, weight, labels = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        compute = grad_total.dtype
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            exp, total, _, valid = _chunk_exp(hidden[rows], weight, labels[rows], ctx.ignore_index, compute)
            grad = exp.div_(total)  # softmax, in place
            safe = torch.where(valid, labels[rows], 0).long()
            grad.scatter_add_(1, safe[:, None], -valid.to(compute)[:, None])
            grad.mul_(torch.where(valid, grad_total, 0)[:, None])
            if grad_hidden is not None:
                grad_hidden[rows] = grad.to(weight.dtype) @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, hidden[rows].to(compute))
            del exp, grad  # before the next chunk's logits: one chunk alive at a time
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, ignore_index: int = -100, chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """``sum_{t: labels[t] != ignore_index} CE(hidden[t] @ weight^T, labels[t])``, ``chunk_size`` tokens at a time.

    Equal to ``F.cross_entropy(F.linear(hidden, weight).to(compute), labels, ignore_index=ignore_index,
    reduction="sum")`` (``compute = promote_types(hidden.dtype, float32)``), value and gradients
    w.r.t. ``hidden`` and ``weight``, up to the order of floating-point sums; never holds more
    than one chunk's logits (forward and backward: the module docstring says how).

    Args:
        hidden: ``[N, H]`` floating, e.g. a causal LM's final hidden states (after the last norm).
        weight: ``[V, H]`` the head's weight, ``hidden``'s dtype and device (no bias).
        labels: ``[N]`` integer class ids in ``[0, V)``, or ``ignore_index``.
        ignore_index: labels that do not count (no loss, zero gradient).
        chunk_size: tokens per chunk (``>= 1``); default :data:`DEFAULT_CHUNK_SIZE`.

    Returns:
        0-d, the compute dtype, differentiable w.r.t. ``hidden`` and ``weight``.

    Shapes:
        N tokens, H hidden size, V vocabulary size.

    Raises:
        TypeError: a non-tensor, a non-floating ``hidden``/``weight``, non-integer ``labels``,
            ``weight`` of another dtype or device. ValueError: shapes other than the above,
            ``chunk_size < 1``.

    Example:
        >>> h, w = torch.randn(5, 4, requires_grad=True), torch.randn(7, 4, requires_grad=True)
        >>> loss = linear_cross_entropy(h, w, torch.tensor([1, 2, -100, 6, 0]), chunk_size=2)
        >>> loss.shape, loss.dtype
        (torch.Size([]), torch.float32)
    """
    _check_inputs(hidden, weight, labels, ignore_index, chunk_size)
    loss: Tensor = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        hidden, weight, labels.to(hidden.device), ignore_index, chunk_size
    )
    return loss


class TokenScores(NamedTuple):
    """Result of :func:`linear_token_scores`: per token, its label's log-probability and the head's argmax.

    Attributes:
        log_probs: ``[N]`` compute dtype (``promote_types(hidden.dtype, float32)``):
            ``log softmax(hidden[t] @ weight^T)[labels[t]]``, 0 where ``labels[t] == ignore_index``.
        argmax: ``[N]`` int64: the most likely class of each token (the first of ties), every token.
    """

    log_probs: Tensor
    argmax: Tensor


def linear_token_scores(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, ignore_index: int = -100, chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenScores:
    """Each token's label log-probability and argmax under the head ``hidden @ weight^T``, ``chunk_size`` tokens at a time.

    Forward only (no autograd graph, whatever the grad mode): the evaluation counterpart of
    :func:`linear_cross_entropy`, whose per-token terms are ``-log_probs`` at the valid labels.
    At most one chunk's ``[chunk_size, V]`` logits (and their compute-dtype copy) live at a time;
    never ``[N, V]``.

    Args:
        hidden, weight, labels, ignore_index, chunk_size: as in :func:`linear_cross_entropy`.

    Returns:
        :class:`TokenScores` on ``hidden``'s device.

    Raises:
        TypeError, ValueError: as :func:`linear_cross_entropy`.

    Example:
        >>> h, w = torch.randn(5, 4), torch.randn(7, 4)
        >>> scores = linear_token_scores(h, w, torch.tensor([1, 2, -100, 6, 0]), chunk_size=2)
        >>> scores.log_probs.shape, scores.argmax.dtype, float(scores.log_probs[2])
        (torch.Size([5]), torch.int64, 0.0)
    """
    _check_inputs(hidden, weight, labels, ignore_index, chunk_size)
    compute = torch.promote_types(hidden.dtype, torch.float32)
    labels = labels.to(hidden.device)
    log_probs = torch.empty(hidden.shape[0], dtype=compute, device=hidden.device)
    argmax = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = F.linear(hidden[rows], weight).to(compute)
            argmax[rows] = logits.argmax(dim=1)
            ce, valid = _exp_of(logits, labels[rows], ignore_index)[2:]
            log_probs[rows] = torch.where(valid, -ce, 0)
            del logits  # one chunk's [C, V] alive at a time
        return TokenScores(log_probs, argmax)
