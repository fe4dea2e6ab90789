"""The need planner under any layout, against brute force, every rank simulated in one process.

Each rank's rows are the global ids of what it holds (tokens, or entries); moving them along
the plan's routes and assembling the buffers as the executor does must give exactly the rows
a per-query loop over the documents says each query reads.
"""

import random

import pytest
import torch

from cpkv.plan.cost import CostModel
from cpkv.plan import AttentionPlan, Routes, ShardLayout, layout_from_ranges, plan_attention, seqlens_to_cu_seqlens


def _move(plans: list[AttentionPlan], routes_of: list[Routes], rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """What every rank receives when every rank sends ``rows[src][send_rows]`` (the exchange's all-to-all)."""
    cp = len(plans)
    received: list[list[torch.Tensor]] = [[] for _ in range(cp)]
    for src in range(cp):
        chunks = rows[src][routes_of[src].send_rows].split(list(routes_of[src].send_splits))
        for dst in range(cp):
            received[dst].append(chunks[dst])
    for dst in range(cp):
        assert [c.numel() for c in received[dst]] == list(routes_of[dst].recv_splits)
        assert routes_of[dst].any_traffic == any(r.num_send for r in routes_of)
    return [torch.cat(r) for r in received]


def _gather(received: torch.Tensor, own: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    pool = torch.cat([received, own])
    return pool if rows is None else pool[rows]


def _random_layout(rng: random.Random) -> tuple[torch.Tensor, int, ShardLayout]:
    lengths = [rng.choice([0, 1, 3, 5, 9, 17, 30, 41]) for _ in range(rng.randint(1, 5))]
    cu = seqlens_to_cu_seqlens(lengths, dtype=torch.int64)
    cp = rng.randint(1, 4)
    total = int(cu[-1])
    cuts = sorted({0, total, *cu.tolist(), *(rng.randrange(total + 1) for _ in range(rng.randint(0, 8)))})
    starts, ends = torch.tensor(cuts[:-1]), torch.tensor(cuts[1:])
    ranks = torch.tensor([rng.randrange(cp) for _ in range(starts.numel())], dtype=torch.int64)
    return cu, cp, layout_from_ranges(cu, cp, starts, ends, ranks)


def _doc(cu: list[int], t: int) -> int:
    return max(d for d in range(len(cu) - 1) if cu[d] <= t < cu[d + 1])


@pytest.mark.parametrize("seed", range(6))
def test_need_buffers_hold_what_every_query_reads(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(5):
        cu_t, cp, layout = _random_layout(rng)
        cu = cu_t.tolist()
        windows: list[int | None] = [None, rng.choice([1, 2, 4, 7])]
        ratio, prev = rng.choice([2, 3, 4]), rng.choice([0, 1, 2])
        ring = rng.choice([1, 2, 3])
        plans = [
            plan_attention(cu_t, cp, r, layout=layout, cost_model=CostModel(), exchange="need", windows=windows, compress_ratios=[ratio],
                           prev_blocks={ratio: prev}, ring_degree=ring)
            for r in range(cp)
        ]
        own = [layout.local_tokens(r) for r in range(cp)]
        for r, plan in enumerate(plans):
            assert plan.layout == "custom" and torch.equal(plan.shard(torch.arange(int(cu[-1]))), own[r])
        for window in windows:
            sources = [p.kv_source(window) for p in plans]
            if ring == 1:
                got = _move(plans, [s.halo for s in sources], own)  # type: ignore[misc]
                for r, source in enumerate(sources):
                    buffer = _gather(got[r], own[r], source.rows)
                    expected = []
                    starts, ends = layout.ranges_of(r)
                    for s, e in zip(starts.tolist(), ends.tolist()):
                        d_start = cu[_doc(cu, s)]
                        expected += range(d_start if window is None else max(d_start, s - window + 1), e)
                    assert buffer.tolist() == expected
                    # The window rows each query's segments give are the tokens of its window.
                    if window is not None:
                        rows = source.segments.window_indices(window)
                        for i, t in enumerate(own[r].tolist()):
                            seen = sorted(int(buffer[j]) for j in rows[i].tolist() if j >= 0)
                            assert seen == list(range(max(cu[_doc(cu, t)], t - window + 1), t + 1))
            else:
                for i in range(ring):
                    rounds = [s.rounds[i] for s in sources]
                    got = _move(plans, [rd.routes for rd in rounds], own)
                    for r, rd in enumerate(rounds):
                        keys = got[r] if rd.rows is None else got[r][rd.rows]
                        assert keys.tolist() == sorted(keys.tolist())  # index order
                        for q, t in enumerate(own[r].tolist()):
                            d_start = cu[_doc(cu, t)]
                            first = d_start if window is None else max(d_start, t - window + 1)
                            local = {tok for s, e in zip(*map(torch.Tensor.tolist, layout.ranges_of(r))) if s <= t < e
                                     for tok in range(s, t + 1)}
                            want = [k for k in keys.tolist() if first <= k <= t and k not in local]
                            assert keys[int(rd.ranges.lo[q]):int(rd.ranges.hi[q])].tolist() == want
            # Together the rounds deliver each remote row a query reads exactly once.
        # Compressed entries: owners compute each entry once, from rows of its own blocks.
        cu_cmp = [0]
        for d in range(len(cu) - 1):
            cu_cmp.append(cu_cmp[-1] + (cu[d + 1] - cu[d]) // ratio)
        entry_doc = {cu_cmp[d] + j: (d, j) for d in range(len(cu) - 1) for j in range(cu_cmp[d + 1] - cu_cmp[d])}
        halo = _move(plans, [p.compressed[ratio].hidden for p in plans], own)
        owned_ids = []
        for r, plan in enumerate(plans):
            routes = plan.compressed[ratio]
            read = own[r][: routes.straddle_rows] if routes.straddle_own is None else own[r][routes.straddle_own]
            straddle_buffer = _gather(halo[r], read, routes.straddle_order) if routes.straddle_order is not None else torch.cat([halo[r], read])
            ids = []
            for buffer, blocks in ((straddle_buffer, routes.straddle), (own[r], routes.own)):
                for b, pos in zip(blocks.block_starts.tolist(), blocks.entry_positions.tolist()):
                    first_token = int(buffer[b])
                    d = _doc(cu, first_token)
                    j = pos // ratio
                    assert first_token == cu[d] + pos and pos % ratio == 0
                    reads = list(range(cu[d] + max(0, j - prev) * ratio, cu[d] + (j + 1) * ratio))
                    assert buffer[b - (min(j, prev)) * ratio: b + ratio].tolist() == reads  # contiguous in its buffer
                    assert int(layout.local_tokens(r).eq(cu[d] + (j + 1) * ratio - 1).sum()) == 1  # owner holds the last token
                    ids.append(cu_cmp[d] + j)
            owned_ids.append(torch.tensor(ids, dtype=torch.int64))
        assert sorted(torch.cat(owned_ids).tolist()) == list(range(cu_cmp[-1]))  # each entry once
        got = _move(plans, [p.compressed[ratio].entries for p in plans], owned_ids)
        for r, plan in enumerate(plans):
            routes = plan.compressed[ratio]
            buffer = _gather(got[r], owned_ids[r], routes.entry_rows)
            visible = plan.visible_for(ratio)
            assert visible is routes.visible and visible.num_entries == buffer.numel()
            for q, t in enumerate(own[r].tolist()):
                d = _doc(cu, t)
                start, count = int(visible.visible_start[q]), int(visible.visible_count[q])
                assert count == (t - cu[d] + 1) // ratio
                assert [entry_doc[int(k)] for k in buffer[start:start + count]] == [(d, j) for j in range(count)]


def test_contiguous_and_zigzag_are_shard_layouts() -> None:
    cu = torch.tensor([0, 8, 24, 24, 32])
    zig = plan_attention(cu, 2, 1, layout="zigzag").shards
    assert zig is not None
    # chunks 1 and 2 of each document (size L/4) on rank 1, joined where they touch
    assert list(zip(*map(torch.Tensor.tolist, zig.ranges_of(1)))) == [(2, 6), (12, 20), (26, 30)]
    contiguous = plan_attention(cu, 2, 0).shards
    assert contiguous is not None and contiguous.local_lens == (16, 16)
    x = torch.arange(32) * 10
    for plan in (plan_attention(cu, 2, r, layout=lay, cost_model=CostModel()) for lay in ("contiguous", "zigzag", "balanced") for r in (0, 1)):
        parts = [plan.layout_ranges.shard(x, r) for r in range(2)]
        assert torch.equal(plan.unshard(parts), x)


def test_layouts_reject_bad_ranges_and_other_batches() -> None:
    cu = torch.tensor([0, 4, 10])
    with pytest.raises(ValueError, match="inside one document"):
        layout_from_ranges(cu, 2, torch.tensor([0, 3]), torch.tensor([3, 10]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="exactly once"):
        layout_from_ranges(cu, 2, torch.tensor([0, 4]), torch.tensor([4, 9]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rank"):
        layout_from_ranges(cu, 2, torch.tensor([0, 4]), torch.tensor([4, 10]), torch.tensor([0, 2]))
    layout = layout_from_ranges(cu, 2, torch.tensor([0, 4]), torch.tensor([4, 10]), torch.tensor([1, 0]))
    assert layout.local_lens == (6, 4)
    with pytest.raises(ValueError, match="ShardLayout"):
        plan_attention(torch.tensor([0, 5, 10]), 2, 0, layout=layout)
    with pytest.raises(ValueError, match="T = 10 tokens must be divisible"):
        plan_attention(cu, 4, 0)
    with pytest.raises(TypeError, match="cost_model"):
        plan_attention(cu, 2, 0, cost_model=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shards"):
        layout.unshard([torch.zeros(6)])
    with pytest.raises(ValueError, match="T = 10"):
        layout.shard(torch.zeros(9), 0)
