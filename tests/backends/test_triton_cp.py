"""The CP-equivalence check once through the Triton kernels (CPU interpreter, small shapes).

``CUDABackend(triton_kernels=True)`` on fp32 CPU tensors sends every attention primitive of the
layer (window and dense layers through the index-list kernel, sparse attention with sinks and
the KL target from its forward, the indexer top-k, the indexer KL loss and its backward) to
cpkv's Triton kernels, run by Triton's interpreter. On 2 gloo ranks, every compress mode under
both exchanges, contiguous and zigzag, must equal the single-process oracle
``reference_forward`` (pure torch): outputs, input gradients and rank-summed parameter
gradients. Tolerance 1e-4 relative: fp32 kernels with another summation order than torch's.

The same layer in bf16 (every mode, fp8 index keys and queries for the indexer as well;
contiguous, all-gather) against the oracle in fp64, by the GPU check's rule
(``benchmarks/device_common.compare``: error at most twice that of the same cp 2 run through
the reference ops in bf16, plus one bf16 ulp of the largest value), the bf16 kernels run by
the patched interpreter (``benchmarks/interpreter_patch.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.plan.cost import CostModel
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
FP8 = torch.float8_e4m3fn
QUERY_GAIN = 15.0  # scores of standard deviation ~5 instead of ~0.3 at nn.Linear's init: a peaked softmax
BF16_MODES = {**MODES, "indexer fp8": V4Config(compress_ratio=4, window=6, topk=3, heads=2, index_key_dtype=FP8,
                                               index_query_dtype=FP8)}


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
    return plan_attention(cu, world, rank, layout=layout, cost_model=CostModel(), exchange=exchange, compress_ratios=ratios,  # type: ignore[arg-type]
                          windows=[config.window])


def _both(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {"fp32": triton_cases(rank, world), "bf16": bf16_cases(rank, world)}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict[str, Any]]]:
    """One spawn of 2 ranks runs the fp32 and the bf16 cases (``{"fp32": per_rank, "bf16": per_rank}``)."""
    per_rank = spawn(_both, 2, timeout=540.0)
    return {key: [r[key] for r in per_rank] for key in ("fp32", "bf16")}


@pytest.mark.timeout(560)
def test_layer_through_the_triton_kernels_equals_the_oracle(runs: dict[str, list[dict[str, Any]]]) -> None:
    per_rank = runs["fp32"]
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



def _bf16_layer(config: V4Config) -> V4Attention:
    """The layer in bf16, its query projection times ``QUERY_GAIN`` (the regime where bf16 roundings of the
    scores show: at unit-scale scores the rule's floor hides them, see tests/backends/test_triton_bf16.py)."""
    layer = V4Attention(config, seed=3)
    with torch.no_grad():
        layer.wq.weight.mul_(QUERY_GAIN)
    return layer.bfloat16()


def bf16_cases(rank: int, world: int) -> dict[str, Any]:
    """Each bf16 mode's output, input gradient and parameter gradients on this rank (contiguous, all-gather),
    through the Triton kernels and through the reference ops."""
    from cpkv.backends import ReferenceBackend
    from tests.backends.triton_interpreter import interpreted_kernels

    interpreted_kernels()
    x_all, g_all = (t.bfloat16() for t in _inputs())
    results: dict[str, Any] = {}
    for name, config in BF16_MODES.items():
        plan = _plan("contiguous", config, world, rank)
        for label, backend in (("triton", CUDABackend(triton_kernels=True)), ("reference", ReferenceBackend())):
            layer = _bf16_layer(config)
            x = plan.shard(x_all).clone().requires_grad_(True)
            out = layer(x, plan, None, backend=backend).out
            out.backward(plan.shard(g_all))
            grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
            results[f"{name}/{label}"] = (out.detach(), x.grad, grads)
    return results


def _unsharded(plan: AttentionPlan, runs: list[Any]) -> dict[str, torch.Tensor]:
    """The ranks' outputs and input gradients unsharded, their parameter gradients summed (in fp64: the ranks'
    bf16 partials, without a rounding of the test's own)."""
    got = {"out": plan.unshard([r[0] for r in runs]), "grad x": plan.unshard([r[1] for r in runs])}
    for param in runs[0][2]:
        got[f"grad {param}"] = torch.stack([r[2][param].double() for r in runs if param in r[2]]).sum(0)
    return got


def _oracle(config: V4Config) -> dict[str, torch.Tensor]:
    """``reference_forward`` in fp64 of the bf16 layer's weights and inputs: out, grad x, parameter gradients."""
    layer = _bf16_layer(config).double()
    x_all, g_all = (t.bfloat16().double() for t in _inputs())
    x = x_all.clone().requires_grad_(True)
    out = reference_forward(layer, x, seqlens_to_cu_seqlens(LENGTHS)).out
    out.backward(g_all)
    assert x.grad is not None
    return {"out": out.detach(), "grad x": x.grad,
            **{f"grad {n}": p.grad for n, p in layer.named_parameters() if p.grad is not None}}


@pytest.mark.timeout(560)
def test_bf16_layer_through_the_triton_kernels_within_twice_the_reference_error(runs: dict[str, list[dict[str, Any]]]) -> None:
    """The rule's reference in bf16 is the same cp 2 run through the reference ops: a cp run rounds each rank's
    partial parameter gradient to bf16 before they are summed, which one process never does (the sinks'
    gradient of the indexer mode: 7.6e-3 from fp64 through the reference ops at cp 2, 1.0e-3 in one process)."""
    from tests.backends.triton_interpreter import interpreted_kernels

    interpreted_kernels()  # puts benchmarks/ on sys.path
    from device_common import compare

    per_rank = runs["bf16"]
    failures = []
    for name, config in BF16_MODES.items():
        plan = _plan("contiguous", config, 2, 0)
        got, low = (_unsharded(plan, [r[f"{name}/{label}"] for r in per_rank]) for label in ("triton", "reference"))
        exact = _oracle(config)
        assert set(got) == set(exact) == set(low), name
        rows, ok = compare(name, exact, low, got)
        failures += [] if ok else [row for row in rows if row.endswith("FAIL |")]
    assert not failures, "\n".join(failures)
