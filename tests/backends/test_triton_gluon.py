"""The Gluon forward's tile schedule (cpkv/backends/triton/gluon_kernels.py), emulated in torch, against the reference.

Gluon does not run under Triton's interpreter, so this checks the schedule the kernel
implements, step for step, in torch: tile 0 gathered before the loop, at step j the
entries of tile j (kept from the previous step) scored, masked outside ``[0, N)``, an online
softmax from a running max of ``-1e30``, PV with the same tile, tile j + 1 gathered for the
next step (past K: all padding), and the sink joined at the end. fp32 throughout; the
tolerance is the one of the Triton kernel tests (``1e-5`` of the largest magnitude: a few
ulps over at most a few hundred terms).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cpkv.backends.reference.sparse import sparse_attention_op as ref_sparse


def emulate(q: Tensor, kv: Tensor, idx: Tensor, sinks: Tensor | None, scale: float, block_k: int) -> tuple[Tensor, Tensor]:
    num_q, heads, dim = q.shape
    out, lse_all = torch.zeros(num_q, heads, dim), torch.zeros(num_q, heads)
    width, num_kv = idx.shape[1], kv.shape[0]

    def gather(t: int, k0: int) -> tuple[Tensor, Tensor]:
        kk = torch.arange(k0, k0 + block_k)
        rows = torch.where(kk < width, idx[t, kk.clamp(max=max(width - 1, 0))], -1)
        valid = (rows >= 0) & (rows < num_kv)
        tile = torch.where(valid[:, None], kv[rows.clamp(0, num_kv - 1)], 0.0)
        return tile, valid

    for t in range(num_q):
        tile, valid = gather(t, 0)
        m, l, acc = torch.full((heads,), -1.0e30), torch.zeros(heads), torch.zeros(heads, dim)
        for j in range(-(-width // block_k)):
            nxt = gather(t, (j + 1) * block_k)  # prefetch of the next stage
            s = torch.where(valid[None, :], (q[t] @ tile.T) * scale, float("-inf"))
            m_new = torch.maximum(m, s.max(1).values)
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new[:, None])
            l, m = l * alpha + p.sum(1), m_new
            acc = acc * alpha[:, None] + p @ tile
            tile, valid = nxt
        lse = torch.where(l > 0, m + torch.log(l), float("-inf"))
        if sinks is not None:
            top = torch.maximum(lse, sinks)
            lse = top + torch.log(torch.exp(lse - top) + torch.exp(sinks - top))
        out[t] = acc * torch.where(l > 0, torch.exp(m - lse), 0.0)[:, None]
        lse_all[t] = lse
    return out, lse_all


def test_gluon_schedule_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    num_q, heads, dim, num_kv, width = 5, 4, 64, 9, 150  # three K steps of 64, the last partial
    q, kv = torch.randn(num_q, heads, dim, generator=gen), torch.randn(num_kv, dim, generator=gen)
    idx = torch.randint(-1, num_kv + 2, (num_q, width), generator=gen)  # -1, in range, and past N
    idx[2] = -1  # no valid entry
    for sinks in (None, torch.randn(heads, generator=gen)):
        got = emulate(q, kv, idx, sinks, dim**-0.5, 64)
        want = ref_sparse(q, kv, torch.where(idx < num_kv, idx, -1), sinks, dim**-0.5, dim, 64)
        for g, w in zip(got, want):
            finite = torch.isfinite(w)
            assert torch.equal(finite, torch.isfinite(g))
            assert (g[finite] - w[finite]).abs().max() <= 1e-5 * max(1.0, float(w[finite].abs().max()))
