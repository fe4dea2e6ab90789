# mypy: ignore-errors
# (Triton ships no type information, and @triton.jit kernels cannot carry Python annotations.)
"""The lightning indexer's Triton kernel: scores on tensor cores and the exact running top-k, in one launch.

Launch wrappers live in :mod:`cpkv.backends.triton.indexer_ops`; this module only defines
``@triton.jit`` kernels, so it is imported lazily (``TRITON_INTERPRET=1`` is read when it is
imported, as for :mod:`cpkv.backends.triton.kernels`).

**Order keys.** A (score, entry) pair becomes one int64 whose signed order is the selection
order: the high 32 bits are the fp32 score's bits made order-preserving as a signed int
(negative floats get their magnitude bits flipped; ``-0.0`` is first made ``+0.0`` and every
NaN the positive quiet NaN, so equal scores give equal bits and NaN sorts first, as in
``torch.sort``), the low 32 bits are ``2**31 - 1 - j``, so among equal scores the earlier entry
``j`` is the larger key (the reference's tie rule). ``EMPTY`` (``-2**63 + 1``) is below
every real key: an empty slot, decoded as index ``-1`` and score ``-inf``.

**Running top-k.** Each program owns a scratch row of ``SORT`` keys per query of its tile:
slots ``[0, K_PAD)`` hold the best keys so far (sorted, descending), slots
``[K_PAD, SORT)`` collect candidates. Per chunk of ``BLOCK_N`` entries, only keys above the
query's threshold (its ``topk``-th best key at the last merge; ``EMPTY`` until ``topk``
entries were seen) are appended, compacted with a prefix sum. A query whose candidate area
could overflow on the next chunk is merged: one bitonic sort of its ``SORT`` slots (never a
sort of every score), which also yields its new threshold. Every key is distinct (the entry
is part of it), so the selection is exactly the ``topk`` largest keys: bitwise the
reference's stable-sort selection whenever the scores are equal bitwise.
"""

import triton
import triton.language as tl

EMPTY = tl.constexpr(-9223372036854775807)  # -2**63 + 1: below every real order key (see the module doc)


@triton.jit
def _score_bits(score):
    """The high halves of the order keys of fp32 ``score``: int32, signed order = the selection order."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 -> +0.0: ties compare as floats do
    score = tl.where(score != score, float("nan"), score)  # one NaN (positive): sorts first
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _decode(keys):
    """(entry int64, score fp32) of order keys; ``EMPTY`` -> (-1, -inf)."""
    hi = (keys >> 32).to(tl.int32)
    lo = keys - (hi.to(tl.int64) << 32)
    bits = tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi)
    empty = keys == EMPTY
    score = tl.where(empty, float("-inf"), bits.to(tl.float32, bitcast=True))
    return tl.where(empty, -1, 0x7FFFFFFF - lo), score


@triton.jit
def _merge_row(row_ptr, count, TOPK, K_PAD: tl.constexpr, SORT: tl.constexpr):
    """Sort one query's best keys and its ``count`` candidates in place; return its new threshold."""
    slots = tl.arange(0, SORT)
    keys = tl.load(row_ptr + slots, mask=slots < K_PAD + count, other=EMPTY)
    keys = tl.sort(keys, descending=True)
    tl.debug_barrier()  # every thread has read the row before any overwrites it
    tl.store(row_ptr + slots, keys, mask=slots < K_PAD)
    tl.debug_barrier()
    return tl.sum(tl.where(slots == TOPK - 1, keys, 0), 0)


@triton.jit
def indexer_topk_kernel(
    q_ptr, k_ptr, ks_ptr, w_ptr, start_ptr, count_ptr, buf_ptr, idx_ptr, score_ptr,
    T, N, HI, DI, TOPK, num_tiles,
    stride_qt, stride_qh, stride_kn, stride_wt,
    HAS_SCALE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    K_PAD: tl.constexpr, SORT: tl.constexpr, PREC: tl.constexpr, SELECT: tl.constexpr = True,
):
    """Top-``TOPK`` entries of ``I[t, j] = scale[j] * sum_h w[t, h] relu(q[t, h] . k[j])`` over ``[start, start + count)``.

    Persistent: program ``p`` of ``P`` takes query tiles ``num_tiles - 1 - p``,
    ``num_tiles - 1 - p - P``, ... (the last tiles of a causal batch see the most entries,
    so they go first). Per tile it streams the union of its queries' ranges (clamped to
    ``[0, N)``) in chunks of ``BLOCK_N`` entries: one ``[BLOCK_N, D]`` key tile, then per
    head one ``[BLOCK_T, D] x [D, BLOCK_N]`` tensor-core product, relu, times the head's
    weight. ``scale`` (``HAS_SCALE``: fp8 keys, one fp32 scale per key) multiplies the head
    sum. ``buf`` is ``[P * BLOCK_T, SORT]`` int64 scratch (no initial value); outputs
    ``idx`` ``[T, TOPK]`` int64 (-1 padded) and ``score`` ``[T, TOPK]`` fp32 (-inf at padding),
    by descending score. Grid ``(P,)``. ``SELECT=False`` (benchmarks only: the cost of the
    scores alone) skips the selection and writes each query's best score to ``score[t, 0]``.
    """
    pid = tl.program_id(0)
    CAP: tl.constexpr = SORT - K_PAD
    rows = tl.arange(0, BLOCK_T)
    offs_n = tl.arange(0, BLOCK_N)
    slots = tl.arange(0, SORT)
    buf_rows = buf_ptr + (pid * BLOCK_T + rows).to(tl.int64) * SORT
    for i in range(pid, num_tiles, tl.num_programs(0)):
        tile_t0 = (num_tiles - 1 - i) * BLOCK_T
        offs_t = tile_t0 + rows
        mask_t = offs_t < T
        t64 = offs_t.to(tl.int64)
        start = tl.load(start_ptr + offs_t, mask=mask_t, other=0)
        end = start + tl.load(count_ptr + offs_t, mask=mask_t, other=0)
        start = tl.minimum(tl.maximum(start, 0), N).to(tl.int32)  # clamped: no key row past N is scored
        end = tl.minimum(tl.maximum(end, 0), N).to(tl.int32)
        live = mask_t & (end > start)
        lo = tl.min(tl.where(live, start, N), 0)
        hi = tl.max(tl.where(live, end, 0), 0)
        for r in range(BLOCK_T):  # every best slot empty
            tl.store(buf_ptr + (pid * BLOCK_T + r).to(tl.int64) * SORT + slots, tl.full([SORT], EMPTY, tl.int64),
                     mask=slots < K_PAD)
        theta_hi = tl.full([BLOCK_T], -2147483648, tl.int32)  # EMPTY's halves: below every real key
        theta_lo = tl.full([BLOCK_T], 1, tl.int32)
        count = tl.zeros([BLOCK_T], tl.int32)
        best = tl.full([BLOCK_T], float("-inf"), tl.float32)
        for j0 in range(lo, hi, BLOCK_N):
            j = j0 + offs_n
            k_blk = tl.make_block_ptr(k_ptr, (N, DI), (stride_kn, 1), (j0, 0), (BLOCK_N, BLOCK_D), (1, 0))
            kc = tl.load(k_blk, boundary_check=(0, 1), padding_option="zero")  # rows past N: 0, never seen
            acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
            for h in range(0, HI):
                q_blk = tl.make_block_ptr(q_ptr + h * stride_qh, (T, DI), (stride_qt, 1), (tile_t0, 0),
                                          (BLOCK_T, BLOCK_D), (1, 0))
                qh = tl.load(q_blk, boundary_check=(0, 1), padding_option="zero")
                wh = tl.load(w_ptr + t64 * stride_wt + h, mask=mask_t, other=0.0).to(tl.float32)
                acc += wh[:, None] * tl.maximum(tl.dot(qh, tl.trans(kc), input_precision=PREC), 0.0)
            if HAS_SCALE:
                acc = acc * tl.load(ks_ptr + j, mask=j < hi, other=0.0)[None, :]
            seen = (j[None, :] >= start[:, None]) & (j[None, :] < end[:, None])
            if not SELECT:
                best = tl.maximum(best, tl.max(tl.where(seen, acc, float("-inf")), 1))
            else:
                hi_bits = _score_bits(acc)
                lo_bits = 0x7FFFFFFF - j[None, :]
                cand = seen & ((hi_bits > theta_hi[:, None]) | ((hi_bits == theta_hi[:, None]) & (lo_bits > theta_lo[:, None])))
                num_cand = tl.sum(cand.to(tl.int32), 1)
                if tl.max(num_cand, 0) > 0:  # rare once the thresholds settle: 64-bit keys only here
                    pos = count[:, None] + tl.cumsum(cand.to(tl.int32), 1) - 1
                    keys = (hi_bits.to(tl.int64) << 32) + lo_bits.to(tl.int64)
                    tl.store(buf_rows[:, None] + K_PAD + pos, keys, mask=cand)
                    count += num_cand
                if tl.max(count, 0) > CAP - BLOCK_N:  # some query's candidates may not fit the next chunk
                    tl.debug_barrier()
                    for r in range(BLOCK_T):
                        count_r = tl.sum(tl.where(rows == r, count, 0), 0)
                        if count_r > CAP - BLOCK_N:
                            row_ptr = buf_ptr + (pid * BLOCK_T + r).to(tl.int64) * SORT
                            theta_r = _merge_row(row_ptr, count_r, TOPK, K_PAD, SORT)
                            theta_rhi = (theta_r >> 32).to(tl.int32)
                            theta_hi = tl.where(rows == r, theta_rhi, theta_hi)
                            theta_lo = tl.where(rows == r, (theta_r - (theta_rhi.to(tl.int64) << 32)).to(tl.int32), theta_lo)
                            count = tl.where(rows == r, 0, count)
        tl.debug_barrier()
        if not SELECT:
            tl.store(score_ptr + t64 * TOPK, best, mask=mask_t)
        else:
            for r in range(BLOCK_T):  # final merge and decode, one query at a time
                t = (num_tiles - 1 - i) * BLOCK_T + r
                if t < T:
                    row_ptr = buf_ptr + (pid * BLOCK_T + r).to(tl.int64) * SORT
                    count_r = tl.sum(tl.where(rows == r, count, 0), 0)
                    keys = tl.load(row_ptr + slots, mask=slots < K_PAD + count_r, other=EMPTY)
                    if count_r > 0:  # else the best slots are sorted already (by the last merge, or all EMPTY)
                        keys = tl.sort(keys, descending=True)
                    entry, score = _decode(keys)
                    out = t.to(tl.int64) * TOPK + slots
                    tl.store(idx_ptr + out, entry, mask=slots < TOPK)
                    tl.store(score_ptr + out, score, mask=slots < TOPK)
        tl.debug_barrier()  # the next tile reuses the scratch rows


@triton.jit
def indexer_selected_scores_kernel(
    q_ptr, k_ptr, w_ptr, sel_ptr, out_ptr,
    N, H, DI, K,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_st,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
):
    """out[t, k] = sum_h w[t, h] relu(q[t, h] . k[sel[t, k]]), -inf where ``sel`` is outside ``[0, N)``.

    One program per (query, chunk of ``BLOCK_K`` selected entries): the heads are the MMA's
    M dimension over the gathered keys. ``out`` is ``[T, K]`` fp32 contiguous. Grid
    ``(T, cdiv(K, BLOCK_K))``.
    """
    t = tl.program_id(0).to(tl.int64)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < DI
    rows = tl.load(sel_ptr + t * stride_st + kk, mask=kk < K, other=-1)
    valid = (rows >= 0) & (rows < N)  # outside [0, N): padding, never loaded
    keys = tl.load(k_ptr + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
                   mask=valid[:, None] & mask_d[None, :], other=0.0)
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dots = tl.dot(q, tl.trans(keys), input_precision=PREC)
    scores = tl.sum(w[:, None] * tl.maximum(dots, 0.0), 0)
    tl.store(out_ptr + t * K + kk, tl.where(valid, scores, float("-inf")), mask=kk < K)


@triton.jit
def indexer_selected_grads_kernel(
    q_ptr, k_ptr, w_ptr, sel_ptr, ds_ptr, dq_ptr, dk_ptr, dw_ptr,
    N, H, DI, K,
    stride_qt, stride_qh, stride_kn, stride_wt, stride_st,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, PREC: tl.constexpr,
    ATOMIC_DK: tl.constexpr,
):
    """Gradients of ``sum_{t, k} ds[t, k] * I[t, k]`` (``I`` as above) w.r.t. q, w and (``ATOMIC_DK``) k, in fp32.

    ``ds`` ``[T, K]`` fp32 contiguous (0 at padding). One program per query: over chunks of
    its selection, ``d_dots = ds * w * (dots > 0)``; ``dq[t] = d_dots . keys``,
    ``dw[t, h] = sum_k ds * relu(dots)`` (stored, ``[T, H_I, D_I]`` and ``[T, H_I]`` contiguous)
    and, with ``ATOMIC_DK``, ``dk[sel] += d_dots^T . q[t]`` with fp32 atomics (``[N, D_I]``
    contiguous; padding adds nothing); without it :func:`indexer_dk_kernel` sums dk in a
    fixed order. The dots take q and the keys in their own dtype (bf16/fp16: tensor cores,
    fp32 accumulation) and ``d_dots`` rounded to it, as flash attention's backward rounds
    ``dS``; fp32 stays fp32. Grid ``(T,)``.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < DI
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(w_ptr + t * stride_wt + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    dq = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    dw = tl.zeros([BLOCK_H], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        rows = tl.load(sel_ptr + t * stride_st + kk, mask=kk < K, other=-1)
        valid = (rows >= 0) & (rows < N)
        safe = tl.where(valid, rows, 0).to(tl.int64)
        keys = tl.load(k_ptr + safe[:, None] * stride_kn + offs_d[None, :],
                       mask=valid[:, None] & mask_d[None, :], other=0.0)
        ds = tl.load(ds_ptr + t * K + kk, mask=(kk < K) & valid, other=0.0)
        dots = tl.dot(q, tl.trans(keys), input_precision=PREC)
        dw += tl.sum(ds[None, :] * tl.maximum(dots, 0.0), 1)
        d_dots = tl.where(dots > 0, ds[None, :] * w[:, None], 0.0).to(q.dtype)
        dq += tl.dot(d_dots, keys, input_precision=PREC)
        if ATOMIC_DK:  # dk^T = q^T d_dots: D_I is the MMA's M (a multiple of 64), whatever BLOCK_K is
            dk_t = tl.dot(tl.trans(q), d_dots, input_precision=PREC)
            tl.atomic_add(dk_ptr + safe[None, :] * DI + offs_d[:, None], dk_t, mask=mask_d[:, None] & valid[None, :],
                          sem="relaxed")
    tl.store(dq_ptr + t * H * DI + offs_h[:, None] * DI + offs_d[None, :], dq, mask=mask_h[:, None] & mask_d[None, :])
    tl.store(dw_ptr + t * H + offs_h, dw, mask=mask_h)


@triton.jit
def indexer_dk_kernel(
    q_ptr, k_ptr, w_ptr, ds_ptr, pair_ptr, row_ptr, dk_ptr,
    H, DI, K,
    stride_qt, stride_qh, stride_kn, stride_wt,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``dk[j] = sum over the (t, k) selecting j of sum_h d_dots[t, h, k] q[t, h]``, in a fixed order (deterministic).

    Key-major over the inverted selection: ``pair`` lists the flat positions ``t * K + k``
    of the valid selected entries grouped by key row (``row_ptr`` ``[N + 1]``, each group
    in ``(t, k)`` order, :func:`cpkv.backends.triton.ops.inverted_pairs`). Program ``j``
    walks its group ``BLOCK_R`` entries at a time: it recomputes ``dots = q[t, h] . k[j]``
    and ``d_dots = ds[t, k] * w[t, h] * (dots > 0)`` in fp32 (CUDA cores) and adds
    ``sum_{r, h} d_dots q[t, h]``: one store per key, no atomics, the same summation
    order on every run. ``dk`` ``[N, D_I]`` fp32 contiguous. Grid ``(N,)``.
    """
    j = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h, mask_d = offs_h < H, offs_d < DI
    lo = tl.load(row_ptr + j)
    hi = tl.load(row_ptr + j + 1)
    kj = tl.load(k_ptr + j * stride_kn + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(lo, hi, BLOCK_R):
        p = p0 + offs_r
        live = p < hi
        flat = tl.load(pair_ptr + p, mask=live, other=0).to(tl.int64)
        t = flat // K
        ds = tl.load(ds_ptr + flat, mask=live, other=0.0)
        mask_rh = live[:, None] & mask_h[None, :]
        w = tl.load(w_ptr + t[:, None] * stride_wt + offs_h[None, :], mask=mask_rh, other=0.0).to(tl.float32)
        q = tl.load(q_ptr + t[:, None, None] * stride_qt + offs_h[None, :, None] * stride_qh + offs_d[None, None, :],
                    mask=mask_rh[:, :, None] & mask_d[None, None, :], other=0.0).to(tl.float32)
        dots = tl.sum(q * kj[None, None, :], 2)
        d_dots = tl.where(dots > 0, ds[:, None] * w, 0.0)
        acc += tl.sum(tl.sum(d_dots[:, :, None] * q, 1), 0)
    tl.store(dk_ptr + j * DI + offs_d, acc, mask=mask_d)
