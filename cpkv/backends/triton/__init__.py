"""Triton kernels for the sparse primitives: shared-KV attention with sinks, the KL target, the indexer top-k.

:class:`~cpkv.backends.cuda.CUDABackend` runs these where they apply (docs/backends.md);
they are also usable directly as ``torch.library`` custom ops (:mod:`cpkv.backends.triton.ops`):

* ``sparse_attention_op(q, kv, indices, sinks, scale, d_v, deterministic)`` -> ``(out, lse)``:
  q ``[T, H, D]`` (any D; the value channels and the rest are two resident tiles) over the listed rows
  ``indices`` ``[T, K]`` (-1 padded) of one shared kv head ``[N, D]`` whose first ``d_v``
  channels are the values, per-head sinks, natural-log LSE including the sink; forward
  and backward (dq, dkv, dsinks, also through the LSE). ``deterministic=True`` sums dkv
  in a fixed order (each entry's terms stored, then a key-major pass over an inverted
  index) instead of fp32 atomics: bitwise reproducible.
* ``selected_probs_op(q, kv, indices, lse, scale)`` -> ``[T, K]``: head-summed probabilities
  from that LSE (the indexer KL target before normalisation).
* ``indexer_topk_op(q, k, weights, k_scale, start, count, topk)`` -> ``(indices, scores)``
  (:mod:`cpkv.backends.triton.indexer_ops`): lightning-indexer scores on tensor cores (bf16,
  fp16, fp32, or fp8 e4m3 with per-key scales) and the exact running top-k in one launch,
  visible rows ``[start[t], start[t] + count[t])``, ties to the earlier row, no host sync.

Semantics equal the reference ops (:mod:`cpkv.backends.reference`). ``triton`` is imported
only when a kernel first runs (:func:`is_available` checks for it without importing the
kernels). On CPU the kernels run only under Triton's interpreter (``TRITON_INTERPRET=1`` set
before the kernels are imported), which is how the tests run them.
"""

from __future__ import annotations

import importlib.util

from cpkv.backends.triton.indexer_ops import indexer_topk_op
from cpkv.backends.triton.ops import inverted_index, selected_probs_op, sparse_attention_op

__all__ = ["indexer_topk_op", "inverted_index", "is_available", "selected_probs_op", "sparse_attention_op"]


def is_available() -> bool:
    """Whether the ``triton`` package is importable (the kernels need it; a GPU is checked by the caller)."""
    return importlib.util.find_spec("triton") is not None
