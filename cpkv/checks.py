"""Argument checks shared by the public functions.

Every check raises ``TypeError`` or ``ValueError`` whose message names the
argument, the expected form and what was received. The checks only look at
values every rank derives identically (shapes, cu_seqlens, sizes), so ranks
given the same bad input all raise before any collective is issued.
"""

from __future__ import annotations

import math

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


# --------------------------------------------------------------------------- tensor forms (reference ops)

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor_form(name: str, value: object, ndim: int, *, floating: bool = True) -> Tensor:
    """Return ``value`` if it is an ``ndim``-D tensor of a float (or, ``floating=False``, int32/int64) dtype.

    Raises:
        TypeError: not a tensor, or the wrong dtype kind.
        ValueError: the wrong number of dimensions.
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {value.dtype}")
    if not floating and value.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got {value.dtype}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(value.shape)}")
    return value


def check_same(what: str, actual: object, expected: object) -> None:
    """Raise ``ValueError`` naming ``what`` unless ``actual == expected``."""
    if actual != expected:
        raise ValueError(f"{what}: expected {expected}, got {actual}")


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int >= 1`` (bools rejected).

    Raises:
        TypeError: not an int. ValueError: ``value < 1``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_sinks(sinks: object, q: Tensor) -> None:
    """Accept ``None`` or a float ``[H]`` tensor on ``q``'s device (``q``: ``[T, H, D]``).

    Raises:
        TypeError: not a float tensor. ValueError: wrong shape or device.
    """
    if sinks is not None:
        sinks = check_tensor_form("sinks", sinks, 1)
        check_same("sinks.shape must be [H]", tuple(sinks.shape), (q.shape[1],))
        check_same("sinks.device must match q", sinks.device, q.device)


def check_cu_seqlens(name: str, cu: object, total: int) -> Tensor:
    """Validate a ``[B + 1]`` int32/int64 cu_seqlens (leading 0, non-decreasing, last = ``total``).

    Host-syncs (reads the first and last entries). Returns an int64 copy on the same device.

    Raises:
        TypeError: not an int32/int64 tensor. ValueError: not 1-D, no leading 0,
            decreasing, or the last entry is not ``total``.
    """
    cu = check_tensor_form(name, cu, 1, floating=False)
    if cu.numel() == 0 or int(cu[0]) != 0:
        raise ValueError(f"{name} must start with a leading 0, got {cu[:4].tolist()}...")
    if bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    if int(cu[-1]) != total:
        raise ValueError(f"{name}[-1] must equal the token count {total}, got {int(cu[-1])}")
    return cu.to(torch.int64)


def check_finite(name: str, value: object, *, positive: bool = False) -> None:
    """A finite real number (and ``> 0`` when ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} float, got {value!r}")
