"""Attention backends behind one narrow interface (:class:`AttentionBackend`).

A backend implements seven primitives over packed (TND) tensors: ``varlen_attention``,
``range_attention`` (ring rounds), ``sparse_attention``, ``sparse_attention_probs``,
``selected_probs``, ``indexer_topk`` and ``indexer_kl`` (:mod:`cpkv.backends.base`).

Select one with :func:`get_backend`:

* ``"reference"``: pure torch, any device, the oracle;
* ``"cuda"``: :class:`~cpkv.backends.cuda.CUDABackend`, flash varlen attention (and ring
  rounds) through ``torch.nn.attention.varlen.varlen_attn`` (reference ops for the sparse
  parts);
* ``"npu"``: :class:`~cpkv.backends.npu.NPUBackend`, torch_npu's fused ops (imported
  lazily, only when this backend is created);
* ``"auto"``: by ``device.type``: ``npu`` -> NPU, ``cuda`` -> CUDA, anything else (or no
  device) -> reference.

Fused backends fall back to the reference, with one warning per backend instance and
reason, where a kernel cannot serve a call (docs/backends.md; the primitives' semantics:
docs/semantics.md). An :class:`AttentionBackend` instance is accepted as is; create one
per model (not per call) so that its fallback warnings are issued once.
"""

from __future__ import annotations

import torch

from cpkv.backends.base import AttentionBackend
from cpkv.backends.reference import ReferenceBackend

BACKEND_NAMES = ("reference", "cuda", "npu", "auto")


def resolve_backend_name(backend: str, device: torch.device | str | None = None) -> str:
    """The concrete backend name for ``backend`` (``"auto"`` resolved by ``device``).

    Example:
        >>> resolve_backend_name("auto", torch.device("cpu"))
        'reference'
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES} or an AttentionBackend, got {backend!r}")
    if backend != "auto":
        return backend
    if device is None:
        return "reference"
    # A string is parsed here: torch.device("npu") only parses once torch_npu is loaded.
    device_type = device.split(":", 1)[0] if isinstance(device, str) else device.type
    return {"npu": "npu", "cuda": "cuda"}.get(device_type, "reference")


def get_backend(backend: str | AttentionBackend, device: torch.device | str | None = None) -> AttentionBackend:
    """Resolve ``backend`` (a name or an instance) to an :class:`AttentionBackend`.

    Args:
        backend: one of :data:`BACKEND_NAMES`, or an instance (returned unchanged).
        device: the tensors' device, used by ``"auto"`` only (None: reference).

    Raises:
        ValueError: an unknown name. TypeError: ``device`` is not a device or string.
        RuntimeError: the named backend is unavailable (no torch_npu/CANN, no varlen_attn).

    Example:
        >>> get_backend("auto", "cpu").name
        'reference'
    """
    if not isinstance(backend, str):
        return backend
    if device is not None and not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a torch.device, a str or None, got {type(device).__name__}")
    name = resolve_backend_name(backend, device)
    if name == "cuda":
        from cpkv.backends.cuda import CUDABackend

        return CUDABackend()
    if name == "npu":
        from cpkv.backends.npu import NPUBackend

        return NPUBackend()
    return ReferenceBackend()


__all__ = ["AttentionBackend", "BACKEND_NAMES", "ReferenceBackend", "get_backend", "resolve_backend_name"]
