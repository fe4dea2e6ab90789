"""The Triton lightning-indexer top-k (``cpkv_triton::indexer_topk``) on CPU under Triton's interpreter.

The oracle is the reference op (:func:`cpkv.backends.reference.indexer.indexer_topk_op`: dense
scores per block, a stable descending sort). Everything runs in fp32. With small-integer
inputs every score is an exact small integer whatever the summation order, so indices and
scores must be **bitwise** equal, ties (relu zeros, repeated key rows, all-equal scores)
included. With random normal inputs the nonzero scores differ from the reference's only by
summation-order rounding (a few fp32 ulps); two distinct continuous scores land within a few
ulps of each other with probability ~1e-6 per pair, and the seeds are fixed, so the indices
are compared bitwise too; exact ties there are the relu zeros (a score of exactly 0 on both
sides). Scores of random inputs: ``1e-5`` relative to the largest (a few ulps over <= 64 terms).

Small tiles (``block_t = block_n = 16``) with up to a few hundred visible entries make the
kernel merge its candidate buffer many times mid-stream, which is the path a long context takes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from tests.backends.op_names import OpNames
from tests.backends.triton_interpreter import interpreted_kernels

from cpkv.backends.reference.indexer import indexer_topk_op as ref_topk  # noqa: E402
from cpkv.backends.triton.indexer_ops import (  # noqa: E402
    aot_launches,
    indexer_tiles,
    indexer_topk_launches,
    indexer_topk_op,
)
from cpkv.backends.triton.launches import AOTCase  # noqa: E402

CANARY_ROWS = 4


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    interpreted_kernels()


def _run(q: Tensor, k: Tensor, w: Tensor, start: Tensor, count: Tensor, topk: int, **tiles: int) -> tuple[Tensor, Tensor]:
    launches, indices, scores = indexer_topk_launches(q, k, w, None, start, count, topk, **tiles)
    for launch in launches:
        launch()
    return indices, scores


def _integer_inputs(gen: torch.Generator, num_q: int, heads: int, dim: int, num_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Small integers: exact scores, many exact ties (relu zeros, repeated rows)."""
    q = torch.randint(-2, 3, (num_q, heads, dim), generator=gen).float()
    k = torch.randint(-1, 2, (num_k, dim), generator=gen).float()
    k[5:9] = k[4]
    w = torch.randint(0, 3, (num_q, heads), generator=gen).float()
    return q, k, w


def _close(got: Tensor, want: Tensor, rel: float) -> None:
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), "same -inf pattern"
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= rel * max(scale, 1.0), f"max error {err:.3g} > {rel:.0e} * {scale:.3g}"


@pytest.mark.parametrize("integer", [True, False], ids=["exact-ties", "random"])
def test_indexer_topk_matches_reference(integer: bool) -> None:
    gen = torch.Generator().manual_seed(11)
    num_q, heads, dim, num_k, topk = 20, 3, 16, 37, 6
    if integer:
        q, k, w = _integer_inputs(gen, num_q, heads, dim, num_k)
    else:
        q, k, w = torch.randn(num_q, heads, dim, generator=gen), torch.randn(num_k, dim, generator=gen), torch.rand(num_q, heads, generator=gen)
    start = torch.randint(0, 10, (num_q,), generator=gen)
    count = torch.randint(0, 28, (num_q,), generator=gen)
    count[0], count[1] = 0, 3  # nothing visible; fewer than topk visible
    got = indexer_topk_op(q, k, w, None, start, count, topk)  # the op's own (CPU) tiles
    want = ref_topk(q, k, w, start, start + count, topk, 16)
    assert torch.equal(got[0], want[0])
    if integer:
        assert torch.equal(got[1], want[1])
    else:
        _close(got[1], want[1], 1e-5)
    assert (got[0][0] == -1).all() and (got[0][1, 3:] == -1).all()


@pytest.mark.parametrize("order", ["integers", "increasing", "random"])
def test_long_ranges_merge_exactly(order: str) -> None:
    """Hundreds of entries per query through 16-entry chunks: many mid-stream merges, bitwise the reference."""
    gen = torch.Generator().manual_seed(5)
    num_q, heads, dim, num_k, topk = 20, 2, 16, 160, 4  # 2 query tiles, the last one partial
    if order == "integers":
        q, k, w = _integer_inputs(gen, num_q, heads, dim, num_k)
    elif order == "increasing":  # every entry beats the current top-k: the worst case for the candidate buffer
        q = torch.ones(num_q, heads, dim)
        k = torch.arange(num_k, dtype=torch.float32)[:, None].expand(num_k, dim) / 64  # dyadic: exact
        w = torch.ones(num_q, heads)
    else:
        q, k, w = torch.randn(num_q, heads, dim, generator=gen), torch.randn(num_k, dim, generator=gen), torch.rand(num_q, heads, generator=gen)
    start = torch.randint(0, 40, (num_q,), generator=gen)
    count = torch.randint(0, num_k - 40, (num_q,), generator=gen)
    count[3] = 0
    got = _run(q, k, w, start, count, topk, block_t=16, block_n=16, programs=1)  # one program: scratch reused
    want = ref_topk(q, k, w, start, start + count, topk, 64)
    assert torch.equal(got[0], want[0])
    if order == "random":
        _close(got[1], want[1], 1e-5)
    else:
        assert torch.equal(got[1], want[1])


def test_all_tied_scores_pick_the_earliest_entries() -> None:
    """Every score equal (zero queries: relu(0) = 0): the first ``topk`` visible entries, in order; -1 after."""
    num_q, heads, dim, num_k, topk = 18, 2, 16, 130, 5
    q, k, w = torch.zeros(num_q, heads, dim), torch.randn(num_k, dim), -torch.ones(num_q, heads)  # scores -0.0 and 0.0
    start = torch.arange(num_q) * 7
    count = torch.arange(num_q) % 9
    got = _run(q, k, w, start, count, topk, block_t=16, block_n=16)
    want = ref_topk(q, k, w, start, start + count, topk, 32)
    assert torch.equal(got[0], want[0])
    slots = torch.arange(topk)
    expect = torch.where(slots < count[:, None], start[:, None] + slots, -1)
    assert torch.equal(got[0], expect)
    assert torch.equal(got[1], torch.where(expect >= 0, 0.0, float("-inf")))


def test_empty_and_zero_query_calls() -> None:
    q, k, w = torch.randn(5, 2, 16), torch.randn(7, 16), torch.rand(5, 2)
    zero = torch.zeros(5, dtype=torch.int64)
    indices, scores = indexer_topk_op(q, k, w, None, zero + 3, zero, 4)
    assert (indices == -1).all() and (scores == float("-inf")).all()
    indices, scores = indexer_topk_op(q[:0], k, w[:0], None, zero[:0], zero[:0], 4)
    assert indices.shape == (0, 4) and scores.shape == (0, 4)
    indices, _ = indexer_topk_op(q, k[:0], w, None, zero, zero + 3, 4)  # no key row at all: clamped away
    assert (indices == -1).all()


def test_indexer_topk_clamps_the_ranges_to_the_key_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    num_q, heads, dim, num_k, topk = 6, 2, 16, 9, 4
    q, w = torch.rand(num_q, heads, dim, generator=gen), torch.rand(num_q, heads, generator=gen)
    k_big = torch.full((num_k + CANARY_ROWS, dim), 1.0e4)  # rows past N_c would win every top-k
    k_big[:num_k] = torch.rand(num_k, dim, generator=gen)
    k = k_big[:num_k]
    start = torch.tensor([-3, 0, 2, 7, -1, num_k + 1])
    end = torch.tensor([num_k + 1, num_k, num_k + 3, num_k + 1, 4, num_k + 3])
    clamped = (start.clamp(0, num_k), end.clamp(0, num_k))
    got = indexer_topk_op(q, k, w, None, start, end - start, topk)
    want = indexer_topk_op(q, k, w, None, clamped[0], clamped[1] - clamped[0], topk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[0].max()) < num_k
    assert torch.equal(got[0], ref_topk(q, k, w, *clamped, topk, 16)[0])


class _NoHostSync(TorchFunctionMode):
    """Raises on every way a tensor's value reaches the host (``.item()``, ``int()``, ``bool()``, ``.tolist()``, ...)."""

    SYNCS = {Tensor.item, Tensor.tolist, Tensor.__int__, Tensor.__bool__, Tensor.__float__, Tensor.__index__, Tensor.numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in self.SYNCS:
            raise AssertionError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


def test_one_launch_and_no_host_sync() -> None:
    """The op's host code reads no tensor value and builds exactly one kernel launch."""
    gen = torch.Generator().manual_seed(2)
    q, k, w = torch.randn(20, 2, 16, generator=gen), torch.randn(40, 16, generator=gen), torch.rand(20, 2, generator=gen)
    start, count = torch.randint(0, 10, (20,), generator=gen), torch.randint(0, 30, (20,), generator=gen)
    with _NoHostSync():
        launches, indices, scores = indexer_topk_launches(q, k, w, None, start, count, 8)
    assert [launch.name for launch in launches] == ["indexer_topk"]
    launches[0]()
    assert torch.equal(indices, ref_topk(q, k, w, start, start + count, 8, 32)[0])


def test_aot_launches_build_on_meta_tensors() -> None:
    """The compile report's launches: fp8 (with key scales) and bf16 for a bf16 case, fp32 for fp32, GPU tiles,
    then the KL path's (scores, gradients with atomic dk, gradients and the key-major dk) in the case's dtype."""
    case = AOTCase("V4", torch.bfloat16, 8192, 10240, 64, 512, 512, 640, 64, 128, 512, 2048)
    launches = aot_launches(case)
    kl = ["indexer_selected_scores", "indexer_selected_grads_atomic", "indexer_selected_grads", "indexer_dk_keymajor"]
    names = ["indexer_topk float8_e4m3fn", "indexer_topk bfloat16", *kl]
    assert [x.name for x in launches] == names
    assert launches[3].constexprs["ATOMIC_DK"] and not launches[4].constexprs["ATOMIC_DK"]
    fp8, bf16 = launches[:2]
    assert all(x.args[0].dtype == torch.bfloat16 for x in launches[1:])
    assert fp8.args[0].dtype == torch.float8_e4m3fn and fp8.args[0].device.type == "meta"
    assert fp8.constexprs["HAS_SCALE"] and not bf16.constexprs["HAS_SCALE"]
    runtime = [n for n in fp8.kernel.arg_names if n not in fp8.constexprs]
    assert len(runtime) == len(fp8.args)
    tiles = indexer_tiles(torch.device("meta"), 128, 512)
    assert (fp8.constexprs["BLOCK_T"], fp8.constexprs["BLOCK_N"], fp8.constexprs["SORT"]) == (tiles.block_t, tiles.block_n, 1024)
    f32, *rest = aot_launches(AOTCase("fp32", torch.float32, 64, 80, 4, 64, 64, 16, 4, 32, 16, 64))
    assert [x.name for x in rest] == kl
    assert all(x.args[0].dtype == torch.float32 and x.constexprs.get("PREC", "ieee") == "ieee" for x in [f32, *rest])


def test_bad_dtypes_and_scales_are_refused() -> None:
    q, k, w, s = torch.randn(3, 2, 16), torch.randn(4, 16), torch.rand(3, 2), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(TypeError, match="q and k must share"):
        indexer_topk_launches(q, k.double(), w, None, s, s, 2)
    with pytest.raises(ValueError, match="k_scale"):
        indexer_topk_launches(q.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn), w, None, s, s, 2)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        indexer_topk_launches(q, k, w, None, s, s, 2, block_n=24)


def test_fake_matches_the_kernel() -> None:
    q, k, w, s = torch.randn(3, 2, 16), torch.randn(4, 16), torch.rand(3, 2), torch.zeros(3, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(indexer_topk_op, (q, k, w, None, s, s + 2, 3), test_utils=("test_schema", "test_faketensor"))


def test_scores_only_launch_gives_each_best_score() -> None:
    """``select=False`` (the benchmarks' scoring-only launch) computes the same scores: its row max is the top-1."""
    gen = torch.Generator().manual_seed(4)
    q, k, w = _integer_inputs(gen, 20, 2, 16, 40)
    start, count = torch.randint(0, 10, (20,), generator=gen), torch.randint(1, 30, (20,), generator=gen)
    launches, _, scores = indexer_topk_launches(q, k, w, None, start, count, 2, select=False)
    launches[0]()
    assert torch.equal(scores[:, 0], ref_topk(q, k, w, start, start + count, 1, 16)[1][:, 0])


def test_fp8_rows_is_the_index_key_rounding() -> None:
    """``fp8_rows`` (what fp8 scoring feeds the kernel) dequantizes to exactly ``round_index_keys(x, fp8)``."""
    from cpkv.backends.triton.indexer_ops import fp8_rows
    from cpkv.index_keys import round_index_keys

    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(6)) * torch.logspace(-3, 3, 9)[:, None]
    x[4] = 0.0
    payload, scale = fp8_rows(x)
    assert payload.dtype == torch.float8_e4m3fn and scale.shape == (9,)
    assert torch.equal(payload.float() * scale[:, None], round_index_keys(x, torch.float8_e4m3fn))


def _kl_inputs(integer: bool) -> tuple[Tensor, ...]:
    gen = torch.Generator().manual_seed(8)
    num_q, heads, dim, num_k, width = 6, 3, 16, 11, 40  # K = 40: two 32-entry chunks in the gradient kernel
    if integer:
        q, k, w = _integer_inputs(gen, num_q, heads, dim, num_k)
    else:
        q, k, w = torch.randn(num_q, heads, dim, generator=gen), torch.randn(num_k, dim, generator=gen), torch.randn(num_q, heads, generator=gen)
    sel = torch.randint(0, num_k, (num_q, width), generator=gen)
    sel[0] = -1  # a query without selection
    sel[1, ::3] = -1
    sel[2, 5], sel[3, 7] = num_k, -4  # outside [0, N_c): padding too
    target = torch.rand(num_q, width, generator=gen) * (sel >= 0) * (sel < num_k)
    target = target / target.sum(1, keepdim=True).clamp_min(1e-30)
    return q, k, w, sel, target


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("integer", [True, False], ids=["integers", "random"])
def test_kl_path_matches_the_torch_ops(integer: bool, deterministic: bool) -> None:
    """Scores, loss and gradients of ``cpkv_triton::indexer_kl`` against ``cpkv::indexer_kl``'s torch ops (fp32).

    Integer scores are exact; the loss and gradients go through exp/log: ``1e-5`` relative to the
    largest magnitude (fp32 ulps over <= 40 terms; dk sums up to 40 terms per row, many rows
    selected several times, as the atomic and the key-major dk must both handle).
    """
    from cpkv.backends.triton.indexer_ops import indexer_kl_backward_op, indexer_kl_op, selected_scores_op
    from cpkv.indexer_loss import indexer_kl_backward_op as ref_backward
    from cpkv.indexer_loss import indexer_kl_op as ref_kl
    from cpkv.indexer_loss import selected_index_scores

    q, k, w, sel, target = _kl_inputs(integer)
    clean = torch.where((sel >= 0) & (sel < k.shape[0]), sel, -1)
    scores = selected_scores_op(q, k, w, sel)
    want = selected_index_scores(q, k, w, clean)
    if integer:
        assert torch.equal(scores, want)
    else:
        _close(scores, want, 1e-5)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, w)]
    loss, anchor = indexer_kl_op(*leaves, sel, target, 0.5, deterministic)
    _close(loss.reshape(1), ref_kl(q, k, w, clean, target, 0.5)[0].reshape(1), 1e-5)
    assert anchor.item() == 0.0
    (loss * 7.0 + anchor).backward()  # the upstream gradient is ignored: the injected one is grad_factor's
    want_grads = ref_backward(q, k, w, clean, target, 0.5)
    for leaf, r in zip(leaves, want_grads):
        assert leaf.grad is not None and leaf.grad.shape == r.shape and leaf.grad.dtype == r.dtype
        _close(leaf.grad, r, 1e-5)
    again = indexer_kl_backward_op(q, k, w, sel, target, 0.5, deterministic)
    if deterministic:  # a fixed summation order: the same bits on every run
        assert all(torch.equal(a, leaf.grad) for a, leaf in zip(again, leaves))


def test_deterministic_dk_reads_only_its_key_rows() -> None:
    """The key-major dk pass: rows nobody selected get exactly 0; a row selected once gets that one term."""
    from cpkv.backends.triton.indexer_ops import selected_grads_op

    gen = torch.Generator().manual_seed(11)
    q, k, w = torch.randn(3, 2, 16, generator=gen), torch.randn(6, 16, generator=gen), torch.rand(3, 2, generator=gen)
    sel = torch.tensor([[4, -1], [4, 1], [-1, 7]])  # row 7 is past N_c = 6: padding
    ds = torch.randn(3, 2, generator=gen)
    _, dk, _ = selected_grads_op(q, k, w, sel, ds, True)
    _, dk_atomic, _ = selected_grads_op(q, k, w, sel, ds, False)
    assert torch.equal(dk[[0, 2, 3, 5]], torch.zeros(4, 16))
    dots = torch.einsum("hd,d->h", q[1], k[1])
    torch.testing.assert_close(dk[1], ((dots > 0) * ds[1, 1] * w[1]) @ q[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dk, dk_atomic, rtol=1e-5, atol=1e-6)


def test_cuda_backend_attaches_the_loss_through_the_triton_op() -> None:
    """``attach_indexer_loss(kl=CUDABackend.indexer_kl)`` dispatches ``cpkv_triton::indexer_kl`` (not the torch op)
    and gives the reference backend's loss and injected gradients (fp32, 1e-5 as above)."""
    from cpkv.backends.cuda import CUDABackend
    from cpkv.backends.reference import ReferenceBackend
    from cpkv.indexer_loss import attach_indexer_loss

    q, k, w, sel, target = _kl_inputs(False)
    sel = torch.where((sel >= 0) & (sel < k.shape[0]), sel, -1)
    results = []
    for backend in (CUDABackend(triton_kernels=True), ReferenceBackend()):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, w)]
        out = torch.zeros(q.shape[0], 2, 4, requires_grad=True)
        with OpNames() as ops:
            attached = attach_indexer_loss(out, *leaves, sel, target, grad_scale=2.0, num_global_queries=8,
                                           kl=backend.indexer_kl)
            attached.out.sum().backward()
        results.append((attached.loss, [leaf.grad for leaf in leaves], ops.names))
    (loss, grads, names), (want_loss, want_grads, want_names) = results
    assert "cpkv_triton.indexer_kl" in names and "cpkv.indexer_kl" not in names
    assert "cpkv.indexer_kl" in want_names
    _close(loss.reshape(1), want_loss.reshape(1), 1e-5)
    for g, r in zip(grads, want_grads):
        assert g is not None and r is not None
        _close(g, r, 1e-5)


def test_backend_layer_call_is_one_op_and_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CUDABackend.indexer_topk``: around the op only detaches (no copy, no sync), inside it one kernel launch."""
    from cpkv.backends.cuda import CUDABackend
    from cpkv.backends.reference import ReferenceBackend
    from cpkv.backends.triton.launches import KernelLaunch
    from cpkv.plan.segments import plan_segments

    launched: list[str] = []
    run = KernelLaunch.__call__
    monkeypatch.setattr(KernelLaunch, "__call__", lambda self: (launched.append(self.name), run(self))[1])
    cu = torch.tensor([0, 14, 40])
    segments = plan_segments(cu, cu, compress_ratios=[4])
    visible = segments.visible_for(4)
    gen = torch.Generator().manual_seed(9)
    q, w = torch.randn(40, 2, 16, generator=gen), torch.rand(40, 2, generator=gen)
    k = torch.randn(visible.num_entries, 16, generator=gen)
    ops = OpNames()
    with ops:
        got = CUDABackend(triton_kernels=True).indexer_topk(q, k, w, segments, visible, topk=4)
    assert ops.names == ["aten.detach"] * 3 + ["cpkv_triton.indexer_topk"]
    assert launched == ["indexer_topk"]
    assert torch.equal(got, ReferenceBackend().indexer_topk(q, k, w, segments, visible, topk=4))


def test_key_scales_multiply_the_head_sums() -> None:
    """``k_scale`` (the fp8 path's per-key scale, here on fp32 keys, so that powers of two keep it exact;
    test_triton_bf16.py runs it on fp8 payloads) gives the selection of the reference on the scaled keys ``k * scale``; powers of two keep it exact."""
    gen = torch.Generator().manual_seed(12)
    q, k, w = _integer_inputs(gen, 20, 2, 16, 60)
    scale = 2.0 ** torch.randint(-3, 4, (60,), generator=gen).float()
    start, count = torch.randint(0, 10, (20,), generator=gen), torch.randint(0, 50, (20,), generator=gen)
    got = indexer_topk_op(q, k, w, scale, start, count, 6)
    want = ref_topk(q, k * scale[:, None], w, start, start + count, 6, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fp8_layer_scores_pass_the_payloads_and_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CUDABackend.indexer_topk(..., fp8=True)`` on fp8-rounded rows calls the op with e4m3 payloads, the keys'
    scales and the queries' scales folded into the weights; run on those (dequantized in fp32 here, so that the
    selection is exact; test_triton_bf16.py runs the fp8 dots themselves), it selects what the reference selects from the rounded rows."""
    from cpkv.backends.cuda import CUDABackend
    from cpkv.backends.reference import ReferenceBackend
    from cpkv.backends.triton import indexer_ops
    from cpkv.index_keys import round_index_keys, round_index_queries
    from cpkv.plan.segments import plan_segments

    fp8 = torch.float8_e4m3fn
    cu = torch.tensor([0, 14, 40])
    segments = plan_segments(cu, cu, compress_ratios=[4])
    visible = segments.visible_for(4)
    gen = torch.Generator().manual_seed(13)
    q = round_index_queries(torch.randn(40, 2, 16, generator=gen) * torch.logspace(-2, 2, 40)[:, None, None], fp8)
    k = round_index_keys(torch.randn(visible.num_entries, 16, generator=gen), fp8)
    w = torch.rand(40, 2, generator=gen)
    seen: list[tuple[Tensor, ...]] = []

    def dequantized(q8: Tensor, k8: Tensor, weights: Tensor, k_scale: Tensor | None, start: Tensor, count: Tensor,
                    topk: int) -> tuple[Tensor, Tensor]:
        assert k_scale is not None
        seen.append((q8, k8, weights, k_scale))
        return indexer_topk_op(q8.float(), k8.float(), weights, k_scale, start, count, topk)

    monkeypatch.setattr(indexer_ops, "indexer_topk_op", dequantized)
    got = CUDABackend(triton_kernels=True).indexer_topk(q, k, w, segments, visible, topk=4, fp8=True)
    (q8, k8, weights, k_scale), = seen
    assert q8.dtype == fp8 and k8.dtype == fp8 and weights.dtype == torch.float32
    assert torch.equal(k8.float() * k_scale[:, None], k)  # fp32 rows: the round trip is exact
    q_scale = weights / w
    torch.testing.assert_close(q8.float() * q_scale[..., None], q, rtol=1e-6, atol=0)
    assert torch.equal(got, ReferenceBackend().indexer_topk(q, k, w, segments, visible, topk=4))
