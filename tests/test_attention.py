"""attention_forward's input checks: every rank raises the same clear error, none hangs."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.attention_zigzag import attention_forward_bsnd
from cpkv.attention_plan import plan_attention
from cpkv.launch import spawn
from cpkv.v4 import V4Attention, V4Config

CU = torch.tensor([0, 5, 12, 16])


def _bad_calls(rank: int, world: int) -> list[tuple[str, Callable[[], Any]]]:
    local = 16 // world
    q, kv = torch.randn(local, 4, 32), torch.randn(local, 32)
    spec = AttentionSpec(d_v=24, window=4)
    cmp_spec = AttentionSpec(d_v=24, window=4, compress_ratio=8)
    layer = V4Attention(V4Config(compress_ratio=4))
    other_plan = plan_attention(CU, world, (rank + 1) % world) if world > 1 else plan_attention(torch.tensor([0, 8]), 1, 0)
    return [
        ("ring_degree", lambda: attention_forward(q, kv, CU, None, spec=spec, ring_degree=2)),
        ("ring_degree", lambda: attention_forward(q, kv, CU, None, spec=spec, ring_degree=0)),
        ("T / cp", lambda: attention_forward(q[:-1], kv[:-1], CU, None, spec=spec)),
        ("kv", lambda: attention_forward(q, kv[:, None], CU, None, spec=spec)),
        ("spec.d_v", lambda: attention_forward(q, kv, CU, None, spec=AttentionSpec(d_v=40, window=4))),
        ("compressor", lambda: attention_forward(q, kv, CU, None, spec=cmp_spec)),
        ("spec.window", lambda: attention_forward(q, kv, CU, None, spec=AttentionSpec(d_v=24, window=None, compress_ratio=8))),
        ("indexer", lambda: attention_forward(
            q, kv, CU, None, spec=AttentionSpec(d_v=24, window=4, compress_ratio=4), hidden=torch.randn(local, 64),
            compressor=layer.compressor)),
        ("cu_seqlens", lambda: attention_forward(q, kv, torch.tensor([5, 12, 16]), None, spec=spec)),
        ("plan", lambda: attention_forward(q, kv, CU, None, spec=spec, plan=other_plan)),
        ("q", lambda: attention_forward_bsnd(q, kv, None, spec=spec)),
    ]


def _check_all_raise(rank: int, world: int) -> list[str]:
    messages = []
    for _expected, call in _bad_calls(rank, world):
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as err:
            messages.append(str(err))
    dist.barrier()  # reached only if no rank entered a collective alone
    return messages


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_every_rank_raises_before_any_collective(world: int) -> None:
    per_rank = spawn(_check_all_raise, world, timeout=90.0)
    names = [name for name, _ in _bad_calls(0, world)]
    for messages in per_rank:
        assert len(messages) == len(names)
        for name, message in zip(names, messages):
            assert name in message, (name, message)


def test_spec_mode_follows_ratio() -> None:
    assert AttentionSpec(d_v=8, compress_ratio=128).mode.name == "COMPRESSOR_ONLY"
    with pytest.raises(ValueError, match="spec.topk"):
        AttentionSpec(d_v=8, topk=0).validate()
