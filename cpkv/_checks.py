"""Argument checks shared by the public functions.

Every check raises ``TypeError`` or ``ValueError`` whose message names the
argument, the expected form and what was received. The checks only look at
values every rank derives identically (shapes, cu_seqlens, sizes), so ranks
given the same bad input all raise before any collective is issued.
"""

from __future__ import annotations

import torch
from torch import Tensor

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def check_tensor(name: str, value: object) -> Tensor:
    """Return ``value`` if it is a tensor, else raise ``TypeError``."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` as an ``int`` (bools rejected), optionally bounded below."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_ndim(name: str, tensor: Tensor, ndim: int | tuple[int, ...], form: str) -> None:
    """Raise ``ValueError`` unless ``tensor.ndim`` is one of ``ndim``."""
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if tensor.ndim not in allowed:
        raise ValueError(f"{name} must have shape {form}, got shape {tuple(tensor.shape)}")


def check_int_dtype(name: str, tensor: Tensor) -> None:
    """Raise ``TypeError`` unless ``tensor`` holds integers."""
    if tensor.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must be an integer tensor (int32 or int64), got dtype {tensor.dtype}")


def check_rank(name: str, rank: object, world_size: int) -> int:
    """Return ``rank`` if it is an int in ``[0, world_size)``."""
    value = check_int(name, rank)
    if not 0 <= value < world_size:
        raise ValueError(f"{name} must be in [0, {world_size}), got {value}")
    return value


def check_dim(name: str, dim: int, ndim: int) -> int:
    """Normalise a possibly negative dimension index, raising if out of range."""
    check_int(name, dim)
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for a tensor with {ndim} dimensions")
    return dim % ndim
