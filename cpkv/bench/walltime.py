"""Wall time of forward + backward of the V4-style layer on CPU gloo ranks, per strategy."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from cpkv.attention_plan import plan_attention
from cpkv.launch import spawn
from cpkv.ring import peak_received_rows
from cpkv.sharding import shard_contiguous
from cpkv.v4 import V4Attention, V4Config


def _best_seconds(layer: V4Attention, x: torch.Tensor, cu: torch.Tensor, plan: object, world: int, rank: int,
                  repeats: int, **options: object) -> float:
    """Best-of-``repeats`` seconds of forward + backward on this rank, ranks aligned by barriers."""
    best = float("inf")
    for _ in range(repeats):
        x_local = shard_contiguous(x, world, rank).clone().requires_grad_(True)
        dist.barrier()
        start = time.perf_counter()
        out = layer(x_local, cu, None, plan=plan, **options).out
        torch.autograd.backward(out, torch.ones_like(out))
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def _rank_times(rank: int, world: int, cu: torch.Tensor, ratios: list[int], repeats: int) -> dict[str, float]:
    times: dict[str, float] = {}
    plan = plan_attention(cu, world, rank, compress_ratios=[r for r in ratios if r > 1], need_windows=[128])
    x = torch.randn(int(cu[-1]), 64, generator=torch.Generator().manual_seed(0))
    for ratio in ratios:
        layer = V4Attention(V4Config(compress_ratio=ratio, window=128, topk=64), seed=0)
        for exchange in ("allgather", "need"):
            times[f"{ratio}/{exchange}"] = _best_seconds(layer, x, cu, plan, world, rank, repeats, exchange=exchange)
    return times


def wall_times(cu: torch.Tensor, cp: int, ratios: list[int], repeats: int = 3) -> dict[str, float]:
    """Best-of-``repeats`` seconds of forward + backward (slowest rank) per ``"ratio/exchange"``."""
    per_rank = spawn(_rank_times, cp, cu, ratios, repeats, timeout=600.0)
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}


def _ring_times(rank: int, world: int, cu: torch.Tensor, rings: list[int], repeats: int) -> dict[str, float]:
    x = torch.randn(int(cu[-1]), 64, generator=torch.Generator().manual_seed(0))
    layer = V4Attention(V4Config(compress_ratio=0, window=None), seed=0)
    times: dict[str, float] = {}
    for ring in rings:
        plan = plan_attention(cu, world, rank, need_windows=[None], ring_degree=ring)
        if plan.need is None:
            raise RuntimeError("plan_attention did not plan the need-based exchange")
        rows = peak_received_rows(plan.need, None)
        times[f"{ring}/peak_rows"] = float(rows)
        times[f"{ring}/peak_bytes"] = float(rows * layer.config.head_dim * x.element_size())
        times[f"{ring}/seconds"] = _best_seconds(layer, x, cu, plan, world, rank, repeats, exchange="need", ring_degree=ring)
    return times


def ring_times(cu: torch.Tensor, cp: int, rings: list[int], repeats: int = 3) -> dict[str, float]:
    """Per ring degree: peak received-kv rows held at once (max over ranks) and wall seconds (slowest rank)."""
    per_rank = spawn(_ring_times, cp, cu, rings, repeats, timeout=600.0)
    return {key: max(r[key] for r in per_rank) for key in per_rank[0]}
