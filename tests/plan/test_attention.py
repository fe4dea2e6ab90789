"""The attention plan: every layout and exchange as plan data, checked against brute force."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.plan import bsnd_cu_seqlens, plan_attention
from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_zigzag, zigzag_tnd_gather_index, zigzag_tnd_index


def test_worked_example_rank1() -> None:
    plan = plan_attention(torch.tensor([0, 5, 12, 16]), 2, 1, compress_ratios=[4])
    seg = plan.segments
    assert seg.q_positions.tolist() == [3, 4, 5, 6, 0, 1, 2, 3]
    assert seg.q_kv_rows.tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    assert seg.q_doc_rows.tolist() == [0, 0, 0, 0, 7, 7, 7, 7]
    cmp, vis = seg.compressed_for(4), seg.visible_for(4)
    # kv segments [7, 4] -> entries [1, 1]; queries at positions 3..6 see 1, 1, 1, 1; 0..3 see 0, 0, 0, 1.
    assert vis.cu_seqlens.tolist() == [0, 1, 2]
    assert vis.visible_count.tolist() == [1, 1, 1, 1, 0, 0, 0, 1]
    assert vis.visible_start.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert cmp.block_starts.tolist() == [0, 7] and cmp.entry_positions.tolist() == [0, 0]
    assert plan.num_global_queries == 16


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
        seg, cmp = plan.segments, plan.segments.visible_for(ratio)
        win = seg.window_indices(window)
        vis = cmp.visible_indices()
        assert plan.prefix is not None
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
def test_bsnd_is_zigzag_over_equal_documents(cp: int) -> None:
    """Flattened zigzag BSND shards are the per-document zigzag TND shards of B equal documents."""
    batch, seq = 2, 8 * cp
    cu = bsnd_cu_seqlens(batch, seq)
    tokens = torch.arange(batch * seq).reshape(batch, seq)
    for rank in range(cp):
        plan = plan_attention(cu, cp, rank, layout="zigzag", compress_ratios=[4])
        assert torch.equal(shard_zigzag(tokens, cp, rank).flatten(), zigzag_tnd_index(cu, cp, rank))
        c = seq // (2 * cp)
        expected = list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))
        assert plan.q_positions.tolist() == expected * batch


def test_plan_options_are_checked() -> None:
    cu = torch.tensor([0, 8, 16])
    with pytest.raises(ValueError, match="layout"):
        plan_attention(cu, 2, 0, layout="bsnd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exchange"):
        plan_attention(cu, 2, 0, exchange="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ring_degree"):
        plan_attention(cu, 2, 0, ring_degree=2)
    with pytest.raises(ValueError, match="divisible by 2"):  # zigzag lengths, under either exchange
        plan_attention(torch.tensor([0, 6, 16]), 2, 0, layout="zigzag", exchange="need")
    with pytest.raises(ValueError, match="window"):
        plan_attention(cu, 2, 0, exchange="need", windows=[16]).kv_source(32)


def test_ring_rounds_partition_the_halo_and_plan_kernel_ranges() -> None:
    """Rounds split [lo, a_r); each round's kernel form (num_rows, left) equals its lo/hi ranges."""
    cu = torch.tensor([0, 5, 40, 48])
    for window in (None, 3, 9):
        plan = plan_attention(cu, 4, 2, exchange="need", ring_degree=3, windows=[window])
        source = plan.kv_source(window)
        assert source.halo is None and len(source.rounds) == 3
        sizes = [r.ranges.num_keys for r in source.rounds]
        halo = plan_attention(cu, 4, 2, exchange="need", windows=[window]).kv_source(window).halo
        assert halo is not None and sum(sizes) == halo.num_recv
        for ring_round in source.rounds:
            ranges, n = ring_round.ranges, ring_round.ranges.num_keys
            rows = torch.arange(plan.local_len)
            d = n - ranges.num_rows
            kernel_lo = torch.clamp(rows + d - ranges.left, min=0) if ranges.left >= 0 else torch.zeros_like(rows)
            seen = rows < ranges.num_rows
            assert torch.equal(torch.where(seen, kernel_lo, n), ranges.lo)
            assert bool((ranges.hi[seen] == n).all()) and torch.equal(ranges.lo[~seen], ranges.hi[~seen])


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_tnd_plan_reads_each_chunk_prefix(cp: int) -> None:
    lengths = [24, 0, 48]
    cu = seqlens_to_cu_seqlens(lengths)
    natural_of_gathered = torch.argsort(zigzag_tnd_gather_index(cu, cp))
    for rank in range(cp):
        plan = plan_attention(cu, cp, rank, layout="zigzag", compress_ratios=[4])
        seg = plan.segments
        local = zigzag_tnd_index(cu, cp, rank)
        # Document start of each segment: two chunks per document (empty doc skipped), one on the
        # middle rank, whose chunks r and 2cp-1-r touch (joined into one range).
        starts = torch.tensor([0, 24]).repeat_interleave(1 if rank == cp - 1 else 2)
        # Positions are document positions of the local tokens; kv rows are the causal prefixes.
        assert torch.equal(seg.q_positions, local - starts.repeat_interleave(seg.cu_seqlens_q.diff().long()))
        assert plan.gather_rows is not None
        kv_natural = natural_of_gathered[plan.gather_rows]
        cu_kv = seg.cu_seqlens_kv.tolist()
        for b in range(len(cu_kv) - 1):
            rows = kv_natural[cu_kv[b] : cu_kv[b + 1]].tolist()
            assert rows == list(range(int(starts[b]), int(starts[b]) + len(rows)))
        assert plan.num_global_queries == 72


def test_compressed_cu_seqlens_come_from_the_kv_of_a_document_crossing_ranks() -> None:
    """Rank 1 of [10, 6] at cp 2 holds 2 queries of document 0, whose kv prefix holds 10 tokens: 2 entries of
    ratio 4 (MindSpeed-LLM's TND wrapper derives them from the 2 query tokens: none; docs/mindspeed.md)."""
    plan = plan_attention(torch.tensor([0, 10, 16]), 2, 1, compress_ratios=[4])
    assert plan.segments.cu_seqlens_q.tolist() == [0, 2, 8] and plan.segments.cu_seqlens_kv.tolist() == [0, 10, 16]
    assert plan.segments.visible[0].cu_seqlens.tolist() == [0, 10 // 4, 10 // 4 + 6 // 4]


@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_positions_continue_across_rank_boundaries(layout: str) -> None:
    """Every rank's RoPE positions, put back in packed order, are each document's 0..n-1: no position repeats
    across a CP boundary (cp 3; MindSpeed-LLM's SP x CP offset repeats them, docs/mindspeed.md)."""
    from cpkv.plan.cost import CostModel

    lengths = [7, 0, 20, 3, 6]
    cu = seqlens_to_cu_seqlens(lengths)
    plans = [plan_attention(cu, 3, r, layout=layout, cost_model=CostModel()) for r in range(3)]  # type: ignore[arg-type]
    positions = plans[0].unshard([p.q_positions for p in plans])
    assert positions.tolist() == [i for n in lengths for i in range(n)]
