"""Need-exchange routes of the attention plan against brute force, simulated for every rank in one process."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.plan import AttentionPlan, Routes, plan_attention
from cpkv.plan.conventions import compress_cu_seqlens, seqlens_to_cu_seqlens
from cpkv.plan.prefix import compute_prefix_kv_cu_seqlens


def _routes(plan: AttentionPlan, routes_of: str, key: object) -> Routes:
    if routes_of == "kv":
        halo = plan.kv[key].halo  # type: ignore[index]
        assert halo is not None
        return halo
    routes: Routes = getattr(plan.compressed[key], routes_of)  # type: ignore[index]
    return routes


def simulate(plans: list[AttentionPlan], routes_of: str, key: object, owned_rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """What every rank receives, moving owned_rows[src][send_rows] to each destination."""
    cp = len(plans)
    received: list[list[torch.Tensor]] = [[] for _ in range(cp)]
    for src, plan in enumerate(plans):
        routes = _routes(plan, routes_of, key)
        chunks = owned_rows[src][routes.send_rows].split(list(routes.send_splits))
        for dst, chunk in enumerate(chunks):
            received[dst].append(chunk)
    for dst, plan in enumerate(plans):
        assert [c.shape[0] for c in received[dst]] == list(_routes(plan, routes_of, key).recv_splits)
    return [torch.cat(r) for r in received]


def plan_need_exchange(cu: torch.Tensor, cp: int, rank: int, *, windows: list[int | None], compress_ratios: list[int]) -> AttentionPlan:
    return plan_attention(cu, cp, rank, exchange="need", windows=windows, compress_ratios=compress_ratios)


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=7),
    cp=st.integers(min_value=1, max_value=5),
    window=st.sampled_from([None, 1, 3, 8]),
    ratio=st.sampled_from([2, 4, 8]),
)
def test_routes_deliver_exactly_what_is_needed(lengths: list[int], cp: int, window: int | None, ratio: int) -> None:
    pad = -sum(lengths) % cp
    lengths = [*lengths, pad] if pad else lengths
    cu = seqlens_to_cu_seqlens(lengths, dtype=torch.int64)
    total, local = int(cu[-1]), int(cu[-1]) // cp
    plans = [plan_need_exchange(cu, cp, r, windows=[window], compress_ratios=[ratio]) for r in range(cp)]
    tokens = torch.arange(total)
    got_tokens = simulate(plans, "kv", window, [tokens[r * local : (r + 1) * local] for r in range(cp)])
    cu_cmp = compress_cu_seqlens(cu, ratio).cu_seqlens
    starts = cu[:-1]
    for r, plan in enumerate(plans):
        prefix = compute_prefix_kv_cu_seqlens(cu, r * local, local)
        lo = prefix.kv_start if window is None else max(prefix.kv_start, r * local - window + 1)
        assert got_tokens[r].tolist() == list(range(lo, r * local))
        assert plan.kv[window].offset == lo - prefix.kv_start
        # Owned entries: blocks whose last token lies in this rank's range, computable from the local buffer.
        routes = plan.compressed[ratio]
        hidden_lo = r * local - routes.hidden.num_recv  # the halo ends at a_r
        block_first = torch.cat([routes.straddle.block_starts + hidden_lo, routes.own.block_starts + r * local])
        positions = torch.cat([routes.straddle.entry_positions, routes.own.entry_positions])
        ends = block_first + ratio - 1
        assert bool(((ends >= r * local) & (ends < (r + 1) * local)).all())
        reach = ratio if ratio == 4 else 0  # the default prev_blocks: 1 at ratio 4
        # straddling blocks read their previous block from the halo buffer; the others only own rows
        assert bool((routes.straddle.block_starts >= reach * (routes.straddle.entry_positions > 0)).all())
        assert bool((routes.own.block_starts - reach * (routes.own.entry_positions > 0) >= 0).all())
        assert routes.straddle.num_entries <= 2 and routes.straddle_rows <= routes.straddle.num_entries * ratio
        doc_of_block = torch.searchsorted(cu[1:], block_first, right=True)
        assert torch.equal(block_first - starts[doc_of_block], positions)
    # Entries: every rank ends up with all entries of its prefix documents, in order.
    owned_ids, first = [], 0
    for plan in plans:
        n = plan.compressed[ratio].num_owned
        owned_ids.append(torch.arange(first, first + n))
        first += n
    assert first == int(cu_cmp[-1])
    got_entries = simulate(plans, "entries", ratio, owned_ids)
    for r in range(cp):
        prefix = compute_prefix_kv_cu_seqlens(cu, r * local, local)
        n_prefix = int(compress_cu_seqlens(prefix.cu_seqlens_kv, ratio).cu_seqlens[-1])
        full = torch.cat([got_entries[r], owned_ids[r]])
        first_doc = int(prefix.doc_ids[0]) if prefix.doc_ids.numel() else 0
        expected = list(range(int(cu_cmp[first_doc]), int(cu_cmp[first_doc]) + n_prefix)) if prefix.doc_ids.numel() else []
        assert full.tolist() == expected


def test_single_long_document_window_halo_is_small() -> None:
    cu = torch.tensor([0, 4096])
    plan = plan_need_exchange(cu, 4, 3, windows=[128, None], compress_ratios=[4, 128])
    assert plan.kv[128].halo.num_recv == 127 and plan.kv[None].halo.num_recv == 3 * 1024  # type: ignore[union-attr]
    assert plan.compressed[4].hidden.num_recv == 4  # the overlap's previous block: 2m - 1 at most
    assert plan.compressed[4].entries.num_recv == 3 * 1024 // 4
    assert plan.compressed[128].entries.num_recv == 3 * 1024 // 128
