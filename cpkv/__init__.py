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
* layouts: every layout is a :class:`ShardLayout` (each rank's token ranges;
  :func:`layout_from_ranges` for your own); :func:`balanced_layout` cuts documents so that a
  DeepSeek-V4 :class:`CostModel` is equal on every rank (:func:`rank_costs`);
* the pipeline: :func:`plan_attention` (layout, exchange, ring rounds, compress ratios and
  windows: the whole description of a micro-batch) and its one executor :func:`attention_forward`;
* :func:`exchange_rows` (need-exchange routes), :func:`merge_partials` and
  :class:`BackwardOrder`, which keeps backward collectives in one order on every rank;
* :class:`StepStatus`: a step's layer-call failures, recorded without a host sync and
  raised on every rank once per step (:mod:`cpkv.status`).

What every operation means: docs/semantics.md.
"""

from cpkv.attention import (
    AttentionOutput,
    AttentionSpec,
    CompressorFn,
    IndexerFn,
    attention_forward,
)
from cpkv.backends.base import AttentionBackend, AttentionResult, BackendName
from cpkv.collectives import BackwardOrder, Group
from cpkv.comm import (
    IndexerInputs,
    all_gather_qk_weight_kvallgather,
    check_same_on_all_ranks,
    gather_from_sp_cp,
    global_num_seqs,
)
from cpkv.compress_mode import LayerCompressMode, effective_cmp_ratio
from cpkv.exchange import exchange_rows
from cpkv.merge import merge_partials
from cpkv.status import StepStatus
from cpkv.plan import (
    AttentionPlan,
    CompressedPlan,
    CompressedSeqlens,
    CostModel,
    EntryVisibility,
    Exchange,
    KeyRanges,
    Layout,
    PaddedDocuments,
    PrefixKVPlan,
    Routes,
    SegmentPlan,
    ShardLayout,
    actual_seq_len_to_cu_seqlens,
    balanced_layout,
    bsnd_cu_seqlens,
    compress_cu_seqlens,
    compute_prefix_kv_cu_seqlens,
    cu_seqlens_to_actual_seq_len,
    layout_from_ranges,
    pad_documents,
    plan_attention,
    plan_segments,
    rank_costs,
    rearrange_prefix_kv,
    seqlens_to_cu_seqlens,
    slice_tnd_kv_prefix,
    token_positions,
    validate_cu_seqlens,
)
from cpkv.plan.sharding import (
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

__version__ = "0.4.0"

__all__ = [
    "AttentionBackend",
    "AttentionOutput",
    "AttentionPlan",
    "AttentionResult",
    "AttentionSpec",
    "BackendName",
    "BackwardOrder",
    "CompressedPlan",
    "CompressedSeqlens",
    "CompressorFn",
    "CostModel",
    "EntryVisibility",
    "Exchange",
    "Group",
    "IndexerFn",
    "IndexerInputs",
    "KeyRanges",
    "LayerCompressMode",
    "Layout",
    "PaddedDocuments",
    "PrefixKVPlan",
    "Routes",
    "SegmentPlan",
    "ShardLayout",
    "StepStatus",
    "actual_seq_len_to_cu_seqlens",
    "all_gather_qk_weight_kvallgather",
    "attention_forward",
    "balanced_layout",
    "bsnd_cu_seqlens",
    "check_same_on_all_ranks",
    "check_zigzag_tnd_lengths",
    "compress_cu_seqlens",
    "compute_prefix_kv_cu_seqlens",
    "contiguous_shard_range",
    "cu_seqlens_to_actual_seq_len",
    "effective_cmp_ratio",
    "exchange_rows",
    "gather_from_sp_cp",
    "global_num_seqs",
    "layout_from_ranges",
    "merge_partials",
    "pad_documents",
    "permute_cp_shard",
    "plan_attention",
    "plan_segments",
    "rank_costs",
    "rearrange_prefix_kv",
    "seqlens_to_cu_seqlens",
    "shard_contiguous",
    "shard_zigzag",
    "shard_zigzag_tnd",
    "slice_tnd_kv_prefix",
    "token_positions",
    "unshard_contiguous",
    "unshard_zigzag",
    "unshard_zigzag_tnd",
    "validate_cu_seqlens",
    "zigzag_gather_index",
    "zigzag_tnd_gather_index",
    "zigzag_tnd_index",
]
