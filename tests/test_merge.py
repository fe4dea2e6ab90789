"""Ring rounds: the exact LSE merge, empty rounds and fully masked rows, and the option checks."""

from typing import Any

import pytest
import torch

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.backends.base import AttentionResult
from cpkv.backends.reference import range_attention, varlen_attention
from cpkv.merge import merge_partials
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_contiguous
from tests.shared_spawn import shared_spawn


def _inputs(t_q: int, t_kv: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t_q, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(t_kv, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, kv, sinks


@pytest.mark.parametrize("cuts", [[0, 10], [0, 3, 10], [0, 0, 4, 4, 10], [0, 1, 2, 9, 10]])
def test_merge_of_parts_equals_one_attention(cuts: list[int]) -> None:
    """Queries 10..13 of one document over keys 0..13: remote parts by range, local part causal."""
    q, kv, sinks = _inputs(4, 14)
    cu_q, cu_kv = torch.tensor([0, 4]), torch.tensor([0, 14])
    full = varlen_attention(q, kv[:, None], kv[:, None, :6], cu_q, cu_kv, sinks=sinks)
    local = varlen_attention(q, kv[10:, None], kv[10:, None, :6], cu_q, torch.tensor([0, 4]))
    parts = [local]
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        rows = kv[lo:hi]
        zeros = torch.zeros(4, dtype=torch.int64)
        parts.append(range_attention(q, rows[:, None], rows[:, None, :6], zeros, zeros + (hi - lo)))
    merged = merge_partials(parts, sinks)
    torch.testing.assert_close(merged.out, full.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.lse, full.lse, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad((merged.out * torch.arange(6.0, dtype=torch.float64)).sum(), (q, kv, sinks))
    expected = torch.autograd.grad((full.out * torch.arange(6.0, dtype=torch.float64)).sum(), (q, kv, sinks))
    for got, exp in zip(grads, expected):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-12)


def test_fully_masked_rows_and_empty_parts_give_zero_and_finite_gradients() -> None:
    q, kv, _ = _inputs(3, 5)
    lo = torch.tensor([0, 2, 5])  # row 2 sees nothing
    empty = range_attention(q, kv[:0, None], kv[:0, None, :6], torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    part = range_attention(q, kv[:, None], kv[:, None, :6], lo, torch.full((3,), 5))
    merged = merge_partials([empty, part])
    assert torch.equal(merged.out[2], torch.zeros_like(merged.out[2])) and bool(torch.isinf(merged.lse[2]).all())
    merged.out.sum().backward()
    assert q.grad is not None and kv.grad is not None
    assert bool(torch.isfinite(q.grad).all()) and bool(torch.isfinite(kv.grad).all())
    assert torch.equal(q.grad[2], torch.zeros_like(q.grad[2]))


LENGTHS = [5, 0, 37, 3, 2, 60, 21, 0, 1, 15]


def _ring_vs_one(rank: int, world: int) -> dict[str, Any]:
    """Window 4 (3 halo rows) in 1 and 20 rounds: most of the 20 rounds are empty."""
    cu = seqlens_to_cu_seqlens(LENGTHS)
    gen = torch.Generator().manual_seed(rank)
    results: dict[str, Any] = {}
    spec = AttentionSpec(d_v=6, window=4)
    for ring in (1, 20):
        torch.manual_seed(0)
        q = shard_contiguous(torch.randn(144, 2, 8, dtype=torch.float64), world, rank).clone().requires_grad_(True)
        kv = shard_contiguous(torch.randn(144, 8, dtype=torch.float64), world, rank).clone().requires_grad_(True)
        plan = plan_attention(cu, world, rank, exchange="need", windows=[4], ring_degree=ring)
        out = attention_forward(q, kv, plan, None, spec=spec, backend="reference").out
        out.backward(torch.ones_like(out))
        results[f"r{ring}"] = (out.detach(), q.grad, kv.grad)
    try:
        plan_attention(cu, world, rank, ring_degree=2)
        results["errors"] = []
    except ValueError as err:
        results["errors"] = [str(err)]
    del gen
    return results


RING_VS_ONE = shared_spawn(_ring_vs_one, 3, timeout=100.0)


@pytest.mark.timeout(120)
def test_many_empty_rounds_equal_one_round_on_gloo(request: pytest.FixtureRequest) -> None:
    for per_rank in RING_VS_ONE.run(request):
        for one, many in zip(per_rank["r1"], per_rank["r20"]):
            torch.testing.assert_close(many, one, rtol=1e-12, atol=1e-12)
        assert len(per_rank["errors"]) == 1 and "exchange='need'" in per_rank["errors"][0]


def test_a_nan_sink_or_partial_makes_the_row_nan() -> None:
    """0.2.0 read a NaN total as 'no key seen' and returned finite garbage instead of NaN."""
    gen = torch.Generator().manual_seed(0)
    parts = [AttentionResult(torch.randn(3, 2, 4, generator=gen), torch.randn(3, 2, generator=gen)) for _ in range(2)]
    sinks = torch.tensor([float("nan"), 0.5])
    merged = merge_partials(parts, sinks)
    assert merged.out[:, 0].isnan().all() and merged.lse[:, 0].isnan().all()
    clean = merge_partials(parts, torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(merged.out[:, 1], clean.out[:, 1], rtol=0, atol=0)
    parts[1] = AttentionResult(parts[1].out, parts[1].lse.index_put((torch.tensor([1]), torch.tensor([1])), torch.tensor(float("nan"))))
    merged = merge_partials(parts)
    assert merged.out[1, 1].isnan().all() and int(merged.out.isnan().flatten(1).any(1).sum()) == 1


def _nan_sink(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Head 0's sink is NaN: every query of head 0 sees it, so head 0 is NaN in every exchange."""
    cu = seqlens_to_cu_seqlens(LENGTHS)
    torch.manual_seed(0)
    q = shard_contiguous(torch.randn(144, 2, 8), world, rank)
    kv = shard_contiguous(torch.randn(144, 8) * 4, world, rank)
    sinks = torch.tensor([float("nan"), 0.3])
    spec = AttentionSpec(d_v=6, window=16)
    outs = {}
    for name, plan in {"allgather": plan_attention(cu, world, rank),
                       "ring2": plan_attention(cu, world, rank, exchange="need", windows=[16], ring_degree=2)}.items():
        outs[name] = attention_forward(q, kv, plan, None, spec=spec, sinks=sinks, backend="reference").out
    return outs


NAN_SINK = shared_spawn(_nan_sink, 2, timeout=100.0)


@pytest.mark.timeout(120)
def test_ring_rounds_propagate_a_nan_sink_on_gloo(request: pytest.FixtureRequest) -> None:
    for outs in NAN_SINK.run(request):
        for name, out in outs.items():
            assert out[:, 0].isnan().all(), name  # 0.2.0's ring2 gave finite values up to |43| here
        torch.testing.assert_close(outs["ring2"][:, 1], outs["allgather"][:, 1], rtol=1e-6, atol=1e-6)
