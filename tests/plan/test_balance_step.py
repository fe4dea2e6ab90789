"""Balanced training steps: never costlier than contiguous, within the token cap; plans made in a data-loader worker."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from cpkv.bench.layouts import limit_rows, need_rows, short_cu_seqlens, stack_bytes
from cpkv.bench.traffic import Dims, lognormal_cu_seqlens
from cpkv.integrations.causal_lm import shift_labels
from cpkv.integrations.collate import PackedCPBatch, PackedCPCollator
from cpkv.plan.attention import AttentionPlan, plan_attention
from cpkv.plan.balance import DEFAULT_MAX_TOKENS_RATIO, balanced_layout, rank_costs, token_cap
from cpkv.plan.cost import CostModel
from cpkv.plan.layouts import ShardLayout, contiguous_layout


@pytest.mark.parametrize("cp", [2, 3, 8, 16, 64])
def test_balanced_is_never_costlier_than_contiguous_and_keeps_the_cap(cp: int) -> None:
    model = CostModel()
    for seed in range(3):
        cu = lognormal_cu_seqlens(1024 * cp, 512 if seed else 4096, seed=seed)
        for ratio in (1.0, 1.05, None):
            layout = balanced_layout(cu, cp, model, max_tokens_ratio=ratio)
            assert max(layout.local_lens) <= token_cap(int(cu[-1]), cp, ratio)
            balanced = float(rank_costs(layout, model).max())
            contiguous = float(rank_costs(contiguous_layout(cu, cp), model).max())
            assert balanced <= contiguous * (1 + 1e-12), (seed, ratio)
    one = torch.tensor([0, 4096 * cp])
    costs = rank_costs(balanced_layout(one, cp, model), model)
    assert float(costs.max() / costs.mean()) <= 1.02  # one long document: head-tail cuts balance both


PREV_BLOCKS = {4: 1, 128: 0}  # DeepSeek-V4's compressors (plan_attention's default)


def _busiest_bytes(layout: ShardLayout, model: CostModel) -> tuple[int, int]:
    """``(rank, bytes)`` of the busiest rank's forward bytes over the stack (V4-Flash dims): the layout's physical limit
    from set arithmetic on its token sets (``cpkv.bench.layouts.limit_rows``, independent of the planner)."""
    counts = [stack_bytes(limit_rows(layout, r, model.window, PREV_BLOCKS), model, Dims()) for r in range(layout.cp_size)]
    return counts.index(max(counts)), max(counts)


@pytest.mark.parametrize("family", ["log-normal", "short"])
def test_balanced_meets_its_targets_on_packs(family: str) -> None:
    """Issue 29's targets on 1M-token packs (the layouts bench's families and seeds 0-2), V4-Flash, the default cap:
    busiest-rank cost at most contiguous's and within 1.02 of the mean, tokens within the cap at cp 2-64; need bytes
    of the busiest rank within 1.05 of contiguous's at cp 8-64. At cp 2-4 one or three cuts' depth is set by the
    cost line, and log-normal seed 0 takes 1.20x contiguous's bytes there (docs/semantics.md, "Balanced layout").
    The need plan of the busiest rank moves exactly its limit (so the limit is the need exchange's bytes)."""
    model = CostModel()
    for seed in range(3):
        cu = lognormal_cu_seqlens(1 << 20, 8192, seed=seed) if family == "log-normal" else short_cu_seqlens(1 << 20, 1024, 2048, seed)
        for cp in (2, 4, 8, 16, 32, 64):
            layout, contiguous = balanced_layout(cu, cp, model), contiguous_layout(cu, cp)
            costs = rank_costs(layout, model)
            assert float(costs.max()) <= float(rank_costs(contiguous, model).max()) * (1 + 1e-12), (seed, cp)
            assert float(costs.max() / costs.mean()) <= 1.02, (seed, cp)
            assert max(layout.local_lens) <= token_cap(1 << 20, cp, DEFAULT_MAX_TOKENS_RATIO), (seed, cp)
            if cp >= 8:
                rank, busiest = _busiest_bytes(layout, model)
                assert busiest <= 1.05 * _busiest_bytes(contiguous, model)[1], (seed, cp)
                plan = plan_attention(cu, cp, rank, layout=layout, exchange="need", windows=[model.window],
                                      compress_ratios=[model.csa_ratio, model.hca_ratio])
                assert stack_bytes(need_rows(plan, model.window, (model.csa_ratio, model.hca_ratio)), model, Dims()) == busiest


def test_the_cap_trades_cost_balance_on_a_dominant_document() -> None:
    """The documented trade-off (docs/semantics.md, "Balanced layout"): log-normal seed 8 holds a 342,997-token document
    (a third of the batch); within the 1.10 cap the busiest rank costs 1.17x the mean at cp 8, without a cap 1.00x
    (on 1.27x the mean tokens). Tokens of dear positions cannot be spread over cut documents without more cuts."""
    cu = lognormal_cu_seqlens(1 << 20, 8192, seed=8)
    assert int(cu.diff().max()) == 342_997
    capped, free = balanced_layout(cu, 8), balanced_layout(cu, 8, max_tokens_ratio=None)
    ratio = {name: float((c := rank_costs(lay)).max() / c.mean()) for name, lay in (("capped", capped), ("free", free))}
    assert round(ratio["capped"], 2) == 1.17 and ratio["free"] <= 1.02
    assert max(capped.local_lens) <= token_cap(1 << 20, 8, DEFAULT_MAX_TOKENS_RATIO) < max(free.local_lens)


def test_the_cap_binds_and_bad_ratios_raise() -> None:
    cu = lognormal_cu_seqlens(64 * 1024, 2048, seed=1)
    free = balanced_layout(cu, 8, max_tokens_ratio=None)
    tight = balanced_layout(cu, 8, max_tokens_ratio=1.0)
    assert max(free.local_lens) > 8 * 1024  # without a cap, equal cost means unequal tokens
    assert max(tight.local_lens) == 8 * 1024
    with pytest.raises(ValueError, match="max_tokens_ratio"):
        balanced_layout(cu, 8, max_tokens_ratio=0.9)
    with pytest.raises(TypeError, match="max_tokens_ratio"):
        plan_attention(cu, 8, 0, max_tokens_ratio="1")  # type: ignore[arg-type]


def test_plan_reports_rank_costs_and_tokens() -> None:
    cu = torch.tensor([0, 100, 356, 512])
    model = CostModel(dense=(("x", 10),))
    plans = [plan_attention(cu, 4, r, layout="balanced", cost_model=model) for r in range(4)]
    assert plans[0].local_lens == tuple(p.local_len for p in plans)
    expected = tuple(rank_costs(plans[0].layout_ranges, model).tolist())
    assert all(p.rank_costs == expected for p in plans) and sum(expected) == float(model.prefix(cu.diff()).sum())


def _same(a: Any, b: Any, where: str = "plan") -> None:
    """Field-by-field equality of two plans (tensors: values, dtype and device)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device, where
        assert torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert list(a) == list(b), where
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(a) and not isinstance(a, CostModel):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        assert a == b, where


def _docs(seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
    return [{"input_ids": torch.randint(0, 1000, (n,), generator=gen)} for n in lengths]


def test_plans_made_in_a_data_loader_worker_equal_plans_made_here() -> None:
    options = {"compress_ratios": [4, 16], "windows": [8, None], "cost_model": CostModel()}
    collate = PackedCPCollator(4, 3, layout="balanced", exchange="need", plan_options=options)
    loader = DataLoader([_docs(s) for s in range(3)], batch_size=None, collate_fn=collate, num_workers=1)
    for seed, batch in enumerate(loader):
        assert isinstance(batch, PackedCPBatch)
        ids = torch.cat([d["input_ids"] for d in _docs(seed)])
        lengths = [d["input_ids"].numel() for d in _docs(seed)]
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(lengths).cumsum(0)])
        here = plan_attention(cu, 4, 3, layout="balanced", exchange="need", **options)  # type: ignore[arg-type]
        moved = batch.to("cpu", non_blocking=True)
        _same(moved.plan, here)
        assert isinstance(moved.plan, AttentionPlan) and torch.equal(moved.cu_seqlens, cu)
        # The collator's shards are plan.shard of the whole batch (labels shifted within documents first).
        labels = torch.cat([torch.cat([torch.tensor([-100]), d["input_ids"][1:]]) for d in _docs(seed)])
        assert torch.equal(batch.input_ids, here.shard(ids))
        assert torch.equal(batch.labels, here.shard(shift_labels(labels, cu)))
        assert torch.equal(batch.position_ids, here.q_positions)


def test_the_collator_takes_a_packed_row_and_checks_it() -> None:
    ids = torch.arange(10)[None]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]])
    batch = PackedCPCollator(2, 0, layout="contiguous")({"input_ids": ids, "position_ids": positions})
    plan = plan_attention(torch.tensor([0, 3, 10]), 2, 0)
    assert torch.equal(batch.input_ids, plan.shard(ids[0]))
    assert torch.equal(batch.labels, plan.shard(shift_labels(ids[0], torch.tensor([0, 3, 10]))))
    with pytest.raises(ValueError, match="position_ids"):
        PackedCPCollator(2, 0, layout="contiguous")({"input_ids": ids, "position_ids": positions[:, :5]})
    with pytest.raises(ValueError, match="cost_model"):  # balanced, the default, never guesses the model's cost
        PackedCPCollator(2, 0)
    model = CostModel(dense=(("x", 10),))
    planned = PackedCPCollator(2, 0, plan_options={"cost_model": model, "windows": [4]})({"input_ids": ids, "position_ids": positions}).plan
    assert (planned.layout, planned.exchange, planned.cost_model) == ("balanced", "need", model)  # the defaults
    with pytest.raises(ValueError, match="plan_options"):
        PackedCPCollator(2, 0, plan_options={"layout": "zigzag"})
    with pytest.raises(ValueError, match="cp_rank"):
        PackedCPCollator(2, 2)
