"""The reference custom ops (opcheck), ReferenceBackend against the fp64 oracle, and compilation.

``torch.library.opcheck`` checks each ``cpkv::`` op's schema, fake (shape-only) kernel,
autograd registration and AOT dispatch. The backend is compared with the brute-force
masked oracle of test_reference.py; a fullgraph compile of a layer-like function is
compared with eager.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor

from cpkv.backends.base import KeyRanges
from cpkv.backends.reference import ReferenceBackend, indexer_scores, sparse_attention, varlen_attention
from cpkv.indexer_loss import attach_indexer_loss
from cpkv.plan.segments import plan_segments
from tests.backends.test_reference import oracle, range_mask, rand, sparse_mask, varlen_mask

F64 = torch.float64
OPS = torch.ops.cpkv
INDICES = torch.tensor([[0, 3, 5, -1], [2, -1, 7, 1], [-1, -1, -1, -1], [6, 4, 0, 2], [7, -1, -1, -1]])
LO, HI = torch.tensor([0, 0, 0, 3, 3, 5]), torch.tensor([0, 1, 3, 3, 6, 7])  # rows 0 and 3 see nothing


def grad_inputs(*xs: Tensor, dtype: torch.dtype) -> list[Tensor]:
    return [x.detach().to(dtype, copy=True).requires_grad_(True) for x in xs]


# --------------------------------------------------------------------------- opcheck

DTYPES = [torch.float32, F64]
# Each dtype and each sinks option once (opcheck is slow); every case has an all-masked row.
DTYPE_SINKS = [(torch.float32, True), (F64, False)]


@pytest.mark.parametrize(("dtype", "with_sinks"), DTYPE_SINKS)
def test_opcheck_range_attention(dtype: torch.dtype, with_sinks: bool) -> None:
    q, k, v = grad_inputs(rand(6, 4, 3), rand(7, 2, 3, seed=1), rand(7, 2, 2, seed=2), dtype=dtype)
    sinks = grad_inputs(rand(4, seed=3), dtype=dtype)[0] if with_sinks else None
    torch.library.opcheck(OPS.range_attention, (q, k, v, LO, HI, sinks, 0.5, 2))
    out, lse = OPS.range_attention(q, k, v, LO, HI, sinks, 0.5, 2)
    d_out, d_lse = rand(*out.shape, seed=4).to(dtype), rand(*lse.shape, seed=5).to(lse.dtype)
    args = (d_out, d_lse, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), LO, HI,
            None if sinks is None else sinks.detach(), 0.5, 2)
    torch.library.opcheck(OPS.range_attention_backward, args)


@pytest.mark.parametrize(("dtype", "with_sinks"), DTYPE_SINKS)
def test_opcheck_sparse_attention(dtype: torch.dtype, with_sinks: bool) -> None:
    q, kv = grad_inputs(rand(5, 2, 4), rand(8, 4, seed=1), dtype=dtype)  # row 2: all padding
    sinks = grad_inputs(rand(2, seed=2), dtype=dtype)[0] if with_sinks else None
    torch.library.opcheck(OPS.sparse_attention, (q, kv, INDICES, sinks, 0.5, 3, 2))
    out, lse = OPS.sparse_attention(q, kv, INDICES, sinks, 0.5, 3, 2)
    d_out, d_lse = rand(*out.shape, seed=4).to(dtype), rand(*lse.shape, seed=5).to(lse.dtype)
    args = (d_out, d_lse, q.detach(), kv.detach(), INDICES.reshape(-1), out.detach(), lse.detach(),
            None if sinks is None else sinks.detach(), 0.5, 3, 2)
    torch.library.opcheck(OPS.sparse_attention_backward, args)
    torch.library.opcheck(OPS.selected_probs, (q.detach(), kv.detach(), INDICES, lse.detach(), 0.5, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_indexer_ops(dtype: torch.dtype) -> None:
    q_i, k_i, w = rand(5, 2, 3).to(dtype), rand(8, 3, seed=1).to(dtype), rand(5, 2, seed=2).to(dtype)
    start, end = torch.tensor([0, 0, 2, 4, 8]), torch.tensor([0, 3, 8, 6, 8])  # rows 0, 4: nothing visible
    torch.library.opcheck(OPS.indexer_topk, (q_i, k_i, w, start, end, 3, 2))
    target = torch.rand(INDICES.shape, generator=torch.Generator().manual_seed(0), dtype=dtype) * (INDICES >= 0)
    target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    q_g, k_g, w_g = grad_inputs(q_i, k_i, w, dtype=dtype)
    torch.library.opcheck(OPS.indexer_kl, (q_g, k_g, w_g, INDICES, target, 0.25))
    torch.library.opcheck(OPS.indexer_kl_backward, (q_i, k_i, w, INDICES, target, 0.25))


# --------------------------------------------------------------------------- backend vs oracle

LENS_Q, LENS_KV = [3, 0, 5, 2], [6, 1, 5, 9]


@pytest.mark.parametrize(("window", "kv_offset"), [(None, 0), (3, 0), (2, 2)])
def test_backend_varlen_matches_oracle(window: int | None, kv_offset: int) -> None:
    plan = plan_segments(torch.tensor([0, 3, 3, 8, 10]), torch.tensor([0, 6, 7, 12, 21]), kv_offset=kv_offset)
    q, k, v, sinks = rand(10, 4, 5), rand(21, 2, 5, seed=1), rand(21, 2, 3, seed=2), rand(4, seed=3)
    res = ReferenceBackend(block_size=3).varlen_attention(q, k, v, plan, scale=0.4, window=window, sinks=sinks)
    # kv_offset only moves the (unseen) document start before row 0: the mask is unchanged.
    ref_out, ref_lse = oracle(q, k, v, varlen_mask(LENS_Q, LENS_KV, window), 0.4, sinks)
    torch.testing.assert_close(res.out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res.lse, ref_lse, rtol=1e-10, atol=1e-10)


def test_backend_range_and_sparse_match_oracle() -> None:
    backend = ReferenceBackend(block_size=2)
    q, k, v = rand(6, 4, 5), rand(7, 2, 5, seed=1), rand(7, 2, 3, seed=2)
    res = backend.range_attention(q, k, v, KeyRanges(LO, HI, num_keys=7, num_rows=6, left=-1), scale=0.4)
    ref_out, ref_lse = oracle(q, k, v, range_mask(LO, HI, 7), 0.4)
    torch.testing.assert_close(res.out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res.lse, ref_lse, rtol=1e-10, atol=1e-10)

    q, kv, sinks = rand(5, 3, 6), rand(8, 6, seed=1), rand(3, seed=2)
    res = backend.sparse_attention(q, kv, INDICES, d_v=4, scale=0.4, sinks=sinks)
    ref_out, ref_lse = oracle(q, kv[:, None], kv[:, None, :4], sparse_mask(INDICES, 8), 0.4, sinks)
    torch.testing.assert_close(res.out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(res.lse, ref_lse, rtol=1e-10, atol=1e-10)
    probs = backend.selected_probs(q, kv, INDICES, res.lse, scale=0.4)
    dense = torch.softmax(torch.cat([torch.einsum("thd,nd->thn", q, kv) * 0.4
                                     + torch.where(sparse_mask(INDICES, 8), 0.0, -torch.inf)[:, None],
                                     sinks[None, :, None].expand(5, 3, 1)], -1), -1).sum(1)
    expected = torch.where(INDICES >= 0, dense.gather(1, INDICES.clamp(min=0)), 0.0)
    torch.testing.assert_close(probs, expected, rtol=1e-10, atol=1e-12)


def test_backend_indexer_topk_brute_force() -> None:
    plan = plan_segments(torch.tensor([0, 5, 13]), torch.tensor([0, 9, 17]), compress_ratios=[2])
    visible = plan.visible_for(2)
    q_i, k_i, w = rand(13, 3, 4), rand(visible.num_entries, 4, seed=1), rand(13, 3, seed=2)
    got = ReferenceBackend(block_size=3).indexer_topk(q_i, k_i, w, plan, visible, topk=3)
    dense = indexer_scores(q_i, k_i, w)
    for t in range(13):
        lo = int(visible.visible_start[t])
        rows = list(range(lo, lo + int(visible.visible_count[t])))
        best = sorted(rows, key=lambda j: (-float(dense[t, j]), j))[:3]  # ties: the earlier row
        assert got[t].tolist() == best + [-1] * (3 - len(best)), t


# --------------------------------------------------------------------------- NaN at padding row 0


def test_padding_never_reads_or_writes_kv_row_0() -> None:
    q, kv = rand(5, 3, 6).requires_grad_(True), rand(9, 6, seed=1)
    kv[0] = float("nan")
    kv.requires_grad_(True)
    indices = torch.where(INDICES == 0, 8, INDICES)  # row 0 only ever appears as -1 padding
    for res in (sparse_attention(q, kv, indices, d_v=4, block_size=2),
                ReferenceBackend(block_size=2).sparse_attention(q, kv, indices, d_v=4, scale=0.4, sinks=None)):
        d_q, d_kv = torch.autograd.grad(res.out.sum() + res.lse[res.lse.isfinite()].sum(), [q, kv])
        assert bool(res.out.isfinite().all()) and bool(d_q.isfinite().all()) and bool(d_kv[1:].isfinite().all())
        assert torch.equal(d_kv[0], torch.zeros(6, dtype=F64))
        probs = ReferenceBackend().selected_probs(q, kv, indices, res.lse, scale=0.4)
        assert bool(probs.isfinite().all()) and bool((probs[indices < 0] == 0).all())


# --------------------------------------------------------------------------- compile


def layer_like(backend: ReferenceBackend, t: dict[str, Any]) -> tuple[Tensor, ...]:
    """Every backend primitive and the indexer loss, as an attention layer chains them."""
    plan, scale = t["plan"], 0.3
    dense = backend.varlen_attention(t["q"], t["k"], t["v"], plan, scale=scale, window=3, sinks=t["sinks"])
    ring = backend.range_attention(t["q"], t["k"], t["v"], t["ranges"], scale=scale)
    selected = backend.indexer_topk(t["q_index"], t["k_index"], t["weights"], plan, t["visible"], topk=3)
    sparse = backend.sparse_attention(t["q"], t["kv"], selected, d_v=4, scale=scale, sinks=t["sinks"])
    probs = backend.selected_probs(t["q"], t["kv"], selected, sparse.lse, scale=scale)
    res = attach_indexer_loss(sparse.out, t["q_index"], t["k_index"], t["weights"], selected, probs,
                              grad_scale=2.0, num_global_queries=20)
    loss = (dense.out.sum() + (dense.lse * t["w_lse"]).sum() + ring.out.sum()
            + ring.lse.where(ring.lse.isfinite(), 0.0).sum() + (res.out * t["w_out"]).sum())
    return loss, dense.out, ring.lse, selected, res.out, res.loss


def test_compile_fullgraph_matches_eager() -> None:
    plan = plan_segments(torch.tensor([0, 4, 10]), torch.tensor([0, 6, 14]), compress_ratios=[2])
    visible = plan.visible_for(2)
    n_c = visible.num_entries
    lo, hi = torch.tensor([0, 0, 1, 1, 1, 2, 4, 4, 5, 6]), torch.tensor([0, 2, 2, 3, 5, 5, 6, 8, 8, 8])
    leaves = {"q": rand(10, 4, 6), "k": rand(14, 2, 6, seed=1), "v": rand(14, 2, 5, seed=2), "sinks": rand(4, seed=3),
              "kv": rand(n_c, 6, seed=4), "q_index": rand(10, 2, 3, seed=5), "k_index": rand(n_c, 3, seed=6),
              "weights": rand(10, 2, seed=7)}
    fixed = {"plan": plan, "visible": visible, "ranges": KeyRanges(lo, hi, num_keys=8, num_rows=10, left=-1),
             "w_lse": rand(10, 4, seed=8).float(), "w_out": rand(10, 4, 4, seed=9).float()}
    backend = ReferenceBackend(block_size=4)
    compiled = torch.compile(layer_like, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (layer_like, compiled):
        inputs = {name: x.float().requires_grad_(True) for name, x in leaves.items()}
        outs = fn(backend, {**inputs, **fixed})
        grads = torch.autograd.grad(outs[0], list(inputs.values()))
        results.append((outs, grads))
    (eager, eager_grads), (comp, comp_grads) = results
    assert bool((eager[3] >= 0).any()) and bool((eager[3] < 0).any())  # both selections and padding
    assert float(eager[5]) > 0 and float(eager_grads[6].abs().max()) > 0  # the KL reaches k_index
    # Same fp32 kernels on the same inputs; only the decomposition outside the ops may differ.
    for a, b in zip(eager + eager_grads, comp + comp_grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)
