"""Compile-only probe (not used by the ops, not in CI): a Gluon sparse backward for Hopper, atomic dkv.

    python benchmarks/gluon_bwd_probe.py [BLOCK_K G_SPLIT]     # default 16 2

One program per query row and 64 heads, 8 warps: Q and dO resident in shared memory; kv tiles
gathered by cp.async into a two-stage ring; S and dP on ``warps [4, 2]`` (no replicated
rows, unlike plain Triton's chained-dot layout); dq ``[64, 512]`` accumulated on wgmma;
the dkv terms as ``G^T = Q^T dS + dO^T P`` (``[D / G_SPLIT, BLOCK_K]`` pieces, Q/dO
transposed views of the resident tiles, dS/P staged in shared memory: every dot on wgmma,
no Q/dO re-reads from L2), added with fp32 atomics after a shared-memory transpose.
Prints registers, spills, shared memory and the wgmma count. At Triton 3.6 (issue 18): it
compiles with 97 wgmma and 16 bytes of spill at 255 registers (BLOCK_K 16, G_SPLIT 2;
64 bytes at 32/4): the dq accumulator (128 registers) plus the G piece leave no room. Not
checked numerically (no device in that session); the next step is to remove the last
spill (e.g. dq accumulated by one warpgroup pair while another computes G: warp
specialization) and wire it into ``ops`` behind ``CPKV_TRITON_GLUON`` like the forward.
"""
import os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, fence_async_shared
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.jit
def gsparse_bwd(q_ptr, kv_ptr, idx_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dkv_ptr, N, H, K,
                stride_qt, stride_qh, stride_kvn, stride_it, stride_dot, stride_doh, scale,
                D: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, G_SPLIT: gl.constexpr,
                num_warps: gl.constexpr):
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_K // 2, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    GD: gl.constexpr = D // G_SPLIT
    g_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BLOCK_K, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    kv_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, D], gl.bfloat16)
    q_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, D], gl.bfloat16)
    ds_sh: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], gl.bfloat16)
    t = gl.program_id(0).to(gl.int64)
    offs_h = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, ld))
    hmask = (offs_h < H)[:, None]
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sh,
                                    gl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hmask, other=0.0))
    do_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D], q_sh,
                                     gl.load(do_ptr + t * stride_dot + offs_h[:, None] * stride_doh + offs_d[None, :], mask=hmask, other=0.0))
    kv_s = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_K, D], kv_sh)
    ds_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], ds_sh)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], ds_sh)
    offs_hs = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_l))
    lse = gl.load(lse_ptr + t * H + offs_hs, mask=offs_hs < H, other=0.0)
    lse = gl.where(lse == float("-inf"), 0.0, lse)
    delta = gl.load(delta_ptr + t * H + offs_hs, mask=offs_hs < H, other=0.0)
    idx_row = idx_ptr + t * stride_it
    rows = gl.load(idx_row + offs_k, mask=offs_k < K, other=-1)
    valid = (rows >= 0) & (rows < N)
    async_copy.async_copy_global_to_shared(kv_s.index(0), kv_ptr + gl.where(valid, rows, 0).to(gl.int64)[:, None] * stride_kvn + offs_d[None, :], mask=valid[:, None])
    async_copy.commit_group()
    dq = gl.zeros([BLOCK_H, D], gl.float32, layout=o_l)
    fence_async_shared()
    g0 = gl.zeros([GD, BLOCK_K], gl.float32, layout=g_l)
    st: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    offs_sc = gl.arange(0, GD, layout=gl.SliceLayout(0, st))
    g_s = gl.allocate_shared_memory(gl.float32, [GD, BLOCK_K], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for j in range(gl.cdiv(K, BLOCK_K)):
        stage = j % 2
        nk = (j + 1) * BLOCK_K + offs_k
        rows_n = gl.load(idx_row + nk, mask=nk < K, other=-1)
        valid_n = (rows_n >= 0) & (rows_n < N)
        async_copy.async_copy_global_to_shared(kv_s.index(1 - stage), kv_ptr + gl.where(valid_n, rows_n, 0).to(gl.int64)[:, None] * stride_kvn + offs_d[None, :], mask=valid_n[:, None])
        async_copy.commit_group()
        async_copy.wait_group(1)
        gl.thread_barrier()
        fence_async_shared()
        kv = kv_s.index(stage)
        zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_l)
        s = warpgroup_mma(q_s, kv.permute((1, 0)), zero, is_async=True)
        dp = warpgroup_mma(do_s, kv.permute((1, 0)), zero, is_async=True)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        ok = gl.convert_layout(valid, gl.SliceLayout(0, s_l))
        live = (offs_hs < H)[:, None] & ok[None, :]
        p = gl.where(live, gl.exp(s * scale - lse[:, None]), 0.0)
        ds = (p * (dp - delta[:, None]) * scale).to(gl.bfloat16)
        ds_s.store(ds)
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        dq = warpgroup_mma(ds_s, kv, dq, is_async=True)
        rows_g = gl.convert_layout(gl.where(valid, rows, 0), gl.SliceLayout(1, st)).to(gl.int64)
        okst = gl.convert_layout(valid, gl.SliceLayout(1, st))
        for c in gl.static_range(G_SPLIT):
            g = warpgroup_mma(q_s.slice(c * GD, GD, dim=1).permute((1, 0)), ds_s, g0, use_acc=False, is_async=True)
            g = warpgroup_mma(do_s.slice(c * GD, GD, dim=1).permute((1, 0)), p_s, g, is_async=True)
            g = warpgroup_mma_wait(num_outstanding=0, deps=(g,))
            g_s.store(g)
            gl.thread_barrier()
            gt = g_s.permute((1, 0)).load(st)
            gl.atomic_add(dkv_ptr + rows_g[:, None] * D + (c * GD + offs_sc)[None, :], gt, mask=okst[:, None], sem="relaxed")
            gl.thread_barrier()
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))
        gl.thread_barrier()
        valid = valid_n
        rows = rows_n
    async_copy.wait_group(0)
    oh = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l))
    od = gl.arange(0, D, layout=gl.SliceLayout(0, o_l))
    gl.store(dq_ptr + t * H * D + oh[:, None] * D + od[None, :], dq, mask=(oh < H)[:, None])


def main():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.backends.nvidia.compiler import get_ptxas
    bk, split = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (16, 2)
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "do_ptr": "*bf16", "lse_ptr": "*fp32", "delta_ptr": "*fp32",
           "dq_ptr": "*fp32", "dkv_ptr": "*fp32", "N": "i32", "H": "i32", "K": "i32", "stride_qt": "i32", "stride_qh": "i32",
           "stride_kvn": "i32", "stride_it": "i32", "stride_dot": "i32", "stride_doh": "i32", "scale": "fp32",
           "D": "constexpr", "BLOCK_H": "constexpr", "BLOCK_K": "constexpr", "G_SPLIT": "constexpr", "num_warps": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(17)}
    src = GluonASTSource(gsparse_bwd, sig, {"D": 512, "BLOCK_H": 64, "BLOCK_K": bk, "G_SPLIT": split, "num_warps": 8}, attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    ptx = c.asm["ptx"]
    tmp = tempfile.mkdtemp()
    open(os.path.join(tmp, "kb.ptx"), "w").write(ptx)
    r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", os.path.join(tmp, "kb.ptx"), "-o", os.path.join(tmp, "kb.cubin")], capture_output=True, text=True)
    print(bk, split, re.findall(r"Used \d+ registers|\d+ bytes spill \w+", r.stderr), "smem", c.metadata.shared,
          "wgmma", len(re.findall(r"wgmma\.mma_async", ptx)), "red", len(re.findall(r"red\.|atom\.", ptx)))


main()
