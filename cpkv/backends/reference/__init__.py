"""Pure-torch reference ops: the oracle of every test and the CPU path.

The numeric kernels are ``torch.library`` custom ops in namespace ``cpkv``
(``range_attention``, ``sparse_attention`` and their ``*_backward`` ops, ``selected_probs``,
``indexer_topk``), each with a shape-only fake and, where differentiable, a registered
autograd, so code calling them compiles with ``torch.compile(fullgraph=True)``. The
functions exported here validate their arguments (which may host-sync) and then call the
ops; :class:`ReferenceBackend` calls the ops directly from plan tensors, without syncs.

Modules: ``common`` (precision and ``-inf`` helpers), ``varlen`` (varlen and key-range
attention), ``sparse`` (shared-KV sparse attention, head probabilities), ``indexer``
(lightning indexer scores and top-k), ``backend`` (:class:`ReferenceBackend`).

Precision: fp64 inputs are computed in fp64; fp16/bf16/fp32 inputs accumulate in fp32 and
outputs come back in the input dtype. LSEs, probabilities and indexer scores are fp32 (fp64
for fp64 inputs). Memory: every op walks ``block_size`` query rows at a time (the attention
also ``block_size`` keys, with an online softmax) and the backward recomputes
probabilities per block: no ``[T_q, T_kv]`` matrix exists.
"""

from cpkv.backends.base import AttentionResult
from cpkv.backends.reference.backend import ReferenceBackend
from cpkv.backends.reference.indexer import IndexerTopK, indexer_scores, indexer_topk
from cpkv.backends.reference.sparse import sparse_attention, sparse_attention_head_probs
from cpkv.backends.reference.varlen import range_attention, varlen_attention

__all__ = [
    "AttentionResult",
    "IndexerTopK",
    "ReferenceBackend",
    "indexer_scores",
    "indexer_topk",
    "range_attention",
    "sparse_attention",
    "sparse_attention_head_probs",
    "varlen_attention",
]
