"""Contract tests of NPUBackend against a stand-in ``torch_npu``.

This verifies cpkv's **marshalling against the documented semantics** of torch_npu's
ops (docs/semantics.md, "Fused ops: torch_npu", and the CANN op docs), **not the hardware**. The stand-in
(1) checks every call against the schemas (argument names, layouts, host lists of ints
without a leading 0, monotone, ending at the token count, the 2048x2048 causal mask
whenever ``sparse_mode`` is 2, 3 or 4, ``head_num``, an explicit scale, int32 ``[T, 1, K]``
indices valid-first and -1 padded, ``attention_mode=2``, ``return_softmax_lse=True``),
raising ``AssertionError`` on any violation, and (2) computes what the docs say each op
computes (bottom-right causal per segment pair, band mode for a window, rightDownCausal
over the selected rows / the indexer keys) with the reference ops. The whole V4 layer run
through NPUBackend must then equal the reference backend, forward and backward, in every
compress mode. Hardware limits the stand-in does not model: dtypes (the runs are fp64,
``check_dtypes=False``), head dims (the kernels take D=512/rope 64 or 128), tie order.
Mutations (a dropped mask, a leading 0, a kv buffer without the padding rows) must be caught.
``range_attention`` (ring rounds) is refused with ``NotImplementedError``; ``selected_probs``
is the reference op.

The fused path (``cann_ops_transformer``'s ``sparse_flash_mla`` and the indexer KL grad op,
through the stand-in of tests/backends/cann_standin.py) runs the compressed modes the same
way, at cp 1-2 in every layout and exchange and at cp 3-4 in every layout (cp 3 and 4
splitting the six layout/exchange pairs between them, for the suite's time budget); its
op-level checks and mutations are in tests/backends/test_npu_fused.py.
"""

from __future__ import annotations

import inspect
import math
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

import cpkv.backends.npu as npu_module
from cpkv.plan.cost import CostModel
from cpkv import plan_attention
from cpkv.backends import ReferenceBackend, reference
from cpkv.backends.base import AttentionBackend, KeyRanges
from cpkv.backends.npu import NPUBackend
from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.plan.prefix import compute_prefix_kv_cu_seqlens
from cpkv.plan.segments import SegmentPlan, plan_segments
from cpkv.plan.sharding import contiguous_shard_range, shard_contiguous
from cpkv.v4 import V4Attention, V4Config
from tests.backends.cann_standin import StandInCannOps
from tests.backends.former_kl import FormerKLBackend
from tests.shared_spawn import shared_spawn

UNSET: Any = object()
NO_LIMIT = 2147483647
LN2 = math.log(2.0)
# 144 tokens: zero-length documents, documents shorter than a block, documents straddling ranks.
LENGTHS = [5, 0, 37, 3, 2, 60, 21, 0, 1, 15]
CASES = {
    "window": V4Config(compress_ratio=0, window=16),
    "dense": V4Config(compress_ratio=0, window=None),
    "compressor": V4Config(compress_ratio=8),
    "indexer": V4Config(compress_ratio=4, topk=4),
}
EXCHANGES = ["allgather", "need"]  # the need-based exchange hands the kernels a kv buffer without unseen prefix rows
LAYOUTS = ["contiguous", "zigzag", "balanced"]
ZIGZAG_LENGTHS = [8, 0, 44, 4, 8, 60, 20]  # 144 tokens in multiples of 2*cp (cp 1, 2)
EXPECTED_OPS = {
    "window": {"npu_fusion_attention"},
    "dense": {"npu_fusion_attention"},
    "compressor": {"npu_sparse_flash_attention"},
    "indexer": {"npu_sparse_flash_attention", "npu_lightning_indexer"},
}


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"torch_npu contract violated: {message}")


def check_host_ends(name: str, ends: object, total: int) -> list[int]:
    """Host list of Python ints: cumulative ends without the leading 0."""
    require(isinstance(ends, list) and len(ends) >= 1, f"{name} must be a non-empty host list, got {type(ends).__name__}")
    assert isinstance(ends, list)
    require(all(type(e) is int for e in ends), f"{name} must hold Python ints, got {[type(e).__name__ for e in ends][:3]}")
    require(all(b >= a for a, b in zip(ends, ends[1:])), f"{name} must be non-decreasing, got {ends[:8]}")
    require(ends[-1] == total, f"{name}[-1] must equal the token count {total}, got {ends[-1]}")
    return ends


def check_device_ends(name: str, ends: object, total: int, device: torch.device) -> list[int]:
    """1-D int32 device tensor of cumulative ends without the leading 0."""
    require(isinstance(ends, Tensor) and ends.dtype == torch.int32 and ends.dim() == 1, f"{name} must be a 1-D int32 tensor")
    assert isinstance(ends, Tensor)
    require(ends.device == device, f"{name} must be on {device}, got {ends.device}")
    return check_host_ends(name, [int(e) for e in ends.tolist()], total)


def check_pairs(ends_q: list[int], ends_kv: list[int], need_kv_ge_q: bool) -> None:
    require(len(ends_q) == len(ends_kv), f"actual_seq lists differ in length: {len(ends_q)} vs {len(ends_kv)}")
    require((ends_q[0], ends_kv[0]) != (0, 0), "a leading 0 was sent (first segment pair is empty)")
    if need_kv_ge_q:
        lens = zip([0, *ends_q], ends_q, [0, *ends_kv], ends_kv)
        require(all(q1 - q0 <= k1 - k0 for q0, q1, k0, k1 in lens), "sparse_mode 3/4 needs Sq <= Skv in every batch")


def segment_rows(ends: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Per row: its batch index and its position in the batch."""
    cu = torch.tensor([0, *ends], device=device)
    batch = torch.repeat_interleave(torch.arange(len(ends), device=device), cu.diff())
    return batch, torch.arange(batch.numel(), device=device) - cu[batch]


def split_lse(lse: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """``softmax_max``, ``softmax_sum`` with ``max + log(sum) = lse`` and a sum that is not 1."""
    return (lse.detach().float() - LN2).reshape(shape), torch.full(shape, 2.0)


class StandInTorchNPU:
    """The three torch_npu ops cpkv calls: schema checks plus documented semantics (module doc)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def npu_fusion_attention(  # the torch_npu signature
        self, query: Tensor, key: Tensor, value: Tensor, head_num: int, input_layout: str = UNSET, pse: Any = None,
        padding_mask: Any = None, atten_mask: Tensor | None = None, scale: float = UNSET, keep_prob: float = 1.0,
        pre_tockens: int = NO_LIMIT, next_tockens: int = NO_LIMIT, inner_precise: int = 0, prefix: Any = None,
        actual_seq_qlen: list[int] | None = None, actual_seq_kvlen: list[int] | None = None, sparse_mode: int = 0,
        gen_mask_parallel: bool = True, sync: bool = False, softmax_layout: str = "", sink: Tensor | None = None,
    ) -> tuple[Any, ...]:
        self.calls.append("npu_fusion_attention")
        require(input_layout == "TND", f"input_layout must be 'TND', got {input_layout!r}")
        require(query.dim() == key.dim() == value.dim() == 3, "query/key/value must be TND (3-D)")
        require(type(head_num) is int and head_num == query.shape[1], f"head_num must be q's {query.shape[1]} heads, got {head_num}")
        require(head_num % key.shape[1] == 0 and value.shape[1] == key.shape[1], "kv heads must divide head_num")
        require(query.shape[2] == key.shape[2] == value.shape[2], "query, key and value must share the head dim")
        require(scale is not UNSET and isinstance(scale, float), "scale must be passed explicitly (the op's default is 1.0)")
        require((pse, padding_mask, prefix, keep_prob) == (None, None, None, 1.0), "no pse/padding_mask/prefix, keep_prob 1")
        ends_q = check_host_ends("actual_seq_qlen", actual_seq_qlen, query.shape[0])
        ends_kv = check_host_ends("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
        require(len(ends_q) <= 1024, f"actual_seq_qlen holds at most 1K entries, got {len(ends_q)}")
        require(sparse_mode in (3, 4), f"cpkv needs sparse_mode 3 (causal) or 4 (band), got {sparse_mode}")
        if sparse_mode in (2, 3, 4):
            expected = torch.ones(2048, 2048, dtype=torch.bool, device=query.device).triu(1)
            require(atten_mask is not None, "atten_mask=None with sparse_mode 2/3/4 silently computes full attention")
            assert atten_mask is not None
            require(atten_mask.dtype == torch.bool and tuple(atten_mask.shape) == (2048, 2048), "mask must be bool [2048, 2048]")
            require(atten_mask.device == query.device and bool((atten_mask == expected).all()), "mask must be triu(ones, 1)")
        check_pairs(ends_q, ends_kv, need_kv_ge_q=True)
        require(sparse_mode == 3 or (next_tockens == 0 and 0 <= pre_tockens < NO_LIMIT), "band: pre_tockens=W-1, next_tockens=0")
        require(softmax_layout == "TND", f"softmax_layout must be 'TND', got {softmax_layout!r}")
        require(sink is None or (sink.dtype == torch.float32 and tuple(sink.shape) == (head_num,)), "sink: fp32 [head_num]")
        window = None if sparse_mode == 3 else pre_tockens + 1
        cu_q, cu_kv = (torch.tensor([0, *e], device=query.device) for e in (ends_q, ends_kv))
        out, lse = reference.varlen_attention(query, key, value, cu_q, cu_kv, scale=scale, window=window, sinks=sink)
        shape = (query.shape[0], head_num, 8)
        softmax_max, softmax_sum = split_lse(lse.unsqueeze(-1).expand(shape), shape)
        return out, softmax_max, softmax_sum, torch.empty(0), 0, 0, 0

    def npu_sparse_flash_attention(
        self, query: Tensor, key: Tensor, value: Tensor, sparse_indices: Tensor, scale_value: float, *,
        block_table: Any = None, actual_seq_lengths_query: Tensor | None = None, actual_seq_lengths_kv: Tensor | None = None,
        query_rope: Tensor | None = None, key_rope: Tensor | None = None, sinks: Tensor | None = None,
        sparse_block_size: int = 1, layout_query: str = "BSND", layout_kv: str = "BSND", sparse_mode: int = 3,
        pre_tokens: int = 2**63 - 1, next_tokens: int = 2**63 - 1, attention_mode: int = 0, return_softmax_lse: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        self.calls.append("npu_sparse_flash_attention")
        require((layout_query, layout_kv) == ("TND", "TND"), f"layouts must be TND, got {layout_query!r}, {layout_kv!r}")
        require((sparse_block_size, sparse_mode, attention_mode) == (1, 3, 2), "sparse_block_size=1, sparse_mode=3, attention_mode=2")
        require(return_softmax_lse is True and block_table is None, "return_softmax_lse=True, no block_table")
        require(value is key, "attention_mode=2 (MLA-absorb): value must be key")
        require(query_rope is not None and key_rope is not None, "attention_mode=2 needs query_rope and key_rope")
        assert query_rope is not None and key_rope is not None
        num_q, heads, dim = query.shape
        require(key.dim() == 3 and key.shape[1] == 1 and key.shape[2] == dim, "key must be [T_kv, 1, d]")
        require(query_rope.shape[:2] == query.shape[:2] and key_rope.shape[:2] == key.shape[:2], "rope shapes")
        require(query_rope.shape[2] == key_rope.shape[2] >= 1, "query_rope and key_rope share the rope dim")
        require(isinstance(scale_value, float), "scale_value must be a float")
        require(sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 3, "sparse_indices must be int32 [T, 1, K]")
        require(sparse_indices.shape[:2] == (num_q, 1) and sparse_indices.shape[2] >= 1, "sparse_indices must be [T, 1, K]")
        invalid = sparse_indices[:, 0] < 0
        require(bool((invalid[:, :-1] <= invalid[:, 1:]).all()), "valid indices first, -1 padding last")
        require(bool((sparse_indices >= -1).all()), "indices must be >= -1")
        ends_q = check_device_ends("actual_seq_lengths_query", actual_seq_lengths_query, num_q, query.device)
        ends_kv = check_device_ends("actual_seq_lengths_kv", actual_seq_lengths_kv, key.shape[0], query.device)
        check_pairs(ends_q, ends_kv, need_kv_ge_q=False)
        require(sinks is None or (sinks.dtype == torch.float32 and tuple(sinks.shape) == (heads,)), "sinks: fp32 [N1]")
        batch, pos = segment_rows(ends_q, query.device)
        lens_q, lens_kv = (torch.tensor(e, device=query.device).diff(prepend=torch.zeros(1, dtype=torch.long)) for e in (ends_q, ends_kv))
        rel = sparse_indices[:, 0].long()
        require(bool((rel < lens_kv[batch, None]).all()), "indices must be relative to their batch's kv sequence")
        causal = rel <= (lens_kv - lens_q)[batch, None] + pos[:, None]  # rightDownCausal on the selected rows
        kv_start = torch.tensor([0, *ends_kv[:-1]], device=query.device)[batch, None]
        absolute = torch.where((rel >= 0) & causal, rel + kv_start, -1)
        out, lse = reference.sparse_attention(
            torch.cat([query, query_rope], -1), torch.cat([key, key_rope], -1)[:, 0], absolute,
            d_v=dim, scale=scale_value, sinks=sinks,
        )
        return (out, *split_lse(lse, (1, num_q, heads)))

    def npu_lightning_indexer(
        self, query: Tensor, key: Tensor, weights: Tensor, *, actual_seq_lengths_query: Tensor | None = None,
        actual_seq_lengths_key: Tensor | None = None, block_table: Any = None, layout_query: str = "BSND",
        layout_key: str = "BSND", sparse_count: int = 2048, sparse_mode: int = 3, pre_tokens: int = 2**63 - 1,
        next_tokens: int = 2**63 - 1, return_value: bool = False,
    ) -> tuple[Tensor, Tensor]:
        self.calls.append("npu_lightning_indexer")
        require((layout_query, layout_key, sparse_mode) == ("TND", "TND", 3), "layouts TND and sparse_mode=3")
        require(query.dim() == 3 and key.dim() == 3 and key.shape[1] == 1, "query [T1, N1, D], key [T2, 1, D]")
        require(key.shape[2] == query.shape[2] and key.dtype == query.dtype, "query and key share head dim and dtype")
        require(tuple(weights.shape) == tuple(query.shape[:2]), "weights must be [T1, N1]")
        require(weights.dtype in (torch.float32, query.dtype), "weights: fp32 or query's dtype")
        require(type(sparse_count) is int and sparse_count >= 1 and block_table is None, "sparse_count int >= 1")
        ends_q = check_device_ends("actual_seq_lengths_query", actual_seq_lengths_query, query.shape[0], query.device)
        ends_k = check_device_ends("actual_seq_lengths_key", actual_seq_lengths_key, key.shape[0], query.device)
        check_pairs(ends_q, ends_k, need_kv_ge_q=False)
        batch, pos = segment_rows(ends_q, query.device)
        lens_q, lens_k = (torch.tensor(e, device=query.device).diff(prepend=torch.zeros(1, dtype=torch.long)) for e in (ends_q, ends_k))
        start = torch.tensor([0, *ends_k[:-1]], device=query.device)[batch]
        count = ((lens_k - lens_q)[batch] + pos + 1).clamp(min=0).minimum(lens_k[batch])  # rightDownCausal
        top = reference.indexer_topk(query, key[:, 0], weights, start, count, topk=sparse_count)
        relative = torch.where(top.indices >= 0, top.indices - start[:, None], -1)
        return relative.to(torch.int32).unsqueeze(1), top.scores.to(query.dtype).unsqueeze(1)


# --------------------------------------------------------------------------- the whole layer


ZIGZAG_BY_WORLD = {1: ZIGZAG_LENGTHS, 2: ZIGZAG_LENGTHS, 3: [6, 0, 42, 6, 12, 54, 24], 4: [8, 0, 40, 8, 8, 56, 24]}
COMPRESSED = ["compressor", "indexer"]
EXPECTED_FUSED = {  # the fused path: one sparse_flash_mla per compressed layer (and its grad); the KL on its own op
    "compressor": {"sparse_flash_mla_metadata", "sparse_flash_mla", "sparse_flash_mla_grad_metadata", "sparse_flash_mla_grad"},
    "indexer": {"sparse_flash_mla_metadata", "sparse_flash_mla", "sparse_flash_mla_grad_metadata", "sparse_flash_mla_grad",
                "sparse_lightning_indexer_kl_loss_grad_metadata", "sparse_lightning_indexer_kl_loss_grad", "npu_lightning_indexer"},
}


def _backend_of(kind: str, stand_in: StandInTorchNPU, cann: StandInCannOps) -> AttentionBackend:
    if kind == "reference":
        return ReferenceBackend()
    if kind == "npu":  # the composed path
        return NPUBackend(torch_npu_module=stand_in, check_dtypes=False, fused=False)
    if kind == "former":  # the fused path with cpkv's KL call before issue 46 (one batch, mask_mode=0)
        return FormerKLBackend(stand_in, cann, check_dtypes=False, kernel_limits=False)
    return NPUBackend(torch_npu_module=stand_in, check_dtypes=False, kernel_limits=False, fused_ops_module=cann)


def _run_case(rank: int, world: int, name: str, kind: str, layout: str, exchange: str) -> dict[str, Any]:
    config = CASES[name]
    cu = seqlens_to_cu_seqlens(ZIGZAG_BY_WORLD[world] if layout == "zigzag" else LENGTHS)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(int(cu[-1]), config.hidden, generator=gen, dtype=torch.float64)
    grad_out = torch.randn(int(cu[-1]), config.hidden, generator=gen, dtype=torch.float64)
    layer = V4Attention(config, seed=7).double()
    ratios = [config.compress_ratio] if config.mode.compresses else []
    plan = plan_attention(cu, world, rank, layout=layout, cost_model=CostModel(), exchange=exchange, compress_ratios=ratios,  # type: ignore[arg-type]
                          windows=[config.window])
    stand_in, cann = StandInTorchNPU(), StandInCannOps()
    x_local = plan.shard(x).clone().requires_grad_(True)
    result = layer(x_local, plan, None, backend=_backend_of(kind, stand_in, cann), grad_scale=2.0)
    result.out.backward(plan.shard(grad_out))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    calls = set(stand_in.calls) | set(cann.calls)
    return {"out": result.out.detach(), "grad_x": x_local.grad, "grads": grads, "loss": result.indexer_loss, "calls": calls}


COMBOS = [(layout, exchange) for layout in LAYOUTS for exchange in EXCHANGES]
# cp 3 and 4 together cover every layout with both exchanges (each world half of them: the suite's time budget).
COMBOS_BY_WORLD = {1: COMBOS, 2: COMBOS, 3: COMBOS[0::2][:1] + COMBOS[1::2][1:2] + COMBOS[0::2][2:],
                   4: COMBOS[1::2][:1] + COMBOS[0::2][1:2] + COMBOS[1::2][2:]}


def _cases(world: int) -> list[tuple[str, str]]:
    """(mode, kind) pairs run at ``world``: every path at cp 1-2, the fused path (and its oracle) at cp 3-4; the
    former KL call (issue 46) with the indexer everywhere."""
    if world <= 2:
        return [(n, k) for n in CASES for k in ("reference", "npu")] + [(n, "fused") for n in COMPRESSED] + [("indexer", "former")]
    return [(n, k) for n in COMPRESSED for k in ("reference", "fused")] + [("indexer", "former")]


def _layer_worker(rank: int, world: int) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    return {(name, kind, layout, exchange): _run_case(rank, world, name, kind, layout, exchange)
            for name, kind in _cases(world) for layout, exchange in COMBOS_BY_WORLD[world]}


LAYER_CHECKS = {world: shared_spawn(_layer_worker, world, timeout=180.0) for world in (1, 2, 3, 4)}


@pytest.fixture(scope="module")
def layer_runs(request: pytest.FixtureRequest) -> dict[int, list[dict[tuple[str, str, str, str], dict[str, Any]]]]:
    """Every world's runs, from the shared group of that size (tests/shared_spawn.py)."""
    return {world: check.run(request) for world, check in LAYER_CHECKS.items()}


def assert_close(actual: Tensor | None, expected: Tensor | None, what: str, rtol: float = 1e-6, atol: float = 1e-9) -> None:
    assert actual is not None and expected is not None, what
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _assert_run(got: dict[str, Any], ref: dict[str, Any], what: str, rtol: float, atol: float) -> None:
    assert_close(got["out"], ref["out"], f"{what} out", rtol, atol)
    assert_close(got["grad_x"], ref["grad_x"], f"{what} grad x", rtol, atol)
    assert got["grads"].keys() == ref["grads"].keys()
    for param, grad in ref["grads"].items():
        assert_close(got["grads"][param], grad, f"{what} grad {param}", rtol, atol)
    if ref["loss"] is not None or got["loss"] is not None:
        assert_close(got["loss"], ref["loss"], f"{what} indexer loss", rtol, atol)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("exchange", EXCHANGES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("name", list(CASES))
def test_layer_through_npu_backend_equals_reference(layer_runs: Any, name: str, world: int, layout: str, exchange: str) -> None:
    """The composed path. fp64 both sides, but the kernels take fp32 sinks (schema), so sinks round to fp32 (~6e-8
    relative); everything else agrees to summation order (~1e-15). 1e-6 relative covers the
    former and is ~1e5 times below what a marshalling error produces."""
    for rank, per_rank in enumerate(layer_runs[world]):
        ref, npu = per_rank[(name, "reference", layout, exchange)], per_rank[(name, "npu", layout, exchange)]
        assert npu["calls"] == EXPECTED_OPS[name], f"{name} rank {rank}: kernels called {npu['calls']}"
        _assert_run(npu, ref, f"{name} rank {rank}", 1e-6, 1e-9)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "layout", "exchange"), [(w, *c) for w, combos in COMBOS_BY_WORLD.items() for c in combos])
@pytest.mark.parametrize("name", COMPRESSED)
def test_layer_through_fused_path_equals_reference(layer_runs: Any, name: str, world: int, layout: str, exchange: str) -> None:
    """The fused path (stand-in ``cann_ops_transformer``), forward and backward, indexer loss included.

    Besides the fp32 sinks, the fused ops return an fp32 LSE that their grad consumes and take
    fp32 indexer weights and KL target (schemas): ~1e-7 relative through the layer; 1e-5
    relative (1e-6 absolute: gradients reach ~10, observed <= 1.6e-7) is still ~1e4 below a marshalling error."""
    for rank, per_rank in enumerate(layer_runs[world]):
        ref, fused = per_rank[(name, "reference", layout, exchange)], per_rank[(name, "fused", layout, exchange)]
        assert fused["calls"] == EXPECTED_FUSED[name], f"{name} rank {rank}: kernels called {fused['calls']}"
        _assert_run(fused, ref, f"{name} fused cp {world} rank {rank}", 1e-5, 1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "layout", "exchange"), [(w, *c) for w, combos in COMBOS_BY_WORLD.items() for c in combos])
def test_former_kl_call_fails_the_fused_contract(layer_runs: Any, world: int, layout: str, exchange: str) -> None:
    """cpkv's KL call before issue 46 (one batch, ``mask_mode=0``) fails the fused path's check above on some rank:
    the strict stand-in computes it as the arch22 kernel does (stale columns for rows with fewer than K selections)."""
    failures = []
    for rank, per_rank in enumerate(layer_runs[world]):
        ref, former = per_rank[("indexer", "reference", layout, exchange)], per_rank[("indexer", "former", layout, exchange)]
        try:
            _assert_run(former, ref, f"indexer former cp {world} rank {rank}", 1e-5, 1e-6)
        except AssertionError as err:
            failures.append(str(err))
    assert failures, "the former KL call passed the fused contract"
    assert all("indexer" in f and ("grad indexer." in f or "indexer loss" in f) for f in failures), failures[0]


# --------------------------------------------------------------------------- op level and mutations


def _segments(lengths: list[int], world: int = 2, rank: int = 1, ratio: int = 4) -> SegmentPlan:
    """Rank ``rank`` of ``world`` (contiguous TND): queries with their causal kv prefixes."""
    cu = seqlens_to_cu_seqlens(lengths)
    prefix = compute_prefix_kv_cu_seqlens(cu, *contiguous_shard_range(int(cu[-1]), world, rank))
    return plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv, compress_ratios=[ratio])


def _plan(world: int = 2, rank: int = 1, ratio: int = 4) -> SegmentPlan:
    return _segments(LENGTHS, world, rank, ratio)


def _varlen_inputs(segments: SegmentPlan) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    t_q, t_kv = segments.num_queries, int(segments.cu_seqlens_kv[-1])
    q, k, v = (torch.randn(n, h, d, generator=gen, dtype=torch.float64) for n, h, d in ((t_q, 4, 16), (t_kv, 1, 16), (t_kv, 1, 12)))
    return q, k, v, torch.randn(4, generator=gen, dtype=torch.float64)


def _npu(stand_in: StandInTorchNPU | None = None) -> NPUBackend:
    return NPUBackend(torch_npu_module=stand_in or StandInTorchNPU(), check_dtypes=False, fused=False)


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_matches_reference(window: int | None) -> None:
    segments = _plan()
    q, k, v, sinks = _varlen_inputs(segments)
    got = _npu().varlen_attention(q, k, v, segments, scale=0.3, window=window, sinks=sinks)
    want = ReferenceBackend().varlen_attention(q, k, v, segments, scale=0.3, window=window, sinks=sinks)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse.float())


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_attends_every_kv_head_in_one_call(window: int | None) -> None:
    """GQA: npu_fusion_attention's N1 query heads over N2 kv heads (head_num = N1), one call per segment set."""
    segments = _plan()
    q, _, _, sinks = _varlen_inputs(segments)
    gen = torch.Generator().manual_seed(2)
    t_kv = int(segments.cu_seqlens_kv[-1])
    k, v = torch.randn(t_kv, 2, 16, generator=gen, dtype=torch.float64), torch.randn(t_kv, 2, 12, generator=gen, dtype=torch.float64)
    stand_in = StandInTorchNPU()
    got = _npu(stand_in).varlen_attention(q, k, v, segments, scale=0.3, window=window, sinks=sinks)
    want = ReferenceBackend().varlen_attention(q, k, v, segments, scale=0.3, window=window, sinks=sinks)
    assert stand_in.calls == ["npu_fusion_attention"]
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse.float())


def test_more_than_1k_segments_are_split() -> None:
    lengths = [1 + i % 3 for i in range(1500)]  # 1500 documents, 3000 tokens
    segments = _segments(lengths, 1, 0)
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(3000, 2, 8, generator=gen, dtype=torch.float64), torch.randn(3000, 1, 8, generator=gen, dtype=torch.float64)
    stand_in = StandInTorchNPU()
    got = _npu(stand_in).varlen_attention(q, k, k, segments, scale=0.5, window=None, sinks=None)
    assert stand_in.calls == ["npu_fusion_attention"] * 2
    want = ReferenceBackend().varlen_attention(q, k, k, segments, scale=0.5, window=None, sinks=None)
    torch.testing.assert_close(got.out, want.out)


def test_indexer_topk_matches_reference_exactly() -> None:
    for world, rank in ((1, 0), (2, 0), (2, 1), (3, 2)):
        segments = _plan(world, rank)
        visible = segments.visible_for(4)
        gen = torch.Generator().manual_seed(world + rank)
        q = torch.randn(segments.num_queries, 2, 8, generator=gen, dtype=torch.float64)
        k, w = torch.randn(visible.num_entries, 8, generator=gen, dtype=torch.float64), torch.randn(q.shape[:2], generator=gen, dtype=torch.float64)
        got = _npu().indexer_topk(q, k, w, segments, visible, topk=5)
        want = ReferenceBackend().indexer_topk(q, k, w, segments, visible, topk=5)
        assert torch.equal(got, want), f"cp {world} rank {rank}"


def _sparse_inputs(segments: SegmentPlan) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    visible = segments.visible_for(4)
    num_prefix = int(segments.cu_seqlens_kv[-1])
    indices = torch.cat([segments.window_indices(6), visible.visible_indices(offset=num_prefix)], dim=1)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(segments.num_queries, 4, 16, generator=gen, dtype=torch.float64)
    kv = torch.randn(num_prefix + visible.num_entries, 16, generator=gen, dtype=torch.float64)
    return q, kv, indices, torch.randn(4, generator=gen, dtype=torch.float64)


def test_sparse_attention_matches_reference() -> None:
    segments = _plan()
    q, kv, indices, sinks = _sparse_inputs(segments)
    got = _npu().sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=sinks)
    want = ReferenceBackend().sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=sinks)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got.lse, want.lse.float())


def test_selected_probs_from_the_kernel_lse_match_reference() -> None:
    """The KL target: head-summed probabilities from the sparse kernel's (detached) LSE equal the reference's."""
    segments = _plan()
    q, kv, indices, sinks = _sparse_inputs(segments)
    stand_in = StandInTorchNPU()
    backend, reference_backend = _npu(stand_in), ReferenceBackend()
    lse = backend.sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=sinks).lse
    assert not lse.requires_grad
    got = backend.selected_probs(q, kv, indices, lse, scale=0.25)
    want_lse = reference_backend.sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=sinks).lse
    want = reference_backend.selected_probs(q, kv, indices, want_lse, scale=0.25)
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-5, atol=1e-9)  # the kernel LSE is fp32
    assert stand_in.calls == ["npu_sparse_flash_attention"]  # selected_probs calls no kernel
    assert bool((got[indices < 0] == 0).all()) and float(got.sum(1).max()) <= q.shape[1] + 1e-6  # summed over heads


def test_range_attention_is_refused() -> None:
    """Ring rounds need a differentiable LSE: refused clearly, before any kernel call."""
    stand_in = StandInTorchNPU()
    q, k = torch.randn(6, 4, 16, dtype=torch.float64), torch.randn(5, 1, 16, dtype=torch.float64)
    ranges = KeyRanges(lo=torch.zeros(6, dtype=torch.int64), hi=torch.full((6,), 5), num_keys=5, num_rows=6, left=-1)
    with pytest.raises(NotImplementedError, match="ring_degree > 1"):
        _npu(stand_in).range_attention(q, k, k, ranges, scale=0.25)
    assert stand_in.calls == []


def test_implements_every_primitive_of_the_protocol() -> None:
    for name in ("varlen_attention", "range_attention", "sparse_attention", "selected_probs", "indexer_topk"):
        want = [(p.name, p.kind) for p in inspect.signature(getattr(AttentionBackend, name)).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(NPUBackend, name)).parameters.values()]
        assert got == want, name
    assert not hasattr(NPUBackend, "sparse_attention_with_indexer_loss")


def test_mutation_dropped_causal_mask_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NPUBackend, "_causal_mask", lambda self, device: None)
    segments = _plan()
    q, k, v, _ = _varlen_inputs(segments)
    with pytest.raises(AssertionError, match="atten_mask=None"):
        _npu().varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=None)


@pytest.mark.parametrize("both", [False, True])
def test_mutation_leading_zero_is_caught(monkeypatch: pytest.MonkeyPatch, both: bool) -> None:
    original = npu_module.fusion_attention_chunks

    def with_leading_zero(ends_q: Any, ends_kv: Any, *args: Any) -> list[npu_module.FusionChunk]:
        chunks = original(ends_q, ends_kv, *args)
        return [c._replace(actual_seq_qlen=[0, *c.actual_seq_qlen], actual_seq_kvlen=[0] * both + c.actual_seq_kvlen) for c in chunks]

    monkeypatch.setattr(npu_module, "fusion_attention_chunks", with_leading_zero)
    segments = _plan()
    q, k, v, _ = _varlen_inputs(segments)
    with pytest.raises(AssertionError, match="leading 0|differ in length"):
        _npu().varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=None)


def test_mutation_buffer_without_padding_rows_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Passing the pipeline's buffer without the T padding rows is schema-valid, but the kernel's causal bound then drops rows."""

    def unpadded(kv: Tensor, indices: Tensor) -> tuple[Tensor, Tensor]:
        order = (indices < 0).to(torch.int8).argsort(dim=1, stable=True)
        return kv, indices.gather(1, order).to(torch.int32).unsqueeze(1)

    monkeypatch.setattr(npu_module, "sparse_kernel_layout", unpadded)
    segments = _plan()
    q, kv, indices, sinks = _sparse_inputs(segments)
    got = _npu().sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=sinks)
    want = ReferenceBackend().sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=sinks)
    assert not torch.allclose(got.out, want.out)


def test_dtype_fallback_warns_once_and_calls_no_kernel() -> None:
    segments = _plan()
    q, kv, indices, sinks = _sparse_inputs(segments)
    stand_in = StandInTorchNPU()
    backend = NPUBackend(torch_npu_module=stand_in)  # check_dtypes=True: fp32 is not a sparse-kernel dtype
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = backend.sparse_attention(q.float(), kv.float(), indices, d_v=12, scale=0.25, sinks=sinks.float())
    assert [str(w.message).count("falling back") for w in caught] == [1]
    assert stand_in.calls == []
    want = ReferenceBackend().sparse_attention(q.float(), kv.float(), indices, d_v=12, scale=0.25, sinks=sinks.float())
    torch.testing.assert_close(got.out, want.out)


def test_missing_torch_npu_raises_clearly() -> None:
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is importable here")
    with pytest.raises(RuntimeError, match="torch_npu.*CANN"):
        NPUBackend()
    assert "torch_npu" not in sys.modules
