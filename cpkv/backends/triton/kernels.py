# mypy: ignore-errors
# (Triton ships no type information, and @triton.jit kernels cannot carry Python annotations.)
"""The Triton kernels: sparse shared-KV attention (forward, backward), head-summed probabilities, indexer scores.

Launch wrappers and conventions live in :mod:`cpkv.backends.triton.ops`; this module only
defines ``@triton.jit`` kernels, so it is imported lazily (by the ops, at their first
call). ``TRITON_INTERPRET=1`` (Triton's own switch) is read when this module is imported:
the tests import it under the interpreter to run every kernel on CPU.

Layout (one program per query row ``t`` and block of heads, unless said otherwise):

* ``q [T, H, D]`` (any strides), ``kv [N, D]`` (row stride ``stride_kvn``, unit channel
  stride), ``idx [T, K]`` int32 with ``-1`` padding anywhere in a row. Every entry outside
  ``[0, N)`` (``-1``, but also ``-2`` or ``N + 3``) is padding: it never reads or writes a kv
  row (its loads and atomic adds are masked, its score is ``-inf``), so no index can reach
  memory outside kv or dkv.
* D is split: scores accumulate over ``BLOCK_D`` channel chunks; the forward splits the
  value channels over the grid's third axis (``BLOCK_DV`` each) and the backward splits
  its dq/dkv columns likewise (``BLOCK_DC``), so D = 512 (or 576) never needs a
  ``[BLOCK_H, D]`` fp32 accumulator.
* Softmax in fp32, natural log; a row whose entries are all padding has ``l = 0``: LSE
  ``-inf`` without sink, out 0.
"""

import triton
import triton.language as tl

# The running max starts at -1e30 (finite), so exp(m_old - m_new) of an all-padding block is 1, not NaN.


@triton.jit
def sparse_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr,
    N, H, D, DV, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    scale,
    HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PREC: tl.constexpr,
):
    """out[t, h, v-chunk] and lse[t, h]; grid (T, cdiv(H, BLOCK_H), cdiv(DV, BLOCK_DV))."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_v = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    mask_v = offs_v < DV
    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    m = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        rows = tl.load(idx_ptr + t * stride_it + kk, mask=kk < K, other=-1)
        valid = (rows >= 0) & (rows < N)  # outside [0, N): padding, never loaded or written
        kv_rows = kv_ptr + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_kvn
        s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            qc = tl.load(q_rows + dd[None, :], mask=mask_h[:, None] & (dd < D)[None, :], other=0.0)
            kc = tl.load(kv_rows + dd[None, :], mask=valid[:, None] & (dd < D)[None, :], other=0.0)
            s += tl.dot(qc, tl.trans(kc), input_precision=PREC)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        vc = tl.load(kv_rows + offs_v[None, :], mask=valid[:, None] & mask_v[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vc.dtype), vc, input_precision=PREC)
        m = m_new
    lse = tl.where(l > 0, m + tl.log(l), float("-inf"))
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        top = tl.maximum(lse, sink)
        lse = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
    o_scale = tl.where(l > 0, tl.exp(m - lse), 0.0)
    out = acc * o_scale[:, None]
    o_ptrs = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_v[None, :])
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + t * H + offs_h, lse, mask=mask_h)


@triton.jit
def sparse_bwd_kernel(
    q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr,
    N, H, D, DV, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_dot, stride_doh,
    scale,
    ATOMIC_DKV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr, PREC: tl.constexpr,
):
    """dq[t, h, c-chunk] (fp32, [T, H, D] contiguous) and, with ATOMIC_DKV, fp32 atomics into dkv [N, D].

    Grid (T, cdiv(H, BLOCK_H), cdiv(D, BLOCK_DC)). ``delta = rowsum(do * out) - d_lse``,
    ``P = exp(scale * s - lse)``, ``dS = P * (dP - delta) * scale``.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.program_id(2) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    offs_k = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < H
    mask_c = offs_c < D
    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    do_rows = do_ptr + t * stride_dot + offs_h[:, None] * stride_doh
    lse = tl.load(lse_ptr + t * H + offs_h, mask=mask_h, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    delta = tl.load(delta_ptr + t * H + offs_h, mask=mask_h, other=0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    if ATOMIC_DKV:
        qc_own = tl.load(q_rows + offs_c[None, :], mask=mask_h[:, None] & mask_c[None, :], other=0.0)
        doc_own = tl.load(do_rows + offs_c[None, :], mask=mask_h[:, None] & (offs_c < DV)[None, :], other=0.0)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        rows = tl.load(idx_ptr + t * stride_it + kk, mask=kk < K, other=-1)
        valid = (rows >= 0) & (rows < N)  # outside [0, N): padding, never loaded or written
        safe_rows = tl.where(valid, rows, 0).to(tl.int64)
        kv_rows = kv_ptr + safe_rows[:, None] * stride_kvn
        s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        dp = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            qc = tl.load(q_rows + dd[None, :], mask=mask_h[:, None] & (dd < D)[None, :], other=0.0)
            kc = tl.load(kv_rows + dd[None, :], mask=valid[:, None] & (dd < D)[None, :], other=0.0)
            s += tl.dot(qc, tl.trans(kc), input_precision=PREC)
            if d0 < DV:
                doc = tl.load(do_rows + dd[None, :], mask=mask_h[:, None] & (dd < DV)[None, :], other=0.0)
                kv_v = tl.where((dd < DV)[None, :], kc, 0.0).to(kc.dtype)
                dp += tl.dot(doc.to(kc.dtype), tl.trans(kv_v), input_precision=PREC)
        live = mask_h[:, None] & valid[None, :]
        p = tl.where(live, tl.exp(s * scale - lse[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        kc_own = tl.load(kv_rows + offs_c[None, :], mask=valid[:, None] & mask_c[None, :], other=0.0)
        dq += tl.dot(ds.to(kc_own.dtype), kc_own, input_precision=PREC)
        if ATOMIC_DKV:
            g = tl.dot(tl.trans(ds).to(qc_own.dtype), qc_own, input_precision=PREC)
            g += tl.dot(tl.trans(p).to(doc_own.dtype), doc_own.to(qc_own.dtype), input_precision=PREC)
            g_ptrs = dkv_ptr + safe_rows[:, None] * D + offs_c[None, :]
            tl.atomic_add(g_ptrs, g, mask=valid[:, None] & mask_c[None, :], sem="relaxed")
    dq_ptrs = dq_ptr + t * H * D + offs_h[:, None] * D + offs_c[None, :]
    tl.store(dq_ptrs, dq, mask=mask_h[:, None] & mask_c[None, :])


@triton.jit
def sparse_dkv_keymajor_kernel(
    q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, pair_t_ptr, row_ptr, dkv_ptr,
    H, D, DV,
    stride_qt, stride_qh, stride_kvn, stride_dot, stride_doh,
    scale,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DC: tl.constexpr,
):
    """Deterministic dkv: program (kv row n, column chunk) sums its (query, head) pairs in a fixed order.

    ``pair_t[row_ptr[n] : row_ptr[n + 1]]`` are the query rows listing kv row ``n`` (once per
    listing, in (t, k) order): an inverted index. No atomics; each program owns
    ``dkv[n, c-chunk]``. Grid (N, cdiv(D, BLOCK_DC)).
    """
    n = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_P * BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head = offs_r % BLOCK_H
    mask_c = offs_c < D
    p_lo = tl.load(row_ptr + n)
    p_hi = tl.load(row_ptr + n + 1)
    acc = tl.zeros([BLOCK_DC], tl.float32)
    for p0 in range(p_lo, p_hi, BLOCK_P):
        pair = p0 + offs_r // BLOCK_H
        live = (pair < p_hi) & (head < H)
        t = tl.load(pair_t_ptr + pair, mask=live, other=0).to(tl.int64)
        q_rows = q_ptr + t * stride_qt + head * stride_qh
        do_rows = do_ptr + t * stride_dot + head * stride_doh
        s = tl.zeros([BLOCK_P * BLOCK_H], tl.float32)
        dp = tl.zeros([BLOCK_P * BLOCK_H], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            kvc = tl.load(kv_ptr + n * stride_kvn + dd, mask=dd < D, other=0.0).to(tl.float32)
            qc = tl.load(q_rows[:, None] + dd[None, :], mask=live[:, None] & (dd < D)[None, :], other=0.0)
            s += tl.sum(qc.to(tl.float32) * kvc[None, :], 1)
            if d0 < DV:
                doc = tl.load(do_rows[:, None] + dd[None, :], mask=live[:, None] & (dd < DV)[None, :], other=0.0)
                dp += tl.sum(doc.to(tl.float32) * tl.where(dd < DV, kvc, 0.0)[None, :], 1)
        lse = tl.load(lse_ptr + t * H + head, mask=live, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        delta = tl.load(delta_ptr + t * H + head, mask=live, other=0.0)
        p = tl.where(live, tl.exp(s * scale - lse), 0.0)
        ds = p * (dp - delta) * scale
        qc = tl.load(q_rows[:, None] + offs_c[None, :], mask=live[:, None] & mask_c[None, :], other=0.0)
        doc = tl.load(do_rows[:, None] + offs_c[None, :], mask=live[:, None] & (offs_c < DV)[None, :], other=0.0)
        acc += tl.sum(ds[:, None] * qc.to(tl.float32) + p[:, None] * doc.to(tl.float32), 0)
    tl.store(dkv_ptr + n * D + offs_c, acc, mask=mask_c)


@triton.jit
def selected_probs_kernel(
    q_ptr, kv_ptr, idx_ptr, lse_ptr, out_ptr,
    N, H, D, K,
    stride_qt, stride_qh, stride_kvn, stride_it,
    scale,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    """out[t, k] = sum_h exp(scale * q[t, h] . kv[idx[t, k]] - lse[t, h]), 0 at padding; grid (T, cdiv(K, BLOCK_K))."""
    t = tl.program_id(0).to(tl.int64)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    rows = tl.load(idx_ptr + t * stride_it + kk, mask=kk < K, other=-1)
    valid = (rows >= 0) & (rows < N)  # outside [0, N): padding, never loaded or written
    kv_rows = kv_ptr + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_kvn
    total = tl.zeros([BLOCK_K], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
        s = tl.zeros([BLOCK_H, BLOCK_K], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + offs_d
            qc = tl.load(q_rows + dd[None, :], mask=mask_h[:, None] & (dd < D)[None, :], other=0.0)
            kc = tl.load(kv_rows + dd[None, :], mask=valid[:, None] & (dd < D)[None, :], other=0.0)
            s += tl.dot(qc, tl.trans(kc), input_precision=PREC)
        lse = tl.load(lse_ptr + t * H + offs_h, mask=mask_h, other=0.0)
        lse = tl.where(lse == float("-inf"), 0.0, lse)
        p = tl.where(mask_h[:, None] & valid[None, :], tl.exp(s * scale - lse[:, None]), 0.0)
        total += tl.sum(p, 0)
    tl.store(out_ptr + t * K + kk, total, mask=kk < K)

