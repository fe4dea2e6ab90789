"""cpkv's Triton kernels in bf16 (and the indexer in fp8) on CPU, under Triton's interpreter as patched by
``benchmarks/interpreter_patch.py``, against float64.

The rule is the GPU check's (``benchmarks/device_common.rule_check``, what ``benchmarks/gpu_check.py``
applies): a kernel's error against the fp64 reference op is at most twice the error of the
reference op run in the same dtype, plus one bf16 ulp of the largest value
(``2**-8 * max|fp64|``). The inputs are bf16 values (fp8 values for the fp8 top-k), so the fp64
run sees exactly what the low-precision runs see; what the rule measures is the kernels' own
roundings (P and dS rounded to bf16 before their dots, bf16 outputs, fp32 accumulators, fp8
scales). Scores have a standard deviation of 5 (a peaked softmax, as trained attention has):
with unit-variance scores the bound (dominated by its floor) cannot tell a bf16 rounding of
the scores from fp32 ones, at 5 it can (rounding the scores to bf16 before the running max is
subtracted fails out, dq and dkv).

Shapes are small but keep every code path of the CPU tiles (16 heads, 64 entries a step):
two head blocks with padded heads, the rest channels after ``d_v``, two K steps, ``-1`` and
out-of-range padding, a duplicated entry, a row without valid entry, sinks, the KL target's
scratch (covering both steps, and the second only), the three backward passes with atomic
and deterministic dkv; the indexer with many mid-stream merges (16-entry chunks), empty and
short ranges, tied scores (repeated key rows), the KL path's atomic and key-major dk.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from tests.backends.triton_interpreter import interpreted_kernels  # puts benchmarks/ on sys.path

import interpreter_patch  # noqa: E402
import v4_sparse_section  # noqa: E402
from device_common import RuleCheck, rule_check  # noqa: E402

from cpkv.backends.reference.indexer import indexer_topk_op as ref_topk  # noqa: E402
from cpkv.backends.reference.sparse import selected_probs_op as ref_probs  # noqa: E402
from cpkv.backends.reference.sparse import sparse_attention_op as ref_sparse  # noqa: E402
from cpkv.backends.triton import ops  # noqa: E402
from cpkv.backends.triton.indexer_ops import fp8_rows, indexer_kl_backward, indexer_kl_forward  # noqa: E402
from cpkv.backends.triton.indexer_ops import indexer_topk_launches  # noqa: E402
from cpkv.indexer_loss import indexer_kl_backward_op as ref_kl_backward  # noqa: E402
from cpkv.indexer_loss import indexer_kl_op as ref_kl  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
PEAK = 5.0  # score standard deviation (see the module docstring)


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    interpreted_kernels()


def _assert_rule(checks: dict[str, RuleCheck]) -> None:
    failed = {name: c for name, c in checks.items() if not c.ok}
    assert not failed, "; ".join(f"{n}: err {c.err:.3e} > bound {c.bound:.3e} (reference {c.ref_err:.3e})"
                                 for n, c in failed.items())


def test_interpreter_patch_runs_bf16_as_a_gpu() -> None:
    """A 16x16 bf16 ``tl.dot`` is ``a.float() @ b.float()`` (unpatched: the uint16 patterns multiplied, off by ~1e10);
    bf16 times a Python scalar works; casts to bf16 round to nearest even; fp8 dots are exact products too."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, dot_ptr):
        r = tl.arange(0, 16)
        tile = r[:, None] * 16 + r[None, :]
        tl.store(dot_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))

    @triton.jit
    def bf16_kernel(a_ptr, scaled_ptr, cast_ptr, abs_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r)
        tl.store(scaled_ptr + r, a * 0.375)
        tl.store(cast_ptr + r, (a.to(tl.float32) / 3.0).to(tl.bfloat16))
        tl.store(abs_ptr + r, tl.where(a < 0, -a, a))

    gen = torch.Generator().manual_seed(0)
    for dtype in (BF16, FP8):
        a, b = (torch.randn(16, 16, generator=gen) * 4).to(dtype), (torch.randn(16, 16, generator=gen) * 4).to(dtype)
        dot = torch.empty(16, 16)
        dot_kernel[(1,)](a, b, dot)
        exact = a.double() @ b.double()  # products exact in fp32: only the fp32 sum of 16 terms rounds
        assert float((dot.double() - exact).abs().max()) <= 16 * 2**-24 * float((a.double().abs() @ b.double().abs()).max())
    a = (torch.randn(16, generator=gen) * 4).to(BF16)
    scaled, cast, absolute = (torch.empty(16, dtype=BF16) for _ in range(3))
    bf16_kernel[(1,)](a, scaled, cast, absolute)
    assert torch.equal(scaled, a * 0.375) and torch.equal(cast, (a.float() / 3.0).bfloat16())
    assert torch.equal(absolute, a.abs())


def test_bf16_bits_round_as_torch() -> None:
    """The patch's conversions: bf16 -> fp32 exact, fp32 -> bf16 nearest even (ties, overflow to inf, subnormals, NaN)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1)) * torch.logspace(-40, 38, 4096)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.3961e38, 1e-40, 0.0, -0.0, float("inf")])
    x = torch.cat([x, ties])
    bits = interpreter_patch.fp32_to_bf16_bits(x.numpy())
    assert np.array_equal(bits, x.bfloat16().view(torch.int16).numpy().view(np.uint16))
    back = torch.from_numpy(interpreter_patch.bf16_bits_to_fp32(bits))
    assert torch.equal(back, x.bfloat16().float())
    nan = interpreter_patch.fp32_to_bf16_bits(np.array([float("nan")], np.float32))
    assert np.isnan(interpreter_patch.bf16_bits_to_fp32(nan)).all()


# ------------------------------------------------------------------ sparse attention

CASES = [  # (T, H, D, d_v, N, K): two head blocks + rest channels + two K steps; one block, D == d_v, one step
    (6, 20, 48, 32, 40, 80),
    (5, 4, 64, 64, 30, 20),
]


def _sparse_inputs(case: tuple[int, ...]) -> dict[str, Tensor]:
    """bf16 q, kv, d_out (bf16 values), fp32 sinks and d_lse of bf16 values; indices with every kind of padding."""
    num_q, heads, dim, d_v, num_kv, width = case
    gen = torch.Generator().manual_seed(sum(case))
    idx = torch.randint(-1, num_kv, (num_q, width), generator=gen)
    idx[1, 0] = idx[1, 1] = num_kv - 1  # a duplicate: two separate keys
    idx[2] = -1  # no valid entry: the sink only
    idx[3, 2], idx[4, 3] = num_kv, -5  # outside [0, N): padding too
    return {
        "q": (torch.randn(num_q, heads, dim, generator=gen) * PEAK).to(BF16),
        "kv": torch.randn(num_kv, dim, generator=gen).to(BF16),
        "sinks": (torch.randn(heads, generator=gen) * PEAK).to(BF16).float(),
        "idx": idx.int(),
        "d_out": torch.randn(num_q, heads, d_v, generator=gen).to(BF16),
        "d_lse": torch.randn(num_q, heads, generator=gen).to(BF16).float(),
    }


def _sparse_checks(case: tuple[int, ...]) -> dict[str, RuleCheck]:
    """out, lse, dq, dkv, dsinks of the bf16 kernels (atomic and deterministic dkv) by the rule."""
    dim, d_v = case[2], case[3]
    x, scale = _sparse_inputs(case), dim**-0.5

    def reference(q: Tensor, kv: Tensor, sinks: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
        return ref_sparse(q, kv, idx, sinks, scale, d_v, 64)

    exact = v4_sparse_section.grads_of(reference, x, torch.float64)
    low = v4_sparse_section.grads_of(reference, x, BF16)
    checks = {}
    for mode in ("atomic", "deterministic"):
        def triton(q: Tensor, kv: Tensor, sinks: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
            return ops.sparse_attention_op(q, kv, idx, sinks, scale, d_v, mode == "deterministic")

        got = v4_sparse_section.grads_of(triton, x, BF16)
        for name, g, e, lo in zip(("out", "lse", "dq", "dkv", "dsinks"), got, exact, low):
            checks[f"{name} ({mode})"] = rule_check(g, e, lo)
    return checks


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_sparse_attention_bf16_within_twice_the_reference_error(case: tuple[int, ...]) -> None:
    _assert_rule(_sparse_checks(case))


def _kl_target_checks(case: tuple[int, ...]) -> dict[str, RuleCheck]:
    """The KL target from the forward (its bf16 ``exp(s - m)`` scratch) and ``selected_probs``, by the rule."""
    x, dim, d_v, width = _sparse_inputs(case), case[2], case[3], case[5]
    q, kv, sinks, idx, scale = x["q"], x["kv"], x["sinks"], x["idx"], dim**-0.5
    checks = {}
    with torch.no_grad():
        lse = ops.sparse_attention_op(q, kv, idx, sinks, scale, d_v, False)[1]
        for probs_from in (8, width - 10):  # the target over every step; over the last one only
            exact, low = (ref_probs(q.to(dt), kv.to(dt), idx[:, probs_from:],
                                    ref_sparse(q.to(dt), kv.to(dt), idx, sinks.to(dt), scale, d_v, 64)[1], scale, 64)
                          for dt in (torch.float64, BF16))
            probs = ops.sparse_attention_probs_op(q, kv, idx, sinks, scale, d_v, False, probs_from)[2]
            checks[f"KL target from {probs_from} (forward)"] = rule_check(probs, exact, low)
            selected = ops.selected_probs_op(q, kv, idx[:, probs_from:], lse, scale)
            checks[f"KL target from {probs_from} (selected_probs)"] = rule_check(selected, exact, low)
    return checks


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_kl_target_bf16_within_twice_the_reference_error(case: tuple[int, ...]) -> None:
    _assert_rule(_kl_target_checks(case))


# ------------------------------------------------------------------ the indexer

def _indexer_inputs(dtype: torch.dtype) -> dict[str, Tensor | None]:
    """Kernel inputs (bf16, or fp8 payloads with the query scales in the weights and per-key scales) and their
    dequantized fp64 values; key rows 4..8 repeat row 4 (exact ties), ranges empty, short and long."""
    gen = torch.Generator().manual_seed(21)
    num_q, heads, dim, num_k = 20, 3, 32, 90
    q = torch.randn(num_q, heads, dim, generator=gen) * torch.logspace(-1, 1, num_q)[:, None, None]
    k = torch.randn(num_k, dim, generator=gen)
    k[5:9] = k[4]
    w = torch.rand(num_q, heads, generator=gen) * dim**-0.5
    start = torch.randint(0, 10, (num_q,), generator=gen)
    count = torch.randint(20, num_k - 10, (num_q,), generator=gen)
    count[0], count[1] = 0, 3  # nothing visible; fewer than topk visible
    if dtype == FP8:
        q8, q_scale = fp8_rows(q)
        k8, k_scale = fp8_rows(k)
        exact = (q8.double() * q_scale.double()[..., None], k8.double() * k_scale.double()[:, None], w.double())
        return {"q": q8, "k": k8, "w": w * q_scale, "k_scale": k_scale, "start": start, "count": count,
                "q64": exact[0], "k64": exact[1], "w64": exact[2]}
    qb, kb = q.to(dtype), k.to(dtype)
    return {"q": qb, "k": kb, "w": w, "k_scale": None, "start": start, "count": count,
            "q64": qb.double(), "k64": kb.double(), "w64": w.double()}


def _picked_sums(indices: Tensor, scores64: Tensor) -> Tensor:
    """Per query, the sum of the fp64 scores ``[T, N]`` of the entries in ``indices`` (``-1`` adds nothing)."""
    return torch.where(indices >= 0, scores64.gather(1, indices.clamp(min=0)), 0.0).sum(1)


@pytest.mark.parametrize("dtype", [BF16, FP8], ids=["bf16", "fp8"])
def test_indexer_topk_within_twice_the_reference_error(dtype: torch.dtype) -> None:
    """The top-k of the bf16 / fp8 kernel (16 x 16 tiles, top-8 over up to 80 entries: many merges).

    Scores (sorted, position by position) and the selection (the fp64 scores of the picked
    entries, summed per query) against the fp64 reference op by the rule; the reference in the
    same dtype is the reference op on the same values (for fp8: dequantized in fp32, what the
    reference backend scores). Ties (the repeated key rows score bitwise equal in the kernel)
    go to the earlier entry.
    """
    x, topk = _indexer_inputs(dtype), 8
    start, count = x["start"], x["count"]
    assert isinstance(start, Tensor) and isinstance(count, Tensor)
    launches, got_i, got_s = indexer_topk_launches(x["q"], x["k"], x["w"], x["k_scale"], start, count, topk,
                                                   block_t=16, block_n=16)
    for launch in launches:
        launch()
    q64, k64, w64 = x["q64"], x["k64"], x["w64"]
    assert isinstance(q64, Tensor) and isinstance(k64, Tensor) and isinstance(w64, Tensor)
    exact_i, exact_s = ref_topk(q64, k64, w64, start, start + count, topk, 32)
    low_in = (q64.to(BF16), k64.to(BF16), w64.float()) if dtype == BF16 else (q64.float(), k64.float(), w64.float())
    low_i, low_s = ref_topk(*low_in, start, start + count, topk, 32)
    scores64 = torch.einsum("thd,nd->thn", q64, k64).relu().mul(w64[..., None]).sum(1)
    checks = {
        "scores": rule_check(got_s, exact_s, low_s),
        "selection": rule_check(_picked_sums(got_i, scores64), _picked_sums(exact_i, scores64),
                                _picked_sums(low_i, scores64)),
    }
    _assert_rule(checks)
    for t in range(got_i.shape[0]):  # ties: of the repeated rows 4..8, the selected ones are the earliest visible
        tied = [j for j in range(4, 9) if int(start[t]) <= j < int(start[t] + count[t])]
        picked = [j for j in tied if j in got_i[t].tolist()]
        assert picked == tied[: len(picked)], (t, picked, tied)
    assert (got_i[0] == -1).all() and (got_i[1, 3:] == -1).all()


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_indexer_kl_bf16_within_twice_the_reference_error(deterministic: bool) -> None:
    """The KL loss over the selected entries and its gradients (bf16 kernels, ``d_dots`` rounded to bf16 for the
    MMAs) against the torch op ``cpkv::indexer_kl`` in fp64, bounded by the torch op in bf16."""
    gen = torch.Generator().manual_seed(8)
    num_q, heads, dim, num_k, width = 6, 3, 32, 11, 40  # K = 40: two 32-entry chunks in the gradient kernel
    q = torch.randn(num_q, heads, dim, generator=gen).to(BF16)
    k = torch.randn(num_k, dim, generator=gen).to(BF16)
    w = torch.randn(num_q, heads, generator=gen).to(BF16).float()
    sel = torch.randint(0, num_k, (num_q, width), generator=gen)
    sel[0] = -1
    sel[1, ::3] = -1
    target = torch.rand(num_q, width, generator=gen) * (sel >= 0)
    target = target / target.sum(1, keepdim=True).clamp_min(1e-30)
    factor = 1.0 / num_q
    got = (indexer_kl_forward(q, k, w, sel, target), *indexer_kl_backward(q, k, w, sel, target, factor, deterministic))
    exact, low = ((ref_kl(q.to(dt), k.to(dt), w.to(dt), sel, target.to(dt), factor)[0],
                   *ref_kl_backward(q.to(dt), k.to(dt), w.to(dt), sel, target.to(dt), factor))
                  for dt in (torch.float64, BF16))
    _assert_rule({name: rule_check(g, e, lo) for name, g, e, lo in zip(("loss", "dq", "dk", "dw"), got, exact, low)})
