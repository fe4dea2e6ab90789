"""A bad token reaches only what depends on it: packed documents stay independent under CP.

One token of one document gets a NaN (or inf) hidden state. On gloo ranks, in every
compress mode, every layout and both exchanges, the layer's outputs and input gradients of every *other*
document must stay finite and equal to a clean run (the bad value replaced by a finite one).
The bad document's own rows at and after the token may be non-finite.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.plan.cost import CostModel
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.v4 import V4Attention, V4Config
from tests.shared_spawn import shared_spawn

LENGTHS = [24, 36, 12, 24]  # 96 tokens in multiples of 2*cp (zigzag); document 1 = [24, 60) straddles the cp 2 and 3 boundaries
BAD_TOKEN = 27  # in document 1
DOC1 = slice(24, 60)
LAYOUTS = ["contiguous", "zigzag", "balanced"]
MODES = {"window": V4Config(window=8), "dense": V4Config(window=None), "compressor": V4Config(compress_ratio=8, window=8),
         "indexer": V4Config(compress_ratio=4, window=8, topk=3)}


def _plan(world: int, rank: int, config: V4Config, layout: str, exchange: str) -> Any:
    ratios = [config.compress_ratio] if config.mode.compresses else []
    return plan_attention(seqlens_to_cu_seqlens(LENGTHS), world, rank, layout=layout, cost_model=CostModel(), exchange=exchange,  # type: ignore[arg-type]
                          compress_ratios=ratios, windows=[config.window])


def _run(
    rank: int, world: int, config: V4Config, layout: str, exchange: str, bad: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    cu = seqlens_to_cu_seqlens(LENGTHS)
    gen = torch.Generator().manual_seed(5)
    x_all, g_all = torch.randn(96, 64, generator=gen), torch.randn(96, 64, generator=gen)
    if bad is not None:
        x_all[BAD_TOKEN, 3] = bad
    layer = V4Attention(config, seed=1)
    plan = _plan(world, rank, config, layout, exchange)
    x = plan.shard(x_all).clone().requires_grad_(True)
    out = layer(x, plan, None, backend="reference").out
    out.backward(plan.shard(g_all))
    assert x.grad is not None
    return out.detach(), x.grad


def nan_cases(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for name, config in MODES.items():
        for layout in LAYOUTS:
            for exchange in ("allgather", "need"):
                bads = (("clean", None), ("nan", float("nan")), ("inf", float("inf")))
                for label, bad in bads if layout == "contiguous" else bads[:2]:
                    results[f"{name}/{layout}/{exchange}/{label}"] = _run(rank, world, config, layout, exchange, bad)
    return results


NAN_CASES = {world: shared_spawn(nan_cases, world, timeout=220.0) for world in (2, 3)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_token_stays_in_its_document(world: int, request: pytest.FixtureRequest) -> None:
    per_rank = NAN_CASES[world].run(request)
    other = torch.ones(96, dtype=torch.bool)
    other[DOC1] = False  # document 1 and its dependents
    for key in per_rank[0]:
        name, layout, exchange, label = key.split("/")
        if label == "clean":
            continue
        plan = _plan(world, 0, MODES[name], layout, exchange)
        out = plan.unshard([r[key][0] for r in per_rank])
        grad = plan.unshard([r[key][1] for r in per_rank])
        clean_out = plan.unshard([r[f"{name}/{layout}/{exchange}/clean"][0] for r in per_rank])
        clean_grad = plan.unshard([r[f"{name}/{layout}/{exchange}/clean"][1] for r in per_rank])
        assert bool(torch.isfinite(out[other]).all()) and bool(torch.isfinite(grad[other]).all()), key
        torch.testing.assert_close(out[other], clean_out[other], rtol=1e-6, atol=1e-6, msg=key)
        torch.testing.assert_close(grad[other], clean_grad[other], rtol=1e-6, atol=1e-6, msg=key)
        if label == "nan":  # the bad token's own output depends on it
            assert not bool(torch.isfinite(out[BAD_TOKEN]).all()), key
