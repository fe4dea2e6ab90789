"""INDEXER layers on ranks that own no compressed entry, under the need exchange (a 0.2 regression).

A rank whose shard holds no block of a compressed layer still receives the indexer keys of
earlier ranks; its key buffer must have the keys' width (the indexer's declared ``key_dim``),
and an empty fp8 key buffer must pack without error. Each batch below crashed or hung 0.2.0
(gloo "Received data size doesn't match expected size", or ``IndexError: amax()`` on the
empty keys while the peers waited in the all-to-all). Every rank's output, input gradient and
the rank-summed parameter gradients are compared with the single-process oracle
``reference_forward`` on the whole batch.

Tolerance: fp32 against fp32, both accumulating in fp32 and differing only in summation
order: 1e-5 relative (observed ~1e-7). The fp8 keys are rounded identically on both sides.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.plan.cost import CostModel
from cpkv.plan import plan_attention
from cpkv.v4 import V4Attention, V4Config, reference_forward
from tests.shared_spawn import shared_spawn

FP8 = torch.float8_e4m3fn
# (cp, cu_seqlens, config): the batches of the issue, and T = 0, 4, 8 at cp 4.
CASES: dict[int, list[tuple[list[int], V4Config]]] = {
    2: [
        ([0, 6, 8], V4Config(compress_ratio=4, window=2, topk=4)),
        ([0, 6, 8], V4Config(compress_ratio=4, window=2, topk=4, index_key_dtype=FP8)),
        ([0, 2, 4, 6, 8, 10, 12, 14, 32], V4Config(compress_ratio=4, window=8, topk=4, index_key_dtype=FP8)),
    ],
    3: [
        ([0, 10, 12], V4Config(compress_ratio=4, window=2, topk=4, index_key_dtype=FP8)),
        ([0, 10, 12], V4Config(compress_ratio=4, window=2, topk=4)),
    ],
    4: [([0, 0], V4Config(compress_ratio=4, window=8, topk=4, index_key_dtype=FP8))]
    + [([0, t], V4Config(compress_ratio=4, window=8, topk=4, index_key_dtype=FP8)) for t in (4, 8)],
}
EXCHANGES = ("need", "allgather")
LAYOUTS = ("contiguous", "zigzag", "balanced")


def _runs(world: int) -> list[tuple[list[int], V4Config, str, str]]:
    """Every case under every layout that takes it (zigzag: document lengths multiples of 2*cp) and exchange."""
    runs = []
    for cu_list, config in CASES[world]:
        lengths = torch.tensor(cu_list).diff()
        for layout in LAYOUTS:
            if layout == "zigzag" and bool((lengths % (2 * world)).any()):
                continue
            runs += [(cu_list, config, layout, exchange) for exchange in EXCHANGES]
    return runs


def _plan(cu_list: list[int], config: V4Config, layout: str, exchange: str, world: int, rank: int) -> Any:
    return plan_attention(torch.tensor(cu_list), world, rank, layout=layout, cost_model=CostModel(), exchange=exchange,  # type: ignore[arg-type]
                          compress_ratios=[4], windows=[config.window])


def _inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(num_tokens, 64, generator=gen), torch.randn(num_tokens, 64, generator=gen)


def _grads(layer: V4Attention) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _run(rank: int, world: int) -> list[dict[str, Any]]:
    results = []
    for cu_list, config, layout, exchange in _runs(world):
        x, grad_out = _inputs(cu_list[-1])
        layer = V4Attention(config, seed=5)
        plan = _plan(cu_list, config, layout, exchange, world, rank)
        x_local = plan.shard(x).clone().requires_grad_(True)
        result = layer(x_local, plan, None)
        result.out.backward(plan.shard(grad_out))
        results.append({"out": result.out.detach(), "grad_x": x_local.grad, "params": _grads(layer)})
    return results


def _reference(cu_list: list[int], config: V4Config) -> dict[str, Any]:
    x, grad_out = _inputs(cu_list[-1])
    layer = V4Attention(config, seed=5)
    x = x.clone().requires_grad_(True)
    result = reference_forward(layer, x, torch.tensor(cu_list))
    result.out.backward(grad_out)
    return {"out": result.out.detach(), "grad_x": x.grad, "params": _grads(layer)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    if b.numel() == 0:  # T = 0: nothing to compare but the shape
        return 0.0 if a.shape == b.shape else float("inf")
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


RUN = {world: shared_spawn(_run, world, timeout=200.0) for world in sorted(CASES)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", sorted(CASES))
def test_ranks_without_entries_match_single_process(world: int, request: pytest.FixtureRequest) -> None:
    per_rank = RUN[world].run(request)
    for i, (cu_list, config, layout, exchange) in enumerate(_runs(world)):
        expected = _reference(cu_list, config)
        ranks = [r[i] for r in per_rank]
        plan = _plan(cu_list, config, layout, exchange, world, 0)
        what = f"cp {world} cu {cu_list} {layout} {exchange} keys {config.index_key_dtype}"
        assert _rel(plan.unshard([r["out"] for r in ranks]), expected["out"]) <= 1e-5, what
        assert _rel(plan.unshard([r["grad_x"] for r in ranks]), expected["grad_x"]) <= 1e-5, what
        for name, grad in expected["params"].items():
            summed = sum(r["params"][name].double() for r in ranks if name in r["params"])
            assert isinstance(summed, torch.Tensor) and _rel(summed, grad) <= 1e-5, (what, name)
