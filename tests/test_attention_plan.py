"""Per-query index plans: positions, windows, compressed visibility, BSND steps."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.attention_plan import plan_attention, plan_attention_bsnd, plan_segments
from cpkv.layout import seqlens_to_cu_seqlens


def test_worked_example_rank1() -> None:
    plan = plan_attention(torch.tensor([0, 5, 12, 16]), 2, 1, compress_ratios=[4])
    seg = plan.segments
    assert seg.q_positions.tolist() == [3, 4, 5, 6, 0, 1, 2, 3]
    assert seg.q_kv_rows.tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    assert seg.q_doc_rows.tolist() == [0, 0, 0, 0, 7, 7, 7, 7]
    cmp = seg.compressed_for(4)
    # kv segments [7, 4] -> entries [1, 1]; queries at positions 3..6 see 1, 1, 1, 1; 0..3 see 0, 0, 0, 1.
    assert cmp.cu_seqlens.tolist() == [0, 1, 2]
    assert cmp.visible_count.tolist() == [1, 1, 1, 1, 0, 0, 0, 1]
    assert cmp.visible_start.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert cmp.block_starts.tolist() == [0, 7] and cmp.entry_positions.tolist() == [0, 0]
    assert plan.num_global_queries == 16


def test_window_indices_literal() -> None:
    cu = torch.tensor([0, 2, 6])
    seg = plan_segments(cu, cu)
    assert seg.window_indices(3).tolist() == [
        [-1, -1, 0], [-1, 0, 1], [-1, -1, 2], [-1, 2, 3], [2, 3, 4], [3, 4, 5],
    ]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=20), min_size=1, max_size=6),
    cp=st.integers(min_value=1, max_value=4),
    ratio=st.sampled_from([2, 4, 8]),
    window=st.integers(min_value=1, max_value=9),
)
def test_index_sets_match_global_brute_force(lengths: list[int], cp: int, ratio: int, window: int) -> None:
    """Window rows and visible compressed entries, mapped to global ids, equal a brute-force enumeration."""
    pad = -sum(lengths) % cp
    lengths = [*lengths, pad] if pad else lengths
    cu = seqlens_to_cu_seqlens(lengths)
    starts = cu[:-1].tolist()
    doc_of = [d for d, n in enumerate(lengths) for _ in range(n)]
    for rank in range(cp):
        plan = plan_attention(cu, cp, rank, compress_ratios=[ratio])
        seg, cmp = plan.segments, plan.segments.compressed_for(ratio)
        win = seg.window_indices(window)
        vis = cmp.visible_indices()
        for i in range(plan.prefix.local_len):
            q = plan.prefix.rank_offset + i
            s = starts[doc_of[q]]
            expected_keys = set(range(max(s, q - window + 1), q + 1))
            got_keys = {plan.prefix.kv_start + int(r) for r in win[i] if r >= 0}
            assert got_keys == expected_keys
            visible = (q - s + 1) // ratio
            assert cmp.visible_count[i] == visible
            assert [int(r) for r in vis[i] if r >= 0] == list(range(int(cmp.visible_start[i]), int(cmp.visible_start[i]) + visible))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_bsnd_plan_steps(cp: int) -> None:
    seq, batch = 8 * cp, 2
    covered = []
    for rank in range(cp):
        plan = plan_attention_bsnd(batch, seq, cp, rank, compress_ratios=[4])
        c = plan.chunk_len
        assert c == seq // (2 * cp)
        assert plan.prefix_lens == ((rank + 1) * c, (2 * cp - rank) * c)
        for step, prefix_len in zip(plan.steps, plan.prefix_lens):
            assert step.cu_seqlens_q.tolist() == [0, c, 2 * c]
            assert step.cu_seqlens_kv.tolist() == [0, prefix_len, 2 * prefix_len]
            assert step.q_positions.tolist() == list(range(prefix_len - c, prefix_len)) * batch
        covered += plan.positions.tolist()
    assert sorted(covered) == list(range(seq))


def test_plan_errors_name_arguments() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        plan_attention_bsnd(1, 10, 3, 0)
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        plan_segments(torch.tensor([0, 4]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="compress_ratios"):
        plan_segments(torch.tensor([0, 4]), torch.tensor([0, 4]), compress_ratios=[1])
    with pytest.raises(ValueError, match="not planned"):
        plan_segments(torch.tensor([0, 4]), torch.tensor([0, 4])).compressed_for(4)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_tnd_plan_reads_each_chunk_prefix(cp: int) -> None:
    from cpkv.attention_plan import plan_attention_zigzag_tnd
    from cpkv.sharding import zigzag_tnd_gather_index, zigzag_tnd_index

    lengths = [24, 0, 48]
    cu = seqlens_to_cu_seqlens(lengths)
    natural_of_gathered = torch.argsort(zigzag_tnd_gather_index(cu, cp))
    for rank in range(cp):
        plan = plan_attention_zigzag_tnd(cu, cp, rank, compress_ratios=[4])
        seg = plan.segments
        local = zigzag_tnd_index(cu, cp, rank)
        starts = torch.tensor([0, 0, 24, 24])  # document start of each segment (empty doc skipped)
        # Positions are document positions of the local tokens; kv rows are the causal prefixes.
        assert torch.equal(seg.q_positions, local - starts.repeat_interleave(seg.cu_seqlens_q.diff().long()))
        kv_natural = natural_of_gathered[plan.kv_rows]
        cu_kv = seg.cu_seqlens_kv.tolist()
        for b in range(len(cu_kv) - 1):
            rows = kv_natural[cu_kv[b] : cu_kv[b + 1]].tolist()
            assert rows == list(range(int(starts[b]), int(starts[b]) + len(rows)))
        assert plan.num_global_queries == 72
