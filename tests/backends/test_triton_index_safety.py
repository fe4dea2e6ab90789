"""Index safety of cpkv's Triton ops (under Triton's CPU interpreter): no index reaches memory outside kv.

Every op gets a *narrowed view* (``big[:N]``) whose storage continues with canary rows (NaN
for kv, huge scores for the indexer keys, a sentinel in the dkv buffer); the interpreter
runs the kernels on that very storage, so an out-of-bounds read or write would see or
change the canary. The oracle is the same call with every index outside ``[0, N)``
replaced by ``-1`` (the documented contract: such an index is padding), and for the indexer
the call with ``start``/``end`` clamped to ``[0, N_c]`` (and the reference op on that call).
Comparisons are exact: both calls run the same tiles, a masked entry contributes exactly 0
(score ``-inf``) either way, and the interpreter runs the programs one after another, so
even the fp32 atomics sum in the same order.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tests.backends.triton_interpreter import interpreted_kernels

from cpkv.backends.triton import ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")

T, H, D, DV, N, K = 4, 2, 24, 16, 5, 6  # small: the interpreter runs numpy per tile op
CANARY_ROWS = 4  # storage rows past N: row N + 3 is the last one


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    interpreted_kernels()


def _inputs(dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, kv_big (NaN rows past N), sinks, indices with -2, N, N + 3 (and 2**32 + 1 for int64), their -1 form."""
    gen = torch.Generator().manual_seed(0)
    q, sinks = torch.randn(T, H, D, generator=gen), torch.randn(H, generator=gen)
    kv_big = torch.full((N + CANARY_ROWS, D), float("nan"))
    kv_big[:N] = torch.randn(N, D, generator=gen)
    idx = torch.randint(0, N, (T, K), generator=gen)
    idx[0, 1], idx[1, 0], idx[1, 4], idx[3, 2] = N, N + 3, -1, -2
    idx[2] = torch.tensor([N, N + 3, -2, N, N + 1, -5])  # no valid entry at all
    if dtype == torch.int64:
        idx[0, 3] = 2**32 + 1  # would wrap to row 1 in int32
    clean = torch.where((idx >= 0) & (idx < N), idx, -1)
    return q, kv_big, sinks, idx.to(dtype), clean.to(dtype)


def _attention(q: Tensor, kv_big: Tensor, idx: Tensor, sinks: Tensor, deterministic: bool) -> tuple[Tensor, ...]:
    """(out, lse, dq, dkv, dsinks) of the op on the view ``kv_big[:N]`` (gradients through out and lse)."""
    q_leaf, sink_leaf = q.clone().requires_grad_(True), sinks.clone().requires_grad_(True)
    kv_leaf = kv_big.clone().requires_grad_(True)
    out, lse = ops.sparse_attention_op(q_leaf, kv_leaf[:N], idx, sink_leaf, D**-0.5, DV, deterministic)
    gen = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=gen)).sum() + (lse * torch.randn(lse.shape, generator=gen)).sum()
    dq, dkv, dsinks = torch.autograd.grad(loss, [q_leaf, kv_leaf, sink_leaf])
    return out.detach(), lse.detach(), dq, dkv, dsinks


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sparse_attention_treats_out_of_range_indices_as_padding(dtype: torch.dtype, deterministic: bool) -> None:
    q, kv_big, sinks, idx, clean = _inputs(dtype)
    got = _attention(q, kv_big, idx, sinks, deterministic)
    want = _attention(q, kv_big, clean, sinks, deterministic)
    assert torch.isfinite(want[0]).all(), "the -1 call never reads a NaN canary row"
    for name, g, w in zip(("out", "lse", "dq", "dkv", "dsinks"), got, want):
        assert torch.equal(g, w), name
    assert torch.equal(got[3][N:], torch.zeros(CANARY_ROWS, D)), "no gradient for rows past N"


def test_atomic_dkv_never_writes_past_the_end() -> None:
    q, kv_big, sinks, idx, clean = _inputs(torch.int32)
    kv = kv_big[:N]
    _, lse = ops.sparse_attention_op(q, kv, clean, sinks, D**-0.5, DV, False)
    gen = torch.Generator().manual_seed(2)
    d_out, delta = torch.randn(T, H, DV, generator=gen), torch.randn(T, H, generator=gen)
    results = []
    for indices in (idx, clean):
        grad_big = torch.zeros(N + CANARY_ROWS, D)
        grad_big[N:] = 7.0  # sentinel: an atomic add past row N - 1 would change it
        ops._launch_bwd(d_out, q, kv, indices, lse, delta, D**-0.5, DV, False, dkv=grad_big[:N])
        assert torch.equal(grad_big[N:], torch.full((CANARY_ROWS, D), 7.0)), "dkv written past its end"
        results.append(grad_big[:N])
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_selected_probs_treats_out_of_range_indices_as_padding(dtype: torch.dtype) -> None:
    q, kv_big, sinks, idx, clean = _inputs(dtype)
    kv = kv_big[:N]
    _, lse = ops.sparse_attention_op(q, kv, clean, sinks, D**-0.5, DV, False)
    got = ops.selected_probs_op(q, kv, idx, lse, D**-0.5)
    assert torch.equal(got, ops.selected_probs_op(q, kv, clean, lse, D**-0.5))
    assert torch.equal(got[clean < 0], torch.zeros(int((clean < 0).sum())))


def test_inverted_index_skips_out_of_range_rows() -> None:
    idx = torch.tensor([[1, 3, -2], [7, 1, 2**40]])  # a histogram sized by the largest index would not fit
    pair_t, row_ptr = ops.inverted_index(idx, 3)
    assert row_ptr.tolist() == [0, 0, 2, 2]
    assert pair_t.tolist()[:2] == [0, 1]

