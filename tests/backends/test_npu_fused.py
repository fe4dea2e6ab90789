"""The NPU backend's fused path against a stand-in ``cann_ops_transformer.ops`` (tests/backends/cann_standin.py).

Op level: one compressed layer's ``compressed_attention`` (HCA and CSA, contiguous prefix
segments and need-exchange segments lacking document fronts) equals the reference
backend's ``sparse_attention`` on the same rows, forward and backward, in float64 through
the stand-in; the calls are exactly metadata + main op forward, grad metadata + grad op
backward. Mutations of the marshalling (swapped cu_seqlens, q-derived compressed
cu_seqlens, a window off by one, a missing or zero residual, metadata with the op's default
masks) are each caught by the schema or the oracle. The indexer KL through
``sparse_lightning_indexer_kl_loss_grad`` equals ``cpkv::indexer_kl`` (loss and gradients,
``grad_factor`` per call). Selection: fused when the ops import or are given, composed
otherwise, overridable, reported, and out-of-limit layers fall back with one warning. The
whole V4 layer at cp 1-4 runs in tests/backends/test_npu_contract.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import cpkv.backends.npu as npu_module
import cpkv.backends.npu_fused as fused_module
from cpkv.backends import ReferenceBackend
from cpkv.backends.base import AttentionResult, CompressedLayer, CompressedLayerBackend
from cpkv.backends.npu import NPUBackend
from cpkv.indexer_loss import indexer_kl_op
from cpkv.plan.conventions import compress_cu_seqlens, seqlens_to_cu_seqlens
from cpkv.plan.prefix import compute_prefix_kv_cu_seqlens
from cpkv.plan.segments import plan_segments
from cpkv.plan.sharding import contiguous_shard_range
from tests.backends.cann_standin import StandInCannOps
from tests.backends.former_kl import former_kl_plan
from tests.backends.test_npu_contract import StandInTorchNPU

LENGTHS = [5, 0, 37, 3, 2, 60, 21, 0, 1, 15]  # 144 tokens
WINDOW, RATIO, TOPK, D, D_V, HEADS = 7, 4, 5, 16, 12, 4  # window 7: the need buffer of the straddling document is 41 rows, its prefix 60 (residuals 1 vs 0)
SCALE = 0.25


def _backend(stand_in: StandInCannOps | None = None, **kw: Any) -> NPUBackend:
    return NPUBackend(StandInTorchNPU(), check_dtypes=False, kernel_limits=False,
                      fused_ops_module=stand_in or StandInCannOps(), **kw)


def _layer(csa: bool, need: bool, seed: int = 0) -> tuple[CompressedLayer, Tensor, Tensor, Tensor, Tensor]:
    """Rank 1 of 2 (contiguous): the layer's structure, q, kv buffer, the rows it lists and sinks (float64).

    ``need``: the window kv holds only each segment's last ``WINDOW - 1 + Lq`` rows (the need
    exchange's buffer), while the entries keep the full-prefix layout.
    """
    cu = seqlens_to_cu_seqlens(LENGTHS)
    prefix = compute_prefix_kv_cu_seqlens(cu, *contiguous_shard_range(int(cu[-1]), 2, 1))
    full = plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv, compress_ratios=[RATIO])
    visible = full.visible_for(RATIO)
    segments = full
    if need:
        lens_q, lens_kv = prefix.cu_seqlens_q.diff(), prefix.cu_seqlens_kv.diff()
        kept = torch.minimum(lens_kv, lens_q + WINDOW - 1)
        cu_kv = torch.cat([torch.zeros(1, dtype=torch.int64), kept.cumsum(0)])
        segments = plan_segments(prefix.cu_seqlens_q, cu_kv, kv_offset=lens_kv - kept)
    gen = torch.Generator().manual_seed(seed)
    num_kv = segments.num_kv
    selected = None
    cmp_rows = visible.visible_indices()
    if csa:  # min(K, visible) of each query's visible entries with its latest one (a threshold's edge), -1 padding anywhere
        noise = torch.rand(cmp_rows.shape, generator=gen).masked_fill(cmp_rows < 0, 2.0)
        noise.scatter_(1, (visible.visible_count - 1).clamp(min=0)[:, None], -1.0)
        picked = cmp_rows.gather(1, noise.argsort(dim=1))[:, :TOPK]
        shuffle = torch.rand(picked.shape, generator=gen).argsort(dim=1)
        selected = cmp_rows = picked.gather(1, shuffle)
    indices = torch.cat([segments.window_indices(WINDOW), torch.where(cmp_rows >= 0, cmp_rows + num_kv, -1)], dim=1)
    q = torch.randn(segments.num_queries, HEADS, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(num_kv + visible.num_entries, D, generator=gen, dtype=torch.float64)
    sinks = torch.randn(HEADS, generator=gen, dtype=torch.float64)
    return CompressedLayer(segments, full, visible, WINDOW, num_kv, selected), q, kv, indices, sinks


def _run(backend: Any, layer: CompressedLayer, q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor) -> dict[str, Tensor]:
    """Output, LSE and the gradients of q, kv and sinks under a fixed upstream gradient."""
    q, kv, sinks = (t.clone().requires_grad_(True) for t in (q, kv, sinks))
    if isinstance(backend, CompressedLayerBackend):
        result = backend.compressed_attention(q, kv, indices, layer, d_v=D_V, scale=SCALE, sinks=sinks, probs_from=None).result
    else:
        result = backend.sparse_attention(q, kv, indices, d_v=D_V, scale=SCALE, sinks=sinks)
    grad = torch.randn(result.out.shape, generator=torch.Generator().manual_seed(9), dtype=result.out.dtype)
    result.out.backward(grad)
    assert q.grad is not None and kv.grad is not None and sinks.grad is not None
    return {"out": result.out.detach(), "lse": result.lse.double(), "q": q.grad, "kv": kv.grad, "sinks": sinks.grad}


def assert_matches(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    """fp64 both sides, but the op takes fp32 sinks and returns an fp32 LSE that its grad consumes (schema):
    P = exp(S - lse) then carries ~|lse| * 6e-8 relative error (observed <= 1.5e-7 absolute on O(1) values);
    a marshalling error moves entries in or out of a softmax, an O(1) change."""
    for name, value in want.items():
        torch.testing.assert_close(got[name], value.to(got[name].dtype), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("need", [False, True])
@pytest.mark.parametrize("csa", [False, True])
def test_fused_layer_matches_reference(csa: bool, need: bool) -> None:
    layer, q, kv, indices, sinks = _layer(csa, need)
    stand_in = StandInCannOps()
    got = _run(_backend(stand_in), layer, q, kv, indices, sinks)
    assert stand_in.calls == ["sparse_flash_mla_metadata", "sparse_flash_mla", "sparse_flash_mla_grad_metadata", "sparse_flash_mla_grad"]
    assert_matches(got, _run(ReferenceBackend(), layer, q, kv, indices, sinks))


def test_fused_kl_target_comes_from_the_op_lse() -> None:
    """``probs_from``: the target is ``selected_probs`` under the fused call's LSE (no attention recomputed)."""
    layer, q, kv, indices, sinks = _layer(True, False)
    probs_from = indices.shape[1] - TOPK
    got = _backend().compressed_attention(q, kv, indices, layer, d_v=D_V, scale=SCALE, sinks=sinks, probs_from=probs_from)
    want = ReferenceBackend().sparse_attention_probs(q, kv, indices, d_v=D_V, scale=SCALE, sinks=sinks, probs_from=probs_from)
    assert got.probs is not None
    torch.testing.assert_close(got.probs, want[1].to(got.probs.dtype), rtol=1e-6, atol=1e-9)


def test_fused_without_sinks_passes_minus_inf() -> None:
    layer, q, kv, indices, _ = _layer(False, False)
    got = _backend().compressed_attention(q, kv, indices, layer, d_v=D_V, scale=SCALE, sinks=None, probs_from=None).result
    want = ReferenceBackend().sparse_attention(q, kv, indices, d_v=D_V, scale=SCALE, sinks=None)
    torch.testing.assert_close(got.out, want.out)


# --------------------------------------------------------------------------- mutations of the marshalling


def _mutated(monkeypatch: pytest.MonkeyPatch, change: Callable[[fused_module.FusedArgs], fused_module.FusedArgs]) -> None:
    original = fused_module.fused_arguments
    monkeypatch.setattr(fused_module, "fused_arguments", lambda layer: change(original(layer)))


def _forward(backend: Any, csa: bool, need: bool) -> Tensor:
    layer, q, kv, indices, sinks = _layer(csa, need)
    if isinstance(backend, CompressedLayerBackend):
        result = backend.compressed_attention(q, kv, indices, layer, d_v=D_V, scale=SCALE, sinks=sinks, probs_from=None).result
    else:
        result = backend.sparse_attention(q, kv, indices, d_v=D_V, scale=SCALE, sinks=sinks)
    return torch.cat([result.out.flatten(1), result.lse.double()], dim=1)


@pytest.fixture(scope="module")
def oracle() -> dict[tuple[bool, bool], Tensor]:
    """The reference forward (out and LSE side by side) of each layer kind."""
    return {(csa, need): _forward(ReferenceBackend(), csa, need) for csa in (False, True) for need in (False, True)}


def assert_caught(oracle: dict[tuple[bool, bool], Tensor], csa: bool, need: bool) -> None:
    """The stand-in rejects the call (schema), or the forward differs from the oracle (every mutation moves rows)."""
    try:
        got = _forward(_backend(), csa, need)
    except AssertionError as err:
        assert "contract violated" in str(err)
        return
    assert not torch.allclose(got, oracle[csa, need], rtol=1e-5, atol=1e-6), "mutation not caught"


def _q_derived(args: fused_module.FusedArgs) -> fused_module.FusedArgs:
    return args._replace(cu_seqlens_cmp_kv=compress_cu_seqlens(args.cu_seqlens_q, args.cmp_ratio).cu_seqlens.to(torch.int32))


MUTATIONS: dict[str, Callable[[fused_module.FusedArgs], fused_module.FusedArgs]] = {
    "swapped cu_seqlens": lambda a: a._replace(cu_seqlens_q=a.cu_seqlens_ori_kv, cu_seqlens_ori_kv=a.cu_seqlens_q),
    "q-derived compressed cu_seqlens": _q_derived,
    "window off by one (W)": lambda a: a._replace(ori_win_left=a.ori_win_left + 1),
    "window off by one (W - 2)": lambda a: a._replace(ori_win_left=a.ori_win_left - 1),
    "missing residual": lambda a: a._replace(cmp_residual_kv=None),  # type: ignore[arg-type]
    "zero residual": lambda a: a._replace(cmp_residual_kv=torch.zeros_like(a.cmp_residual_kv)),
    "kv lengths as residual": lambda a: a._replace(cmp_residual_kv=a.cu_seqlens_ori_kv.diff() % a.cmp_ratio),
}


@pytest.mark.parametrize("need", [False, True])
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(monkeypatch: pytest.MonkeyPatch, oracle: dict[tuple[bool, bool], Tensor], name: str, need: bool) -> None:
    if name == "kv lengths as residual" and not need:
        pytest.skip("with the full prefix as window kv, the kv lengths give the right residual")
    _mutated(monkeypatch, MUTATIONS[name])
    if name != "kv lengths as residual":  # here it raises the threshold: harmless to CSA (it lists only visible entries)
        assert_caught(oracle, csa=True, need=need)
    assert_caught(oracle, csa=False, need=need)


def test_mutation_metadata_with_default_masks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The metadata call's documented mask defaults (0, 0) differ from the main op's (4, 3): cpkv passes them explicitly."""
    original = fused_module.FusedArgs.metadata_kwargs

    def defaults(self: fused_module.FusedArgs) -> dict[str, Any]:
        return {k: v for k, v in original(self).items() if k not in ("ori_mask_mode", "cmp_mask_mode")}

    monkeypatch.setattr(fused_module.FusedArgs, "metadata_kwargs", defaults)
    with pytest.raises(AssertionError, match="metadata's ori_mask_mode"):
        _forward(_backend(), True, False)


def test_mutation_unsorted_indices_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Indices must be valid first: the op reads at most ``min(K, threshold)`` slots, up to the first -1."""
    original = fused_module.relative_indices

    def unsorted(selected: Tensor, first_entry: Tensor) -> Tensor:
        rows = selected.long()
        return torch.where(rows >= 0, rows - first_entry[:, None], -1).to(torch.int32).unsqueeze(1)

    monkeypatch.setattr(fused_module, "relative_indices", unsorted)
    with pytest.raises(AssertionError, match="valid first"):
        _forward(_backend(), True, False)


# --------------------------------------------------------------------------- the kernels' own limits (issue 46)


def _wide(topk: int, heads: int) -> tuple[CompressedLayer, Tensor, Tensor, Tensor, Tensor]:
    """Three queries at the end of an 8400-token document (2100 visible entries), each selecting ``topk`` of them."""
    full = plan_segments(torch.tensor([0, 3]), torch.tensor([0, 8400]), compress_ratios=[RATIO])
    visible = full.visible_for(RATIO)
    gen = torch.Generator().manual_seed(5)
    rows = visible.visible_indices()
    selected = rows.gather(1, torch.rand(rows.shape, generator=gen).masked_fill(rows < 0, 2.0).argsort(dim=1))[:, :topk]
    num_kv = full.num_kv
    indices = torch.cat([full.window_indices(WINDOW), selected + num_kv], dim=1)
    q = torch.randn(3, heads, D, generator=gen, dtype=torch.float64)
    kv = torch.randn(num_kv + visible.num_entries, D, generator=gen, dtype=torch.float64)
    sinks = torch.randn(heads, generator=gen, dtype=torch.float64)
    return CompressedLayer(full, full, visible, WINDOW, num_kv, selected), q, kv, indices, sinks


@pytest.mark.parametrize(("topk", "heads", "caught"), [(2048, 2, True), (2048, 1, False), (1024, 2, False)])
def test_mutation_topk_above_1024_with_heads_is_caught(topk: int, heads: int, caught: bool) -> None:
    """The strict stand-in re-reads the first 512 indices past 1024 when H > 1 (arch22 CSA kernel), as the kernel does:
    K = 2048 with 2 heads differs from the oracle; one head, or K = 1024, does not."""
    layer, q, kv, indices, sinks = _wide(topk, heads)
    got = _backend().compressed_attention(q, kv, indices, layer, d_v=D_V, scale=SCALE, sinks=sinks, probs_from=None).result
    want = ReferenceBackend().sparse_attention(q, kv, indices, d_v=D_V, scale=SCALE, sinks=sinks)
    assert torch.allclose(got.out, want.out, rtol=1e-5, atol=1e-6) != caught


def test_limits_refuse_topk_above_1024_with_heads_and_the_deterministic_grad() -> None:
    full = plan_segments(torch.tensor([0, 300]), torch.tensor([0, 300]), compress_ratios=[4, 128])
    q = torch.zeros(300, 16, 512, dtype=torch.bfloat16)
    for topk, heads, limited in ((2048, 16, True), (2048, 1, False), (1024, 16, False), (1024, 128, False)):
        layer = CompressedLayer(full, full, full.visible_for(4), 128, 300, torch.zeros(300, topk, dtype=torch.int64))
        reason = fused_module.fused_limit_reason(q[:, :heads], layer, True)
        assert (reason is not None and "re-reads the first 512" in reason) == limited, (topk, heads, reason)
    csa = CompressedLayer(full, full, full.visible_for(4), 128, 300, torch.zeros(300, 512, dtype=torch.int64))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in str(fused_module.fused_limit_reason(q, csa, True, needs_grad=True))
        assert fused_module.fused_limit_reason(q, csa, True, needs_grad=False) is None  # forward only: the forward is fine
    finally:
        torch.use_deterministic_algorithms(previous)
    assert fused_module.fused_limit_reason(q, csa, True, needs_grad=True) is None


def _a3_layer(topk: int = 512) -> tuple[CompressedLayer, Tensor, Tensor, Tensor]:
    """One 300-token document at the A2/A3 shapes (D=512, window 128, ratio 4), bf16."""
    full = plan_segments(torch.tensor([0, 300]), torch.tensor([0, 300]), compress_ratios=[4])
    visible = full.visible_for(4)
    rows = visible.visible_indices()
    selected = torch.cat([rows, rows.new_full((300, max(topk - rows.shape[1], 0)), -1)], dim=1)[:, :topk]
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(300, 16, 512, generator=gen).bfloat16().requires_grad_(True)
    kv = torch.randn(300 + visible.num_entries, 512, generator=gen).bfloat16()
    indices = torch.cat([full.window_indices(128), torch.where(selected >= 0, selected + 300, -1)], dim=1)
    return CompressedLayer(full, full, visible, 128, 300, selected), q, kv, indices


def test_fused_true_outside_the_limits_raises_and_none_falls_back() -> None:
    """fused=True: a clear ValueError at planning, before any kernel call; fused=None: the composed path, one warning."""
    layer, q, kv, indices = _a3_layer()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        cann = StandInCannOps()
        with pytest.raises(ValueError, match=r"fused=True.*deterministic"):
            NPUBackend(StandInTorchNPU(), fused_ops_module=cann, fused=True).compressed_attention(
                q, kv, indices, layer, d_v=448, scale=SCALE, sinks=None, probs_from=None)
        assert cann.calls == []
        torch_npu = StandInTorchNPU()
        with pytest.warns(UserWarning, match="composed path.*deterministic"):
            NPUBackend(torch_npu, fused_ops_module=cann).compressed_attention(
                q, kv, indices, layer, d_v=448, scale=SCALE, sinks=None, probs_from=None)
        assert cann.calls == [] and torch_npu.calls == ["npu_sparse_flash_attention"]
    finally:
        torch.use_deterministic_algorithms(previous)
    wide, q_w, kv_w, idx_w = _a3_layer(2048)
    with pytest.raises(ValueError, match=r"fused=True.*topk 2048 > 1024 and 16 heads"):
        NPUBackend(StandInTorchNPU(), fused_ops_module=StandInCannOps(), fused=True).compressed_attention(
            q_w, kv_w, idx_w, wide, d_v=448, scale=SCALE, sinks=None, probs_from=None)


def test_mutation_deterministic_mode_is_caught() -> None:
    """The strict stand-in's grad fails under deterministic algorithms, as the A2/A3 tiling does (kernel_limits=False)."""
    layer, q, kv, indices, sinks = _layer(True, False)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic"):
            _run(_backend(), layer, q, kv, indices, sinks)
    finally:
        torch.use_deterministic_algorithms(previous)


def _drop_one(selected: Tensor) -> Tensor:
    """A -1 in place of the second valid entry of every row listing at least three."""
    order = (selected < 0).to(torch.int8).argsort(dim=1, stable=True)
    second = order[:, 1]
    many = (selected >= 0).sum(1) >= 3
    return selected.scatter(1, second[:, None], torch.where(many, -1, selected.gather(1, second[:, None]).squeeze(1))[:, None])


def test_index_count_invariant_is_checked_where_indices_are_built() -> None:
    """A row listing fewer than min(K, visible) entries: a RuntimeError on CPU (torch._assert_async)."""
    layer, q, kv, indices, sinks = _layer(True, False)
    assert layer.selected is not None
    assert bool(fused_module.index_count_ok(fused_module.relative_indices(layer.selected, layer.visible.visible_start)[:, 0],
                                            layer.visible.visible_count))
    broken = dataclasses.replace(layer, selected=_drop_one(layer.selected))
    with pytest.raises(RuntimeError, match="index-count invariant"):
        _backend().compressed_attention(q, kv, indices, broken, d_v=D_V, scale=SCALE, sinks=sinks, probs_from=None)


def test_mutation_minus_one_inside_a_valid_range_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Indices handed to the kernel with a -1 between valid entries (the kernel would stop gathering there)."""
    original = fused_module.relative_indices
    monkeypatch.setattr(fused_module, "relative_indices", lambda sel, first: original(_drop_one(sel), first))
    with pytest.raises(RuntimeError, match="index-count invariant"):
        _forward(_backend(), True, False)
    # without the check, the strict stand-in still catches it: the kernel softmaxes over min(K, visible) columns,
    # those past the first -1 holding stale rows
    monkeypatch.setattr(fused_module, "check_index_count", lambda indices, count, out: out)
    layer, q, kv, indices, sinks = _layer(True, False)
    assert layer.selected is not None
    got = _forward(_backend(), True, False)
    listed = torch.cat([indices[:, : indices.shape[1] - TOPK], torch.where(_drop_one(layer.selected) >= 0,
                                                                           _drop_one(layer.selected) + layer.num_kv, -1)], 1)
    dropped = ReferenceBackend().sparse_attention(q, kv, listed, d_v=D_V, scale=SCALE, sinks=sinks)
    assert not torch.allclose(got, torch.cat([dropped.out.flatten(1), dropped.lse.double()], dim=1), rtol=1e-5, atol=1e-6)


def test_index_count_check_poisons_without_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no device assert runs (NPU), the check is tensor-valued: a NaN output, no host read."""
    monkeypatch.setattr(torch, "_assert_async", lambda *args: None)
    out = torch.ones(4, 2, 3, dtype=torch.float64)
    good = torch.tensor([[0, 1, -1], [2, 0, 1], [-1, -1, -1], [0, -1, -1]])
    counts = torch.tensor([2, 5, 0, 1])
    assert torch.equal(fused_module.check_index_count(good, counts, out), out)
    bad = good.clone()
    bad[1, 1] = -1  # a -1 before a valid entry, and one entry short
    assert bool(fused_module.check_index_count(bad, counts, out).isnan().all())
    assert not bool(fused_module.index_count_ok(good, counts + 1))


# --------------------------------------------------------------------------- indexer KL


def _kl_inputs(seed: int = 3, lengths: list[int] | None = None, topk: int = TOPK) -> tuple[Tensor, ...]:
    """The KL's inputs on a real plan (rank 1 of 2): each query selects ``min(topk, visible)`` of its visible
    entries (the indexer's top-k: all of them when fewer than ``topk``), -1 padding anywhere; a random target."""
    cu = seqlens_to_cu_seqlens(lengths or LENGTHS)
    prefix = compute_prefix_kv_cu_seqlens(cu, *contiguous_shard_range(int(cu[-1]), 2, 1))
    visible = plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv, compress_ratios=[RATIO]).visible_for(RATIO)
    gen = torch.Generator().manual_seed(seed)
    rows = visible.visible_indices()
    noise = torch.rand(rows.shape, generator=gen).masked_fill(rows < 0, 2.0)
    picked = rows.gather(1, noise.argsort(dim=1))[:, :topk]
    if picked.shape[1] < topk:
        picked = torch.cat([picked, picked.new_full((picked.shape[0], topk - picked.shape[1]), -1)], dim=1)
    sel = picked.gather(1, torch.rand(picked.shape, generator=gen).argsort(dim=1))
    t, n_c = sel.shape[0], visible.num_entries
    q_i, k_i = torch.randn(t, 2, 8, generator=gen, dtype=torch.float64), torch.randn(n_c, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(t, 2, generator=gen, dtype=torch.float64)
    p = torch.rand(sel.shape, generator=gen, dtype=torch.float64).masked_fill(sel < 0, 0.0)
    return q_i, k_i, w, sel, p / p.sum(-1, keepdim=True).clamp_min(1e-30)


def _broken_inputs(seed: int = 3) -> tuple[Tensor, ...]:
    """Selections breaking the index-count invariant: random rows, -1 anywhere, and a row selecting nothing."""
    gen = torch.Generator().manual_seed(seed)
    q_i, k_i = torch.randn(70, 2, 8, generator=gen, dtype=torch.float64), torch.randn(30, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(70, 2, generator=gen, dtype=torch.float64)
    sel = torch.stack([torch.randperm(30, generator=gen)[:6] for _ in range(70)])
    sel = torch.where(torch.rand(sel.shape, generator=gen) < 0.3, -1, sel)
    sel[5] = -1  # a query selecting nothing (a padding row)
    p = torch.rand(sel.shape, generator=gen, dtype=torch.float64).masked_fill(sel < 0, 0.0)
    return q_i, k_i, w, sel, p / p.sum(-1, keepdim=True).clamp_min(1e-30)


def _kl_grads(kl: Any, inputs: tuple[Tensor, ...], factor: float) -> tuple[Tensor, ...]:
    q_i, k_i, w = (t.clone().requires_grad_(True) for t in inputs[:3])
    loss, anchor = kl(q_i, k_i, w, inputs[3], inputs[4], factor)
    (loss * 0 + anchor * 5).backward()  # the upstream gradients are ignored
    assert q_i.grad is not None and k_i.grad is not None and w.grad is not None
    return loss.detach(), q_i.grad, k_i.grad, w.grad


def assert_kl_matches(got: tuple[Tensor, ...], want: tuple[Tensor, ...]) -> None:
    """fp32 weights and target (the op's schema) against fp64: ~1e-7 relative to the O(1) terms (observed <= 3e-8 absolute)."""
    for name, a, b in zip(("loss", "dq", "dk", "dw"), got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def kl_differs(got: tuple[Tensor, ...], want: tuple[Tensor, ...]) -> bool:
    return any(not torch.allclose(a, b.to(a.dtype), rtol=1e-5, atol=1e-6) for a, b in zip(got, want))


def test_fused_indexer_kl_matches_reference() -> None:
    """Rows with fewer than K selections (short documents, document fronts) and full rows, one call, no fallback."""
    inputs = _kl_inputs()
    count = (inputs[3] >= 0).sum(1)
    assert bool(((count > 0) & (count < TOPK)).any()) and bool((count == TOPK).any()) and bool((count == 0).any())
    stand_in = StandInCannOps()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _kl_grads(_backend(stand_in).indexer_kl, inputs, 0.375)
    assert stand_in.calls == ["sparse_lightning_indexer_kl_loss_grad_metadata", "sparse_lightning_indexer_kl_loss_grad"]
    assert_kl_matches(got, _kl_grads(indexer_kl_op, inputs, 0.375))


@pytest.mark.parametrize(("lengths", "topk"), [([1] * 20, 3), ([200, 8], 40), ([200, 8], 1), (LENGTHS, 2)])
def test_fused_indexer_kl_matches_reference_across_shapes(lengths: list[int], topk: int) -> None:
    """One-token documents, long fronts with K above every count, K = 1 (every row full or empty), K = 2."""
    inputs = _kl_inputs(lengths=lengths, topk=topk)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no row falls back
        got = _kl_grads(_backend().indexer_kl, inputs, 1.5)
    assert_kl_matches(got, _kl_grads(indexer_kl_op, inputs, 1.5))


def test_kl_plan_edges_and_errors() -> None:
    empty = fused_module.indexer_kl_plan(torch.full((5, 4), -1), 30)
    assert empty.calls == [] and empty.fallback_rows.numel() == 0  # nothing selected: no call, no term
    mixed = fused_module.indexer_kl_plan(torch.tensor([[0, -1], [1, 2], [-1, -1], [-1, 4]]), 30)
    assert [c.cu_seqlens_q.tolist() for c in mixed.calls] == [[0, 1, 2, 3]]  # one full batch, two one-row chains
    assert [c.cu_seqlens_k.tolist() for c in mixed.calls] == [[0, 30, 31, 32]]  # all keys (no padding for one row)
    assert mixed.calls[0].key_rows.tolist() == [*range(30), 0, 4]  # the chains' keys: [0, 1) and [4, 5)
    assert mixed.calls[0].indices[:, 0].tolist() == [[1, 2], [0, -1], [0, -1]]  # relative to each batch
    with pytest.raises(ValueError, match=r"selected must be \[T, K\]"):
        fused_module.indexer_kl_plan(torch.zeros(3, dtype=torch.int64), 30)
    with pytest.raises(ValueError, match="max_batches must be >= 1"):
        fused_module.indexer_kl_plan(torch.zeros(3, 2, dtype=torch.int64), 30, max_batches=0)


def test_fused_indexer_kl_calls_have_at_most_256_batches() -> None:
    """150 short documents: ~4 chains each, more than 256 batches: several calls (the stand-in refuses more)."""
    inputs = _kl_inputs(lengths=[9, 13] * 75)
    plan = fused_module.indexer_kl_plan(inputs[3], inputs[1].shape[0])
    assert len(plan.calls) >= 2 and all(int(c.cu_seqlens_q.numel()) - 1 <= 256 for c in plan.calls)
    stand_in = StandInCannOps()
    got = _kl_grads(_backend(stand_in).indexer_kl, inputs, 1.0)
    assert stand_in.calls.count("sparse_lightning_indexer_kl_loss_grad") == len(plan.calls)
    assert_kl_matches(got, _kl_grads(indexer_kl_op, inputs, 1.0))


def test_fused_indexer_kl_chunks_queries_and_batches() -> None:
    inputs = _kl_inputs()
    small = fused_module.indexer_kl_plan(inputs[3], inputs[1].shape[0], max_queries=16, max_batches=3)
    assert len(small.calls) > 3
    assert all(c.rows.numel() <= 16 or int(c.cu_seqlens_q.numel()) == 2 for c in small.calls)
    assert all(int(c.cu_seqlens_q.numel()) - 1 <= 3 for c in small.calls)

    def chunked(q_i: Tensor, k_i: Tensor, w: Tensor, sel: Tensor, p: Tensor, factor: float) -> tuple[Tensor, Tensor]:
        return fused_module.fused_indexer_kl(StandInCannOps(), q_i, k_i, w, p, small, factor)

    assert_kl_matches(_kl_grads(chunked, inputs, 2.0), _kl_grads(indexer_kl_op, inputs, 2.0))


def test_fused_indexer_kl_keeps_grad_factor_per_call() -> None:
    """Two calls with different factors in one backward: each keeps its own (autograd ctx, no class state)."""
    inputs = _kl_inputs()
    backend = _backend()
    q_i = inputs[0].clone().requires_grad_(True)
    _, a1 = backend.indexer_kl(q_i, inputs[1], inputs[2], inputs[3], inputs[4], 1.0)
    _, a2 = backend.indexer_kl(q_i, inputs[1], inputs[2], inputs[3], inputs[4], 3.0)
    (a1 + a2).backward()
    assert q_i.grad is not None
    want = _kl_grads(indexer_kl_op, inputs, 4.0)[1]
    torch.testing.assert_close(q_i.grad, want, rtol=1e-5, atol=1e-6)


def test_rows_breaking_the_invariant_take_the_composed_kl_with_one_warning() -> None:
    inputs = _broken_inputs()
    plan = fused_module.indexer_kl_plan(inputs[3], inputs[1].shape[0])
    assert plan.fallback_rows.numel() > 0 and 5 not in plan.fallback_rows.tolist()  # the empty row: no term at all
    backend = _backend()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _kl_grads(backend.indexer_kl, inputs, 0.5)
        _kl_grads(backend.indexer_kl, inputs, 0.5)
    assert [str(w.message) for w in caught if "composed KL" in str(w.message)] != [] and len(caught) == 1
    assert_kl_matches(got, _kl_grads(indexer_kl_op, inputs, 0.5))


PLAN = fused_module.indexer_kl_plan


def _mid_range_minus_one(selected: Tensor, num_keys: int, **kw: Any) -> fused_module.KLPlan:
    plan = PLAN(selected, num_keys, **kw)
    calls = []
    for call in plan.calls:
        indices = call.indices.clone()
        long_rows = (indices[:, 0] >= 0).sum(1) >= 3
        indices[long_rows, 0, 1] = -1  # a -1 between valid entries
        calls.append(call._replace(indices=indices))
    return plan._replace(calls=calls)


KL_MUTATIONS: dict[str, tuple[Callable[..., fused_module.KLPlan], int]] = {  # (the plan, the mode it uses)
    "main's call (one batch, mode 0)": (former_kl_plan, 0),
    "mode 0 instead of 3": (lambda s, n, **kw: PLAN(s, n)._replace(mask_mode=0), 0),
    "-1 inside a valid range": (_mid_range_minus_one, 3),
    "more than 256 batches a call": (lambda s, n, **kw: PLAN(s, n, max_batches=300), 3),
}


@pytest.mark.parametrize("name", list(KL_MUTATIONS))
def test_kl_mutation_is_caught(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Each is caught by the strict stand-in: the schema, or values differing from the fp64 composed KL."""
    inputs = _kl_inputs(lengths=[9, 13] * 75 if "256" in name else None)
    want = _kl_grads(indexer_kl_op, inputs, 1.0)
    plan, mode = KL_MUTATIONS[name]
    assert plan(inputs[3], inputs[1].shape[0]).mask_mode == mode
    monkeypatch.setattr(npu_module, "indexer_kl_plan", plan)
    try:
        got = _kl_grads(_backend().indexer_kl, inputs, 1.0)
    except AssertionError as err:
        assert "contract violated" in str(err)
        return
    assert kl_differs(got, want), "mutation not caught"


# --------------------------------------------------------------------------- selection


def test_path_selection_and_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fused iff the custom ops are given or import; overridable both ways; reported by ``attention_path``."""
    monkeypatch.setitem(sys.modules, "cann_ops_transformer", None)  # import fails here whatever is installed
    monkeypatch.setitem(sys.modules, "cann_ops_transformer.ops", None)
    assert NPUBackend(StandInTorchNPU()).attention_path == "composed"
    with pytest.raises(RuntimeError, match="fused=True.*custom ops"):
        NPUBackend(StandInTorchNPU(), fused=True)
    assert NPUBackend(StandInTorchNPU(), fused_ops_module=StandInCannOps()).attention_path == "fused"
    assert NPUBackend(StandInTorchNPU(), fused_ops_module=StandInCannOps(), fused=False).attention_path == "composed"
    with pytest.raises(TypeError, match="fused must be"):
        NPUBackend(StandInTorchNPU(), fused="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["composed", "fused"])
def test_selected_path_makes_its_calls(path: str) -> None:
    layer, q, kv, indices, sinks = _layer(True, False)
    torch_npu, cann = StandInTorchNPU(), StandInCannOps()
    backend = NPUBackend(torch_npu, check_dtypes=False, kernel_limits=False, fused_ops_module=cann, fused=path == "fused")
    got = _run(backend, layer, q, kv, indices, sinks)
    assert (torch_npu.calls, bool(cann.calls)) == (([], True) if path == "fused" else (["npu_sparse_flash_attention"], False))
    assert_matches(got, _run(ReferenceBackend(), layer, q, kv, indices, sinks))


def test_out_of_limit_layer_takes_the_composed_path_with_one_warning() -> None:
    """D=16, window 6 are outside the A2/A3 limits: composed path, one warning per reason, no fused call."""
    layer, q, kv, indices, sinks = _layer(True, False)
    cann = StandInCannOps()
    backend = NPUBackend(StandInTorchNPU(), check_dtypes=False, fused_ops_module=cann)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            result = backend.compressed_attention(q, kv, indices, layer, d_v=D_V, scale=SCALE, sinks=sinks, probs_from=None)
    assert [str(w.message) for w in caught if "composed path" in str(w.message)] != [] and len(caught) == 1
    assert cann.calls == []
    want = ReferenceBackend().sparse_attention(q, kv, indices, d_v=D_V, scale=SCALE, sinks=sinks)
    assert isinstance(result.result, AttentionResult)
    torch.testing.assert_close(result.result.out, want.out)


def test_limits_follow_the_documented_a3_shapes() -> None:
    """D=512, H in powers of two up to 128, window 128, ratio 4 (CSA) / 128 (HCA), bf16: in limits."""
    full = plan_segments(torch.tensor([0, 300]), torch.tensor([0, 300]), compress_ratios=[4, 128])
    q = torch.zeros(300, 16, 512, dtype=torch.bfloat16)
    csa = CompressedLayer(full, full, full.visible_for(4), 128, 300, torch.zeros(300, 512, dtype=torch.int64))
    hca = CompressedLayer(full, full, full.visible_for(128), 128, 300, None)
    assert fused_module.fused_limit_reason(q, csa, True) is None and fused_module.fused_limit_reason(q, hca, True) is None
    assert "window 64" in str(fused_module.fused_limit_reason(q, CompressedLayer(full, full, full.visible_for(4), 64, 300, None), True))
    assert "dtype" in str(fused_module.fused_limit_reason(q.float(), csa, True))


def test_capability_signature_matches_the_protocol() -> None:
    want = [(p.name, p.kind) for p in inspect.signature(CompressedLayerBackend.compressed_attention).parameters.values()]
    got = [(p.name, p.kind) for p in inspect.signature(NPUBackend.compressed_attention).parameters.values()]
    assert got == want
    assert isinstance(_backend(), CompressedLayerBackend) and not isinstance(ReferenceBackend(), CompressedLayerBackend)
