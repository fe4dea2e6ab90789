"""Hugging Face ``DeepseekV4Attention`` under CP equals the module run on each document alone.

Oracle: the ``transformers`` module itself (eager path, batch 1, positions from 0, an explicit
sliding-window causal mask), once per document; zero-length documents contribute nothing.
The CP side runs :func:`cpkv.integrations.transformers.deepseek_v4_attention_forward` on gloo
ranks, every layer type (sliding, CSA with its indexer, HCA), every layout (contiguous,
per-document zigzag, balanced) under both exchanges, at cp 1-4 (the 4-rank group shared with
other test modules, tests/shared_spawn.py, runs every case at every cp size on the groups of
ranks 0..cp-1: the ranks' imports of transformers dominate the cost). Compared: outputs and
input gradients in natural order, and every parameter gradient summed over ranks (what CP
gradient reduction does), all in float64 with a tiny random config.

Tolerances. HF computes its RMSNorms, RoPE, the gate softmax and the indexer scores in
float32 even in a float64 module; the adapter computes them in float64. Against HF with
those casts lifted to float64 (``lifted``) the error is summation order only: <= 1e-10
relative. Against HF as shipped: <= 1e-5 (float32 rounding of those intermediates, ~1e-7).

The batches hold zero-length documents, documents shorter than a block (ratio 4 and 16),
documents straddling several ranks, and CSA blocks whose previous block (read by the
overlapping compressor) lives on an earlier rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers>=5.23 (the transformers/test extra) is missing")

from cpkv.plan import plan_attention, seqlens_to_cu_seqlens  # noqa: E402
from tests.integrations import hf_oracle  # noqa: E402
from tests.shared_spawn import shared_spawn  # noqa: E402

HIDDEN, WINDOW = 64, 8
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
# 96 tokens (divisible by cp 1-4). At cp 4 (24 tokens a rank) the 52-token document (rows
# 5-56) spans ranks 0-2, its ratio-4 block at rows 21-24 straddles ranks 0 and 1, and the CSA
# entry of the block at rows 25-28 reads that block's first half on rank 0. Documents of 3, 2
# and 1 tokens are shorter than a block; the 14-token one holds no ratio-16 block.
LENGTHS = [5, 0, 52, 3, 2, 19, 0, 1, 14]
ZIGZAG_LENGTHS = [48, 0, 24, 24]  # multiples of 2*cp for cp 1-4
# Both exchanges on contiguous shards, the need exchange on the other layouts (the layout x
# exchange matrix itself is the CP suites' (tests/test_attention_cp.py); here: HF's layer).
RUNS = [("contiguous", "allgather"), ("contiguous", "need"), ("zigzag", "need"), ("balanced", "need")]
REL_LIFTED, REL_SHIPPED = 1e-10, 1e-5


def _config() -> Any:
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, sliding_window=WINDOW, layer_types=LAYERS, mlp_layer_types=["moe"] * 3,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=2, index_head_dim=16, index_topk=4, partial_rotary_factor=0.25,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=2,
    )
    config._attn_implementation = "eager"
    return config


def _layer(index: int, *, ties: bool = False) -> Any:
    """Layer ``index`` in float64 with every parameter random (HF leaves sinks and position biases empty)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    torch.manual_seed(100 + index)
    layer: Any = DeepseekV4Attention(_config(), index).double()
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name == "sinks" or name.endswith("position_bias"):
                param.normal_()
        if ties:  # every indexer score is 0: the top-k is decided by the tie order alone
            layer.compressor.indexer.q_b_proj.weight.zero_()
    return layer


def _inputs(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(num_tokens, HIDDEN, generator=gen, dtype=torch.float64), torch.randn(
        num_tokens, HIDDEN, generator=gen, dtype=torch.float64
    )


def _grads(layer: Any) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in layer.named_parameters()}


# --- the CP side, on every rank ------------------------------------------------------------


def _cp_case(
    rank: int, world: int, group: Any, index: int, layout: Any, exchange: Any, *, ties: bool, indexer_loss: bool
) -> dict[str, Any]:
    from cpkv.integrations.transformers import deepseek_v4_attention_forward, deepseek_v4_plan_options

    layer = _layer(index, ties=ties)
    lengths = ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS
    cu = seqlens_to_cu_seqlens(lengths)
    x, grad_out = _inputs(int(cu[-1]))
    plan = plan_attention(cu, world, rank, layout=layout, exchange=exchange, **deepseek_v4_plan_options(layer.config))
    x_local = plan.shard(x).clone().requires_grad_(True)
    out = deepseek_v4_attention_forward(layer, x_local, plan, group, backend="reference", indexer_loss=indexer_loss)
    out.backward(plan.shard(grad_out))  # type: ignore[no-untyped-call]
    return {"out": out.detach(), "grad_x": x_local.grad, "params": _grads(layer)}


def _cases() -> dict[str, tuple[int, str, str, bool, bool]]:
    cases = {f"{LAYERS[i]}/{layout}/{exchange}": (i, layout, exchange, False, False) for i in range(3) for layout, exchange in RUNS}
    cases["ties/contiguous/need"] = (1, "contiguous", "need", True, False)
    for layout, exchange in RUNS:
        cases[f"indexer_loss/{layout}/{exchange}"] = (1, layout, exchange, False, True)
    return cases


def _all_cp_sizes(rank: int, world: int) -> dict[int, dict[str, Any]]:
    """Every case at cp 1..world: the group of cp ``k`` is ranks ``0..k-1`` (the others wait)."""
    import torch.distributed as dist

    results = {}
    for cp_size in range(1, world + 1):
        group = dist.new_group(list(range(cp_size)))  # collective: every rank creates every group
        if rank < cp_size:
            results[cp_size] = {key: _cp_case(rank, cp_size, group, i, layout, exchange, ties=ties, indexer_loss=loss)
                                for key, (i, layout, exchange, ties, loss) in _cases().items()}
    return results


def _combine(layout: str, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    from cpkv.integrations.transformers import deepseek_v4_plan_options

    cu = seqlens_to_cu_seqlens(ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS)
    # The ranks' own plan options: the balanced layout's ranges depend on the model's cost.
    plan = plan_attention(cu, len(per_rank), 0, layout=layout, **deepseek_v4_plan_options(_config()))  # type: ignore[arg-type]

    def cat(name: str) -> torch.Tensor:
        return plan.unshard([r[name] for r in per_rank])

    params: dict[str, torch.Tensor | None] = {}
    for name in per_rank[0]["params"]:
        grads = [r["params"][name] for r in per_rank if r["params"][name] is not None]
        params[name] = torch.stack(grads).sum(0) if grads else None
    return {"out": cat("out"), "grad_x": cat("grad_x"), "params": params}


CP_CHECK = shared_spawn(_all_cp_sizes, 4, timeout=240.0)


@pytest.fixture(scope="module")
def cp_runs(request: pytest.FixtureRequest) -> dict[int, list[dict[str, Any]]]:
    """The shared 4-rank group runs every cp size (each spawned rank imports transformers: ~5 s of CPU)."""
    per_rank = CP_CHECK.run(request)
    return {cp_size: [r[cp_size] for r in per_rank[:cp_size]] for cp_size in range(1, 5)}


@pytest.fixture(params=[1, 2, 3, 4], ids=lambda w: f"cp{w}")
def cp_run(request: pytest.FixtureRequest, cp_runs: dict[int, list[dict[str, Any]]]) -> tuple[int, dict[str, Any]]:
    per_rank = cp_runs[request.param]
    return request.param, {key: _combine(key.split("/")[1], [r[key] for r in per_rank]) for key in per_rank[0]}


# --- the Hugging Face side, in the test process ------------------------------------------


def _hf_run(index: int, lengths: list[int], *, ties: bool = False, lifted: bool = True) -> dict[str, Any]:
    """HF's module on each document alone (batch 1, positions from 0, window mask, top-k ties to the earlier entry)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    layer = _layer(index, ties=ties)
    rotary = DeepseekV4RotaryEmbedding(layer.config)
    cu = seqlens_to_cu_seqlens(lengths).tolist()
    x, grad_out = _inputs(cu[-1])
    x = x.clone().requires_grad_(True)
    outs, total = [], x.new_zeros(())
    with hf_oracle.lifted() if lifted else contextlib.nullcontext(), hf_oracle.earlier_ties():
        for start, end in zip(cu[:-1], cu[1:]):
            if end == start:
                continue
            doc, positions = x[start:end][None], torch.arange(end - start)[None]
            embeddings = {kind: rotary(doc, positions, layer_type=kind) for kind in ("main", "compress")}
            tok = torch.arange(end - start)
            allowed = (tok[None, :] <= tok[:, None]) & (tok[None, :] > tok[:, None] - WINDOW)
            mask = torch.zeros(allowed.shape, dtype=x.dtype).masked_fill(~allowed, float("-inf"))[None, None]
            out = layer(doc, embeddings, positions, mask)[0][0]
            outs.append(out)
            total = total + (out * grad_out[start:end]).sum()
        total.backward()  # type: ignore[no-untyped-call]
    return {"out": torch.cat(outs).detach(), "grad_x": x.grad, "params": _grads(layer)}


@functools.cache
def _hf(index: int, layout: str, *, ties: bool = False, lifted: bool = True) -> dict[str, Any]:
    lengths = ZIGZAG_LENGTHS if layout == "zigzag" else LENGTHS
    result = _hf_run(index, lengths, ties=ties, lifted=lifted)
    keep = torch.tensor([n > 0 for n in lengths for _ in range(n)])  # zero-length documents hold no rows anyway
    assert int(keep.sum()) == result["out"].shape[0]
    return result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _errors(actual: dict[str, Any], expected: dict[str, Any]) -> dict[str, float]:
    """Max relative error per output, input gradient and parameter gradient (None must match None)."""
    errors = {"out": _rel(actual["out"], expected["out"]), "grad_x": _rel(actual["grad_x"], expected["grad_x"])}
    assert actual["params"].keys() == expected["params"].keys()
    for name, grad in expected["params"].items():
        mine = actual["params"][name]
        assert (mine is None) == (grad is None), f"{name}: gradient {'missing' if mine is None else 'unexpected'}"
        if grad is not None:
            errors[name] = _rel(mine, grad)
    return errors


CASE_IDS = [f"{LAYERS[i]}/{layout}/{exchange}" for i in range(3) for layout, exchange in RUNS]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASE_IDS)
def test_matches_hf_per_document(cp_run: tuple[int, dict[str, Any]], case: str) -> None:
    _world, results = cp_run
    name, layout, _exchange = case.split("/")
    index = LAYERS.index(name)
    lifted = _errors(results[case], _hf(index, layout))
    assert max(lifted.values()) <= REL_LIFTED, lifted
    shipped = _errors(results[case], _hf(index, layout, lifted=False))
    assert max(shipped.values()) <= REL_SHIPPED, shipped


def test_lifting_changes_hf() -> None:
    """The lifted reference really differs from HF as shipped (the casts are where we think)."""
    for index in range(3):
        assert _rel(_hf(index, "contiguous")["out"], _hf(index, "contiguous", lifted=False)["out"]) > 1e-12


def test_ties_go_to_the_earlier_entry(cp_run: tuple[int, dict[str, Any]]) -> None:
    """All indexer scores tie at 0: cpkv keeps the earliest visible entries (HF with a stable top-k)."""
    _world, results = cp_run
    errors = _errors(results["ties/contiguous/need"], _hf(1, "contiguous", ties=True))
    assert max(errors.values()) <= REL_LIFTED, errors


@pytest.mark.parametrize("run", [f"{layout}/{exchange}" for layout, exchange in RUNS])
def test_indexer_loss(cp_run: tuple[int, dict[str, Any]], run: str) -> None:
    """``indexer_loss=True``: same outputs, and the indexer's parameters get gradients (none by default, as in HF)."""
    _world, results = cp_run
    trained, plain = results[f"indexer_loss/{run}"], results[f"compressed_sparse_attention/{run}"]
    assert torch.equal(trained["out"], plain["out"])
    indexer = [n for n in trained["params"] if ".indexer." in n]
    assert indexer and all(plain["params"][n] is None for n in indexer)
    assert all(trained["params"][n] is not None and bool(trained["params"][n].abs().sum() > 0) for n in indexer)
    others = [n for n in trained["params"] if n not in indexer]
    assert all(_rel(trained["params"][n], plain["params"][n]) <= REL_LIFTED for n in others if plain["params"][n] is not None)
