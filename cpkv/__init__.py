"""cpkv: context parallelism with prefix KV over packed (TND) sequences.

Pure, typed functions over tensors and explicit process groups:

* planning (no communication): :func:`compute_prefix_kv_cu_seqlens`,
  :func:`rearrange_prefix_kv`, :func:`slice_tnd_kv_prefix`, :class:`PrefixKVPlan`;
* sequence-length conventions: :func:`validate_cu_seqlens`,
  :func:`cu_seqlens_to_actual_seq_len`, :func:`actual_seq_len_to_cu_seqlens`,
  :func:`compress_cu_seqlens`;
* sharding: :func:`permute_cp_shard`, :func:`shard_contiguous`, :func:`shard_zigzag`,
  :func:`shard_zigzag_tnd` (load-balanced per-document zigzag), :func:`pad_documents`
  and their inverses;
* collectives: :func:`gather_from_sp_cp`, :func:`global_num_seqs`,
  :func:`all_gather_qk_weight_kvallgather`;
* DeepSeek-V4 compression modes: :class:`LayerCompressMode`, :func:`effective_cmp_ratio`;
* the pipeline: :func:`plan_attention`, :func:`attention_forward` (``exchange`` "allgather"
  or "need", ``ring_degree`` rounds) and the zigzag variants;
* the need-based exchange (:func:`plan_need_exchange`, :func:`exchange_rows`) and
  :class:`BackwardOrder`, which keeps backward collectives in one order on every rank.
"""

from cpkv.attention import (
    AttentionOutput,
    AttentionSpec,
    attend_prefix,
    attention_forward,
)
from cpkv.attention_zigzag import attention_forward_bsnd, attention_forward_zigzag_tnd
from cpkv.attention_plan import (
    AttentionPlan,
    BSNDPlan,
    SegmentPlan,
    ZigzagTNDPlan,
    plan_attention,
    plan_attention_bsnd,
    plan_attention_zigzag_tnd,
    plan_segments,
)
from cpkv.comm import (
    BackwardOrder,
    IndexerInputs,
    all_gather_qk_weight_kvallgather,
    check_same_on_all_ranks,
    gather_from_sp_cp,
    global_num_seqs,
)
from cpkv.exchange import NeedPlan, Routes, exchange_rows, plan_need_exchange
from cpkv.indexer_loss import IndexerLossConfig, sparse_attention_with_indexer_loss
from cpkv.compress_mode import LayerCompressMode, effective_cmp_ratio
from cpkv.layout import (
    CompressedSeqlens,
    PaddedDocuments,
    actual_seq_len_to_cu_seqlens,
    compress_cu_seqlens,
    cu_seqlens_to_actual_seq_len,
    pad_documents,
    seqlens_to_cu_seqlens,
    token_positions,
    validate_cu_seqlens,
)
from cpkv.plan import PrefixKVPlan, compute_prefix_kv_cu_seqlens, rearrange_prefix_kv, slice_tnd_kv_prefix
from cpkv.sharding import (
    check_zigzag_tnd_lengths,
    contiguous_shard_range,
    permute_cp_shard,
    shard_contiguous,
    shard_zigzag,
    shard_zigzag_tnd,
    unshard_contiguous,
    unshard_zigzag,
    unshard_zigzag_tnd,
    zigzag_gather_index,
    zigzag_tnd_gather_index,
    zigzag_tnd_index,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionOutput",
    "AttentionPlan",
    "AttentionSpec",
    "BSNDPlan",
    "BackwardOrder",
    "CompressedSeqlens",
    "IndexerInputs",
    "IndexerLossConfig",
    "LayerCompressMode",
    "NeedPlan",
    "PaddedDocuments",
    "PrefixKVPlan",
    "Routes",
    "SegmentPlan",
    "ZigzagTNDPlan",
    "actual_seq_len_to_cu_seqlens",
    "all_gather_qk_weight_kvallgather",
    "attend_prefix",
    "check_same_on_all_ranks",
    "attention_forward",
    "attention_forward_bsnd",
    "attention_forward_zigzag_tnd",
    "check_zigzag_tnd_lengths",
    "compress_cu_seqlens",
    "compute_prefix_kv_cu_seqlens",
    "contiguous_shard_range",
    "cu_seqlens_to_actual_seq_len",
    "effective_cmp_ratio",
    "exchange_rows",
    "gather_from_sp_cp",
    "global_num_seqs",
    "pad_documents",
    "permute_cp_shard",
    "plan_attention",
    "plan_attention_bsnd",
    "plan_attention_zigzag_tnd",
    "plan_need_exchange",
    "plan_segments",
    "rearrange_prefix_kv",
    "seqlens_to_cu_seqlens",
    "shard_contiguous",
    "shard_zigzag",
    "shard_zigzag_tnd",
    "slice_tnd_kv_prefix",
    "sparse_attention_with_indexer_loss",
    "token_positions",
    "unshard_contiguous",
    "unshard_zigzag",
    "unshard_zigzag_tnd",
    "validate_cu_seqlens",
    "zigzag_gather_index",
    "zigzag_tnd_gather_index",
    "zigzag_tnd_index",
]
