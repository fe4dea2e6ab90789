"""The CP-equivalence check once through the Triton kernels (CPU interpreter, small shapes).

``CUDABackend(triton_kernels=True)`` on fp32 CPU tensors sends every attention primitive of the
layer (window and dense layers through the index-list kernel, sparse attention with sinks and
the KL target from its forward, the indexer top-k, the indexer KL loss and its backward) to
cpkv's Triton kernels, run by Triton's interpreter. On 2 gloo ranks, every compress mode under
both exchanges, contiguous and zigzag, must equal the single-process oracle
``reference_forward`` (pure torch): outputs, input gradients and rank-summed parameter
gradients. Tolerance 1e-4 relative: fp32 kernels with another summation order than torch's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.backends.cuda import CUDABackend
from cpkv.launch import spawn
from cpkv.plan import AttentionPlan, plan_attention, seqlens_to_cu_seqlens
from cpkv.v4 import V4Attention, V4Config, reference_forward

pytest.importorskip("triton")

LENGTHS = [5, 19, 3, 13]  # 40 tokens; documents straddle the cp 2 boundary
ZIGZAG_LENGTHS = [8, 20, 4, 8]  # 40 tokens in multiples of 2*cp
LAYOUTS = ["contiguous", "zigzag"]  # the kernels see index lists; balanced plans: the reference CP suites
MODES = {
    "window": V4Config(window=6, heads=2),
    "compressor": V4Config(compress_ratio=8, window=6, heads=2),
    "indexer": V4Config(compress_ratio=4, window=6, topk=3, heads=2),
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return torch.randn(40, 64, generator=gen), torch.randn(40, 64, generator=gen)


def triton_cases(rank: int, world: int) -> dict[str, Any]:
    from tests.backends.triton_interpreter import interpreted_kernels

    interpreted_kernels()  # CPU interpreter (the session's TRITON_INTERPRET=1 is inherited)
    x_all, g_all = _inputs()
    backend = CUDABackend(triton_kernels=True)
    results: dict[str, Any] = {}
    for name, config in MODES.items():
        layer = V4Attention(config, seed=3)
        for layout in LAYOUTS:
            for exchange in ("allgather", "need"):
                plan = _plan(layout, config, world, rank, exchange)
                layer.zero_grad(set_to_none=True)
                x = plan.shard(x_all).clone().requires_grad_(True)
                out = layer(x, plan, None, backend=backend).out
                out.backward(plan.shard(g_all))
                grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
                results[f"{name}/{layout}/{exchange}"] = (out.detach(), x.grad, grads)
    return results


def _plan(layout: str, config: V4Config, world: int, rank: int, exchange: str = "allgather") -> AttentionPlan:
    cu = seqlens_to_cu_seqlens(ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS)
    ratios = [config.compress_ratio] if config.mode.compresses else []
    return plan_attention(cu, world, rank, layout=layout, exchange=exchange, compress_ratios=ratios,  # type: ignore[arg-type]
                          windows=[config.window])


@pytest.mark.timeout(300)
def test_layer_through_the_triton_kernels_equals_the_oracle() -> None:
    per_rank = spawn(triton_cases, 2, timeout=280.0)
    x_all, g_all = _inputs()
    for name, config in MODES.items():
        for layout in LAYOUTS:
            layer = V4Attention(config, seed=3)
            x = x_all.clone().requires_grad_(True)
            plan = _plan(layout, config, 2, 0)
            out = reference_forward(layer, x, seqlens_to_cu_seqlens(ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS)).out
            out.backward(g_all)
            assert x.grad is not None
            expected = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
            for exchange in ("allgather", "need"):
                case = (name, layout, exchange)
                runs = [r[f"{name}/{layout}/{exchange}"] for r in per_rank]
                for got, want in ((plan.unshard([r[0] for r in runs]), out.detach()), (plan.unshard([r[1] for r in runs]), x.grad)):
                    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4, case
                for param, grad in expected.items():
                    summed = torch.stack([r[2][param] for r in runs if param in r[2]]).sum(0)
                    assert float((summed - grad).abs().max() / grad.abs().max().clamp(min=1e-12)) <= 1e-4, (*case, param)
