"""Wall time of forward + backward of the V4-style layer on CPU gloo ranks, per strategy."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from cpkv.launch import spawn
from cpkv.plan.attention import AttentionPlan, plan_attention
from cpkv.plan.sharding import shard_contiguous
from cpkv.v4 import V4Attention, V4Config

WALL_WINDOW = 128
"""The sliding window of the wall-time layers (every kind; DeepSeek-V4-Flash's)."""


def _best_seconds(layer: V4Attention, x: torch.Tensor, plan: AttentionPlan, world: int, rank: int, repeats: int) -> float:
    """Best-of-``repeats`` seconds of forward + backward on this rank, ranks aligned by barriers."""
    best = float("inf")
    for _ in range(repeats):
        x_local = shard_contiguous(x, world, rank).clone().requires_grad_(True)
        dist.barrier()
        start = time.perf_counter()
        out = layer(x_local, plan, None).out
        torch.autograd.backward(out, torch.ones_like(out))
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def _rank_times(rank: int, world: int, cu: torch.Tensor, ratios: list[int], repeats: int) -> dict[str, float]:
    times: dict[str, float] = {}
    compressed = [r for r in ratios if r > 1]
    plans = {  # once per micro-batch, shared by every layer kind
        exchange: plan_attention(cu, world, rank, exchange=exchange, compress_ratios=compressed, windows=[WALL_WINDOW])
        for exchange in ("allgather", "need")
    }
    x = torch.randn(int(cu[-1]), 64, generator=torch.Generator().manual_seed(0))
    for ratio in ratios:
        layer = V4Attention(V4Config(compress_ratio=ratio, window=WALL_WINDOW, topk=64), seed=0)
        for exchange, plan in plans.items():
            times[f"{ratio}/{exchange}"] = _best_seconds(layer, x, plan, world, rank, repeats)
    return times


def wall_times(cu: torch.Tensor, cp: int, ratios: list[int], repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` seconds of forward + backward (slowest rank) per ``"ratio/exchange"``."""
    per_rank = spawn(_rank_times, cp, cu, ratios, repeats, timeout=600.0)
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


def largest_round_rows(plan: AttentionPlan, window: int | None) -> int:
    """Received kv rows of the largest single exchange of the need plan's ``window`` source on this rank.

    ``ring_degree == 1``: the halo; otherwise the largest ring round (rounds run one after
    the other, so a round's rows are the most remote kv held at once).
    """
    source = plan.kv_source(window)
    sizes = [source.halo.num_recv] if source.halo is not None else []
    sizes += [ring_round.routes.num_recv for ring_round in source.rounds]
    return max(sizes, default=0)


def _ring_times(rank: int, world: int, cu: torch.Tensor, rings: list[int], repeats: int) -> dict[str, float]:
    x = torch.randn(int(cu[-1]), 64, generator=torch.Generator().manual_seed(0))
    layer = V4Attention(V4Config(compress_ratio=0, window=None), seed=0)
    times: dict[str, float] = {}
    for ring in rings:
        plan = plan_attention(cu, world, rank, exchange="need", ring_degree=ring, windows=[None])
        rows = largest_round_rows(plan, None)
        times[f"{ring}/round_rows"] = float(rows)
        times[f"{ring}/round_bytes"] = float(rows * layer.config.head_dim * x.element_size())
        times[f"{ring}/seconds"] = _best_seconds(layer, x, plan, world, rank, repeats)
    return times


def ring_times(cu: torch.Tensor, cp: int, rings: list[int], repeats: int = 3) -> dict[str, float]:
    """Per ring degree: received kv rows of the largest single round (max over ranks) and wall seconds (slowest rank)."""
    per_rank = spawn(_ring_times, cp, cu, rings, repeats, timeout=600.0)
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}
