# mypy: ignore-errors
# (Triton ships no type information, and @gluon.jit kernels cannot carry Python annotations.)
"""Gluon (Triton 3.6's explicit-layout dialect) twin of the sparse forward for Hopper: QK^T split over the warpgroups.

Why Gluon: plain Triton lays out a ``tl.dot`` whose result feeds another dot with all warps
along M (``warpsPerTileV3`` returns ``[num_warps, 1]`` for a chained dot), so at 64 heads and
8 warps both warpgroups would compute the same 64 x BLOCK_K scores (QK^T done twice, 1.5x the
counted forward FLOPs). The plain kernel now avoids that with a branch (see
:mod:`cpkv.backends.triton.kernels`); this twin states the schedule outright. Here the layouts
are explicit: S ``[64, BLOCK_K]`` on ``warps_per_cta [4, 2]`` (each warpgroup half of the
entries), the output ``[64, 512]`` on ``[4, 2]`` with instruction N 256 (each warpgroup 256
of the 512 columns), P converted to the PV dot's register operand. Q is loaded once into
shared memory; kv tiles ``[BLOCK_K, D]`` are gathered with cp.async into a two-stage ring
(tile j + 1 in flight while tile j is used for both QK^T and PV).

It serves bf16/fp16 with ``D == d_v`` (V4: 512, no rope tail), a power of two in
[64, 512]; everything else uses :func:`cpkv.backends.triton.kernels.sparse_fwd_kernel`, its
plain-Triton twin with the same math. Gluon does not run under Triton's interpreter: the
CPU tests check the twin, and ``tests/backends/test_triton_gluon.py`` a torch emulation of
this tile schedule; ``benchmarks/gpu_check.py`` checks and times it beside the plain kernel
on a GPU. Opt-in (the ops use it only with ``CPKV_TRITON_GLUON=1``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def sparse_fwd_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, lse_ptr,
    N, H, K,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_ot, stride_oh,
    scale,
    D: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
    S_N: gl.constexpr, O_N: gl.constexpr, num_warps: gl.constexpr,
):
    """out[t, heads] and lse[t, heads] (same contract as ``sparse_fwd_kernel`` with ``D == DV``); grid (T, cdiv(H, 64)).

    ``S_N``/``O_N``: the wgmma instruction N of the scores and of the output (each warpgroup
    owns ``BLOCK_K / 2`` entries of S and ``D / 2`` output columns at 8 warps).
    """
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                  instr_shape=[16, S_N, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                  instr_shape=[16, O_N, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    kv_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D], q_ptr.dtype.element_ty)
    q_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], q_ptr.dtype.element_ty)
    t = gl.program_id(0).to(gl.int64)
    h0 = gl.program_id(1) * BLOCK_H
    offs_h = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, ld))
    q = gl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_h < H)[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(q_ptr.dtype.element_ty, [BLOCK_H, D], q_sh, q)
    kv_s = gl.allocate_shared_memory(kv_ptr.dtype.element_ty, [2, BLOCK_K, D], kv_sh)
    idx_row = idx_ptr + t * stride_it
    # Tile 0 into stage 0. Entries outside [0, N) are padding: never loaded, score -inf.
    rows = gl.load(idx_row + offs_k, mask=offs_k < K, other=-1)
    valid = (rows >= 0) & (rows < N)
    async_copy.async_copy_global_to_shared(
        kv_s.index(0), kv_ptr + gl.where(valid, rows, 0).to(gl.int64)[:, None] * stride_kvn + offs_d[None, :],
        mask=valid[:, None])
    async_copy.commit_group()
    m = gl.full([BLOCK_H], -1.0e30, gl.float32, layout=gl.SliceLayout(1, s_l))
    l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([BLOCK_H, D], gl.float32, layout=o_l)
    fence_async_shared()  # Q (generic-proxy store) before the wgmma (async proxy) reads it
    for j in range(gl.cdiv(K, BLOCK_K)):
        stage = j % 2
        # Tile j + 1 into the other stage (its last readers, step j - 1's wgmma, have completed).
        nk = (j + 1) * BLOCK_K + offs_k
        rows_n = gl.load(idx_row + nk, mask=nk < K, other=-1)
        valid_n = (rows_n >= 0) & (rows_n < N)
        async_copy.async_copy_global_to_shared(
            kv_s.index(1 - stage),
            kv_ptr + gl.where(valid_n, rows_n, 0).to(gl.int64)[:, None] * stride_kvn + offs_d[None, :],
            mask=valid_n[:, None])
        async_copy.commit_group()
        async_copy.wait_group(1)  # tile j has landed (this thread's copies)
        gl.thread_barrier()  # ... and every thread's
        fence_async_shared()
        kv = kv_s.index(stage)
        s = warpgroup_mma(q_s, kv.permute((1, 0)), gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_l),
                          is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        ok = gl.convert_layout(valid, gl.SliceLayout(0, s_l))
        s = gl.where(ok[None, :], s * scale, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, 1))
        alpha = gl.exp(m - m_new)
        p = gl.exp(s - m_new[:, None])
        l = l * alpha + gl.sum(p, 1)
        m = m_new
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        acc = warpgroup_mma(gl.convert_layout(p.to(kv_ptr.dtype.element_ty), p_l), kv, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warpgroup is done with this stage before step j + 1 refills it
        valid = valid_n
    async_copy.wait_group(0)
    offs_hs = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_l))
    lse = gl.where(l > 0, m + gl.log(l), float("-inf"))
    if HAS_SINK:
        sink = gl.load(sink_ptr + offs_hs, mask=offs_hs < H, other=0.0).to(gl.float32)
        top = gl.maximum(lse, sink)
        lse = top + gl.log(gl.exp(lse - top) + gl.exp(sink - top))
    o_scale = gl.convert_layout(gl.where(l > 0, gl.exp(m - lse), 0.0), gl.SliceLayout(1, o_l))
    out = (acc * o_scale[:, None]).to(out_ptr.dtype.element_ty)
    offs_ho = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    offs_do = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    gl.store(out_ptr + t * stride_ot + offs_ho[:, None] * stride_oh + offs_do[None, :], out,
             mask=(offs_ho < H)[:, None])
    gl.store(lse_ptr + t * H + offs_hs, lse, mask=offs_hs < H)
