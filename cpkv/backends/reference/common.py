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


# --------------------------------------------------------------------------- non-finite isolation
# Masked (invisible) pairs get probability 0, but ``0 * NaN = NaN``: a tile product such as
# ``P @ V`` would spread one bad row of V to every query row of the tile, other documents
# included. The ops therefore multiply only finite data (``finite_rows``) and afterwards poison
# exactly the results that see a non-finite row (``ranges_hit`` / ``ranges_cover``).


def finite_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(x with its non-finite rows zeroed, bad)``: a row is ``x[..., :]``; ``bad`` is ``x.shape[:-1]`` bool."""
    bad = ~torch.isfinite(x).all(-1)
    return x.masked_fill(bad.unsqueeze(-1), 0.0), bad


def _clamped(lo: Tensor, hi: Tensor, n: int) -> tuple[Tensor, Tensor]:
    lo = lo.long().clamp(0, n)
    return lo, torch.maximum(lo, hi.long().clamp(0, n))


def ranges_hit(lo: Tensor, hi: Tensor, flagged: Tensor) -> Tensor:
    """Per row ``t``: whether some flagged key ``lo[t] <= j < hi[t]`` exists.

    ``lo``, ``hi``: ``[T]`` int (any order; ``lo >= hi`` is empty). ``flagged``: ``[T_kv, ...]``
    bool. Returns ``[T, ...]`` bool (prefix sums: no ``[T, T_kv]`` matrix, no host sync).
    """
    lo, hi = _clamped(lo, hi, flagged.shape[0])
    counts = torch.nn.functional.pad(flagged.long().cumsum(0), (0, 0) * (flagged.dim() - 1) + (1, 0))
    return counts[hi] > counts[lo]


def ranges_cover(lo: Tensor, hi: Tensor, flagged: Tensor, num_keys: int) -> Tensor:
    """Per key ``j < num_keys``: whether some flagged row ``t`` has ``lo[t] <= j < hi[t]``.

    ``lo``, ``hi``: ``[T]`` int (``lo >= hi`` is empty). ``flagged``: ``[T, ...]`` bool.
    Returns ``[num_keys, ...]`` bool (a difference array: no ``[T, T_kv]`` matrix, no host sync).
    """
    lo, hi = _clamped(lo, hi, num_keys)
    f = flagged.long()
    diff = f.new_zeros((num_keys + 1, *f.shape[1:])).index_add_(0, lo, f).index_add_(0, hi, -f)
    return diff.cumsum(0)[:num_keys] > 0
