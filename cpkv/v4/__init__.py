"""A small DeepSeek-V4-style attention layer: cpkv's executable specification.

Random-initialised and small, it holds every piece the CP pipeline must get right:
shared-KV MQA with RoPE, a sliding window with sinks, the gated-pooling compressor
(overlapping for ratio 4) and the lightning indexer with its KL loss. It runs under CP
through :func:`cpkv.attention.attention_forward` (:meth:`V4Attention.forward`) and on a
whole packed batch in one process (:func:`reference_forward`, a dense brute-force oracle).
"""

from cpkv.v4.compressor import Compressor
from cpkv.v4.dense_reference import reference_forward
from cpkv.v4.indexer import Indexer
from cpkv.v4.layer import LayerOutput, V4Attention, V4Config
from cpkv.v4.rope import apply_rope

__all__ = ["Compressor", "Indexer", "LayerOutput", "V4Attention", "V4Config", "apply_rope", "reference_forward"]
