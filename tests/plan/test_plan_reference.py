"""The vectorised planners against brute-force per-token constructions, field by field.

The helpers here loop over documents, tokens and ranks in plain Python (the definitions of
docs/semantics.md, "Segments" and "Exchanges"), so they share no code with the planners; the
optimised planners must return exactly these values, dtypes included.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from cpkv.plan.attention import plan_attention
from cpkv.plan.routes import Routes
from cpkv.plan.segments import SegmentPlan, plan_segments

I64 = torch.int64


def _t(values: list[int], dtype: torch.dtype = I64) -> Tensor:
    return torch.tensor(values, dtype=dtype)


def _equal(got: Tensor, expected: Tensor, what: str) -> None:
    assert got.dtype == expected.dtype, (what, got.dtype, expected.dtype)
    assert got.tolist() == expected.tolist(), what


def _check_segments(
    got: SegmentPlan, cu_q: list[int], cu_kv: list[int], ratios: tuple[int, ...] = (), kv_offset: int = 0,
    cmp_dtype: torch.dtype = I64,
) -> None:
    """``got`` against a per-query loop over bottom-right aligned segment pairs."""
    positions, doc_rows, visible = [], [], {r: ([], []) for r in ratios}
    cu_cmp = {r: [0] for r in ratios}
    for b in range(len(cu_q) - 1):
        lq, lkv = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        gap = kv_offset if b == 0 else 0
        for r in ratios:
            cu_cmp[r].append(cu_cmp[r][-1] + lkv // r)
        for i in range(lq):
            positions.append(lkv - lq + i + gap)
            doc_rows.append(cu_kv[b] - gap)
            for r in ratios:
                visible[r][0].append(cu_cmp[r][b])
                visible[r][1].append((positions[-1] + 1) // r)
    _equal(got.cu_seqlens_q, _t(cu_q, torch.int32), "cu_seqlens_q")
    _equal(got.cu_seqlens_kv, _t(cu_kv, torch.int32), "cu_seqlens_kv")
    lq_all = [e - s for s, e in zip(cu_q, cu_q[1:])]
    lkv_all = [e - s for s, e in zip(cu_kv, cu_kv[1:])]
    assert (got.max_seqlen_q, got.max_seqlen_kv) == (max(lq_all, default=0), max(lkv_all, default=0))
    assert got.actual_seq_qlen == tuple(cu_q[1:]) and got.actual_seq_kvlen == tuple(cu_kv[1:])
    assert all(type(v) is int for v in got.actual_seq_qlen + got.actual_seq_kvlen)
    _equal(got.q_positions, _t(positions), "q_positions")
    _equal(got.q_doc_rows, _t(doc_rows), "q_doc_rows")
    _equal(got.q_kv_rows, _t([d + p for d, p in zip(doc_rows, positions)]), "q_kv_rows")
    assert got.ratios == ratios and tuple(v.ratio for v in got.visible) == ratios
    for blocks, vis in zip(got.compressed, got.visible):
        r = blocks.ratio
        starts = [cu_kv[b] + j * r for b in range(len(cu_kv) - 1) for j in range((cu_kv[b + 1] - cu_kv[b]) // r)]
        entry_pos = [j * r for b in range(len(cu_kv) - 1) for j in range((cu_kv[b + 1] - cu_kv[b]) // r)]
        _equal(blocks.block_starts, _t(starts), f"block_starts {r}")
        _equal(blocks.entry_positions, _t(entry_pos), f"entry_positions {r}")
        assert blocks.num_entries == vis.num_entries == len(starts)
        _equal(vis.cu_seqlens, _t(cu_cmp[r], cmp_dtype), f"compressed cu_seqlens {r}")
        _equal(vis.visible_start, _t(visible[r][0]), f"visible_start {r}")
        _equal(vis.visible_count, _t(visible[r][1]), f"visible_count {r}")
        assert vis.max_visible == max(visible[r][1], default=0)


def _check_routes(got: Routes, needed: list[tuple[int, int]], owned: list[tuple[int, int]], rank: int) -> None:
    """``got`` against the intersections of every rank's needed range with every rank's owned range."""
    def overlap(n: tuple[int, int], o: tuple[int, int]) -> range:
        return range(max(n[0], o[0]), min(n[1], o[1]))

    send = [overlap(needed[d], owned[rank]) for d in range(len(owned))]
    assert got.send_splits == tuple(len(s) for s in send)
    assert got.recv_splits == tuple(len(overlap(needed[rank], o)) for o in owned)
    _equal(got.send_rows, _t([row - owned[rank][0] for s in send for row in s]), "send_rows")
    assert got.any_traffic == any(len(overlap(n, o)) for n in needed for o in owned)


@dataclass
class _Batch:
    cu: list[int]
    cp: int

    @property
    def local(self) -> int:
        return self.cu[-1] // self.cp

    def owned(self) -> list[tuple[int, int]]:
        return [(r * self.local, (r + 1) * self.local) for r in range(self.cp)]

    def doc_of(self, token: int) -> int:
        return next(d for d in range(len(self.cu) - 1) if self.cu[d] <= token < self.cu[d + 1])

    def prefix(self, rank: int) -> tuple[list[int], list[int], int]:
        a, b = self.owned()[rank]
        cu_q, cu_kv, kv_start = [0], [0], b
        for s, e in zip(self.cu, self.cu[1:]):
            if min(e, b) > max(s, a):
                kv_start = min(kv_start, s)
                cu_q.append(cu_q[-1] + min(e, b) - max(s, a))
                cu_kv.append(cu_kv[-1] + min(e, b) - s)
        return cu_q, cu_kv, kv_start

    def need_start(self, rank: int, window: int | None) -> int:
        """First token before ``a`` the rank's queries see with ``window`` (``a`` if none)."""
        a = self.owned()[rank][0]
        if a >= self.cu[-1]:
            return a
        lo = self.cu[self.doc_of(a)]
        return lo if window is None else max(lo, a - window + 1)

    def entries(self, ratio: int) -> list[tuple[int, int, int]]:
        """``(document, j, last token of the block)`` of every compressed entry, in order."""
        return [(d, j, self.cu[d] + (j + 1) * ratio - 1) for d in range(len(self.cu) - 1)
                for j in range((self.cu[d + 1] - self.cu[d]) // ratio)]


def _random_batch(rng: random.Random) -> _Batch:
    cp = rng.choice([1, 2, 3, 4, 8])
    lengths = [rng.choice([0, rng.randint(1, 9), rng.randint(1, 160)]) for _ in range(rng.randint(1, 10))]
    lengths[-1] += -sum(lengths) % cp
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return _Batch(cu, cp)


def _check_need_plan(batch: _Batch, rank: int, windows: list[int | None], ratios: list[int], reach: dict[int, int],
                     ring: int, dtype: torch.dtype) -> None:
    plan = plan_attention(_t(batch.cu, dtype), batch.cp, rank, exchange="need", windows=windows,
                          compress_ratios=ratios, prev_blocks=reach, ring_degree=ring)
    cu_q, cu_kv, kv_start = batch.prefix(rank)
    _check_segments(plan.segments, cu_q, cu_kv, tuple(ratios), cmp_dtype=torch.int32)
    owned = batch.owned()
    a = owned[rank][0]
    for window in windows:
        source = plan.kv_source(window)
        lo = [batch.need_start(r, window) for r in range(batch.cp)]
        if ring == 1:
            assert source.halo is not None and source.rounds == ()
            _check_routes(source.halo, [(lo[r], owned[r][0]) for r in range(batch.cp)], owned, rank)
            offset = lo[rank] - kv_start
        else:
            assert source.halo is None and len(source.rounds) == ring
            offset = a - kv_start
            for i, ring_round in enumerate(source.rounds):
                cuts = [[lo[r] + (owned[r][0] - lo[r]) * k // ring for k in (i, i + 1)] for r in range(batch.cp)]
                _check_routes(ring_round.routes, [(c[0], c[1]) for c in cuts], owned, rank)
                start, size = cuts[rank][0], cuts[rank][1] - cuts[rank][0]
                key_lo, key_hi = [], []
                for t in range(a, owned[rank][1]):
                    first = batch.cu[batch.doc_of(t)] if window is None else max(batch.cu[batch.doc_of(t)], t - window + 1)
                    key_lo.append(min(max(first - start, 0), size))
                    key_hi.append(max(key_lo[-1], min(max(t + 1 - start, 0), size)))
                ranges = ring_round.ranges
                _equal(ranges.lo, _t(key_lo), "ring lo")
                _equal(ranges.hi, _t(key_hi), "ring hi")
                num_rows = sum(x < y for x, y in zip(key_lo, key_hi))
                assert (ranges.num_keys, ranges.num_rows) == (size, num_rows)
                left = -1 if window is None else (size - num_rows) - (a - window + 1 - start)
                assert ranges.left == left
        assert source.offset == offset
        cu_buffer = [0] + [v - offset for v in cu_kv[1:]]
        _check_segments(source.segments, cu_q, cu_buffer, kv_offset=offset)
    for ratio in ratios:
        routes = plan.compressed[ratio]
        entries = batch.entries(ratio)
        bounds = [sum(last < x for _, _, last in entries) for x in [o[0] for o in owned] + [owned[-1][1]]]
        entry_owned = list(zip(bounds, bounds[1:]))
        needed = []
        for r in range(batch.cp):
            first = entry_owned[r][0]
            if owned[r][0] < batch.cu[-1]:
                doc = batch.doc_of(owned[r][0])
                first = min(first, next((k for k, e in enumerate(entries) if e[0] >= doc), len(entries)))
            needed.append((first, entry_owned[r][0]))
        _check_routes(routes.entries, needed, entry_owned, rank)
        halo = []
        for r, (lo_r, hi_r) in enumerate(owned):
            reads = [max(batch.cu[d], batch.cu[d] + (j - reach[ratio]) * ratio)
                     for d, j, last in entries if lo_r <= last < hi_r]
            halo.append(min([lo_r, *reads]))
        _check_routes(routes.hidden, [(halo[r], owned[r][0]) for r in range(batch.cp)], owned, rank)


@pytest.mark.parametrize("seed", range(6))
def test_need_plans_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(4):
        batch = _random_batch(rng)
        windows = rng.sample([None, 1, 5, 16, 64], 2)
        ratios = rng.sample([2, 3, 4, 8, 128], 2)
        reach = {r: rng.choice([0, 1, 2]) for r in ratios}
        for rank in range(batch.cp):
            for ring in (1, rng.choice([2, 3])):
                _check_need_plan(batch, rank, windows, ratios, reach, ring, rng.choice([torch.int32, I64]))


@pytest.mark.parametrize("seed", range(4))
def test_allgather_plans_and_segments_match_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(6):
        batch = _random_batch(rng)
        ratios = tuple(rng.sample([2, 3, 4, 8, 128], rng.randint(0, 3)))
        for rank in range(batch.cp):
            plan = plan_attention(_t(batch.cu), batch.cp, rank, compress_ratios=ratios)
            cu_q, cu_kv, kv_start = batch.prefix(rank)
            assert plan.prefix is not None and plan.prefix.kv_start == kv_start
            _check_segments(plan.segments, cu_q, cu_kv, ratios, cmp_dtype=torch.int32)
        # plan_segments on its own: any pairs with Lkv >= Lq, a kv_offset, int64 input.
        q_lens = [rng.randint(0, 6) for _ in range(rng.randint(1, 5))]
        kv_lens = [q + rng.randint(0, 9) for q in q_lens]
        cu_q, cu_kv = [0], [0]
        for q, k in zip(q_lens, kv_lens):
            cu_q.append(cu_q[-1] + q)
            cu_kv.append(cu_kv[-1] + k)
        offset = rng.randint(0, 3)
        _check_segments(plan_segments(_t(cu_q), _t(cu_kv), kv_offset=offset), cu_q, cu_kv, kv_offset=offset)
        _check_segments(plan_segments(_t(cu_q), _t(cu_kv), compress_ratios=ratios), cu_q, cu_kv, ratios)


def test_large_need_plan_matches_brute_force_on_the_boundary_rank() -> None:
    """A long document over several ranks with windows and both V4 ratios (the bench's case, scaled down)."""
    batch = _Batch([0, 3000, 3001, 5000, 6144], 4)
    for rank in range(4):
        _check_need_plan(batch, rank, [128, None], [4, 128], {4: 1, 128: 0}, 1, I64)
