"""Pure planning (no communication): conventions, sharding, the prefix plan, segments, routes, the attention plan.

Everything here maps the global ``cu_seqlens`` of a micro-batch and a rank's position in
the CP group to index tensors and host ints, once per micro-batch; the layers only read it.
"""

from cpkv.plan.attention import AttentionPlan, Exchange, Layout, bsnd_cu_seqlens, plan_attention
from cpkv.plan.balance import balanced_layout, rank_costs, token_cap
from cpkv.plan.cost import CostModel
from cpkv.plan.conventions import (
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
from cpkv.plan.prefix import PrefixKVPlan, compute_prefix_kv_cu_seqlens, rearrange_prefix_kv, slice_tnd_kv_prefix
from cpkv.plan.layouts import ShardLayout, contiguous_layout, layout_from_ranges, zigzag_layout
from cpkv.plan.routes import CompressedRoutes, KVSource, RingRound, Routes, plan_routes
from cpkv.plan.segments import CompressedPlan, EntryVisibility, KeyRanges, SegmentPlan, plan_segments

__all__ = [
    "AttentionPlan", "CompressedPlan", "CompressedRoutes", "CompressedSeqlens", "CostModel", "EntryVisibility", "Exchange",
    "KVSource", "KeyRanges", "Layout", "PaddedDocuments", "PrefixKVPlan", "RingRound", "Routes", "SegmentPlan",
    "ShardLayout", "contiguous_layout", "layout_from_ranges", "zigzag_layout",
    "actual_seq_len_to_cu_seqlens", "balanced_layout", "bsnd_cu_seqlens", "compress_cu_seqlens", "compute_prefix_kv_cu_seqlens",
    "cu_seqlens_to_actual_seq_len", "pad_documents", "plan_attention", "plan_routes", "plan_segments",
    "rank_costs", "rearrange_prefix_kv", "token_cap", "seqlens_to_cu_seqlens", "slice_tnd_kv_prefix", "token_positions", "validate_cu_seqlens",
]
