"""A bad token reaches only what depends on it: packed documents stay independent under CP.

One token of one document gets a NaN (or inf) hidden state. On gloo ranks, in every
compress mode and both exchanges, the layer's outputs and input gradients of every *other*
document must stay finite and equal to a clean run (the bad value replaced by a finite one).
The bad document's own rows at and after the token may be non-finite.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.launch import spawn
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_contiguous
from cpkv.v4 import V4Attention, V4Config

LENGTHS = [20, 30, 14, 32]  # 96 tokens; document 1 = [20, 50) straddles the cp 2 boundary
BAD_TOKEN = 27  # in document 1
MODES = {"window": V4Config(window=8), "dense": V4Config(window=None), "compressor": V4Config(compress_ratio=8, window=8),
         "indexer": V4Config(compress_ratio=4, window=8, topk=3)}


def _run(rank: int, world: int, config: V4Config, exchange: str, bad: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    cu = seqlens_to_cu_seqlens(LENGTHS)
    gen = torch.Generator().manual_seed(5)
    x_all, g_all = torch.randn(96, 64, generator=gen), torch.randn(96, 64, generator=gen)
    if bad is not None:
        x_all[BAD_TOKEN, 3] = bad
    layer = V4Attention(config, seed=1)
    ratios = [config.compress_ratio] if config.mode.compresses else []
    plan = plan_attention(cu, world, rank, exchange=exchange, compress_ratios=ratios, windows=[config.window])  # type: ignore[arg-type]
    x = shard_contiguous(x_all, world, rank).clone().requires_grad_(True)
    out = layer(x, plan, None, backend="reference").out
    out.backward(shard_contiguous(g_all, world, rank))
    assert x.grad is not None
    return out.detach(), x.grad


def nan_cases(rank: int, world: int) -> dict[str, Any]:
    results = {}
    for name, config in MODES.items():
        for exchange in ("allgather", "need"):
            for label, bad in (("clean", None), ("nan", float("nan")), ("inf", float("inf"))):
                results[f"{name}/{exchange}/{label}"] = _run(rank, world, config, exchange, bad)
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_a_bad_token_stays_in_its_document(world: int) -> None:
    per_rank = spawn(nan_cases, world, timeout=220.0)
    other = torch.ones(96, dtype=torch.bool)
    other[20:50] = False  # document 1 and its dependents
    for key in per_rank[0]:
        name, exchange, label = key.split("/")
        if label == "clean":
            continue
        out = torch.cat([r[key][0] for r in per_rank])
        grad = torch.cat([r[key][1] for r in per_rank])
        clean_out = torch.cat([r[f"{name}/{exchange}/clean"][0] for r in per_rank])
        clean_grad = torch.cat([r[f"{name}/{exchange}/clean"][1] for r in per_rank])
        assert bool(torch.isfinite(out[other]).all()) and bool(torch.isfinite(grad[other]).all()), key
        torch.testing.assert_close(out[other], clean_out[other], rtol=1e-6, atol=1e-6, msg=key)
        torch.testing.assert_close(grad[other], clean_grad[other], rtol=1e-6, atol=1e-6, msg=key)
        if label == "nan":  # the bad token's own output depends on it
            assert not bool(torch.isfinite(out[BAD_TOKEN]).all()), key
