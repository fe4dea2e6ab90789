"""cpkv's Triton kernels (``cpkv.backends.triton.ops``) on CPU under Triton's interpreter, against the reference ops.

Everything runs in fp32, where both sides differ only in summation order: tolerances are
``1e-5`` relative to the largest magnitude (a few fp32 ulps of accumulated error over at most
a few hundred terms), ``1e-4`` for gradients (longer sums). Shapes are small (the interpreter
runs numpy per tile op) but cover D = 512, -1 padding anywhere, duplicate indices, empty
lists (K = 0), rows with no valid entry, and sinks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

from tests.backends.triton_interpreter import interpreted_kernels

from cpkv.backends.reference.sparse import selected_probs_op as ref_probs  # noqa: E402
from cpkv.backends.reference.sparse import sparse_attention_op as ref_sparse  # noqa: E402
from cpkv.backends.triton import ops  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    interpreted_kernels()


def _close(got: Tensor, want: Tensor, rel: float) -> None:
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)), "same -inf pattern"
    assert torch.equal(got[~finite], want[~finite])
    scale = want[finite].abs().max().item() if finite.any() else 1.0
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= rel * max(scale, 1.0), f"max error {err:.3g} > {rel:.0e} * {scale:.3g}"


def _indices(num_q: int, width: int, num_kv: int, gen: torch.Generator) -> Tensor:
    """Random rows with -1 padding anywhere, one duplicated entry, one all-padding row."""
    idx = torch.randint(-1, num_kv, (num_q, width), generator=gen)
    if num_q > 2 and width > 2:
        idx[1, 0] = idx[1, 1] = num_kv - 1  # duplicate: two separate keys
        idx[2] = -1  # no valid entry
    return idx


def _run(q: Tensor, kv: Tensor, idx: Tensor, sinks: Tensor | None, d_v: int, deterministic: bool, triton: bool):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, kv)]
    sink = None if sinks is None else sinks.detach().clone().requires_grad_(True)
    scale = q.shape[-1] ** -0.5
    if triton:
        out, lse = ops.sparse_attention_op(*leaves, idx, sink, scale, d_v, deterministic)
    else:
        out, lse = ref_sparse(*leaves, idx, sink, scale, d_v, 64)
    gen = torch.Generator().manual_seed(7)
    g_out, g_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    loss = (out * g_out).sum() + torch.where(torch.isfinite(lse), lse * g_lse, 0.0).sum()
    grads = torch.autograd.grad(loss, leaves + ([] if sink is None else [sink]))
    return out.detach(), lse.detach(), grads


CASES = [  # (T, H, D, d_v, N, K)
    (6, 3, 40, 24, 9, 7),
    (5, 20, 40, 24, 9, 70),  # two head blocks (16 a program on CPU), padded heads; two K steps (64 each)
    (4, 4, 512, 512, 6, 5),  # DeepSeek-V4's shared kv dim
    (3, 2, 576, 512, 5, 4),  # MLA-style: 512 values + 64 rope channels
]


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_sparse_attention_matches_reference(case: tuple[int, ...], with_sinks: bool) -> None:
    num_q, heads, dim, d_v, num_kv, width = case
    gen = torch.Generator().manual_seed(sum(case))
    q, kv = torch.randn(num_q, heads, dim, generator=gen), torch.randn(num_kv, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) if with_sinks else None
    idx = _indices(num_q, width, num_kv, gen)
    want = _run(q, kv, idx, sinks, d_v, False, triton=False)
    for deterministic in (False, True):
        got = _run(q, kv, idx, sinks, d_v, deterministic, triton=True)
        _close(got[0], want[0], 1e-5)
        _close(got[1], want[1], 1e-5)
        for g, w in zip(got[2], want[2]):
            _close(g, w, 1e-4)


def test_deterministic_dkv_is_bitwise_reproducible_and_matches_atomic(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three chunks of query rows (5 rows each), two head blocks, many repeats of each kv row."""
    monkeypatch.setattr(ops, "_chunk_rows", lambda num_q, row_bytes, device: 5)
    gen = torch.Generator().manual_seed(3)
    q, kv = torch.randn(12, 20, 64, generator=gen), torch.randn(5, 64, generator=gen)
    idx = torch.randint(-1, 5, (12, 12), generator=gen)  # every kv row listed ~24 times: long sums
    sinks = torch.randn(20, generator=gen)
    first = _run(q, kv, idx, sinks, 32, True, triton=True)
    second = _run(q, kv, idx, sinks, 32, True, triton=True)
    for a, b in zip(first[2], second[2]):
        assert torch.equal(a, b)
    atomic = _run(q, kv, idx, sinks, 32, False, triton=True)
    want = _run(q, kv, idx, sinks, 32, False, triton=False)
    for g, a, w in zip(first[2], atomic[2], want[2]):
        _close(g, w, 1e-4)
        _close(g, a, 1e-5)  # same terms, other summation order: fp32 rounding only


def test_empty_lists_and_no_queries() -> None:
    q, kv, sinks = torch.randn(3, 2, 16), torch.randn(4, 16), torch.randn(2)
    for idx, s in ((torch.empty(3, 0, dtype=torch.int64), sinks), (torch.full((3, 2), -1), None)):
        got, want = _run(q, kv, idx, s, 8, False, triton=True), _run(q, kv, idx, s, 8, False, triton=False)
        for g, w in zip((got[0], got[1], *got[2]), (want[0], want[1], *want[2])):
            _close(g, w, 1e-6)
    out, lse = ops.sparse_attention_op(q[:0], kv, torch.empty(0, 2, dtype=torch.int64), None, 0.5, 8, False)
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)


def test_padding_never_reads_row_zero() -> None:
    q, kv = torch.randn(2, 2, 16), torch.randn(3, 16)
    kv[0] = float("nan")
    idx = torch.tensor([[1, -1, 2], [-1, -1, 1]])
    out, lse = ops.sparse_attention_op(q, kv, idx, None, 0.25, 16, False)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_selected_probs_matches_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    q, kv, sinks = torch.randn(5, 3, 512, generator=gen), torch.randn(7, 512, generator=gen), torch.randn(3, generator=gen)
    idx = _indices(5, 6, 7, gen)
    _, lse = ops.sparse_attention_op(q, kv, idx, sinks, 512**-0.5, 512, False)
    got = ops.selected_probs_op(q, kv, idx, lse, 512**-0.5)
    _close(got, ref_probs(q, kv, idx, lse, 512**-0.5, 64), 1e-5)
    assert torch.equal(got[idx < 0], torch.zeros(int((idx < 0).sum())))
    assert (got.sum(1) <= q.shape[1] + 1e-4).all()  # the sink keeps part of each head's mass


@pytest.mark.parametrize("case", [(5, 20, 40, 24, 9, 70, 64), (6, 3, 512, 512, 7, 9, 4), (4, 4, 40, 24, 6, 5, 0),
                                  (4, 4, 40, 24, 6, 5, 5)], ids=lambda c: "x".join(map(str, c)))
def test_forward_writes_the_kl_target_of_its_own_scores(case: tuple[int, ...]) -> None:
    """``sparse_attention_probs_op``: the same out, lse and gradients as ``sparse_attention_op`` (bitwise: the same
    kernel arithmetic), and the probabilities of the columns ``>= probs_from`` of ``selected_probs`` (1e-5 as above).

    Cases: two head blocks with the target in the second K step only; D = 512 with a sink; every column; none.
    """
    num_q, heads, dim, d_v, num_kv, width, probs_from = case
    gen = torch.Generator().manual_seed(sum(case))
    q, kv, sinks = torch.randn(num_q, heads, dim, generator=gen), torch.randn(num_kv, dim, generator=gen), torch.randn(heads, generator=gen)
    idx = _indices(num_q, width, num_kv, gen)
    scale = dim**-0.5
    leaves = [x.clone().requires_grad_(True) for x in (q, kv, sinks)]
    out, lse, probs = ops.sparse_attention_probs_op(leaves[0], leaves[1], idx, leaves[2], scale, d_v, False, probs_from)
    assert not probs.requires_grad and probs.shape == (num_q, width - probs_from)
    want_out, want_lse = ops.sparse_attention_op(q, kv, idx, sinks, scale, d_v, False)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    _close(probs, ref_probs(q, kv, idx[:, probs_from:], want_lse, scale, 64), 1e-5)
    got = torch.autograd.grad(out.sum() + lse.sum(), leaves)
    plain = [x.clone().requires_grad_(True) for x in (q, kv, sinks)]
    p_out, p_lse = ops.sparse_attention_op(*plain[:2], idx, plain[2], scale, d_v, False)
    for g, w in zip(got, torch.autograd.grad(p_out.sum() + p_lse.sum(), plain)):
        assert torch.equal(g, w)


def test_the_kl_target_forward_is_the_same_in_chunks_of_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 2 query rows (2, 2, 1), each with its own scratch: bitwise the one-chunk result."""
    gen = torch.Generator().manual_seed(3)
    q, kv, sinks = torch.randn(5, 20, 40, generator=gen), torch.randn(9, 40, generator=gen), torch.randn(20, generator=gen)
    idx = _indices(5, 70, 9, gen)
    whole = ops.sparse_attention_probs_op(q, kv, idx, sinks, 0.2, 24, False, 64)
    budgets: list[int] = []

    def two_rows(num_q: int, row_bytes: int, device: torch.device, budget: int = 0) -> int:
        budgets.append(budget)
        return 2

    monkeypatch.setattr(ops, "_chunk_rows", two_rows)
    chunked = ops.sparse_attention_probs_op(q, kv, idx, sinks, 0.2, 24, False, 64)
    assert budgets == [512 << 20]
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_inverted_index_lists_each_row_in_query_order() -> None:
    idx = torch.tensor([[2, -1, 0], [2, 2, -1], [-1, -1, -1], [0, 1, 2]])
    pair_t, row_ptr = ops.inverted_index(idx, 4)
    assert row_ptr.tolist() == [0, 2, 3, 7, 7]
    assert pair_t.tolist()[:7] == [0, 3, 3, 0, 1, 1, 3]


def test_fakes_match_the_kernels() -> None:
    q, kv, idx = torch.randn(3, 2, 16), torch.randn(4, 16), torch.tensor([[0, -1], [1, 2], [3, 3]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(ops.sparse_attention_op, (q, kv, idx, torch.randn(2), 0.25, 8, False),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(ops.selected_probs_op, (q, kv, idx, torch.randn(3, 2), 0.25),
                              test_utils=("test_schema", "test_faketensor"))
        torch.library.opcheck(ops.sparse_attention_probs_op, (q, kv, idx, torch.randn(2), 0.25, 8, False, 1),
                              test_utils=("test_schema", "test_faketensor"))
