"""attention_forward's input checks: every rank raises the same clear error, none hangs."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.plan import plan_attention
from cpkv.v4 import V4Attention, V4Config
from tests.shared_spawn import shared_spawn

CU = torch.tensor([0, 5, 12, 16])


def _bad_calls(rank: int, world: int) -> list[tuple[str, Callable[[], Any]]]:
    local = 16 // world
    q, kv = torch.randn(local, 4, 32), torch.randn(local, 32)
    spec = AttentionSpec(d_v=24, window=4)
    cmp_spec = AttentionSpec(d_v=24, window=4, compress_ratio=8)
    layer = V4Attention(V4Config(compress_ratio=4))
    plan = plan_attention(CU, world, rank)
    need_plan = plan_attention(CU, world, rank, exchange="need", windows=[8])
    other_plan = plan_attention(CU, world, (rank + 1) % world) if world > 1 else plan_attention(CU, 2, 1)
    return [
        ("plan must be an AttentionPlan", lambda: attention_forward(q, kv, CU, None, spec=spec)),  # type: ignore[arg-type]
        ("plan.local_len", lambda: attention_forward(q[:-1], kv[:-1], plan, None, spec=spec)),
        ("kv has 3 heads, which must divide q's 4", lambda: attention_forward(q, torch.randn(local, 3, 32), plan, None, spec=spec)),
        ("v must be [T/cp, H_kv, spec.d_v]", lambda: attention_forward(q, kv[:, None], plan, None, spec=spec,
                                                                       v=torch.randn(local, 1, 20))),
        ("take one shared kv head", lambda: attention_forward(q, kv[:, None], plan_attention(CU, world, rank, compress_ratios=[8]),
                                                              None, spec=cmp_spec)),
        ("spec.d_v", lambda: attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=40, window=4))),
        ("compress_ratio=8 was not planned", lambda: attention_forward(q, kv, plan, None, spec=cmp_spec)),
        ("compressor", lambda: attention_forward(q, kv, plan_attention(CU, world, rank, compress_ratios=[8]), None, spec=cmp_spec)),
        ("spec.window", lambda: attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=24, window=None, compress_ratio=8))),
        ("indexer", lambda: attention_forward(
            q, kv, plan_attention(CU, world, rank, compress_ratios=[4]), None, spec=AttentionSpec(d_v=24, window=4, compress_ratio=4),
            hidden=torch.randn(local, 64), compressor=layer.compressor)),
        ("window=4", lambda: attention_forward(q, kv, need_plan, None, spec=spec)),
        ("plan was made for", lambda: attention_forward(q, kv, other_plan, None, spec=spec)),
        ("dtype", lambda: attention_forward(q, kv.double(), plan, None, spec=spec)),
        ("sinks", lambda: attention_forward(q, kv, plan, None, spec=spec, sinks=torch.zeros(3))),
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


CHECK_ALL_RAISE = {world: shared_spawn(_check_all_raise, world, timeout=90.0) for world in (1, 2)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_every_rank_raises_before_any_collective(world: int, request: pytest.FixtureRequest) -> None:
    per_rank = CHECK_ALL_RAISE[world].run(request)
    names = [name for name, _ in _bad_calls(0, world)]
    for messages in per_rank:
        assert len(messages) == len(names)
        for name, message in zip(names, messages):
            assert name in message, (name, message)


def _dense_default_call(rank: int, world: int) -> torch.Tensor:
    plan = plan_attention(torch.tensor([0, 200]), 1, 0, exchange="need")  # plans the dense (None) route only
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(200, 2, 8, generator=gen, dtype=torch.float64), torch.randn(200, 8, generator=gen, dtype=torch.float64)
    return attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=8), backend="reference").out


DENSE_DEFAULT_CALL = shared_spawn(_dense_default_call, 1, timeout=120.0)


def test_spec_window_defaults_to_dense_causal(request: pytest.FixtureRequest) -> None:
    """``AttentionSpec(d_v=...)`` is dense causal (no silent sliding window); compressed layers must name one."""
    assert AttentionSpec(d_v=8).window is None
    AttentionSpec(d_v=8).validate()
    out = DENSE_DEFAULT_CALL.run(request)[0]
    gen = torch.Generator().manual_seed(0)
    q, kv = torch.randn(200, 2, 8, generator=gen, dtype=torch.float64), torch.randn(200, 8, generator=gen, dtype=torch.float64)
    scores = torch.einsum("thd,sd->hts", q, kv) * 8**-0.5
    mask = torch.ones(200, 200, dtype=torch.bool).tril()  # dense causal: query 199 sees all 200 keys, not 128
    want = torch.einsum("hts,sd->thd", scores.masked_fill(~mask, float("-inf")).softmax(-1), kv)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"spec.window is required for compressed layers \(INDEXER\), got None"):
        AttentionSpec(d_v=8, compress_ratio=4).validate()


def test_spec_mode_follows_ratio() -> None:
    assert AttentionSpec(d_v=8, compress_ratio=128).mode.name == "COMPRESSOR_ONLY"
    with pytest.raises(ValueError, match="spec.topk"):
        AttentionSpec(d_v=8, topk=0).validate()


def test_spec_compress_mode_overrides_the_ratio_rule() -> None:
    from cpkv.compress_mode import LayerCompressMode

    assert AttentionSpec(d_v=8, compress_ratio=8, compress_mode=LayerCompressMode.INDEXER).mode is LayerCompressMode.INDEXER
    assert AttentionSpec(d_v=8, compress_ratio=4, compress_mode=LayerCompressMode.COMPRESSOR_ONLY).mode.name == "COMPRESSOR_ONLY"
    with pytest.raises(ValueError, match="spec.compress_mode=NO_COMPRESS does not fit spec.compress_ratio=4"):
        AttentionSpec(d_v=8, compress_ratio=4, compress_mode=LayerCompressMode.NO_COMPRESS).validate()
    with pytest.raises(TypeError, match="spec.compress_mode"):
        AttentionSpec(d_v=8, compress_ratio=4, compress_mode="INDEXER").validate()  # type: ignore[arg-type]
