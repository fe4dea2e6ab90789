# mypy: ignore-errors
# (Triton ships no type information, and @triton.jit kernels cannot carry Python annotations.)
"""The Triton kernels: sparse shared-KV attention (forward, backward), head-summed probabilities.

Launch wrappers and conventions live in :mod:`cpkv.backends.triton.ops`; this module only
defines ``@triton.jit`` kernels, so it is imported lazily (by the ops, at their first
call). ``TRITON_INTERPRET=1`` (Triton's own switch) is read when this module is imported:
the tests import it under the interpreter to run every kernel on CPU.

Layout (one program per query row ``t`` and block of ``BLOCK_H`` heads, unless said otherwise):

* ``q [T, H, D]`` (any strides), ``kv [N, D]`` (row stride ``stride_kvn``, unit channel
  stride), ``idx [T, K]`` int32 with ``-1`` padding anywhere in a row. Every entry outside
  ``[0, N)`` (``-1``, but also ``-2`` or ``N + 3``) is padding: it never reads or writes a kv
  row (its loads and atomic adds are masked, its score is ``-inf``), so no index can reach
  memory outside kv or dkv.
* Channels are two resident tiles: the values ``[0, DV)`` (``BLOCK_V`` wide) and the rest
  ``[DV, D)`` (``BLOCK_R`` wide, absent when ``D == DV``: ``HAS_REST``). The Q (and dO)
  tiles are loaded once per program; each gathered kv tile ``[BLOCK_K, D]`` is loaded once
  per K step and used for both the scores and the values (the values ARE its first ``DV``
  channels). No program recomputes another's scores: the output columns stay in one
  program (Triton splits the ``[BLOCK_H, DV]`` accumulator over its warps).
* ``D`` and ``DV`` are constexprs (model constants), so full-width tiles carry no channel mask.
* Softmax in fp32, natural log; a row whose entries are all padding has ``l = 0``: LSE
  ``-inf`` without sink, out 0.
* The forward's scores and softmax step sit in ``if K > 0:``, always true inside the K loop.
  The branch changes no value; it is there for Triton 3.6's layout choice. A ``tl.dot`` whose
  result reaches another dot (QK^T -> P -> PV) gets all its warps along M
  (``warpsPerTileV3``), so at 64 heads and 8 warps both warpgroups would compute the same 64
  rows of QK^T (1.5x the counted forward FLOPs). The compiler's dependence slice follows uses
  of results and stops at a region's ``yield``, so values leaving the branch do not chain
  QK^T to PV: both dots split over the two warpgroups (``warps [4, 2]``: each warpgroup half
  the entries of S and half the output columns), and P reaches the PV product through shared
  memory. ``benchmarks/compile_report.py`` fails on a replicated bf16 dot, so a Triton that
  folds the branch away is caught in CI.
"""

import triton
import triton.language as tl

# The running max starts at -1e30 (finite), so exp(m_old - m_new) of an all-padding block is 1, not NaN.


@triton.jit
def _block_offsets(hb, H, D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """A program's offsets and masks: ``(offs_h, offs_k, offs_v, offs_r, mask_h, mask_v, mask_r)``, the heads of
    block ``hb``, the entries of one K step, the value channels ``[0, DV)`` and the rest ``[DV, D)``."""
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)
    offs_r = DV + tl.arange(0, BLOCK_R)
    return offs_h, offs_k, offs_v, offs_r, offs_h < H, offs_v < DV, offs_r < D


@triton.jit
def _q_tiles(q_rows, offs_v, offs_r, mask_h, mask_v, mask_r, HAS_REST: tl.constexpr):
    """The resident Q tiles of a head block: the value channels ``[0, DV)`` and the rest ``[DV, D)``
    (``q_v`` again as a never-read placeholder without rest channels)."""
    q_v = tl.load(q_rows + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
    q_r = q_v
    if HAS_REST:
        q_r = tl.load(q_rows + offs_r[None, :], mask=mask_h[:, None] & mask_r[None, :], other=0.0)
    return q_v, q_r


@triton.jit
def _kv_tile(kv_ptr, idx_row, kk, N, K, stride_kvn, offs_v, offs_r, mask_v, mask_r, HAS_REST: tl.constexpr):
    """One K step's gather: ``(valid, kv_v, kv_r)``, the mask of entries ``kk`` (outside ``[0, N)``: padding,
    never loaded) and the gathered tiles of their value channels and rest channels (``kv_v`` again without rest)."""
    rows = tl.load(idx_row + kk, mask=kk < K, other=-1)
    valid = (rows >= 0) & (rows < N)
    kv_rows = kv_ptr + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_kvn
    kv_v = tl.load(kv_rows + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0)
    kv_r = kv_v
    if HAS_REST:
        kv_r = tl.load(kv_rows + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
    return valid, kv_v, kv_r


@triton.jit
def _tile_scores(q_v, q_r, kv_v, kv_r, HAS_REST: tl.constexpr, PREC: tl.constexpr):
    """The scores ``q . kv^T`` ``[BLOCK_H, BLOCK_K]`` fp32 of one gathered tile (both channel tiles)."""
    s = tl.dot(q_v, tl.trans(kv_v), input_precision=PREC)
    if HAS_REST:
        s += tl.dot(q_r, tl.trans(kv_r), input_precision=PREC)
    return s


@triton.jit
def _scores(q_v, q_r, kv_ptr, idx_row, kk, N, K, stride_kvn, offs_v, offs_r, mask_v, mask_r,
            HAS_REST: tl.constexpr, PREC: tl.constexpr):
    """One K step: ``(s, valid, kv_v)``, the scores of entries ``kk``, their mask and the gathered value tile."""
    valid, kv_v, kv_r = _kv_tile(kv_ptr, idx_row, kk, N, K, stride_kvn, offs_v, offs_r, mask_v, mask_r, HAS_REST)
    return _tile_scores(q_v, q_r, kv_v, kv_r, HAS_REST, PREC), valid, kv_v


@triton.jit
def _fwd_item(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, probs_ptr, p_base, m_base,
    t, hb, N, H, K, probs_from,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    scale,
    D: tl.constexpr, DV: tl.constexpr, HAS_SINK: tl.constexpr, HAS_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PREC: tl.constexpr, PROBS: tl.constexpr,
):
    """One (row ``t``, head block ``hb``) of the forward: out, lse, and with ``PROBS`` the KL target (see the kernels;
    ``probs_ptr``, ``p_base`` and ``m_base`` then point at this item's target row and scratch)."""
    offs_h, offs_k, offs_v, offs_r, mask_h, mask_v, mask_r = _block_offsets(hb, H, D, DV, BLOCK_H, BLOCK_K, BLOCK_V,
                                                                            BLOCK_R)
    offs_b = tl.arange(0, BLOCK_H)
    tile = offs_b[:, None] * BLOCK_K + offs_k[None, :]  # a [BLOCK_H, BLOCK_K] scratch tile
    q_v, q_r = _q_tiles(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh, offs_v, offs_r, mask_h, mask_v, mask_r,
                        HAS_REST)
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        valid, kv_v, kv_r = _kv_tile(kv_ptr, idx_ptr + t * stride_it, kk, N, K, stride_kvn, offs_v, offs_r,
                                     mask_v, mask_r, HAS_REST)
        if K > 0:  # always true in this loop: the branch only ends Triton's chained-dot slice (module docstring)
            s = tl.where(valid[None, :], _tile_scores(q_v, q_r, kv_v, kv_r, HAS_REST, PREC) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l_new = l * alpha + tl.sum(p, 1)
            p_lo = p.to(kv_v.dtype)
            if PROBS:
                if k0 + BLOCK_K > probs_from:  # the step's exp(s - m), as the PV product takes it, and m
                    slot = k0 // BLOCK_K - probs_from // BLOCK_K
                    tl.store(p_base + slot * (BLOCK_H * BLOCK_K) + tile, p_lo)
                    tl.store(m_base + slot * BLOCK_H + offs_b, m_new)
        else:  # never taken
            m_new = m
            alpha = tl.full([BLOCK_H], 1.0, tl.float32)
            l_new = l
            p_lo = tl.zeros([BLOCK_H, BLOCK_K], kv_v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_lo, kv_v, input_precision=PREC)
        m = m_new
        l = l_new
    lse = tl.where(l > 0, m + tl.log(l), float("-inf"))
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        top = tl.maximum(lse, sink)
        lse = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
    o_scale = tl.where(l > 0, tl.exp(m - lse), 0.0)
    out = acc * o_scale[:, None]
    o_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_v[None, :])
    tl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)
    if PROBS:  # the KL target from the stored steps: no second QK^T
        tl.debug_barrier()  # every thread's scratch stores are visible to the whole program
        finite = mask_h & (lse > float("-inf"))
        for k0 in range(probs_from // BLOCK_K * BLOCK_K, K, BLOCK_K):
            kk = k0 + offs_k
            slot = k0 // BLOCK_K - probs_from // BLOCK_K
            p_step = tl.load(p_base + slot * (BLOCK_H * BLOCK_K) + tile).to(tl.float32)
            m_step = tl.load(m_base + slot * BLOCK_H + offs_b)
            weight = tl.where(finite, tl.exp(m_step - lse), 0.0)
            tl.store(probs_ptr + (kk - probs_from), tl.sum(p_step * weight[:, None], 0),
                     mask=(kk >= probs_from) & (kk < K))


@triton.jit
def sparse_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr,
    N, H, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    scale,
    D: tl.constexpr, DV: tl.constexpr, HAS_SINK: tl.constexpr, HAS_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PREC: tl.constexpr,
):
    """out[t, heads] and lse[t, heads]; grid (T, cdiv(H, BLOCK_H)). Q resident, each kv tile loaded once."""
    _fwd_item(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, lse_ptr, lse_ptr, lse_ptr,
              tl.program_id(0).to(tl.int64), tl.program_id(1), N, H, K, 0,
              stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, scale,
              D, DV, HAS_SINK, HAS_REST, BLOCK_H, BLOCK_K, BLOCK_V, BLOCK_R, PREC, False)


@triton.jit
def sparse_fwd_probs_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, probs_ptr, p_scratch_ptr, m_scratch_ptr,
    N, H, K, probs_from,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    scale,
    D: tl.constexpr, DV: tl.constexpr, HAS_SINK: tl.constexpr, HAS_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PREC: tl.constexpr,
):
    """:func:`sparse_fwd_kernel` that also writes the KL target of the columns ``k >= probs_from``, without another QK^T.

    Grid (T, cdiv(H, BLOCK_H)), as the forward. Program ``(t, hb)`` stores the ``exp(s - m)`` of
    each step that covers a column ``>= probs_from`` (in the dtype the PV product takes it) and
    its running max ``m`` into its own scratch (``p_scratch [T, HB, S, BLOCK_H, BLOCK_K]`` in q's
    dtype and ``m_scratch [T, HB, S, BLOCK_H]`` fp32, ``S = cdiv(K, BLOCK_K) - probs_from //
    BLOCK_K`` steps; only the programs in flight touch theirs, so it stays in L2); once the
    row's LSE (sink included) is known, ``probs[t, hb, k - probs_from] = sum_h exp(s - m) *
    exp(m - lse)`` for ``k >= probs_from`` (``[T, HB, K - probs_from]`` fp32, 0 at padding): the
    head-summed probabilities of those entries, what ``selected_probs_kernel`` computes with a
    second QK^T.
    """
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    item = t * tl.num_programs(1) + hb
    steps = tl.cdiv(K, BLOCK_K) - probs_from // BLOCK_K
    _fwd_item(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr, probs_ptr + item * (K - probs_from),
              p_scratch_ptr + item * steps * (BLOCK_H * BLOCK_K), m_scratch_ptr + item * steps * BLOCK_H,
              t, hb, N, H, K, probs_from,
              stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh, scale,
              D, DV, HAS_SINK, HAS_REST, BLOCK_H, BLOCK_K, BLOCK_V, BLOCK_R, PREC, True)


@triton.jit
def sparse_bwd_ds_kernel(
    q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, p_ptr, ds_ptr,
    N, H, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dot, stride_doh,
    scale,
    D: tl.constexpr, DV: tl.constexpr, HAS_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PREC: tl.constexpr,
):
    """The backward's first pass: ``P`` and ``dS`` of every (head, entry) of row ``t``, stored for the two others.

    Grid (T, cdiv(H, BLOCK_H)). ``delta = rowsum(do * out) - d_lse``, ``P = exp(scale * s - lse)``,
    ``dS = P * (dP - delta) * scale``, ``dP = dO V^T``. Q and dO stay resident; each kv tile is
    loaded once for S and dP. No dot feeds another here, so on one warpgroup (64 heads) no
    row is computed twice. ``p`` and ``ds`` are ``[T, H, K]`` contiguous buffers in q's dtype
    (what the next passes' MMAs take; fp32 stays fp32), 0 at padding.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h, offs_k, offs_v, offs_r, mask_h, mask_v, mask_r = _block_offsets(tl.program_id(1), H, D, DV, BLOCK_H, BLOCK_K,
                                                                            BLOCK_V, BLOCK_R)
    q_v, q_r = _q_tiles(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh, offs_v, offs_r, mask_h, mask_v, mask_r,
                        HAS_REST)
    do_v = tl.load(do_ptr + t * stride_dot + offs_h[:, None] * stride_doh + offs_v[None, :],
                   mask=mask_h[:, None] & mask_v[None, :], other=0.0).to(q_v.dtype)
    lse = tl.load(lse_ptr + t * H + offs_h, mask=mask_h, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + t * H + offs_h, mask=mask_h, other=0.0)
    out_rows = (t * H + offs_h).to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        s, valid, kv_v = _scores(q_v, q_r, kv_ptr, idx_ptr + t * stride_it, kk, N, K, stride_kvn, offs_v, offs_r,
                                 mask_v, mask_r, HAS_REST, PREC)
        dp = tl.dot(do_v, tl.trans(kv_v), input_precision=PREC)
        p = tl.where(mask_h[:, None] & valid[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        keep = mask_h[:, None] & (kk < K)[None, :]
        tl.store(p_ptr + out_rows + kk[None, :], p.to(p_ptr.dtype.element_ty), mask=keep)
        tl.store(ds_ptr + out_rows + kk[None, :], ds.to(ds_ptr.dtype.element_ty), mask=keep)


@triton.jit
def sparse_bwd_dq_kernel(
    kv_ptr, idx_ptr, ds_ptr, dq_ptr,
    N, H, K,
    stride_kvn, stride_it,
    D: tl.constexpr, DV: tl.constexpr, HAS_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PREC: tl.constexpr,
):
    """The second pass: ``dq[t, heads] = dS K`` over the row's entries (fp32, ``[T, H, D]`` contiguous).

    Grid (T, cdiv(H, BLOCK_H)). ``dS`` is read from the first pass's ``[T, H, K]`` buffer, each
    kv tile is gathered once; one dot per channel tile, so the ``[BLOCK_H, D]`` accumulator
    splits over the warps along the channels.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h, offs_k, offs_v, offs_r, mask_h, mask_v, mask_r = _block_offsets(tl.program_id(1), H, D, DV, BLOCK_H, BLOCK_K,
                                                                            BLOCK_V, BLOCK_R)
    dq_v = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
    if HAS_REST:
        dq_r = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    ds_rows = ds_ptr + (t * H + offs_h).to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        valid, kv_v, kv_r = _kv_tile(kv_ptr, idx_ptr + t * stride_it, kk, N, K, stride_kvn, offs_v, offs_r,
                                     mask_v, mask_r, HAS_REST)
        ds = tl.load(ds_rows + kk[None, :], mask=mask_h[:, None] & valid[None, :], other=0.0).to(kv_v.dtype)
        dq_v += tl.dot(ds, kv_v, input_precision=PREC)
        if HAS_REST:
            dq_r += tl.dot(ds, kv_r, input_precision=PREC)
    dq_rows = dq_ptr + t * H * D + offs_h[:, None] * D
    tl.store(dq_rows + offs_v[None, :], dq_v, mask=mask_h[:, None] & mask_v[None, :])
    if HAS_REST:
        tl.store(dq_rows + offs_r[None, :], dq_r, mask=mask_h[:, None] & mask_r[None, :])


@triton.jit
def sparse_bwd_dkv_kernel(
    q_ptr, idx_ptr, do_ptr, p_ptr, ds_ptr, dkv_ptr,
    N, H, K,
    stride_qt, stride_qh, stride_it, stride_dot, stride_doh,
    D: tl.constexpr, DV: tl.constexpr, ATOMIC_DKV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, PREC: tl.constexpr,
):
    """The third pass: the dkv terms ``G[k] = dS^T Q + P^T dO`` of row ``t``'s entries (``[BLOCK_K, D]`` a step).

    Grid (T, cdiv(H, BLOCK_H)). ``P`` and ``dS`` come from the first pass's buffers. The terms
    are built transposed, ``BLOCK_C`` channels at a time: ``G^T = Q_c^T dS + dO_c^T P``
    (``[BLOCK_C, BLOCK_K]``, M = ``BLOCK_C``, so the dots are wgmma at any ``BLOCK_K``; the Q
    and dO column chunks are re-read from L2, the FLOPs done once) and either added into
    ``dkv [N, D]`` with fp32 atomics (``ATOMIC_DKV``) or stored as rows ``G[hb, t * K + k]`` of
    a ``[cdiv(H, BLOCK_H), T * K, D]`` fp32 buffer, ``hb`` the head block (no atomics:
    :func:`dkv_reduce_kernel` sums them per kv row in a fixed order).
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, BLOCK_C)
    mask_h = offs_h < H
    C_REST: tl.constexpr = (DV + BLOCK_C - 1) // BLOCK_C * BLOCK_C  # first column chunk past the values
    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    do_rows = do_ptr + t * stride_dot + offs_h[:, None] * stride_doh
    buf_rows = (t * H + offs_h).to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        rows = tl.load(idx_ptr + t * stride_it + kk, mask=kk < K, other=-1)
        valid = (rows >= 0) & (rows < N)  # outside [0, N): padding, never written
        live = mask_h[:, None] & valid[None, :]
        ds = tl.load(ds_ptr + buf_rows + kk[None, :], mask=live, other=0.0)
        p = tl.load(p_ptr + buf_rows + kk[None, :], mask=live, other=0.0)
        if ATOMIC_DKV:
            g_cols = dkv_ptr + tl.where(valid, rows, 0).to(tl.int64)[None, :] * D
            g_mask = valid[None, :]
        else:
            g_cols = dkv_ptr + ((tl.program_id(1) * tl.num_programs(0) + t) * K + kk).to(tl.int64)[None, :] * D
            g_mask = (kk < K)[None, :]
        for c0 in range(0, DV, BLOCK_C):  # value columns: dS^T Q + P^T dO
            cc = c0 + offs_c
            q_c = tl.load(q_rows + cc[None, :], mask=mask_h[:, None] & (cc < D)[None, :], other=0.0)
            do_c = tl.load(do_rows + cc[None, :], mask=mask_h[:, None] & (cc < DV)[None, :], other=0.0)
            # a - b, not a + b: Triton folds ``dot + x`` into the dot's accumulator, which would
            # chain the first dot into the second and lay it out with all warps on M.
            g = tl.dot(tl.trans(q_c), ds.to(q_c.dtype), input_precision=PREC) - tl.dot(
                tl.trans(-do_c.to(q_c.dtype)), p.to(q_c.dtype), input_precision=PREC)
            if ATOMIC_DKV:
                tl.atomic_add(g_cols + cc[:, None], g, mask=g_mask & (cc < D)[:, None], sem="relaxed")
            else:
                tl.store(g_cols + cc[:, None], g, mask=g_mask & (cc < D)[:, None])
        for c0 in range(C_REST, D, BLOCK_C):  # the columns after the value chunks: dS^T Q only
            cc = c0 + offs_c
            q_c = tl.load(q_rows + cc[None, :], mask=mask_h[:, None] & (cc < D)[None, :], other=0.0)
            g = tl.dot(tl.trans(q_c), ds.to(q_c.dtype), input_precision=PREC)
            if ATOMIC_DKV:
                tl.atomic_add(g_cols + cc[:, None], g, mask=g_mask & (cc < D)[:, None], sem="relaxed")
            else:
                tl.store(g_cols + cc[:, None], g, mask=g_mask & (cc < D)[:, None])


@triton.jit
def dkv_reduce_kernel(
    g_ptr, pair_ptr, row_ptr, dkv_ptr,
    HB, P,
    D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Deterministic dkv: ``dkv[n] += sum over head blocks hb and pairs listing n of G[hb, pair]``, in a fixed order.

    ``G`` is the ``[HB, P, D]`` fp32 buffer written by :func:`sparse_bwd_dkv_kernel` with
    ``ATOMIC_DKV=False``; ``pair[row_ptr[n] : row_ptr[n + 1]]`` are its rows whose entry is kv
    row ``n``, in (t, k) order: an inverted index. No atomics; each program owns
    ``dkv[n, c-chunk]`` and adds its sum to what is there (an earlier chunk of query rows).
    Grid (N, cdiv(D, BLOCK_C)).
    """
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, BLOCK_P)
    mask_c = offs_c < D
    p_lo = tl.load(row_ptr + n)
    p_hi = tl.load(row_ptr + n + 1)
    acc = tl.zeros([BLOCK_P, BLOCK_C], tl.float32)
    for hb in range(0, HB):
        for p0 in range(p_lo, p_hi, BLOCK_P):
            pp = p0 + offs_p
            pair = tl.load(pair_ptr + pp, mask=pp < p_hi, other=0).to(tl.int64) + hb * P
            acc += tl.load(g_ptr + pair[:, None] * D + offs_c[None, :], mask=(pp < p_hi)[:, None] & mask_c[None, :],
                           other=0.0)
    total = tl.load(dkv_ptr + n * D + offs_c, mask=mask_c, other=0.0) + tl.sum(acc, 0)
    tl.store(dkv_ptr + n * D + offs_c, total, mask=mask_c)


@triton.jit
def selected_probs_kernel(
    q_ptr, kv_ptr, idx_ptr, lse_ptr, out_ptr,
    N, H, K,
    stride_qt, stride_qh, stride_kvn, stride_it,
    scale,
    D: tl.constexpr, DV: tl.constexpr, HAS_REST: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    PREC: tl.constexpr,
):
    """out[hb, t, k] = sum over heads of block hb of exp(scale * q[t, h] . kv[idx[t, k]] - lse[t, h]), 0 at padding.

    ``out`` is ``[cdiv(H, BLOCK_H), T, K]`` fp32 (the op sums the head blocks in order); grid
    (T, cdiv(H, BLOCK_H)). Q resident, each kv tile loaded once, the channels split at ``DV``
    as in the attention kernels.
    """
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h, offs_k, offs_v, offs_r, mask_h, mask_v, mask_r = _block_offsets(hb, H, D, DV, BLOCK_H, BLOCK_K,
                                                                            BLOCK_V, BLOCK_R)
    q_v, q_r = _q_tiles(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh, offs_v, offs_r, mask_h, mask_v, mask_r,
                        HAS_REST)
    lse = tl.load(lse_ptr + t * H + offs_h, mask=mask_h, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    out_row = out_ptr + (hb * tl.num_programs(0) + t) * K
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        s, valid, kv_v = _scores(q_v, q_r, kv_ptr, idx_ptr + t * stride_it, kk, N, K, stride_kvn, offs_v, offs_r,
                                 mask_v, mask_r, HAS_REST, PREC)
        p = tl.where(mask_h[:, None] & valid[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
        tl.store(out_row + kk, tl.sum(p, 0), mask=kk < K)

