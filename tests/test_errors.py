"""Bad input raises a clear ValueError/TypeError that names the argument.

The distributed cases (every rank raises, none hangs) are in test_comm.py.
"""

from collections.abc import Callable

import pytest
import torch

from cpkv.compress_mode import LayerCompressMode
from cpkv.plan.conventions import actual_seq_len_to_cu_seqlens, compress_cu_seqlens, validate_cu_seqlens
from cpkv.plan.prefix import compute_prefix_kv_cu_seqlens, rearrange_prefix_kv, slice_tnd_kv_prefix
from cpkv.plan.sharding import permute_cp_shard, shard_contiguous, shard_zigzag

CU = torch.tensor([0, 5, 12, 16])
PLAN = compute_prefix_kv_cu_seqlens(CU, 8, 8)

BAD_INPUTS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("non-monotonic", lambda: validate_cu_seqlens(torch.tensor([0, 5, 3, 9])), ValueError, "cu_seqlens"),
    ("missing leading zero", lambda: compute_prefix_kv_cu_seqlens(torch.tensor([5, 12, 16]), 0, 8), ValueError, "cu_seqlens"),
    ("float dtype", lambda: compute_prefix_kv_cu_seqlens(torch.tensor([0.0, 5.0, 16.0]), 0, 8), TypeError, "cu_seqlens"),
    ("not a tensor", lambda: compute_prefix_kv_cu_seqlens([0, 5, 16], 0, 8), TypeError, "cu_seqlens"),  # type: ignore[arg-type]
    ("wrong tensor rank", lambda: validate_cu_seqlens(torch.tensor([[0, 5, 16]])), ValueError, "cu_seqlens"),
    ("empty cu_seqlens", lambda: validate_cu_seqlens(torch.tensor([], dtype=torch.int64)), ValueError, "cu_seqlens"),
    ("last entry != token count", lambda: slice_tnd_kv_prefix(torch.zeros(15, 2), CU, 0, 2), ValueError, "kv_gathered"),
    ("last entry != num_tokens", lambda: validate_cu_seqlens(CU, num_tokens=17), ValueError, "cu_seqlens[-1]"),
    ("tokens not divisible by cp", lambda: slice_tnd_kv_prefix(torch.zeros(16, 2), CU, 0, 3), ValueError, "num_tokens"),
    ("rank out of range", lambda: slice_tnd_kv_prefix(torch.zeros(16, 2), CU, 2, 2), ValueError, "cp_rank"),
    ("negative offset", lambda: compute_prefix_kv_cu_seqlens(CU, -1, 8), ValueError, "rank_offset"),
    ("negative local_len", lambda: compute_prefix_kv_cu_seqlens(CU, 0, -2), ValueError, "local_len"),
    ("local range past the end", lambda: compute_prefix_kv_cu_seqlens(CU, 10, 8), ValueError, "rank_offset + local_len"),
    ("bool offset", lambda: compute_prefix_kv_cu_seqlens(CU, True, 8), TypeError, "rank_offset"),
    ("non-positive ratio", lambda: compress_cu_seqlens(CU, 0), ValueError, "ratio"),
    ("float ratio", lambda: compress_cu_seqlens(CU, 4.0), TypeError, "ratio"),  # type: ignore[arg-type]
    ("negative compress_ratio", lambda: LayerCompressMode.from_compress_ratio(-4), ValueError, "compress_ratio"),
    ("kv length not matching the plan", lambda: rearrange_prefix_kv(torch.zeros(12, 2), PLAN), ValueError, "plan.num_tokens"),
    ("ascend list with leading 0", lambda: actual_seq_len_to_cu_seqlens([0, 5, 12]), ValueError, "actual_seq_len"),
    ("zigzag length not divisible", lambda: shard_zigzag(torch.zeros(2, 10, 1), 3, 0), ValueError, "2*cp_size"),
    ("reorder=False without rank", lambda: permute_cp_shard(torch.zeros(8), 2, reorder=False), ValueError, "rank"),
    ("reorder=True with rank", lambda: permute_cp_shard(torch.zeros(8), 2, reorder=True, rank=0), ValueError, "rank"),
    ("zigzag rank out of range", lambda: shard_zigzag(torch.zeros(1, 8, 1), 2, 5), ValueError, "cp_rank"),
    ("bad dim", lambda: shard_contiguous(torch.zeros(8, 2), 2, 0, dim=3), ValueError, "dim"),
    ("cp_size zero", lambda: shard_contiguous(torch.zeros(8, 2), 0, 0), ValueError, "cp_size"),
]


@pytest.mark.parametrize(("case", "call", "error", "names"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_named(case: str, call: Callable[[], object], error: type[Exception], names: str) -> None:
    with pytest.raises(error) as info:
        call()
    assert names in str(info.value), f"{case}: message does not name {names!r}: {info.value}"
