"""Tests for the validated functions of cpkv.backends.reference against a brute-force fp64 oracle.

The custom ops themselves (opcheck, compile, the backend) are tested in test_reference_ops.py.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from torch import Tensor

import cpkv.backends.reference.varlen as varlen_module
from cpkv.backends.reference import (
    indexer_scores,
    indexer_topk,
    range_attention,
    sparse_attention,
    sparse_attention_head_probs,
    varlen_attention,
)

F64 = torch.float64


# --------------------------------------------------------------------------- oracle


def cu(lens: list[int]) -> Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def varlen_mask(lens_q: list[int], lens_kv: list[int], window: int | None = None) -> Tensor:
    """Explicit [T_q, T_kv] mask, built segment by segment from the definition."""
    mask = torch.zeros(sum(lens_q), sum(lens_kv), dtype=torch.bool)
    q0 = k0 = 0
    for lq, lkv in zip(lens_q, lens_kv):
        for i in range(lq):
            for j in range(lkv):
                causal = j <= i + (lkv - lq)
                in_window = window is None or j > i + (lkv - lq) - window
                mask[q0 + i, k0 + j] = causal and in_window
        q0, k0 = q0 + lq, k0 + lkv
    return mask


def oracle(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, sinks: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Dense masked softmax attention in the inputs' dtype; [H, T_q, T_kv] scores.

    Rows with no visible key and no sink give out 0 and lse -inf (computed NaN-free).
    """
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = mask.expand_as(s)
    if sinks is not None:
        s = torch.cat([s, sinks.to(s.dtype)[:, None, None].expand(-1, s.shape[1], 1)], dim=-1)
        mask = torch.cat([mask, torch.ones_like(mask[..., :1])], dim=-1)
    dead = ~mask.any(-1, keepdim=True)
    s = torch.where(mask, s, float("-inf")).where(~dead, 0.0)
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.exp(s - lse) * mask
    out = torch.einsum("hqk,khd->qhd", p[..., : v.shape[0]], v)
    return out, lse.masked_fill(dead, float("-inf"))[..., 0].T


def sparse_mask(indices: Tensor, n: int) -> Tensor:
    mask = torch.zeros(indices.shape[0], n, dtype=torch.bool)
    for t, row in enumerate(indices.tolist()):
        for j in row:
            if j >= 0:
                mask[t, j] = True
    return mask


def grads(fn: Any, inputs: list[Tensor], seed: int = 0) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Run fn, backprop a random weighted sum of out and (finite) lse, return out, lse, grads."""
    inputs = [x.detach().clone().requires_grad_(True) for x in inputs]
    out, lse = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    w_lse = torch.randn(lse.shape, generator=gen, dtype=F64).to(lse.dtype)
    loss = (out * w_out).sum() + (lse.where(lse.isfinite(), 0.0) * w_lse).sum()
    return out.detach(), lse.detach(), list(torch.autograd.grad(loss, inputs))


def rand(*shape: int, dtype: torch.dtype = F64, seed: int = 0) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


# --------------------------------------------------------------------------- varlen

# (lens_q, lens_kv, H, H_kv, D, D_v, window, with_sinks, block_size)
VARLEN_CASES = [
    ([7], [7], 2, 2, 8, 8, None, False, 1024),  # MHA, one segment
    ([3, 0, 5, 2], [6, 4, 5, 9], 4, 2, 8, 6, None, False, 3),  # GQA, zero-length q, Lkv > Lq
    ([4, 6], [10, 6], 4, 1, 5, 3, 3, True, 5),  # MQA, window, sinks
    ([0, 0, 9], [0, 2, 9], 2, 1, 4, 4, 1, True, 2),  # window 1, zero-length pairs
    ([12], [20], 3, 3, 6, 2, 4, False, 4),  # window smaller than the block
]


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_matches_oracle_fp64(case: tuple[Any, ...]) -> None:
    lens_q, lens_kv, h, h_kv, d, d_v, window, with_sinks, bs = case
    q, k, v = rand(sum(lens_q), h, d), rand(sum(lens_kv), h_kv, d, seed=1), rand(sum(lens_kv), h_kv, d_v, seed=2)
    inputs = [q, k, v] + ([rand(h, seed=3)] if with_sinks else [])
    mask, scale = varlen_mask(lens_q, lens_kv, window), 0.7

    def run(q: Tensor, k: Tensor, v: Tensor, *sinks: Tensor) -> tuple[Tensor, Tensor]:
        return varlen_attention(q, k, v, cu(lens_q), cu(lens_kv), scale=scale, window=window,
                                sinks=sinks[0] if sinks else None, block_size=bs)

    out, lse, got = grads(run, inputs)
    ref_out, ref_lse, expected = grads(lambda q, k, v, *s: oracle(q, k, v, mask, scale, *s), inputs)
    assert out.dtype == F64 and lse.dtype == F64
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


def test_bottom_right_alignment_drawn_mask() -> None:
    # Lq = 3 queries against Lkv = 5 keys; 1 = visible. Window 2 keeps the query + 1 earlier key.
    causal = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    windowed = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    for window, drawn in ((None, causal), (2, windowed)):
        assert torch.equal(varlen_mask([3], [5], window), drawn)
        # zero queries -> uniform weights; one-hot values reveal exactly which keys are seen
        q, k, v = torch.zeros(3, 1, 4, dtype=F64), rand(5, 1, 4), torch.eye(5, dtype=F64)[:, None, :]
        out = varlen_attention(q, k, v, cu([3]), cu([5]), window=window).out[:, 0]
        assert torch.equal(out > 0, drawn)
        torch.testing.assert_close(out.sum(-1), torch.ones(3, dtype=F64))


def test_varlen_block_size_invariance() -> None:
    lens_q, lens_kv = [5, 0, 11, 3], [9, 1, 11, 8]
    q, k, v, sinks = rand(19, 4, 6), rand(29, 2, 6, seed=1), rand(29, 2, 5, seed=2), rand(4, seed=3)
    results = [
        varlen_attention(q, k, v, cu(lens_q), cu(lens_kv), window=window, sinks=sinks, block_size=bs)
        for window in (None, 4) for bs in (1, 3, 5, 1024)
    ]
    for i, res in enumerate(results):
        base = results[0 if i < 4 else 4]
        torch.testing.assert_close(res.out, base.out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(res.lse, base.lse, rtol=1e-12, atol=1e-12)


def test_varlen_gradcheck() -> None:
    lens_q, lens_kv = [2, 0, 3], [3, 1, 4]
    inputs = [rand(5, 2, 3), rand(8, 1, 3, seed=1), rand(8, 1, 2, seed=2), rand(2, seed=3)]
    inputs = [x.requires_grad_(True) for x in inputs]

    def fn(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
        res = varlen_attention(q, k, v, cu(lens_q), cu(lens_kv), window=2, sinks=sinks, block_size=2)
        return res.out, res.lse

    assert torch.autograd.gradcheck(fn, tuple(inputs))


def test_varlen_shared_kv() -> None:
    """DeepSeek-V4 shared KV: v is a view k[..., :d_v]; both grads accumulate into k."""
    lens = [4, 6]
    q, k = rand(10, 4, 8), rand(10, 1, 8, seed=1)
    mask = varlen_mask(lens, lens)
    out, _, (dq, dk) = grads(lambda q, k: varlen_attention(q, k, k[..., :5], cu(lens), cu(lens), block_size=3), [q, k])
    ref_out, _, (rq, rk) = grads(lambda q, k: oracle(q, k, k[..., :5], mask, 8**-0.5), [q, k])
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dq, rq, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(dk, rk, rtol=1e-9, atol=1e-10)


def test_varlen_fp32_matches_fp64_oracle() -> None:
    # fp32 accumulation over ~40 keys of O(1) terms: relative error ~ few * 2^-24 * sqrt(40);
    # 1e-5 relative (1e-5 absolute) leaves a wide margin without hiding real bugs (~1e-1).
    lens_q, lens_kv = [16, 24], [20, 24]
    q, k, v, sinks = rand(40, 4, 16), rand(44, 2, 16, seed=1), rand(44, 2, 16, seed=2), rand(4, seed=3)
    res = varlen_attention(q.float(), k.float(), v.float(), cu(lens_q), cu(lens_kv),
                           sinks=sinks.float(), block_size=7)
    ref_out, ref_lse = oracle(q, k, v, varlen_mask(lens_q, lens_kv), 0.25, sinks)
    assert res.out.dtype == torch.float32 and res.lse.dtype == torch.float32
    torch.testing.assert_close(res.out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(res.lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_varlen_bf16_error_bounded_by_plain_bf16() -> None:
    lens_q, lens_kv = [32, 40], [48, 40]
    q, k, v = rand(72, 4, 32), rand(88, 2, 32, seed=1), rand(88, 2, 32, seed=2)
    mask = varlen_mask(lens_q, lens_kv)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref_out, ref_lse = oracle(q, k, v, mask, 32**-0.5)
    plain_out, _ = oracle(qb, kb, vb, mask, 32**-0.5)  # plain dense attention computed in bf16
    res = varlen_attention(qb, kb, vb, cu(lens_q), cu(lens_kv), block_size=16)
    assert res.out.dtype == torch.bfloat16 and res.lse.dtype == torch.float32
    err = (res.out.double() - ref_out).abs().max()
    assert err <= 2 * (plain_out.double() - ref_out).abs().max() + 1e-3
    torch.testing.assert_close(res.lse.double(), ref_lse, rtol=0, atol=2e-2)


def test_varlen_no_queries() -> None:
    q, k, v = rand(0, 2, 4), rand(3, 2, 4, seed=1), rand(3, 2, 4, seed=2)
    out, lse, (dq, dk, dv) = grads(lambda q, k, v: varlen_attention(q, k, v, cu([0]), cu([3])), [q, k, v])
    assert out.shape == (0, 2, 4) and lse.shape == (0, 2)
    assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_varlen_blocks_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """512 x 512 causal with block_size=64: every score tile is at most [64, H, 64]."""
    seen: list[int] = []
    scores = varlen_module._range_scores

    def spy(*args: Any) -> Tensor:
        s = scores(*args)
        seen.append(s.numel())
        return s

    monkeypatch.setattr(varlen_module, "_range_scores", spy)
    t, h = 512, 2
    q, k, v = (rand(t, h, 16, dtype=torch.float32, seed=i).requires_grad_(True) for i in range(3))
    out = varlen_attention(q, k, v, cu([t]), cu([t]), block_size=64).out
    grad_list = torch.autograd.grad(out.sum(), [q, k, v])
    assert max(seen) == 64 * h * 64  # forward and backward tiles alike
    assert len(seen) == 2 * (8 * 9 // 2)  # causal: only the 36 tiles on or below the diagonal, twice
    assert all(bool(g.isfinite().all()) for g in grad_list)


# --------------------------------------------------------------------------- key ranges

# Row t sees keys [lo, hi): rows 0 and 3 see nothing, the ranges overlap; both non-decreasing.
RANGE_LO = torch.tensor([0, 0, 0, 3, 3, 3, 5, 5])
RANGE_HI = torch.tensor([0, 1, 3, 3, 5, 7, 7, 9])


def range_mask(lo: Tensor, hi: Tensor, n: int) -> Tensor:
    mask = torch.zeros(lo.numel(), n, dtype=torch.bool)
    for t, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
        for j in range(a, b):
            mask[t, j] = True
    return mask


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("block_size", [1, 3, 1024])
def test_range_matches_oracle_fp64(with_sinks: bool, block_size: int) -> None:
    lo, hi = RANGE_LO, RANGE_HI
    q, k, v = rand(8, 4, 6), rand(9, 2, 6, seed=1), rand(9, 2, 5, seed=2)
    inputs = [q, k, v] + ([rand(4, seed=3)] if with_sinks else [])
    mask = range_mask(lo, hi, 9)

    def run(q: Tensor, k: Tensor, v: Tensor, *sinks: Tensor) -> tuple[Tensor, Tensor]:
        return range_attention(q, k, v, lo, hi, scale=0.6, sinks=sinks[0] if sinks else None, block_size=block_size)

    out, lse, got = grads(run, inputs)  # the lse term checks the gradient through lse
    ref_out, ref_lse, expected = grads(lambda q, k, v, *s: oracle(q, k, v, mask, 0.6, *s), inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)
    if not with_sinks:
        assert bool(lse[0].isneginf().all()) and torch.equal(out[0], torch.zeros_like(out[0]))


def test_range_empty_rows_where_hi_below_lo() -> None:
    """A row with lo > hi sees nothing, exactly like lo == hi (out 0, lse -inf)."""
    q, k, v = rand(8, 2, 4), rand(9, 1, 4, seed=1), rand(9, 1, 4, seed=2)
    a = range_attention(q, k, v, RANGE_LO, RANGE_HI)
    b = range_attention(q, k, v, RANGE_LO, RANGE_HI.where(torch.arange(8) != 3, 1))
    assert torch.equal(a.out, b.out) and torch.equal(a.lse, b.lse)
    assert bool(b.lse[3].isneginf().all()) and torch.equal(b.out[3], torch.zeros_like(b.out[3]))


# --------------------------------------------------------------------------- non-finite isolation
# Packed segments are independent: a NaN/inf token must reach only the outputs and gradients that
# depend on it, even though the tiles (block_size 8 here) span segments. Everything else must be
# finite and equal to a clean run (the bad token replaced by a finite value).

ISO_LENS = [7, 13, 13]  # cu_seqlens [0, 7, 20, 33]: tiles [0, 8), [8, 16), ... span documents
ISO_LO = torch.tensor([0, 0, 0, 2, 2, 5, 5, 5, 9, 12, 12, 15])  # range rows 0 and 9 see nothing
ISO_HI = torch.tensor([0, 3, 5, 5, 8, 8, 10, 12, 12, 12, 18, 20])


def check_isolated(run: Any, inputs: list[Tensor], mask: Tensor, which: int, index: int, value: float) -> None:
    """Corrupt token ``index`` of ``inputs[which]`` (0 = q, 1 = k, 2 = v; every head) with ``value``.

    Rows that depend on it: the bad query itself, or the queries that see the bad key. The loss
    weighs every output, so their gradients (dq of those rows, dk/dv of every key they see, the
    sinks) may be non-finite; every other output and gradient equals the clean run. With a NaN
    (always for k, v; for q) the dependents are certainly non-finite (out, dq, dk).
    """
    bad = [x.clone() for x in inputs]
    bad[which][index] = value
    out0, lse0, g0 = grads(run, inputs)
    out1, lse1, g1 = grads(run, bad)
    rows = torch.zeros(mask.shape[0], dtype=torch.bool)
    if which == 0:
        rows[index] = bool(mask[index].any())
    else:
        rows = mask[:, index].clone()
    keys = mask[rows].any(0)  # keys seen by a row that depends on the bad token
    ok_rows, ok_keys = ~rows, ~keys
    assert bool(ok_rows.any()) and bool(ok_keys.any())
    for got, clean, ok in ((out1, out0, ok_rows), (lse1, lse0, ok_rows), (g1[0], g0[0], ok_rows),
                           (g1[1], g0[1], ok_keys), (g1[2], g0[2], ok_keys)):
        if got is not lse1:
            assert bool(got[ok].isfinite().all())
        torch.testing.assert_close(got[ok], clean[ok])
    certain = math.isnan(value) or which == 2  # an inf key/query may only mask its pair (score -inf)
    if certain and bool(rows.any()):
        assert not bool(out1[rows].isfinite().any())
        assert not bool(g1[0][rows].isfinite().any())
        assert not bool(g1[1][keys].isfinite().any())
    if len(inputs) > 3 and not bool(rows.any()):
        torch.testing.assert_close(g1[3], g0[3])
    elif len(inputs) > 3 and certain:  # every sink sees every row: the bad rows reach dsinks
        assert not bool(g1[3].isfinite().any())
    empty = ~mask.any(1)  # rows that see nothing and have no sink: out 0, finite gradients
    if len(inputs) == 3 and bool(empty.any()):
        assert torch.equal(out1[empty], torch.zeros_like(out1[empty]))
        assert torch.equal(g1[0][empty], torch.zeros_like(g1[0][empty]))


ISO_BAD = [(1, 3, math.nan), (1, 3, math.inf), (2, 3, math.nan), (2, 3, -math.inf), (1, 12, math.nan),
           (2, 19, math.nan), (0, 4, math.nan), (0, 7, math.nan), (0, 15, math.inf)]


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("which", "index", "value"), ISO_BAD)
@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (4, False), (None, True)])
def test_varlen_nonfinite_token_stays_in_its_document(
    dtype: torch.dtype, which: int, index: int, value: float, window: int | None, with_sinks: bool
) -> None:
    t = sum(ISO_LENS)
    inputs = [rand(t, 4, 8, dtype=dtype), rand(t, 2, 8, dtype=dtype, seed=1), rand(t, 2, 6, dtype=dtype, seed=2)]
    inputs += [rand(4, dtype=dtype, seed=3)] if with_sinks else []

    def run(q: Tensor, k: Tensor, v: Tensor, *sinks: Tensor) -> tuple[Tensor, Tensor]:
        return varlen_attention(q, k, v, cu(ISO_LENS), cu(ISO_LENS), window=window,
                                sinks=sinks[0] if sinks else None, block_size=8)

    check_isolated(run, inputs, varlen_mask(ISO_LENS, ISO_LENS, window), which, index, value)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("which", "index", "value"), [(1, 6, math.nan), (2, 6, math.inf), (1, 0, math.nan),
                                                       (2, 19, math.nan), (0, 6, math.nan), (0, 9, math.nan)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_range_nonfinite_token_stays_in_its_rows(
    dtype: torch.dtype, which: int, index: int, value: float, with_sinks: bool
) -> None:
    inputs = [rand(12, 4, 8, dtype=dtype), rand(20, 2, 8, dtype=dtype, seed=1), rand(20, 2, 6, dtype=dtype, seed=2)]
    inputs += [rand(4, dtype=dtype, seed=3)] if with_sinks else []

    def run(q: Tensor, k: Tensor, v: Tensor, *sinks: Tensor) -> tuple[Tensor, Tensor]:
        return range_attention(q, k, v, ISO_LO, ISO_HI, sinks=sinks[0] if sinks else None, block_size=4)

    check_isolated(run, inputs, range_mask(ISO_LO, ISO_HI, 20), which, index, value)


def test_nonfinite_kv_head_stays_in_its_heads() -> None:
    """A NaN in kv head 0 of one token spares the query heads of kv head 1, in the same rows."""
    t = sum(ISO_LENS)
    q, k, v = rand(t, 4, 8), rand(t, 2, 8, seed=1), rand(t, 2, 6, seed=2)

    def run(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return varlen_attention(q, k, v, cu(ISO_LENS), cu(ISO_LENS), block_size=8)

    out0, _, g0 = grads(run, [q, k, v])
    k[3, 0, 2] = math.nan
    out1, _, g1 = grads(run, [q, k, v])
    torch.testing.assert_close(out1[:, 2:], out0[:, 2:])
    torch.testing.assert_close(g1[0][:, 2:], g0[0][:, 2:])
    torch.testing.assert_close(g1[1][:, 1], g0[1][:, 1])
    torch.testing.assert_close(g1[2][:, 1], g0[2][:, 1])
    assert not bool(out1[3:7, :2].isfinite().any()) and bool(out1[7:].isfinite().all())


def test_nonfinite_upstream_gradient_stays_in_its_document() -> None:
    """A NaN in d_out of one row reaches only dq of that row and dk/dv of the keys it sees."""
    t = sum(ISO_LENS)
    q, k, v = (x.requires_grad_(True) for x in (rand(t, 4, 8), rand(t, 2, 8, seed=1), rand(t, 2, 6, seed=2)))
    out = varlen_attention(q, k, v, cu(ISO_LENS), cu(ISO_LENS), block_size=8).out
    d_out = rand(*out.shape, seed=4)
    clean = torch.autograd.grad(out, [q, k, v], d_out, retain_graph=True)
    d_out[9] = math.nan  # document B row 2 sees keys 7..9
    got = torch.autograd.grad(out, [q, k, v], d_out)
    rows, keys = torch.arange(t) != 9, (torch.arange(t) < 7) | (torch.arange(t) > 9)
    torch.testing.assert_close(got[0][rows], clean[0][rows])
    for g, c in zip(got[1:], clean[1:]):
        torch.testing.assert_close(g[keys], c[keys])
        assert not bool(g[7:10].isfinite().any())


# --------------------------------------------------------------------------- sparse

INDICES = torch.tensor([[0, 3, 5, -1], [2, -1, 7, 1], [-1, -1, -1, -1], [6, 4, 0, 2], [7, -1, -1, -1]])


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("block_size", [1, 2, 1024])
def test_sparse_matches_oracle_fp64(with_sinks: bool, block_size: int) -> None:
    q, kv = rand(5, 3, 6), rand(8, 6, seed=1)
    inputs = [q, kv] + ([rand(3, seed=2)] if with_sinks else [])
    mask = sparse_mask(INDICES, 8)

    def run(q: Tensor, kv: Tensor, *sinks: Tensor) -> tuple[Tensor, Tensor]:
        return sparse_attention(q, kv, INDICES, d_v=4, sinks=sinks[0] if sinks else None, block_size=block_size)

    def ref(q: Tensor, kv: Tensor, *sinks: Tensor) -> tuple[Tensor, Tensor]:
        return oracle(q, kv[:, None], kv[:, None, :4], mask, 6**-0.5, *sinks)

    out, lse, got = grads(run, inputs)
    ref_out, ref_lse, expected = grads(ref, inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


def test_sparse_fully_masked_row() -> None:
    q, kv, sinks = rand(5, 3, 6), rand(8, 6, seed=1), rand(3, seed=2)
    for s in (None, sinks):
        out, lse, grad_list = grads(lambda q, kv: sparse_attention(q, kv, INDICES.int(), d_v=6, sinks=s), [q, kv])
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        expected_lse = torch.full((3,), -math.inf, dtype=F64) if s is None else sinks
        torch.testing.assert_close(lse[2], expected_lse)
        assert all(bool(g.isfinite().all()) for g in grad_list)
        assert torch.equal(grad_list[0][2], torch.zeros_like(grad_list[0][2]))


def test_sparse_gradcheck() -> None:
    inputs = tuple(x.requires_grad_(True) for x in (rand(5, 2, 3), rand(8, 3, seed=1), rand(2, seed=2)))

    def fn(q: Tensor, kv: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
        res = sparse_attention(q, kv, INDICES, d_v=2, sinks=sinks, block_size=2)
        return res.out, res.lse

    assert torch.autograd.gradcheck(fn, inputs)


def test_sparse_head_probs() -> None:
    q, kv, sinks = rand(5, 3, 6), rand(8, 6, seed=1), rand(3, seed=2)
    lse = sparse_attention(q, kv, INDICES, d_v=4, sinks=sinks, scale=0.3).lse
    probs = sparse_attention_head_probs(q, kv, INDICES, lse, scale=0.3, block_size=2)
    s = torch.einsum("thd,nd->thn", q, kv) * 0.3
    expected = torch.zeros(INDICES.shape, dtype=F64)
    for t, row in enumerate(INDICES.tolist()):
        cols = [i for i, j in enumerate(row) if j >= 0]
        logits = torch.cat([s[t][:, [row[i] for i in cols]], sinks[:, None]], 1)  # sink in denominator
        expected[t, cols] = torch.softmax(logits, 1)[:, :-1].sum(0)
    torch.testing.assert_close(probs, expected, rtol=1e-10, atol=1e-12)
    assert probs.dtype == F64
    assert sparse_attention_head_probs(q.float(), kv.float(), INDICES, lse.float()).dtype == torch.float32


# --------------------------------------------------------------------------- indexer


def test_indexer_scores_formula() -> None:
    q, k, w = rand(4, 3, 5), rand(6, 5, seed=1), rand(4, 3, seed=2)
    expected = torch.zeros(4, 6, dtype=F64)
    for t in range(4):
        for j in range(6):
            expected[t, j] = sum(w[t, h] * max(float(q[t, h] @ k[j]), 0.0) for h in range(3))
    torch.testing.assert_close(indexer_scores(q, k, w), expected, rtol=1e-12, atol=1e-12)
    assert indexer_scores(q.bfloat16(), k.bfloat16(), w.float()).dtype == torch.float32


@pytest.mark.parametrize("block_size", [1, 3, 1024])
def test_indexer_topk_brute_force(block_size: int) -> None:
    t, n, topk = 9, 12, 4
    q, k, w = rand(t, 8, 5), rand(n, 5, seed=1), rand(t, 8, seed=2)
    start = torch.tensor([0, 0, 0, 0, 3, 3, 5, 12, 2])
    count = torch.tensor([0, 1, 3, 6, 9, 2, 7, 0, 10])
    res = indexer_topk(q, k, w, start, count, topk=topk, block_size=block_size)
    dense = indexer_scores(q, k, w)
    assert res.indices.dtype == torch.int64 and res.indices.shape == (t, topk)
    for row in range(t):
        visible = dense[row, start[row] : start[row] + count[row]]
        m = min(topk, visible.numel())
        expected = torch.cat([visible.sort(descending=True).values[:m], torch.full((topk - m,), -math.inf, dtype=F64)])
        torch.testing.assert_close(res.scores[row], expected, rtol=1e-12, atol=1e-12)
        idx = res.indices[row]
        assert torch.equal(idx[m:], torch.full((topk - m,), -1))
        chosen = idx[:m]  # valid, distinct, visible, and carrying their own dense scores (ties safe)
        assert len(set(chosen.tolist())) == m
        assert bool(((chosen >= start[row]) & (chosen < start[row] + count[row])).all())
        torch.testing.assert_close(dense[row, chosen], res.scores[row, :m], rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- bad inputs

Q, K, V = torch.randn(5, 4, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 6)
CQ, CK = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 7])
KV, IDX = torch.randn(6, 8), torch.tensor([[0, 1]] * 5)
W, START, COUNT = torch.randn(5, 4), torch.zeros(5, dtype=torch.int64), torch.ones(5, dtype=torch.int64)

BAD_CALLS = [
    ("q", TypeError, lambda: varlen_attention(Q.numpy(), K, V, CQ, CK)),  # type: ignore[arg-type]
    ("q", ValueError, lambda: varlen_attention(Q[0], K, V, CQ, CK)),
    ("k.dtype", ValueError, lambda: varlen_attention(Q, K.double(), V, CQ, CK)),
    ("v.shape", ValueError, lambda: varlen_attention(Q, K, V[:6], CQ, CK)),
    ("k.shape[2]", ValueError, lambda: varlen_attention(Q, K[..., :4], V, CQ, CK)),
    ("H_kv", ValueError, lambda: varlen_attention(Q, torch.randn(7, 3, 8), torch.randn(7, 3, 6), CQ, CK)),
    ("cu_seqlens_q", TypeError, lambda: varlen_attention(Q, K, V, CQ.float(), CK)),
    ("cu_seqlens_q", ValueError, lambda: varlen_attention(Q, K, V, torch.tensor([1, 2, 5]), CK)),
    ("cu_seqlens_q", ValueError, lambda: varlen_attention(Q, K, V, torch.tensor([0, 3, 2, 5]), CK[[0, 1, 1, 2]])),
    ("cu_seqlens_q", ValueError, lambda: varlen_attention(Q, K, V, CQ[None], CK)),
    ("cu_seqlens_kv", ValueError, lambda: varlen_attention(Q, K, V, CQ, torch.tensor([0, 3, 6]))),
    ("len(cu_seqlens_kv)", ValueError, lambda: varlen_attention(Q, K, V, CQ, torch.tensor([0, 1, 3, 7]))),
    ("cu_seqlens_kv segment 0", ValueError, lambda: varlen_attention(Q, K, V, CQ, torch.tensor([0, 1, 7]))),
    ("window", ValueError, lambda: varlen_attention(Q, K, V, CQ, CK, window=0)),
    ("window", TypeError, lambda: varlen_attention(Q, K, V, CQ, CK, window=2.0)),  # type: ignore[arg-type]
    ("block_size", ValueError, lambda: varlen_attention(Q, K, V, CQ, CK, block_size=0)),
    ("sinks", ValueError, lambda: varlen_attention(Q, K, V, CQ, CK, sinks=torch.zeros(3))),
    ("sinks", TypeError, lambda: sparse_attention(Q, KV, IDX, d_v=4, sinks=torch.zeros(4, dtype=torch.int64))),
    ("key_lo", TypeError, lambda: range_attention(Q, K, V, START.float(), COUNT)),
    ("key_hi.shape", ValueError, lambda: range_attention(Q, K, V, START, COUNT[:4])),
    ("non-decreasing", ValueError, lambda: range_attention(Q, K, V, START, torch.tensor([3, 2, 2, 2, 2]))),
    ("key ranges", ValueError, lambda: range_attention(Q, K, V, START, COUNT + 7)),
    ("kv.dtype", ValueError, lambda: sparse_attention(Q, KV.double(), IDX, d_v=4)),
    ("d_v", TypeError, lambda: sparse_attention(Q, KV, IDX, d_v=4.0)),  # type: ignore[arg-type]
    ("indices", TypeError, lambda: sparse_attention(Q, KV, IDX.float(), d_v=4)),
    ("indices", ValueError, lambda: sparse_attention(Q, KV, IDX + 6, d_v=4)),
    ("indices.shape[0]", ValueError, lambda: sparse_attention(Q, KV, IDX[:4], d_v=4)),
    ("kv.shape[1]", ValueError, lambda: sparse_attention(Q, KV[:, :4], IDX, d_v=4)),
    ("d_v", ValueError, lambda: sparse_attention(Q, KV, IDX, d_v=9)),
    ("lse", ValueError, lambda: sparse_attention_head_probs(Q, KV, IDX, torch.zeros(5, 3))),
    ("weights", ValueError, lambda: indexer_scores(Q, KV, W[:, :3])),
    ("visible_count", TypeError, lambda: indexer_topk(Q, KV, W, START, COUNT.float(), topk=2)),
    ("visible_start", ValueError, lambda: indexer_topk(Q, KV, W, START + 6, COUNT, topk=2)),
    ("visible_start", ValueError, lambda: indexer_topk(Q, KV, W, START, COUNT - 2, topk=2)),
    ("topk", ValueError, lambda: indexer_topk(Q, KV, W, START, COUNT, topk=0)),
    ("topk", TypeError, lambda: indexer_topk(Q, KV, W, START, COUNT, topk=None)),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "error", "call"), BAD_CALLS, ids=[f"{i}-{c[0]}" for i, c in enumerate(BAD_CALLS)])
def test_bad_inputs(name: str, error: type[Exception], call: Any) -> None:
    """Each bad input raises the documented error type, and the message names the argument."""
    with pytest.raises(error, match=re.escape(name)):
        call()
