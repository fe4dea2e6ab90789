"""Ring rounds go through the chosen backend: every kv row of every round reaches its kernel.

A counting stand-in backend (the reference ops, with every call recorded) and the CUDA
backend with a counting stand-in ``varlen_attn`` kernel (flash semantics on CPU, bf16) run
``ring_degree`` 2 and 4 on gloo ranks. Per rank, the kv rows handed to ``range_attention``
(the stand-in backend) or to the kernel's range calls (the CUDA path) must add up to exactly
the remote rows of the one-round need exchange, empty rounds must make no call, and the
result must equal one round.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.backends.base import AttentionResult
from cpkv.backends.cuda import CUDABackend
from cpkv.backends.reference import ReferenceBackend
from cpkv.plan import KeyRanges, plan_attention, seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_contiguous
from tests.backends.test_cuda import StandInVarlen
from tests.shared_spawn import shared_spawn

LENGTHS = [5, 70, 3, 2, 50, 14]  # 144 tokens: a document straddling every rank at cp 2-4
WINDOWS = [None, 24]


class CountingBackend(ReferenceBackend):
    """The reference ops, recording the kv rows each primitive receives."""

    def __init__(self) -> None:
        super().__init__()
        self.range_rows: list[int] = []

    def range_attention(self, q: Tensor, k: Tensor, v: Tensor, ranges: KeyRanges, *, scale: float) -> AttentionResult:
        self.range_rows.append(k.shape[0])
        return super().range_attention(q, k, v, ranges, scale=scale)


def _inputs(world: int, rank: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(144, 4, 16, generator=gen).to(dtype)
    kv = torch.randn(144, 16, generator=gen).to(dtype)
    return shard_contiguous(q, world, rank).clone(), shard_contiguous(kv, world, rank).clone()


def _run(
    world: int, rank: int, window: int | None, ring: int, backend: Any, dtype: torch.dtype, forward_calls: list[int] | None = None
) -> list[Tensor]:
    cu = seqlens_to_cu_seqlens(LENGTHS)
    plan = plan_attention(cu, world, rank, exchange="need", ring_degree=ring, windows=[window])
    q, kv = (t.requires_grad_(True) for t in _inputs(world, rank, dtype))
    sinks = torch.linspace(-1.0, 1.0, 4, dtype=dtype).requires_grad_(True)
    out = attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=16, window=window), sinks=sinks, backend=backend).out
    if forward_calls is not None:  # the CUDA path calls the kernel again in backward (the LSE gradient)
        forward_calls.append(len(backend._varlen_attn.calls))
    out.float().sum().backward()
    assert q.grad is not None and kv.grad is not None and sinks.grad is not None
    return [out.detach().float(), q.grad.float(), kv.grad.float(), sinks.grad.float()]


def ring_counts(rank: int, world: int) -> dict[str, Any]:
    cu = seqlens_to_cu_seqlens(LENGTHS)
    results: dict[str, Any] = {}
    for window in WINDOWS:
        halo = plan_attention(cu, world, rank, exchange="need", windows=[window]).kv[window].halo
        remote = halo.num_recv if halo is not None else 0
        one = _run(world, rank, window, 1, ReferenceBackend(), torch.float32)
        one_bf16 = _run(world, rank, window, 1, CUDABackend(StandInVarlen()), torch.bfloat16)
        for ring in (2, 4):
            counting = CountingBackend()
            got = _run(world, rank, window, ring, counting, torch.float32)
            kernel, forward_calls = StandInVarlen(), []
            got_cuda = _run(world, rank, window, ring, CUDABackend(kernel), torch.bfloat16, forward_calls)
            range_calls = [c["rows"][1] for c in kernel.calls[: forward_calls[0]] if c["window_size"][1] == -1]
            results[f"{window}/{ring}"] = {
                "remote": remote, "backend_rows": counting.range_rows, "kernel_rows": range_calls,
                "error": max(float((g - o).abs().max() / o.abs().max().clamp(min=1e-12)) for g, o in zip(got, one)),
                "cuda_error": max(float((g - o).abs().max() / o.abs().max().clamp(min=1e-12)) for g, o in zip(got_cuda, one_bf16)),
            }
    return results


RING_COUNTS = {world: shared_spawn(ring_counts, world, timeout=200.0) for world in (2, 4)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 4])
def test_every_round_row_reaches_the_backend(world: int, request: pytest.FixtureRequest) -> None:
    for rank, per_rank in enumerate(RING_COUNTS[world].run(request)):
        for key, r in per_rank.items():
            assert sum(r["backend_rows"]) == r["remote"], (rank, key, r)
            assert sum(r["kernel_rows"]) == r["remote"], (rank, key, r)
            assert all(n > 0 for n in r["backend_rows"] + r["kernel_rows"]), "empty rounds make no call"
            if rank > 0:
                assert r["remote"] > 0, "the straddling document gives every later rank remote rows"
            # fp32: the LSE merge of rounds equals one round up to summation order.
            assert r["error"] <= 1e-5, (rank, key, r)
            # bf16 kernel path: same kernel, other split of the keys; bf16 rounding of the parts.
            assert r["cuda_error"] <= 2e-2, (rank, key, r)
