"""A compressor declares how many earlier blocks it reads, and the need routes follow.

An overlapping compressor (each entry also reads the previous block of its document) at
ratios other than 4 must give the same layer under ``exchange="need"`` as under
``"allgather"`` (in every layout) and as the single-process oracle, once the plan covers its reach
(``prev_blocks={ratio: 1}``); a plan that does not cover it raises on every rank before any
collective instead of computing a wrong entry. The documents straddle ranks so that a
block's previous block lives on an earlier rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.plan.cost import CostModel
from cpkv.compress_mode import LayerCompressMode
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.v4 import Compressor, V4Attention, V4Config, reference_forward
from tests.shared_spawn import shared_spawn

LENGTHS = [3, 29, 2, 11, 21]  # 66 tokens (cp 2 and 3)
ZIGZAG_LENGTHS = [12, 36, 24]  # 72 tokens: multiples of 2*cp at cp 2 and 3
RATIOS = [2, 3, 8]
RUNS = [(layout, exchange) for layout in ("contiguous", "zigzag", "balanced") for exchange in ("allgather", "need")]


def _cu(layout: str) -> torch.Tensor:
    return seqlens_to_cu_seqlens(ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS)


def _plan(layout: str, exchange: str, world: int, rank: int, ratio: int, **options: Any) -> Any:
    return plan_attention(_cu(layout), world, rank, layout=layout, cost_model=CostModel(), exchange=exchange,  # type: ignore[arg-type]
                          compress_ratios=[ratio], windows=[6], **options)


def _layer(ratio: int) -> V4Attention:
    layer = V4Attention(V4Config(compress_ratio=ratio, window=6), seed=2).double()
    torch.manual_seed(4)
    c = layer.config
    layer.compressor = Compressor(c.hidden, c.head_dim, ratio, rope_dim=c.rope_dim, rope_base=layer.rope_base, overlap=True).double()
    return layer


def _inputs(layout: str = "contiguous") -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    n = int(_cu(layout)[-1])
    return torch.randn(n, 64, generator=gen, dtype=torch.float64), torch.randn(n, 64, generator=gen, dtype=torch.float64)


def reach_cases(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for ratio in RATIOS:
        layer = _layer(ratio)
        for layout, exchange in RUNS:
            x_all, g_all = _inputs(layout)
            plan = _plan(layout, exchange, world, rank, ratio, prev_blocks={ratio: 1})
            x = plan.shard(x_all).clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            out = layer(x, plan, None).out
            out.backward(plan.shard(g_all))
            assert x.grad is not None
            results[f"{ratio}/{layout}/{exchange}"] = (out.detach(), x.grad)
        try:
            plan = _plan("contiguous", "need", world, rank, ratio)
            layer(plan.shard(_inputs()[0]), plan, None)
            results[f"{ratio}/unplanned"] = "no error"
        except ValueError as err:
            results[f"{ratio}/unplanned"] = str(err)
    return results


def mode_cases(rank: int, world: int) -> dict[str, Any]:
    """A layer's declared mode at any ratio: INDEXER at ratio 8, COMPRESSOR_ONLY at ratio 4."""
    results: dict[str, Any] = {}
    for name, config in MODE_CASES.items():
        layer = V4Attention(config, seed=2).double()
        for layout, exchange in RUNS:
            x_all, g_all = _inputs(layout)
            plan = _plan(layout, exchange, world, rank, config.compress_ratio)
            x = plan.shard(x_all).clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            out = layer(x, plan, None).out
            out.backward(plan.shard(g_all))
            results[f"{name}/{layout}/{exchange}"] = (out.detach(), x.grad)
    return results


MODE_CASES = {
    "indexer8": V4Config(compress_ratio=8, window=6, topk=2, compress_mode=LayerCompressMode.INDEXER),
    "compressor4": V4Config(compress_ratio=4, window=6, compress_mode=LayerCompressMode.COMPRESSOR_ONLY),
}


MODE_CHECK = shared_spawn(mode_cases, 2, timeout=180.0)
REACH_CHECKS = {world: shared_spawn(reach_cases, world, timeout=180.0) for world in (2, 3)}


@pytest.mark.timeout(200)
def test_declared_mode_at_any_ratio(request: pytest.FixtureRequest) -> None:
    per_rank = MODE_CHECK.run(request)
    for name, config in MODE_CASES.items():
        for layout, exchange in RUNS:
            layer = V4Attention(config, seed=2).double()
            assert (layer.indexer is not None) == (name == "indexer8")
            x_all, g_all = _inputs(layout)
            x = x_all.clone().requires_grad_(True)
            out = reference_forward(layer, x, _cu(layout)).out
            out.backward(g_all)
            assert x.grad is not None
            plan, key = _plan(layout, exchange, 2, 0, config.compress_ratio), f"{name}/{layout}/{exchange}"
            torch.testing.assert_close(plan.unshard([r[key][0] for r in per_rank]), out.detach(), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(plan.unshard([r[key][1] for r in per_rank]), x.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_overlapping_compressor_at_any_ratio_under_both_exchanges(world: int, request: pytest.FixtureRequest) -> None:
    per_rank = REACH_CHECKS[world].run(request)
    for ratio in RATIOS:
        for layout, exchange in RUNS:
            layer = _layer(ratio)
            x_all, g_all = _inputs(layout)
            x = x_all.clone().requires_grad_(True)
            out = reference_forward(layer, x, _cu(layout)).out
            out.backward(g_all)
            assert x.grad is not None
            plan, key = _plan(layout, exchange, world, 0, ratio), f"{ratio}/{layout}/{exchange}"
            got_out = plan.unshard([r[key][0] for r in per_rank])
            got_grad = plan.unshard([r[key][1] for r in per_rank])
            # fp64 on both sides: only the order of sums differs.
            torch.testing.assert_close(got_out, out.detach(), rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(got_grad, x.grad, rtol=1e-10, atol=1e-12)
        assert all(f"plan_attention(..., prev_blocks={{{ratio}: 1}})" in r[f"{ratio}/unplanned"] for r in per_rank)
