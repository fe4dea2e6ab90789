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

import inspect
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

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
    if csa:  # a random subset of each query's visible entries with its latest one (a threshold's edge), -1 padding anywhere
        noise = torch.rand(cmp_rows.shape, generator=gen).masked_fill(cmp_rows < 0, 2.0)
        noise.scatter_(1, (visible.visible_count - 1).clamp(min=0)[:, None], -1.0)
        picked = cmp_rows.gather(1, noise.argsort(dim=1))[:, :TOPK]
        drop = (torch.rand(picked.shape, generator=gen) < 0.2) & (torch.arange(TOPK) > 0)
        selected = cmp_rows = torch.where(drop, -1, picked)
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


# --------------------------------------------------------------------------- indexer KL


def _kl_inputs(seed: int = 3) -> tuple[Tensor, ...]:
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


def test_fused_indexer_kl_matches_reference() -> None:
    """fp32 weights and target (the op's schema) against fp64: ~1e-7 relative to the O(1) terms (observed <= 3e-8 absolute)."""
    inputs = _kl_inputs()
    stand_in = StandInCannOps()
    got = _kl_grads(_backend(stand_in).indexer_kl, inputs, 0.375)
    want = _kl_grads(indexer_kl_op, inputs, 0.375)
    assert stand_in.calls == ["sparse_lightning_indexer_kl_loss_grad_metadata", "sparse_lightning_indexer_kl_loss_grad"]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6)


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
