"""CUDABackend: varlen_attn marshalling on CPU (a stand-in kernel), the exact LSE/sink math, fallbacks, and the real kernel when a GPU is present.

The stand-in has torch's ``varlen_attn`` signature, checks how cpkv calls it (int32
``cu_seq`` on q's device, a ``window_size`` tuple, an explicit ``scale``, ``enable_gqa``
or equal heads, one head dim), computes the reference semantics, and, like the real
kernel, drops the gradient of the LSE it returns.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor

import cpkv.backends.cuda as cuda_module
from cpkv.attention_plan import SegmentPlan, plan_attention
from cpkv.backends import ReferenceBackend, reference
from cpkv.backends.cuda import CUDABackend, _KernelCall, _lse_to_tnd, _varlen_with_sinks
from cpkv.layout import seqlens_to_cu_seqlens

LENGTHS = [5, 0, 37, 3, 2, 60, 21, 0, 1, 15]


class StandInVarlen:
    """``varlen_attn`` (torch >= 2.12 signature) on any device: checks plus reference semantics."""

    def __init__(self, strict_dtype: bool = True) -> None:
        self.strict_dtype = strict_dtype
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor | None, max_q: int, max_k: int, *,
        return_aux: Any = None, scale: float | None = None, window_size: tuple[int, int] = (-1, -1), enable_gqa: bool = False,
        seqused_k: Tensor | None = None, block_table: Tensor | None = None, num_splits: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        assert cu_seq_k is not None and seqused_k is None and block_table is None
        for cu in (cu_seq_q, cu_seq_k):
            assert cu.dtype == torch.int32 and cu.device == query.device and int(cu[0]) == 0, "int32 leading-0 cu_seq on q's device"
        assert (max_q, max_k) == (int(cu_seq_q.diff().max()), int(cu_seq_k.diff().max())), "max_q/max_k from the plan"
        assert isinstance(window_size, tuple) and len(window_size) == 2 and window_size[1] == 0, f"causal tuple, got {window_size!r}"
        assert isinstance(scale, float), "scale must be passed"
        assert return_aux is not None and return_aux.lse, "the LSE must be requested"
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], "flash kernels take one head dim"
        assert enable_gqa or key.shape[1] == query.shape[1], "MQA needs enable_gqa=True"
        assert not self.strict_dtype or query.dtype in (torch.float16, torch.bfloat16), "fp16/bf16 only"
        self.calls.append({"window_size": window_size, "scale": scale, "enable_gqa": enable_gqa, "kv_heads": key.shape[1]})
        window = None if window_size[0] == -1 else window_size[0] + 1
        out, lse = reference.varlen_attention(query, key, value, cu_seq_q, cu_seq_k, scale=scale, window=window)
        return out, lse.detach().transpose(0, 1).contiguous()  # [H, T_q]; gradient dropped like the kernel


class StandInVarlen210:
    """torch 2.10's ``varlen_attn(..., is_causal=False, return_aux=None)``: no scale, window or GQA."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self, query: Tensor, key: Tensor, value: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int,
        is_causal: bool = False, return_aux: Any = None,
    ) -> tuple[Tensor, Tensor]:
        assert is_causal and key.shape[1] == query.shape[1] and return_aux is not None
        self.calls += 1
        out, lse = reference.varlen_attention(query, key, value, cu_seq_q, cu_seq_k)
        return out, lse.detach().transpose(0, 1).contiguous()


def _plan() -> SegmentPlan:
    return plan_attention(seqlens_to_cu_seqlens(LENGTHS), 2, 1).segments


def _inputs(segments: SegmentPlan, dtype: torch.dtype, dim: int = 16, d_v: int = 12) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    t_q, t_kv = segments.num_queries, int(segments.cu_seqlens_kv[-1])
    shapes = [(t_q, 4, dim), (t_kv, 1, dim), (t_kv, 1, d_v), (4,), (t_q, 4, d_v), (t_q, 4)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]  # q k v sinks d_out d_lse


def _grads(fn: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, d_out: Tensor, d_lse: Tensor) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    sink_leaf = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    out, lse = fn(*leaves, sink_leaf)
    torch.autograd.backward([out, lse], [d_out.to(out.dtype), d_lse.to(lse.dtype)])
    extra = [] if sink_leaf is None else [sink_leaf.grad]
    return [out.detach(), lse.detach()] + [leaf.grad for leaf in leaves] + extra  # type: ignore[misc]


def _reference_fn(segments: SegmentPlan, scale: float, window: int | None) -> Any:
    return lambda q, k, v, s: reference.varlen_attention(q, k, v, segments.cu_seqlens_q, segments.cu_seqlens_kv, scale=scale, window=window, sinks=s)


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
    call = _KernelCall(kernel, form != "torch210", form == "gqa", segments.max_seqlen_q, segments.max_seqlen_kv, scale, window)

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
    call = _KernelCall(StandInVarlen(strict_dtype=False), True, True, segments.max_seqlen_q, segments.max_seqlen_kv, 0.3, None)
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
    assert kernel.calls == [{"window_size": (-1, 0) if window is None else (window - 1, 0), "scale": 0.3, "enable_gqa": True, "kv_heads": 1}]


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


def test_fallback_warns_once_per_reason() -> None:
    segments = _plan()
    kernel = StandInVarlen()
    backend = CUDABackend(kernel)
    q, k, v, sinks, *_ = _inputs(segments, torch.float32)
    wide = _inputs(segments, torch.bfloat16, dim=288, d_v=288)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = backend.varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)
            backend.varlen_attention(*wide[:3], segments, scale=0.3, window=None, sinks=None)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2 and "dtype torch.float32" in messages[0] and "head dims" in messages[1]
    assert kernel.calls == []
    want = ReferenceBackend().varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)
    torch.testing.assert_close(got.out, want.out)


def test_torch210_form_falls_back_for_a_window_and_expands_heads() -> None:
    segments = _plan()
    q, k, v, sinks, *_ = _inputs(segments, torch.bfloat16)
    kernel = StandInVarlen210()
    backend = CUDABackend(kernel)
    with pytest.warns(UserWarning, match="sliding window"):
        backend.varlen_attention(q, k, v, segments, scale=0.3, window=4, sinks=sinks)
    assert kernel.calls == 0
    backend.varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)
    assert kernel.calls == 1


def test_lse_layout_and_bad_signature() -> None:
    lse = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(_lse_to_tnd(lse, 3, 2), lse.T)
    assert torch.equal(_lse_to_tnd(lse.T, 3, 2), lse.T)
    with pytest.raises(RuntimeError, match="LSE of shape"):
        _lse_to_tnd(torch.zeros(4), 3, 2)
    with pytest.raises(RuntimeError, match="unsupported varlen_attn signature"):
        CUDABackend(lambda q, k, v: q)


def test_default_kernel_on_cpu_tensors_falls_back() -> None:
    segments = _plan()
    q, k, v, sinks, *_ = _inputs(segments, torch.bfloat16)
    with pytest.warns(UserWarning, match="device cpu"):
        CUDABackend().varlen_attention(q, k, v, segments, scale=0.3, window=None, sinks=sinks)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_kernel_against_reference(window: int | None, dtype: torch.dtype) -> None:
    """The real varlen_attn: error vs fp64 within twice the reference's error in the same dtype (+ one ulp of max)."""
    segments = plan_attention(seqlens_to_cu_seqlens(LENGTHS).cuda(), 2, 1).segments
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
