"""Shared internals of the reference ops: precision, ``-inf`` handling, defaults.

Precision: fp64 inputs are computed in fp64; fp16/bf16/fp32 inputs accumulate in fp32.
Fully masked rows carry ``lse = -inf``; :func:`probs` and :func:`finite_or_zero` keep
them NaN-free.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NEG_INF = float("-inf")
DEFAULT_BLOCK_SIZE = 1024  # query rows (and keys) per tile of every reference op


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of inputs of ``dtype``: fp64 for fp64, fp32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def scale_or_default(scale: float | None, q: Tensor) -> float:
    """``scale`` as a float, or ``1 / sqrt(D)`` for ``q`` ``[..., D]`` when it is None."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def finite_or_zero(x: Tensor) -> Tensor:
    """Replace -inf (fully masked rows) by 0 so that ``exp(s - x)`` never forms NaN."""
    return x.masked_fill(x == NEG_INF, 0.0)


def probs(s: Tensor, lse: Tensor) -> Tensor:
    """``exp(s - lse[..., None])`` with -inf scores giving exactly 0, also on rows whose lse is -inf."""
    return torch.exp(s - finite_or_zero(lse).unsqueeze(-1))


def padded_rows(indices: Tensor, num_rows: int) -> Tensor:
    """``indices`` (``-1`` padded) as int64 with ``-1`` replaced by ``num_rows``.

    Row ``num_rows`` is an extra zero row appended past the end of the table being indexed,
    so padding never reads (gather) or writes (``index_add``) a real row such as row 0.
    """
    indices = indices.long()
    return torch.where(indices < 0, num_rows, indices)


def block_bounds(lo: Tensor, hi: Tensor, block_size: int) -> list[tuple[int, int, int, int]]:
    """``(t0, t1, k_lo, k_hi)`` per block of rows: rows ``[t0, t1)`` see only keys ``[k_lo, k_hi)``.

    ``lo``, ``hi``: ``[T]`` int64 per-row half-open ranges (any order; ``lo >= hi`` is empty).
    Host-syncs once (meant for op bodies, which are opaque to the compiler).
    """
    n = lo.numel()
    if n == 0:
        return []
    pad = -n % block_size
    big = torch.iinfo(torch.int64).max
    k_lo = torch.nn.functional.pad(lo, (0, pad), value=big).view(-1, block_size).amin(1)
    k_hi = torch.nn.functional.pad(hi, (0, pad), value=-big).view(-1, block_size).amax(1)
    starts = range(0, n, block_size)
    return [(t0, min(t0 + block_size, n), a, b) for t0, a, b in zip(starts, k_lo.tolist(), k_hi.tolist())]
