"""Indexer keys in the layer's key dtype: the same rounding everywhere, and the wire format.

* ``round_index_keys`` against an independent quantizer (bf16 cast; fp8 e4m3 with
  ``scale = amax / 448`` per key), straight-through gradient;
* ``round_index_queries`` rounds each ``(t, h)`` row as a key;
* an INDEXER layer with bf16 keys, and with fp8 keys and queries (DeepSeek's indexer), under
  both exchanges at cp 2 and 3 equals the single-process oracle with the same dtypes (fp32:
  summation order only, <= 1e-5);
* the need exchange sends the keys in that format: the bytes ``count_bytes`` sees for
  ``exchange_index_keys`` are ``rows * D * 2`` (bf16) and ``rows * (D + 4)`` (fp8).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cpkv.plan.cost import CostModel
from cpkv.commstats import count_bytes
from cpkv.index_keys import round_index_keys, round_index_queries
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.v4 import V4Attention, V4Config, reference_forward
from tests.shared_spawn import shared_spawn

LENGTHS = [9, 40, 3, 20]  # 72 tokens
ZIGZAG_LENGTHS = [12, 36, 24]  # 72 tokens in multiples of 2*cp (cp 2, 3)
RUNS = [(layout, exchange) for layout in ("contiguous", "zigzag", "balanced") for exchange in ("allgather", "need")]


def _plan(layout: str, exchange: str, world: int, rank: int) -> Any:
    cu = seqlens_to_cu_seqlens(ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS)
    return plan_attention(cu, world, rank, layout=layout, cost_model=CostModel(), exchange=exchange, compress_ratios=[4], windows=[8])  # type: ignore[arg-type]
FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": (torch.bfloat16, None), "fp8": (FP8, FP8)}  # (index_key_dtype, index_query_dtype)


def test_rounding_matches_an_independent_quantizer() -> None:
    keys = torch.randn(6, 16) * torch.logspace(-3, 3, 6)[:, None]
    keys[2] = 0.0
    torch.testing.assert_close(round_index_keys(keys, torch.bfloat16), keys.bfloat16().float(), rtol=0, atol=0)
    scale = keys.abs().amax(1, keepdim=True) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    expected = (keys / scale).to(torch.float8_e4m3fn).float() * scale
    torch.testing.assert_close(round_index_keys(keys, torch.float8_e4m3fn), expected, rtol=0, atol=0)
    assert float(((round_index_keys(keys, torch.float8_e4m3fn) - keys).abs() / keys.abs().amax(1, keepdim=True).clamp(min=1e-30)).max()) < 2**-3
    assert round_index_keys(keys, None) is keys
    leaf = keys.clone().requires_grad_(True)
    round_index_keys(leaf, torch.float8_e4m3fn).mul(torch.arange(16.0)).sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.grad, torch.arange(16.0).expand(6, 16))


def test_queries_round_per_token_and_head() -> None:
    queries = torch.randn(3, 4, 16) * torch.logspace(-3, 3, 12).reshape(3, 4, 1)
    rounded = round_index_queries(queries, FP8)
    for t in range(3):
        assert torch.equal(rounded[t], round_index_keys(queries[t], FP8))  # rows are (t, h): one scale each
    assert round_index_queries(queries, None) is queries
    leaf = queries.clone().requires_grad_(True)
    round_index_queries(leaf, FP8).sum().backward()
    assert leaf.grad is not None and torch.equal(leaf.grad, torch.ones_like(queries))


def _layer(dtypes: tuple[torch.dtype, torch.dtype | None]) -> V4Attention:
    keys, queries = dtypes
    return V4Attention(V4Config(compress_ratio=4, window=8, topk=3, index_key_dtype=keys, index_query_dtype=queries), seed=3)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(72, 64, generator=gen), torch.randn(72, 64, generator=gen)


def key_dtype_cases(rank: int, world: int) -> dict[str, Any]:
    x_all, g_all = _inputs()
    results: dict[str, Any] = {}
    for name, dtype in DTYPES.items():
        layer = _layer(dtype)
        for layout, exchange in RUNS:
            plan = _plan(layout, exchange, world, rank)
            x = plan.shard(x_all).clone().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            with count_bytes() as counter:
                out = layer(x, plan, None, backend="reference").out
                out.backward(plan.shard(g_all))
            grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
            key_rows = plan.compressed[4].entries.num_recv if exchange == "need" else 0
            results[f"{name}/{layout}/{exchange}"] = {
                "out": out.detach(), "grad_x": x.grad, "params": grads,
                "key_bytes": counter.by_op.get("exchange_index_keys", 0), "key_rows": key_rows,
            }
    return results


KEY_DTYPE_CASES = {world: shared_spawn(key_dtype_cases, world, timeout=180.0) for world in (2, 3)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [2, 3])
def test_key_dtypes_are_exact_under_cp_and_travel_in_their_format(world: int, request: pytest.FixtureRequest) -> None:
    per_rank = KEY_DTYPE_CASES[world].run(request)
    x_all, g_all = _inputs()
    for name, dtype in DTYPES.items():
        for layout in ("contiguous", "zigzag", "balanced"):
            layer = _layer(dtype)
            x = x_all.clone().requires_grad_(True)
            out = reference_forward(layer, x, seqlens_to_cu_seqlens(ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS)).out
            out.backward(g_all)
            assert x.grad is not None
            expected_params = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
            for exchange in ("allgather", "need"):
                plan = _plan(layout, exchange, world, 0)
                runs = [r[f"{name}/{layout}/{exchange}"] for r in per_rank]
                got = plan.unshard([r["out"] for r in runs]).detach()
                assert float((got - out.detach()).abs().max() / out.detach().abs().max()) <= 1e-5, (name, layout, exchange)
                got_grad = plan.unshard([r["grad_x"] for r in runs])
                assert float((got_grad - x.grad).abs().max() / x.grad.abs().max()) <= 1e-5, (name, exchange)
                for param, grad in expected_params.items():
                    summed = torch.stack([r["params"][param] for r in runs]).sum(0)
                    assert float((summed - grad).abs().max() / grad.abs().max().clamp(min=1e-12)) <= 1e-5, (name, exchange, param)
                row_bytes = 16 * 2 if name == "bf16" else 16 + 4  # index_head_dim 16
                for r in runs:
                    assert r["key_bytes"] == r["key_rows"] * row_bytes, (name, exchange, r["key_bytes"], r["key_rows"])
                if exchange == "need":
                    assert any(r["key_rows"] for r in runs), "some rank receives keys"
