"""Attention backends behind one narrow interface (:class:`AttentionBackend`).

Select one with :func:`get_backend`: ``"reference"`` (pure torch, any device, the
oracle). An :class:`AttentionBackend` instance is accepted as is.
"""

from __future__ import annotations

from cpkv.backends.base import AttentionBackend
from cpkv.backends.reference_backend import ReferenceBackend

BACKEND_NAMES = ("reference",)


def get_backend(backend: str | AttentionBackend) -> AttentionBackend:
    """Resolve ``backend`` (a name or an instance) to an :class:`AttentionBackend`.

    Raises:
        ValueError: an unknown name.
    """
    if not isinstance(backend, str):
        return backend
    if backend == "reference":
        return ReferenceBackend()
    raise ValueError(f"backend must be one of {BACKEND_NAMES} or an AttentionBackend, got {backend!r}")


__all__ = ["AttentionBackend", "BACKEND_NAMES", "ReferenceBackend", "get_backend"]
