"""CUDABackend: varlen_attn marshalling on CPU (a stand-in kernel), the exact LSE/sink math, ring rounds, fallbacks, and the real kernel when a GPU is present.

The stand-in has torch's ``varlen_attn`` signature, checks how cpkv calls it (int32
leading-zero ``cu_seq`` on q's device, ``max_q``/``max_k`` matching them, a
``window_size`` tuple, an explicit ``scale``, ``enable_gqa`` or equal heads, one head
dim), computes flash semantics independently of cpkv (dense masked softmax: per segment
pair, bottom-right aligned, ``window_size=(left, right)`` with ``-1`` = unbounded), and,
like the real kernel, drops the gradient of the LSE it returns.
"""

from __future__ import annotations

import inspect
import math
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

import cpkv.backends.cuda as cuda_module
from cpkv.backends import ReferenceBackend
from cpkv.backends.base import AttentionBackend, KeyRanges
from cpkv.backends.cuda import CUDABackend, _KernelCall, _lse_to_tnd, _varlen_with_sinks
from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.plan.prefix import compute_prefix_kv_cu_seqlens
from cpkv.plan.segments import SegmentPlan, plan_segments
from cpkv.plan.sharding import contiguous_shard_range

LENGTHS = [5, 0, 37, 3, 2, 60, 21, 0, 1, 15]
PRIMITIVES = ("varlen_attention", "range_attention", "sparse_attention", "selected_probs", "indexer_topk")


def flash_semantics(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float, window_size: tuple[int, int]
) -> tuple[Tensor, Tensor]:
    """Flash varlen attention by a dense masked softmax: out ``[T_q, H, D_v]`` (q's dtype), lse ``[H, T_q]``.

    Query ``i`` of a segment pair (``L_q`` queries, ``L_k`` keys) sees key ``j`` of the pair iff
    ``i + d - left <= j <= i + d + right`` with ``d = L_k - L_q`` (bottom-right aligned), a
    bound of ``-1`` being absent. Rows that see no key: out 0, lse -inf (finite gradients).
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    seg_q = torch.repeat_interleave(torch.arange(cu_q.numel() - 1), cu_q.diff().cpu()).to(q.device)
    seg_k = torch.repeat_interleave(torch.arange(cu_k.numel() - 1), cu_k.diff().cpu()).to(q.device)
    pos_q = torch.arange(q.shape[0], device=q.device) - cu_q.long()[seg_q]
    pos_k = torch.arange(k.shape[0], device=q.device) - cu_k.long()[seg_k]
    diag = (pos_q + (cu_k.diff() - cu_q.diff()).long()[seg_q])[:, None]
    visible = seg_q[:, None] == seg_k[None, :]
    left, right = window_size
    if left >= 0:
        visible &= pos_k[None, :] >= diag - left
    if right >= 0:
        visible &= pos_k[None, :] <= diag + right
    groups = q.shape[1] // k.shape[1]
    ka, va = k.to(acc).repeat_interleave(groups, 1), v.to(acc).repeat_interleave(groups, 1)
    scores = torch.einsum("thd,jhd->htj", q.to(acc), ka) * scale
    any_key = visible.any(1)
    scores = torch.where(any_key[:, None], scores.masked_fill(~visible, float("-inf")), 0.0)
    probs = torch.softmax(scores, -1) * any_key[:, None]
    lse = torch.logsumexp(scores, -1).masked_fill(~any_key, float("-inf"))
    return torch.einsum("htj,jhd->thd", probs, va).to(q.dtype), lse


class StandInVarlen:
    """``varlen_attn`` (torch >= 2.12 signature) on any device: checks plus flash semantics."""

    def __init__(self, strict_dtype: bool = True) -> None:
        self.strict_dtype = strict_dtype
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None, max_q: int, max_k: int, *,
        return_aux: Any = None, scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
        seqused_k: Tensor | None = None, block_table: Tensor | None = None, num_splits: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        assert cu_seq_k is not None and seqused_k is None and block_table is None
        for cu, rows in ((cu_seq_q, query.shape[0]), (cu_seq_k, key.shape[0])):
            assert cu.dtype == torch.int32 and cu.device == query.device and int(cu[0]) == 0, "int32 leading-0 cu_seq on q's device"
            assert int(cu[-1]) == rows and bool((cu.diff() >= 0).all()), "cu_seq must end at the row count"
        assert (max_q, max_k) == (int(cu_seq_q.diff().max()), int(cu_seq_k.diff().max())), "max_q/max_k from the plan"
        assert isinstance(window_size, tuple) and len(window_size) == 2, f"window_size must be a tuple, got {window_size!r}"
        assert all(type(b) is int and b >= -1 for b in window_size), f"window bounds are ints >= -1, got {window_size!r}"
        assert isinstance(scale, float), "scale must be passed"
        assert return_aux is not None and return_aux.lse, "the LSE must be requested"
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], "flash kernels take one head dim"
        assert enable_gqa or key.shape[1] == query.shape[1], "MQA needs enable_gqa=True"
        assert not self.strict_dtype or query.dtype in (torch.float16, torch.bfloat16), "fp16/bf16 only"
        self.calls.append({
            "window_size": window_size, "scale": scale, "enable_gqa": enable_gqa, "kv_heads": key.shape[1],
            "rows": (query.shape[0], key.shape[0]),
        })
        out, lse = flash_semantics(query, key, value, cu_seq_q, cu_seq_k, scale, window_size)
        return out, lse.detach().contiguous()  # [H, T_q]; gradient dropped like the kernel


class StandInVarlen210:
    """torch 2.10's ``varlen_attn(..., is_causal=False, return_aux=None)``: no scale, window or GQA."""

    def __init__(self) -> None:
        self.causal: list[bool] = []

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int,
        is_causal: bool = False, return_aux: Any = None,
    ) -> tuple[Tensor, Tensor]:
        assert key.shape[1] == query.shape[1] and return_aux is not None
        self.causal.append(is_causal)
        scale = 1 / math.sqrt(query.shape[-1])
        out, lse = flash_semantics(query, key, value, cu_seq_q, cu_seq_k, scale, (-1, 0) if is_causal else (-1, -1))
        return out, lse.detach().contiguous()


def _plan(device: torch.device | str = "cpu") -> SegmentPlan:
    """Rank 1 of 2 (contiguous TND) over LENGTHS: queries with their causal kv prefixes."""
    cu = seqlens_to_cu_seqlens(LENGTHS, device=device)
    prefix = compute_prefix_kv_cu_seqlens(cu, *contiguous_shard_range(int(cu[-1]), 2, 1))
    return plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv)


def _inputs(segments: SegmentPlan, dtype: torch.dtype, dim: int = 16, d_v: int = 12) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    t_q, t_kv = segments.num_queries, int(segments.cu_seqlens_kv[-1])
    shapes = [(t_q, 4, dim), (t_kv, 1, dim), (t_kv, 1, d_v), (4,), (t_q, 4, d_v), (t_q, 4)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]  # q k v sinks d_out d_lse


def _grads(fn: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, d_out: Tensor, d_lse: Tensor) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    out, lse = fn(*leaves, sink_leaf)
    pairs = [(t, g.to(t.dtype)) for t, g in ((out, d_out), (lse, d_lse)) if t.requires_grad]  # an empty round has no graph
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    grads = [torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in (*leaves, sink_leaf) if leaf is not None]
    return [out.detach(), lse.detach(), *grads]


def _reference_fn(segments: SegmentPlan, scale: float, window: int | None) -> Any:
    backend = ReferenceBackend()
    return lambda q, k, v, s: backend.varlen_attention(q, k, v, segments, scale=scale, window=window, sinks=s)


def test_flash_semantics_stand_in_matches_reference_varlen() -> None:
    """The stand-in's independent masked softmax agrees with the reference (so it is a fair oracle)."""
    segments = _plan()
    q, k, v, *_ = _inputs(segments, torch.float64)
    for window, window_size in ((None, (-1, 0)), (5, (4, 0))):
        out, lse = flash_semantics(q, k, v, segments.cu_seqlens_q, segments.cu_seqlens_kv, 0.3, window_size)
        want = ReferenceBackend().varlen_attention(q, k, v, segments, scale=0.3, window=window, sinks=None)
        torch.testing.assert_close(out, want.out)
        torch.testing.assert_close(lse.T, want.lse)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("form", ["gqa", "expand", "torch210"])
def test_lse_gradient_and_sinks_are_exact(window: int | None, with_sinks: bool, form: str) -> None:
    """fp64 through the stand-in: out, lse and every gradient (an upstream gradient on the LSE too) equal the reference."""
    if form == "torch210" and window is not None:
        pytest.skip("the 2.10 form has no window (falls back)")
    segments = _plan()
    q, k, v, sinks, d_out, d_lse = _inputs(segments, torch.float64)
    scale = 0.3
    kernel = StandInVarlen210() if form == "torch210" else StandInVarlen(strict_dtype=False)
    window_size = (-1, 0) if window is None else (window - 1, 0)
    call = _KernelCall(kernel, form != "torch210", form == "gqa", segments.max_seqlen_q, segments.max_seqlen_kv, scale, window_size)

    def cpkv_fn(q: Tensor, k: Tensor, v: Tensor, s: Tensor | None) -> tuple[Tensor, Tensor]:
        return _varlen_with_sinks(call, q, k, v, segments.cu_seqlens_q, segments.cu_seqlens_kv, s)

    got = _grads(cpkv_fn, q, k, v, sinks if with_sinks else None, d_out, d_lse)
    want = _grads(_reference_fn(segments, scale, window), q, k, v, sinks if with_sinks else None, d_out, d_lse)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_dropping_the_lse_gradient_would_be_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: without _LseGradient (the kernel drops the LSE's gradient) the sink gradients of q and k are wrong."""
    monkeypatch.setattr(cuda_module._LseGradient, "apply", lambda lse, *rest: lse)
    segments = _plan()
    q, k, v, sinks, d_out, d_lse = _inputs(segments, torch.float64)
    call = _KernelCall(StandInVarlen(strict_dtype=False), True, True, segments.max_seqlen_q, segments.max_seqlen_kv, 0.3, (-1, 0))
    got = _grads(lambda *a: _varlen_with_sinks(call, *a[:3], segments.cu_seqlens_q, segments.cu_seqlens_kv, a[3]), q, k, v, sinks, d_out, d_lse * 0)
    want = _grads(_reference_fn(segments, 0.3, None), q, k, v, sinks, d_out, d_lse * 0)
    torch.testing.assert_close(got[0], want[0])  # the forward is right
    assert not torch.allclose(got[2], want[2], rtol=1e-3), "dq must differ without the LSE gradient"


@pytest.mark.parametrize("window", [None, 5])
def test_marshalling(window: int | None) -> None:
    segments = _plan()
    q, k, v, sinks, *_ = _inputs(segments, torch.bfloat16)
    kernel = StandInVarlen()
    CUDABackend(kernel).varlen_attention(q, k, v, segments, scale=0.3, window=window, sinks=sinks)
    assert kernel.calls == [{
        "window_size": (-1, 0) if window is None else (window - 1, 0), "scale": 0.3, "enable_gqa": True, "kv_heads": 1,
        "rows": (q.shape[0], k.shape[0]),
    }]


@pytest.mark.parametrize("window", [None, 5])
def test_bf16_error_within_twice_reference_bf16_error(window: int | None) -> None:
    """err(cpkv bf16 vs fp64) <= 2 * err(reference bf16 vs fp64) + 2**-8 * max|fp64| (one bf16 ulp, for extra roundings)."""
    segments = _plan()
    inputs = _inputs(segments, torch.bfloat16)
    exact = _grads(_reference_fn(segments, 0.3, window), *(t.double() for t in inputs[:4]), *inputs[4:])
    low = _grads(_reference_fn(segments, 0.3, window), *inputs)
    backend = CUDABackend(StandInVarlen())
    got = _grads(lambda q, k, v, s: backend.varlen_attention(q, k, v, segments, scale=0.3, window=window, sinks=s), *inputs)
    for name, g, lo, ex in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, low, exact):
        err, ref_err = (g.double() - ex).abs().max(), (lo.double() - ex).abs().max()
        assert err <= 2 * ref_err + 2**-8 * ex.abs().max(), f"{name}: {err:.3g} vs reference bf16 {ref_err:.3g}"


# --------------------------------------------------------------------------- ring rounds (range_attention)


def key_ranges(num_queries: int, num_keys: int, num_rows: int, left: int) -> KeyRanges:
    """The KeyRanges of a round: rows ``i < num_rows`` see keys ``max(0, i + n - num_rows - left) .. n - 1``."""
    rows = torch.arange(num_queries)
    lo = (rows + num_keys - num_rows - left).clamp(min=0) if left >= 0 else torch.zeros(num_queries, dtype=torch.int64)
    seen = rows < num_rows
    lo, hi = torch.where(seen, lo, num_keys), torch.full((num_queries,), num_keys)
    return KeyRanges(lo=lo.long(), hi=hi.long(), num_keys=num_keys, num_rows=num_rows, left=left)


ROUNDS = {  # (num_keys, num_rows, left) for T_q = 12 queries
    "dense, every row": (10, 12, -1),
    "dense, leading rows": (10, 7, -1),
    "window, leading rows": (10, 7, 3),
    "window, more rows than keys": (5, 9, 2),
    "window wider than the round": (6, 12, 40),
    "empty: no row": (10, 0, -1),
    "empty: no key": (0, 0, -1),
}


def _round_inputs(num_keys: int, dtype: torch.dtype, num_queries: int = 12) -> list[Tensor]:
    gen = torch.Generator().manual_seed(num_keys)
    shapes = [(num_queries, 4, 16), (num_keys, 1, 16), (num_keys, 1, 12), (num_queries, 4, 12), (num_queries, 4)]
    q, k, v, d_out, d_lse = (torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes)
    return [q, k, v, d_out, d_lse]


@pytest.mark.parametrize("case", list(ROUNDS))
def test_range_attention_equals_reference(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp64 through the stand-in (kernel dtypes widened): out, lse and dq, dk, dv (gradients through out and lse) equal the reference."""
    monkeypatch.setattr(cuda_module, "KERNEL_DTYPES", (torch.float64,))
    num_keys, num_rows, left = ROUNDS[case]
    q, k, v, d_out, d_lse = _round_inputs(num_keys, torch.float64)
    ranges = key_ranges(q.shape[0], num_keys, num_rows, left)
    kernel = StandInVarlen(strict_dtype=False)
    backend, reference = CUDABackend(kernel), ReferenceBackend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        got = _grads(lambda q, k, v, s: backend.range_attention(q, k, v, ranges, scale=0.3), q, k, v, None, d_out, d_lse)
    want = _grads(lambda q, k, v, s: reference.range_attention(q, k, v, ranges, scale=0.3), q, k, v, None, d_out, d_lse)
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-9, atol=1e-10, msg=lambda m, n=name: f"{case} {n}: {m}")
    assert got[1].dtype == torch.float64 and bool(torch.isinf(got[1][num_rows:]).all())
    expected_calls = 0 if num_rows == 0 or num_keys == 0 else 2  # forward, and the LSE gradient's extra call
    assert len(kernel.calls) == expected_calls
    assert all(c["window_size"] == (left, -1) for c in kernel.calls)


@pytest.mark.parametrize("case", [c for c in ROUNDS if not c.startswith("empty")])
def test_range_attention_passes_only_the_rows_that_see_keys(case: str) -> None:
    """The kernel gets exactly the ``num_rows`` q rows and all ``num_keys`` kv rows, in forward and the LSE backward."""
    num_keys, num_rows, left = ROUNDS[case]
    q, k, v, d_out, d_lse = _round_inputs(num_keys, torch.bfloat16)
    kernel = StandInVarlen()
    backend = CUDABackend(kernel)
    _grads(lambda q, k, v, s: backend.range_attention(q, k, v, key_ranges(12, num_keys, num_rows, left), scale=0.3), q, k, v, None, d_out, d_lse)
    assert [c["rows"] for c in kernel.calls] == [(num_rows, num_keys)] * 2
    assert [(c["scale"], c["enable_gqa"], c["kv_heads"]) for c in kernel.calls] == [(0.3, True, 1)] * 2


def assert_round_error_bound(backend: CUDABackend, ranges: KeyRanges, inputs: list[Tensor], what: str) -> None:
    """err(backend bf16 vs fp64) <= 2 * err(reference bf16 vs fp64) + 2**-8 * max|fp64| over out, lse and dq, dk, dv."""
    reference = ReferenceBackend()
    q, k, v, d_out, d_lse = inputs

    def run(b: Any, q: Tensor, k: Tensor, v: Tensor) -> list[Tensor]:
        return _grads(lambda q, k, v, s: b.range_attention(q, k, v, ranges, scale=0.3), q, k, v, None, d_out, d_lse)

    exact, low = run(reference, q.double(), k.double(), v.double()), run(reference, q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel serves the round
        got = run(backend, q, k, v)
    for name, g, lo, ex in zip(["out", "lse", "dq", "dk", "dv"], got, low, exact):
        finite = torch.isfinite(ex)
        assert torch.equal(torch.isfinite(g), finite), f"{what} {name}"
        err, ref_err = (g.double() - ex)[finite].abs().max(), (lo.double() - ex)[finite].abs().max()
        assert err <= 2 * ref_err + 2**-8 * ex[finite].abs().max(), f"{what} {name}: {err:.3g} vs reference bf16 {ref_err:.3g}"


def test_range_attention_bf16_error_within_twice_reference_bf16_error() -> None:
    num_keys, num_rows, left = ROUNDS["window, leading rows"]
    ranges = key_ranges(12, num_keys, num_rows, left)
    assert_round_error_bound(CUDABackend(StandInVarlen()), ranges, _round_inputs(num_keys, torch.bfloat16), "stand-in")


def test_range_attention_without_lse_gradient_would_be_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutation: the merge of ring rounds differentiates through the LSE; dropping its gradient changes dq and dk."""
    monkeypatch.setattr(cuda_module, "KERNEL_DTYPES", (torch.float64,))
    monkeypatch.setattr(cuda_module._LseGradient, "apply", lambda lse, *rest: lse)
    q, k, v, d_out, d_lse = _round_inputs(10, torch.float64)
    ranges = key_ranges(12, 10, 7, 3)
    got = _grads(lambda q, k, v, s: CUDABackend(StandInVarlen(strict_dtype=False)).range_attention(q, k, v, ranges, scale=0.3), q, k, v, None, d_out, d_lse)
    want = _grads(lambda q, k, v, s: ReferenceBackend().range_attention(q, k, v, ranges, scale=0.3), q, k, v, None, d_out, d_lse)
    torch.testing.assert_close(got[0], want[0])
    assert not torch.allclose(got[2], want[2], rtol=1e-3) and not torch.allclose(got[3], want[3], rtol=1e-3)


def test_range_attention_on_the_torch210_form() -> None:
    """Unbounded rounds run with is_causal=False; a finite left falls back (warned once) to the reference."""
    kernel = StandInVarlen210()
    backend = CUDABackend(kernel)
    q, k, v, *_ = _round_inputs(10, torch.bfloat16)
    dim_scale = 1 / math.sqrt(q.shape[-1])
    dense = key_ranges(12, 10, 7, -1)
    got = backend.range_attention(q, k, v, dense, scale=dim_scale)
    want = ReferenceBackend().range_attention(q, k, v, dense, scale=dim_scale)
    assert kernel.causal == [False]
    torch.testing.assert_close(got.out, want.out, rtol=2e-2, atol=2e-2)
    window = key_ranges(12, 10, 7, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got = backend.range_attention(q, k, v, window, scale=0.3)
    assert [str(w.message).count("sliding window") for w in caught] == [1]
    assert kernel.causal == [False]
    torch.testing.assert_close(got.out, ReferenceBackend().range_attention(q, k, v, window, scale=0.3).out)


def test_range_attention_checks_the_ranges_against_the_tensors() -> None:
    q, k, v, *_ = _round_inputs(10, torch.bfloat16)
    backend = CUDABackend(StandInVarlen())
    with pytest.raises(ValueError, match="num_keys=9"):
        backend.range_attention(q, k, v, key_ranges(12, 9, 5, -1), scale=0.3)
    with pytest.raises(ValueError, match="num_rows=13"):
        backend.range_attention(q, k, v, KeyRanges(lo=torch.zeros(12), hi=torch.zeros(12), num_keys=10, num_rows=13, left=-1), scale=0.3)


# --------------------------------------------------------------------------- fallbacks, the other primitives


def test_fallback_warns_once_per_reason() -> None:
    segments = _plan()
    kernel = StandInVarlen()
    backend = CUDABackend(kernel)
    q, k, v, sinks, *_ = _inputs(segments, torch.float32)
    wide = _inputs(segments, torch.bfloat16, dim=288, d_v=288)
    ranges = key_ranges(q.shape[0], k.shape[0], 5, -1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = backend.varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)
            backend.varlen_attention(wide[0], wide[1], wide[2], segments, scale=0.3, window=None, sinks=None)
            got_range = backend.range_attention(q, k, v, ranges, scale=0.3)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "dtype torch.float32" in messages[0] and "head dims" in messages[1]
    assert kernel.calls == []
    want = ReferenceBackend().varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(got_range.out, ReferenceBackend().range_attention(q, k, v, ranges, scale=0.3).out)


def test_torch210_form_falls_back_for_a_window_and_expands_heads() -> None:
    segments = _plan()
    q, k, v, sinks, *_ = _inputs(segments, torch.bfloat16)
    kernel = StandInVarlen210()
    backend = CUDABackend(kernel)
    with pytest.warns(UserWarning, match="sliding window"):
        backend.varlen_attention(q, k, v, segments, scale=0.3, window=4, sinks=sinks)
    assert kernel.causal == []
    backend.varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)
    assert kernel.causal == [True]


def test_sparse_primitives_are_the_reference_ops() -> None:
    """sparse_attention, selected_probs and indexer_topk run the reference ops (no kernel call)."""
    cu = seqlens_to_cu_seqlens(LENGTHS)
    prefix = compute_prefix_kv_cu_seqlens(cu, *contiguous_shard_range(int(cu[-1]), 2, 1))
    segments = plan_segments(prefix.cu_seqlens_q, prefix.cu_seqlens_kv, compress_ratios=[4])
    visible = segments.visible_for(4)
    num_prefix = int(segments.cu_seqlens_kv[-1])
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(segments.num_queries, 4, 16, generator=gen, dtype=torch.bfloat16)
    kv = torch.randn(num_prefix + visible.num_entries, 16, generator=gen, dtype=torch.bfloat16)
    indices = torch.cat([segments.window_indices(6), visible.visible_indices(offset=num_prefix)], dim=1)
    q_index = torch.randn(segments.num_queries, 2, 8, generator=gen, dtype=torch.bfloat16)
    k_index, weights = torch.randn(visible.num_entries, 8, generator=gen, dtype=torch.bfloat16), torch.randn(q_index.shape[:2], generator=gen)
    kernel = StandInVarlen()
    backend, reference = CUDABackend(kernel), ReferenceBackend()
    got = backend.sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=None)
    want = reference.sparse_attention(q, kv, indices, d_v=12, scale=0.25, sinks=None)
    torch.testing.assert_close(got.out, want.out)
    torch.testing.assert_close(
        backend.selected_probs(q, kv, indices, got.lse, scale=0.25), reference.selected_probs(q, kv, indices, want.lse, scale=0.25)
    )
    assert torch.equal(
        backend.indexer_topk(q_index, k_index, weights, segments, visible, topk=5),
        reference.indexer_topk(q_index, k_index, weights, segments, visible, topk=5),
    )
    assert kernel.calls == []


def test_implements_every_primitive_of_the_protocol() -> None:
    for name in PRIMITIVES:
        want = [(p.name, p.kind) for p in inspect.signature(getattr(AttentionBackend, name)).parameters.values()]
        got = [(p.name, p.kind) for p in inspect.signature(getattr(CUDABackend, name)).parameters.values()]
        assert got == want, name
    assert not hasattr(CUDABackend, "sparse_attention_with_indexer_loss")


def test_lse_layout_and_bad_signature() -> None:
    lse = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(_lse_to_tnd(lse, 3, 2), lse.T)
    assert torch.equal(_lse_to_tnd(lse.T, 3, 2), lse.T)
    with pytest.raises(RuntimeError, match="LSE of shape"):
        _lse_to_tnd(torch.zeros(4), 3, 2)
    with pytest.raises(RuntimeError, match="unsupported varlen_attn signature"):
        CUDABackend(lambda q, k, v: q)


def test_non_callable_varlen_attn_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"varlen_attn must be a callable like torch\.nn\.attention\.varlen\.varlen_attn, or None.*got 42"):
        CUDABackend(varlen_attn=42)  # type: ignore[arg-type]


def test_default_kernel_on_cpu_tensors_falls_back() -> None:
    segments = _plan()
    q, k, v, sinks, *_ = _inputs(segments, torch.bfloat16)
    backend = CUDABackend()
    with pytest.warns(UserWarning, match="device cpu"):
        backend.varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)
    ranges = key_ranges(q.shape[0], k.shape[0], 5, -1)
    got = backend.range_attention(q, k, v, ranges, scale=0.3)  # same reason: warned above already
    torch.testing.assert_close(got.out, ReferenceBackend().range_attention(q, k, v, ranges, scale=0.3).out)


# --------------------------------------------------------------------------- the real kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_kernel_against_reference(window: int | None, dtype: torch.dtype) -> None:
    """The real varlen_attn: error vs fp64 within twice the reference's error in the same dtype (+ one ulp of max)."""
    segments = _plan("cuda")
    inputs = [t.cuda() for t in _inputs(segments, dtype, dim=64, d_v=48)]
    exact = _grads(_reference_fn(segments, 0.125, window), *(t.double() for t in inputs[:4]), *inputs[4:])
    low = _grads(_reference_fn(segments, 0.125, window), *inputs)
    backend = CUDABackend()
    got = _grads(lambda q, k, v, s: backend.varlen_attention(q, k, v, segments, scale=0.125, window=window, sinks=s), *inputs)
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    for name, g, lo, ex in zip(["out", "lse", "dq", "dk", "dv", "dsinks"], got, low, exact):
        err, ref_err = (g.double() - ex).abs().max(), (lo.double() - ex).abs().max()
        assert err <= 2 * ref_err + ulp * ex.abs().max(), f"{name}: {err:.3g} vs reference {ref_err:.3g}"
    assert math.isfinite(float(got[1].max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [c for c in ROUNDS if not c.startswith("empty")])
def test_real_kernel_range_attention_against_reference(case: str) -> None:
    """The real varlen_attn on ring rounds (window_size=(left, -1)): bf16 error within twice the reference's + one ulp."""
    num_keys, num_rows, left = ROUNDS[case]
    ranges = key_ranges(12, num_keys, num_rows, left)
    ranges = KeyRanges(ranges.lo.cuda(), ranges.hi.cuda(), num_keys, num_rows, left)
    assert_round_error_bound(CUDABackend(), ranges, [t.cuda() for t in _round_inputs(num_keys, torch.bfloat16)], case)


def test_range_attention_without_the_kernel_form_never_calls_the_varlen_kernel() -> None:
    """Ranges over two documents (a zigzag ring round) have no bottom-right form: the flash kernel
    would attend every row to the round's last key, so they go to the lo/hi path and equal the reference."""
    from cpkv.plan import plan_attention

    plans = [plan_attention(torch.tensor([0, 16, 32]), 2, r, layout="zigzag", exchange="need", ring_degree=2) for r in (0, 1)]
    rounds = [rnd for p in plans for rnd in p.kv_source(None).rounds if rnd.ranges.num_rows]
    ranges = next(rnd.ranges for rnd in rounds if not rnd.ranges.bottom_right)
    q, k, v, d_out, d_lse = _round_inputs(ranges.num_keys, torch.bfloat16, num_queries=ranges.lo.numel())
    kernel = StandInVarlen()
    backend, reference = CUDABackend(kernel), ReferenceBackend()
    got = _grads(lambda q, k, v, s: backend.range_attention(q, k, v, ranges, scale=0.3), q, k, v, None, d_out, d_lse)
    want = _grads(lambda q, k, v, s: reference.range_attention(q, k, v, ranges, scale=0.3), q, k, v, None, d_out, d_lse)
    assert kernel.calls == []
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
