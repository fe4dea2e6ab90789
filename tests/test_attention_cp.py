"""CP-equivalence suite: the one executor on gloo ranks equals the single-process layer.

For every compress mode (NO_COMPRESS with a window and dense causal, COMPRESSOR_ONLY,
INDEXER, the compressor-None fallback), for every layout (contiguous TND, per-document zigzag
TND, balanced, and an irregular custom ``ShardLayout``: several ranges per rank, out of order,
unequal shards, an empty rank at cp 3) with both exchange strategies and with ring rounds, for
zigzag BSND (the zigzag layout over equal documents, flattened), all through
``V4Attention.forward`` -> ``attention_forward``, at cp 1-4: the local outputs
and input gradients concatenated over ranks, and every parameter gradient summed over
ranks (what CP gradient reduction does), match the dense single-process oracle
``V4Attention.reference_forward`` on the whole batch.

Tolerances: fp32 relative error <= 1e-5 (both sides accumulate in fp32; the observed
error is ~1e-7, reordering of sums only). bf16: the CP error against a float64 run is at
most twice the single-process bf16 error against the same float64 run, plus a floor of
one bf16 ulp-ish (2**-8) relative, since both runs round inputs, weights and outputs to
bf16 and differ only in accumulation order.

One group per cp runs every case (tests/shared_spawn.py's spawn of that size: spawning costs seconds).
"""

import functools
from typing import Any

import pytest
import torch

from cpkv.plan.cost import CostModel
from cpkv.plan import AttentionPlan, ShardLayout, bsnd_cu_seqlens, layout_from_ranges, plan_attention, seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_zigzag, unshard_zigzag
from cpkv.v4 import V4Attention, V4Config, reference_forward
from tests.shared_spawn import shared_spawn

# 144 tokens (divisible by cp 1-4): zero-length documents, documents shorter than one
# block (ratio 4 and 8), and documents straddling several ranks at every cp.
LENGTHS = [5, 0, 37, 3, 2, 60, 21, 0, 1, 15]
SHORT_LENGTHS = [5, 7, 3, 0, 9, 6, 2, 4, 11, 1]  # 48 tokens, no document reaches ratio 16
GRAD_SCALE = 3.0
BSND_BATCH, BSND_SEQ = 2, 48

CASES: dict[str, tuple[V4Config, list[int]]] = {
    "window": (V4Config(compress_ratio=0, window=16), LENGTHS),
    "dense": (V4Config(compress_ratio=0, window=None), LENGTHS),
    "compressor": (V4Config(compress_ratio=8), LENGTHS),
    "indexer": (V4Config(compress_ratio=4, topk=4), LENGTHS),
    "fallback": (V4Config(compress_ratio=16), SHORT_LENGTHS),
    # Some ranks have compressed entries, others none: every rank must still run the same
    # backward collectives (a regression test of a hang/garbage exchange).
    "mixed": (V4Config(compress_ratio=32), [48] + [2] * 48),
}
BSND_CASES = ["window", "compressor", "indexer"]
# Per-document zigzag needs lengths divisible by 2*cp for cp 1-4: multiples of 24.
ZIGZAG_LENGTHS = {"window": [48, 0, 24, 72], "dense": [48, 0, 24, 72], "compressor": [48, 0, 24, 72],
                  "indexer": [48, 0, 24, 72], "fallback": [24, 24, 0, 24],
                  "mixed": [48, 24, 24, 24, 24]}
EXCHANGES = ["allgather", "need"]
RINGS = [2, 3, 4]
LAYOUTS = ["tnd", "zigzag", "balanced", "custom"]  # "tnd": contiguous
LAYOUT_RINGS = {"tnd": RINGS, "zigzag": [3], "balanced": [3], "custom": [2]}
BF16_LAYOUTS = ["tnd", "zigzag", "balanced"]  # the custom layout's plans are checked in fp32 (bf16 checks precision)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _inputs(num_tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(num_tokens, 64, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(num_tokens, 64, generator=gen, dtype=torch.float64)
    return x.to(dtype), grad_out.to(dtype)


def _layer(config: V4Config, dtype: torch.dtype) -> V4Attention:
    return V4Attention(config, seed=5).to(dtype)


def _param_grads(layer: V4Attention) -> dict[str, torch.Tensor | None]:
    return {name: (p.grad.clone() if p.grad is not None else None) for name, p in layer.named_parameters()}


def _custom_layout(cu: torch.Tensor, world: int) -> ShardLayout:
    """Pieces of 7 tokens (cut at documents too) dealt to ranks 0, 3, 2, 1, ...; rank 2 holds nothing at cp 3."""
    cuts = torch.unique(torch.cat([cu.long(), torch.arange(0, int(cu[-1]), 7)]))
    piece = torch.arange(cuts.numel() - 1)
    ranks = piece % 2 if world == 3 else (3 * piece) % world
    return layout_from_ranges(cu, world, cuts[:-1], cuts[1:], ranks)


def _lengths(layout: str, name: str) -> list[int]:
    return ZIGZAG_LENGTHS[name] if layout == "zigzag" else CASES[name][1]


def _plan(layout: str, name: str, world: int, rank: int, exchange: str = "allgather", ring: int = 1) -> AttentionPlan:
    config = CASES[name][0]
    cu = seqlens_to_cu_seqlens(_lengths(layout, name))
    arg = {"tnd": "contiguous", "zigzag": "zigzag", "balanced": "balanced"}.get(layout) or _custom_layout(cu, world)
    ratios = [config.compress_ratio] if config.mode.compresses else []
    return plan_attention(cu, world, rank, layout=arg, cost_model=CostModel(), exchange=exchange, ring_degree=ring, compress_ratios=ratios,  # type: ignore[arg-type]
                          windows=[config.window])


def _tnd_case(
    rank: int, world: int, layout: str, name: str, dtype: torch.dtype, exchange: str, ring: int = 1
) -> dict[str, Any]:
    plan = _plan(layout, name, world, rank, exchange, ring)
    x, grad_out = _inputs(plan.num_tokens, dtype)
    layer = _layer(CASES[name][0], dtype)
    x_local = plan.shard(x).clone().requires_grad_(True)
    result = layer(x_local, plan, None, grad_scale=GRAD_SCALE)
    result.out.backward(plan.shard(grad_out))
    return {"out": result.out.detach(), "grad_x": x_local.grad, "params": _param_grads(layer), "loss": result.indexer_loss}


def _bsnd_case(rank: int, world: int, name: str, dtype: torch.dtype) -> dict[str, Any]:
    config = CASES[name][0]
    x, grad_out = _inputs(BSND_BATCH * BSND_SEQ, dtype)
    x, grad_out = x.reshape(BSND_BATCH, BSND_SEQ, -1), grad_out.reshape(BSND_BATCH, BSND_SEQ, -1)
    layer = _layer(config, dtype)
    ratios = [config.compress_ratio] if config.mode.compresses else []
    # Zigzag BSND is the zigzag layout over B equal documents: flatten [B, S/cp] to tokens.
    plan = plan_attention(bsnd_cu_seqlens(BSND_BATCH, BSND_SEQ), world, rank, layout="zigzag", compress_ratios=ratios)
    x_local = shard_zigzag(x, world, rank).clone().requires_grad_(True)
    result = layer(x_local.flatten(0, 1), plan, None, grad_scale=GRAD_SCALE)
    result.out.reshape(x_local.shape).backward(shard_zigzag(grad_out, world, rank))
    result = result._replace(out=result.out.reshape(x_local.shape))
    return {"out": result.out.detach(), "grad_x": x_local.grad, "params": _param_grads(layer), "loss": result.indexer_loss}


def _all_cases(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for dtype_name, dtype in DTYPES.items():
        for layout in LAYOUTS if dtype_name == "fp32" else BF16_LAYOUTS:
            for name in CASES:
                for exchange in EXCHANGES:
                    results[f"{layout}/{name}/{dtype_name}/{exchange}"] = _tnd_case(rank, world, layout, name, dtype, exchange)
        for name in BSND_CASES:
            results[f"bsnd/{name}/{dtype_name}"] = _bsnd_case(rank, world, name, dtype)
    for layout in LAYOUTS:
        for name in CASES:
            for ring in LAYOUT_RINGS[layout]:
                results[f"{layout}/{name}/fp32/ring{ring}"] = _tnd_case(rank, world, layout, name, torch.float32, "need", ring)
    return results


def _reference(layout: str, name: str, dtype: torch.dtype) -> dict[str, Any]:
    """Single-process run on the whole batch (BSND as B equal documents); one per batch, whatever its layout."""
    return _reference_of(tuple([BSND_SEQ] * BSND_BATCH if layout == "bsnd" else _lengths(layout, name)), name, dtype)


@functools.cache  # the oracle is the same for every cp and layout of a batch: compute it once per test session
def _reference_of(lengths: tuple[int, ...], name: str, dtype: torch.dtype) -> dict[str, Any]:
    config = CASES[name][0]
    cu = seqlens_to_cu_seqlens(list(lengths))
    x, grad_out = _inputs(int(cu[-1]), dtype)
    layer = _layer(config, dtype)
    x = x.clone().requires_grad_(True)
    result = reference_forward(layer, x, cu, grad_scale=GRAD_SCALE)
    result.out.backward(grad_out)
    return {"out": result.out.detach(), "grad_x": x.grad, "params": _param_grads(layer), "loss": result.indexer_loss}


def _combine(layout: str, name: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Outputs/input grads in natural order (``plan.unshard``); parameter grads summed over ranks."""
    if layout != "bsnd":
        plan = _plan(layout, name, len(per_rank), 0)
        out = plan.unshard([r["out"] for r in per_rank])
        grad_x = plan.unshard([r["grad_x"] for r in per_rank])
    else:
        out = unshard_zigzag([r["out"] for r in per_rank]).flatten(0, 1)
        grad_x = unshard_zigzag([r["grad_x"] for r in per_rank]).flatten(0, 1)
    params: dict[str, torch.Tensor | None] = {}
    for name in per_rank[0]["params"]:
        grads = [r["params"][name] for r in per_rank if r["params"][name] is not None]
        params[name] = torch.stack([g.double() for g in grads]).sum(0) if grads else None
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    return {"out": out, "grad_x": grad_x, "params": params, "loss": sum(float(v) for v in losses) if losses else None}


def _flat(result: dict[str, Any]) -> dict[str, torch.Tensor]:
    flat = {"out": result["out"].double(), "grad_x": result["grad_x"].double()}
    for name, grad in result["params"].items():
        if grad is not None:
            flat[f"param:{name}"] = grad.double()
    return flat


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


CP_CHECKS = {world: shared_spawn(_all_cases, world, timeout=240.0) for world in (1, 2, 3, 4)}


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"cp{w}")
def cp_run(request: pytest.FixtureRequest) -> tuple[int, dict[str, Any]]:
    world: int = request.param
    per_rank = CP_CHECKS[world].run(request)
    keys = per_rank[0].keys()
    return world, {k: _combine(k.split("/")[0], k.split("/")[1], [r[k] for r in per_rank]) for k in keys}


CASE_IDS = [f"{la}/{n}/{e}" for la in LAYOUTS for n in CASES for e in EXCHANGES] + [f"bsnd/{n}" for n in BSND_CASES]
BF16_IDS = [c for c in CASE_IDS if c.split("/")[0] in (*BF16_LAYOUTS, "bsnd")]
RING_IDS = [f"{la}/{n}/ring{r}" for la in LAYOUTS for n in CASES for r in LAYOUT_RINGS[la]]


def _key(case: str, dtype: str) -> str:
    layout, name, *exchange = case.split("/")
    return "/".join([layout, name, dtype, *exchange])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASE_IDS)
def test_fp32_matches_single_process(cp_run: tuple[int, dict[str, Any]], case: str) -> None:
    _world, results = cp_run
    layout, name = case.split("/")[:2]
    expected, actual = _flat(_reference(layout, name, torch.float32)), _flat(results[_key(case, "fp32")])
    assert expected.keys() == actual.keys()
    for key in expected:
        assert _rel_err(actual[key], expected[key]) <= 1e-5, key
    ref_loss = _reference(layout, name, torch.float32)["loss"]
    if ref_loss is not None:
        assert results[_key(case, "fp32")]["loss"] == pytest.approx(float(ref_loss), rel=1e-5)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", list(CASES))
def test_need_exchange_equals_allgather(cp_run: tuple[int, dict[str, Any]], name: str, layout: str) -> None:
    """fp32: the two strategies compute the same numbers up to summation order (<= 1e-6 relative)."""
    _world, results = cp_run
    allgather, need = _flat(results[f"{layout}/{name}/fp32/allgather"]), _flat(results[f"{layout}/{name}/fp32/need"])
    assert allgather.keys() == need.keys()
    for key in allgather:
        assert _rel_err(need[key], allgather[key]) <= 1e-6, key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", RING_IDS)
def test_ring_rounds_equal_one_round(cp_run: tuple[int, dict[str, Any]], case: str) -> None:
    """fp32: R rounds merged by LSE equal R = 1 (<= 1e-6 relative), forward and backward."""
    _world, results = cp_run
    layout, name, ring = case.split("/")
    one, rounds = _flat(results[f"{layout}/{name}/fp32/need"]), _flat(results[f"{layout}/{name}/fp32/{ring}"])
    assert one.keys() == rounds.keys()
    for key in one:
        assert torch.isfinite(rounds[key]).all(), key
        assert _rel_err(rounds[key], one[key]) <= 1e-6, key


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", BF16_IDS)
def test_bf16_error_within_twice_single_process(cp_run: tuple[int, dict[str, Any]], case: str) -> None:
    _world, results = cp_run
    layout, name = case.split("/")[:2]
    exact = _flat(_reference(layout, name, torch.float64))
    single = _flat(_reference(layout, name, torch.bfloat16))
    actual = _flat(results[_key(case, "bf16")])
    for key in exact:
        assert _rel_err(actual[key], exact[key]) <= 2 * _rel_err(single[key], exact[key]) + 2**-8, key


@pytest.mark.timeout(300)
def test_compressor_only_compressor_learns_like_cp1(cp_run: tuple[int, dict[str, Any]]) -> None:
    _world, results = cp_run
    expected = _reference("tnd", "compressor", torch.float32)["params"]
    for name in ("compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape", "compressor.norm_weight"):
        grad = results["tnd/compressor/fp32/need"]["params"][name]
        assert grad is not None and float(grad.abs().max()) > 1e-3, name
        assert _rel_err(grad, expected[name].double()) <= 1e-5, name


@pytest.mark.timeout(300)
def test_indexer_learns_only_from_its_loss(cp_run: tuple[int, dict[str, Any]]) -> None:
    _world, results = cp_run
    params = results["tnd/indexer/fp32/need"]["params"]
    indexer_grads = {k: v for k, v in params.items() if k.startswith("indexer.")}
    assert indexer_grads and all(v is not None and float(v.abs().max()) > 0 for v in indexer_grads.values())
