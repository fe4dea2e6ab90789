"""The Triton kernels as ``torch.library`` custom ops (namespace ``cpkv_triton``), with fakes and autograd.

* ``cpkv_triton::sparse_attention(q, kv, indices, sinks, scale, d_v, deterministic)`` ->
  ``(out, lse)``, differentiable w.r.t. q, kv and sinks (also through ``lse``); its
  backward is the op ``cpkv_triton::sparse_attention_backward``.
* ``cpkv_triton::selected_probs(q, kv, indices, lse, scale)`` -> ``[T, K]`` (no autograd).

Semantics are those of the reference ops of the same name (:mod:`cpkv.backends.reference`),
which are the tests' oracle. Nothing is validated here (the backend's plans were validated
when built, and a check of the indices would sync the host every layer); the bodies are
opaque to ``torch.compile``, so a layer calling them still compiles with ``fullgraph=True``.
Index safety is by construction instead: every index outside ``[0, N)`` (``-2``, ``N``,
``N + 3``, ...) is treated exactly as ``-1`` padding (never loaded, never written, also by
the atomic dkv adds). (The indexer's op is in :mod:`cpkv.backends.triton.indexer_ops`.) The
reference's validated entry points raise ``ValueError`` for such input instead.

Inputs: fp16, bf16 or fp32 (fp32 accumulation; fp32 dot products run in IEEE precision, not
TF32), on a CUDA device, or on CPU when the kernels were imported under ``TRITON_INTERPRET=1``.

Backward: three query-major passes per chunk of query rows (their buffers within a 2 GiB
budget): ``P`` and ``dS`` of every (head, entry) into ``[T, H, K]`` buffers (S and dP once, on
one warpgroup), dq from ``dS``, and the dkv terms from both. No pass recomputes another's
products, so the tensor-core FLOPs are the counted ones; the buffers cost a write and two
reads of ``2 * H * K`` values a row. dkv: by default the terms are added with fp32 atomics
(the summation order varies run to run). With ``deterministic=True`` the dkv pass stores each
entry's terms (``[T * K, D]`` fp32) instead, and a key-major pass over an inverted index
(``kv`` row -> the entries listing it, in (t, k) order) sums them in a fixed order: bitwise
reproducible, the same tensor-core FLOPs, plus a write and a read of those terms.

Launches: every kernel launch is a :class:`~cpkv.backends.triton.launches.KernelLaunch`
built by a function of the op's tensors; :func:`aot_launches` calls the same functions on
``meta`` tensors for the sm_90a compile report (``benchmarks/compile_report.py``).

Shapes legend: ``T`` query tokens, ``H`` query heads, ``D`` query/key dim, ``d_v`` value dim
(the first ``d_v`` channels of kv), ``N`` kv rows, ``K`` entries per query row.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpkv.backends.base import unflatten_rows
from cpkv.backends.triton.launches import AOTCase, KernelLaunch

__all__ = [
    "aot_launches", "inverted_index", "inverted_pairs", "selected_probs_op", "sparse_attention_backward_op",
    "sparse_attention_op", "sparse_attention_probs_op",
]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Tiles:
    """Tile sizes and launch options of one sparse kernel (powers of two, at least 16 where they feed ``tl.dot``).

    ``h`` heads, ``k`` entries per step, ``v`` value channels (``>= d_v``), ``r`` the channels
    after the values (``>= D - d_v``; unused when ``D == d_v``), ``c`` the dkv column chunk.
    """

    h: int
    k: int
    v: int
    r: int
    c: int
    warps: int
    stages: int


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _tiles(kernel: str, q: Tensor, d_v: int) -> _Tiles:
    """The tiles of ``kernel`` (``"fwd"``, ``"fwd_probs"``, ``"bwd_ds"``, ``"bwd_dq"``, ``"bwd_dkv"``, ``"probs"``)
    for q's shape, dtype and device.

    GPU (Hopper): 64 heads per program (V4-Flash's 64 in one, V4-Pro's 128 in two). The
    forward and dq put their ``[64, 512]`` fp32 accumulator over 8 warps (two warpgroups, 128
    registers a thread); the backward's ``P``/``dS`` pass runs on one warpgroup (4 warps), so
    its S and dP dots are not computed twice, with 32-entry kv tiles (Q, dO and a tile share
    the shared memory); the dkv pass builds 64-channel chunks of 128 entries a step, the
    entries split over two warpgroups, with up to 128 heads a program (the heads are its dots'
    inner dimension, so V4-Pro's terms are summed over all its heads before they are added or
    stored: half the atomics, or half the stored terms, of two head blocks); the forward with
    the KL target (``"fwd_probs"``) takes the forward's tiles. fp32 (IEEE, no tensor cores)
    takes smaller tiles. On CPU (the interpreter: numpy per tile op) tiles are as large as the
    shapes, so there are few steps.
    """
    heads, dim = q.shape[1], q.shape[2]
    v, r = _pow2(d_v), _pow2(dim - d_v)
    if q.device.type == "cpu":
        return _Tiles(min(16, _pow2(heads)), 64, v, r, _pow2(dim), 4, 1)
    h = min(64, _pow2(heads))
    if q.dtype == torch.float32:
        if kernel.startswith("bwd"):
            return _Tiles(min(16, h), 16, v, r, 16, 4, 1)
        return _Tiles(min(16, h), 16, v, r, 32, 8, 1)
    if kernel == "bwd_ds":  # one warpgroup: S and dP are computed once (no dot feeds another)
        return _Tiles(h, 32, v, r, 64, 4, 1)
    if kernel == "bwd_dq":
        return _Tiles(h, 64, v, r, 64, 8, 1)
    if kernel == "bwd_dkv":  # up to 128 heads (the dots' inner dimension); 128 entries a step over the two warpgroups
        return _Tiles(min(128, _pow2(heads)), 128, v, r, 64, 8, 1)
    return _Tiles(h, 64, v, r, 64, 8, 2)


def _prec(q: Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _kernels() -> Any:
    from cpkv.backends.triton import kernels  # lazy: triton is imported only when a kernel runs

    return kernels


def _channel_constexprs(b: _Tiles, dim: int, d_v: int, q: Tensor) -> dict[str, Any]:
    return {"D": dim, "DV": d_v, "HAS_REST": dim > d_v, "BLOCK_H": b.h, "BLOCK_K": b.k, "BLOCK_V": b.v,
            "BLOCK_R": b.r, "PREC": _prec(q)}


def _gluon_fits(q: Tensor, d_v: int) -> bool:
    """Whether the Gluon forward serves q (not CPU, bf16/fp16, ``D == d_v`` a power of two in [64, 512])."""
    dim = q.shape[2]
    return (q.device.type != "cpu" and q.dtype in (torch.bfloat16, torch.float16) and dim == d_v
            and 64 <= dim <= 512 and dim & (dim - 1) == 0)


def _gluon_enabled() -> bool:
    """``CPKV_TRITON_GLUON=1`` opts the CUDA forward into the Gluon kernel (read at each call)."""
    return os.environ.get("CPKV_TRITON_GLUON", "0") == "1"


def _fwd_gluon_launch(q: Tensor, kv: Tensor, idx: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor,
                      scale: float) -> KernelLaunch:
    """The Gluon forward (:mod:`cpkv.backends.triton.gluon_kernels`): 64 heads, 64 entries a step, 8 warps."""
    from cpkv.backends.triton import gluon_kernels  # lazy, like the Triton kernels

    (num_q, heads, dim), width = q.shape, idx.shape[1]
    block_h, block_k, warps = 64, 64, 8
    return KernelLaunch(
        "sparse_fwd_gluon", gluon_kernels.sparse_fwd_gluon_kernel, (num_q, triton_cdiv(heads, block_h)),
        (q, kv, idx, sinks if sinks is not None else lse, out, lse,
         kv.shape[0], heads, width,
         q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1),
         scale),
        {"D": dim, "HAS_SINK": sinks is not None, "BLOCK_H": block_h, "BLOCK_K": block_k,
         "S_N": block_k // (warps // 4), "O_N": min(256, dim // (warps // 4))}, warps, 1,
    )


def _fwd_launch(q: Tensor, kv: Tensor, idx: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor, scale: float,
                d_v: int) -> KernelLaunch:
    """The forward's one launch, writing ``out`` and ``lse``.

    The Gluon twin where it fits and ``CPKV_TRITON_GLUON=1``; else the plain-Triton kernel.
    """
    if _gluon_enabled() and _gluon_fits(q, d_v):
        return _fwd_gluon_launch(q, kv, idx, sinks, out, lse, scale)
    return _plain_fwd_launch(q, kv, idx, sinks, out, lse, scale, d_v)


def _plain_fwd_launch(q: Tensor, kv: Tensor, idx: Tensor, sinks: Tensor | None, out: Tensor, lse: Tensor,
                      scale: float, d_v: int, probs: Tensor | None = None, probs_from: int = 0) -> KernelLaunch:
    """The plain-Triton forward (:func:`~cpkv.backends.triton.kernels.sparse_fwd_kernel`, grid (T, head blocks)).

    With ``probs`` (``[T, cdiv(H, BLOCK_H), K - probs_from]`` fp32): ``sparse_fwd_probs_kernel``,
    which also writes the KL target of the columns ``>= probs_from``, with each program's steps in
    its own scratch (allocated here for q's rows: callers chunk the rows, :func:`_launch_fwd`).
    """
    (num_q, heads, dim), width = q.shape, idx.shape[1]
    b = _tiles("fwd" if probs is None else "fwd_probs", q, d_v)
    strides = (q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1))
    constexprs = {**_channel_constexprs(b, dim, d_v, q), "HAS_SINK": sinks is not None}
    sink_arg = sinks if sinks is not None else lse
    grid = (num_q, triton_cdiv(heads, b.h))
    if probs is None:
        return KernelLaunch(
            "sparse_fwd", _kernels().sparse_fwd_kernel, grid,
            (q, kv, idx, sink_arg, out, lse, kv.shape[0], heads, width, *strides, scale), constexprs, b.warps, b.stages,
        )
    steps = triton_cdiv(width, b.k) - probs_from // b.k
    p_scratch = torch.empty((*grid, steps, b.h, b.k), dtype=q.dtype, device=q.device)
    m_scratch = torch.empty((*grid, steps, b.h), dtype=torch.float32, device=q.device)
    return KernelLaunch(
        "sparse_fwd_probs", _kernels().sparse_fwd_probs_kernel, grid,
        (q, kv, idx, sink_arg, out, lse, probs, p_scratch, m_scratch, kv.shape[0], heads, width, probs_from,
         *strides, scale), constexprs, b.warps, b.stages,
    )


def _probs_scratch_bytes(q: Tensor, width: int, d_v: int, probs_from: int) -> int:
    """Scratch bytes of one query row of ``sparse_fwd_probs_kernel`` (all its head blocks)."""
    b = _tiles("fwd_probs", q, d_v)
    steps = triton_cdiv(width, b.k) - probs_from // b.k
    return triton_cdiv(q.shape[1], b.h) * steps * b.h * (b.k * q.element_size() + 4)


def _launch_fwd(
    q: Tensor, kv: Tensor, idx: Tensor, sinks: Tensor | None, scale: float, d_v: int, probs_from: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(out, lse, probs)``: the forward, and with ``probs_from`` the head-summed probabilities of the columns
    ``>= probs_from`` (``[T, K - probs_from]`` fp32) from the same kernel (the plain one; no Gluon), launched
    per chunk of query rows whose scratch fits 512 MiB (64 MiB on CPU); without it ``probs`` is ``[T, 0]``."""
    num_q, heads = q.shape[:2]
    out = q.new_zeros((num_q, heads, d_v))
    if sinks is None:
        lse = q.new_full((num_q, heads), NEG_INF, dtype=torch.float32)
    else:
        lse = sinks.to(torch.float32).expand(num_q, heads).contiguous()
    width = idx.shape[1]
    if probs_from is None:
        if num_q and width:
            _fwd_launch(q, kv, idx, sinks, out, lse, scale, d_v)()
        return out, lse, lse.new_zeros((num_q, 0))
    blocks = triton_cdiv(heads, _tiles("fwd_probs", q, d_v).h)
    parts = torch.zeros((num_q, blocks, width - probs_from), dtype=torch.float32, device=q.device)
    if num_q and width:
        rows = _chunk_rows(num_q, _probs_scratch_bytes(q, width, d_v, probs_from), q.device, 512 << 20)
        for t0 in range(0, num_q, rows):
            t1 = min(num_q, t0 + rows)
            _plain_fwd_launch(q[t0:t1], kv, idx[t0:t1], sinks, out[t0:t1], lse[t0:t1], scale, d_v, parts[t0:t1],
                              probs_from)()
    return out, lse, parts.sum(1) if blocks > 1 else parts[:, 0]


def triton_cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive ints."""
    return -(-a // b)


def _prepare(q: Tensor, kv: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q with unit channel stride, kv contiguous, indices int32 contiguous.

    Wider indices are clamped to ``[-1, N]`` first (both ends padding for the kernels), so an
    int64 index such as ``2**32 + 1`` cannot wrap to a valid int32 row.
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    if indices.dtype != torch.int32:
        indices = indices.clamp(-1, kv.shape[0])
    return q, kv.contiguous(), indices.to(torch.int32).contiguous()


@torch.library.custom_op("cpkv_triton::sparse_attention", mutates_args=())
def sparse_attention_op(
    q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, scale: float, d_v: int, deterministic: bool
) -> tuple[Tensor, Tensor]:
    """Shared-KV sparse attention over the listed rows, with sinks (Triton).

    Args:
        q: [T, H, D] fp16/bf16/fp32. kv: [N, D], dtype of q. indices: [T, K] int in ``[-1, N)``
            (-1 padding anywhere; duplicates count as separate keys; any other value outside
            ``[0, N)`` is padding too: never read, no gradient). sinks: [H] float or None.
        scale: score scale. d_v: value channels (``<= D``). deterministic: dkv without atomics
            in the backward (the forward is the same).

    Returns:
        ``(out [T, H, d_v] dtype of q, lse [T, H] fp32)``: natural-log LSE including the sink;
        a row without valid entry has out 0 and lse ``-inf`` (``sink`` with sinks).
    """
    q, kv, idx = _prepare(q, kv, indices)
    out, lse, _ = _launch_fwd(q, kv, idx, None if sinks is None else sinks.contiguous(), scale, d_v)
    return out, lse


@sparse_attention_op.register_fake
def _(q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, scale: float, d_v: int,
      deterministic: bool) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:2], d_v)), q.new_empty(q.shape[:2], dtype=torch.float32)


def inverted_index(indices: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """``(pair_t [P'] int32, row_ptr [N + 1] int32)``: the query rows listing each kv row, in (t, k) order.

    ``indices``: [T, K] int, -1 padded (any entry outside ``[0, num_rows)`` is padding).
    ``pair_t[:row_ptr[N]]`` lists the valid entries (duplicates included); padding sorts after.
    A stable sort keeps each row's pairs in (t, k) order, so the key-major pass is deterministic.
    """
    pairs, row_ptr = inverted_pairs(indices, num_rows)
    return (pairs // max(indices.shape[1], 1)).to(torch.int32), row_ptr


def inverted_pairs(indices: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """:func:`inverted_index` with flat entry positions ``t * K + k`` (int32) instead of query rows.

    What the key-major passes read (the sparse dkv reduce, the indexer's deterministic dk).
    """
    flat = indices.reshape(-1).long()
    key = torch.where((flat < 0) | (flat >= num_rows), num_rows, flat)
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(num_rows + 1, device=indices.device)
    row_ptr = torch.searchsorted(sorted_key, bounds).to(torch.int32)  # no bincount: it reads its max on the host
    return order.to(torch.int32), row_ptr


def _bwd_launches(
    d_out: Tensor, q: Tensor, kv: Tensor, idx: Tensor, lse: Tensor, delta: Tensor, dq: Tensor, p: Tensor,
    ds: Tensor, target: Tensor, scale: float, d_v: int, atomic: bool,
) -> list[KernelLaunch]:
    """The backward's three query-major launches over the rows of ``q`` (one chunk).

    ``sparse_bwd_ds`` writes ``P`` and ``dS`` into ``p`` and ``ds`` (``[T, H, K]`` contiguous, q's
    dtype), ``sparse_bwd_dq`` reads ``dS`` into ``dq`` (``[T, H, D]`` fp32), ``sparse_bwd_dkv`` reads
    both and adds the dkv terms into ``target`` (``dkv [N, D]`` fp32, ``atomic``) or stores them
    (a contiguous ``[cdiv(H, BLOCK_H), T * K, D]`` fp32 buffer).
    """
    (num_q, heads, dim), (rows, width) = q.shape, (kv.shape[0], idx.shape[1])
    a, b, c = _tiles("bwd_ds", q, d_v), _tiles("bwd_dq", q, d_v), _tiles("bwd_dkv", q, d_v)
    kernels = _kernels()
    return [
        KernelLaunch(
            "sparse_bwd_ds", kernels.sparse_bwd_ds_kernel, (num_q, triton_cdiv(heads, a.h)),
            (q, kv, idx, d_out, lse, delta, p, ds, rows, heads, width,
             q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), d_out.stride(0), d_out.stride(1), scale),
            _channel_constexprs(a, dim, d_v, q), a.warps, a.stages,
        ),
        KernelLaunch(
            "sparse_bwd_dq", kernels.sparse_bwd_dq_kernel, (num_q, triton_cdiv(heads, b.h)),
            (kv, idx, ds, dq, rows, heads, width, kv.stride(0), idx.stride(0)),
            _channel_constexprs(b, dim, d_v, q), b.warps, b.stages,
        ),
        KernelLaunch(
            "sparse_bwd_dkv_atomic" if atomic else "sparse_bwd_dkv_partials", kernels.sparse_bwd_dkv_kernel,
            (num_q, triton_cdiv(heads, c.h)),
            (q, idx, d_out, p, ds, target, rows, heads, width,
             q.stride(0), q.stride(1), idx.stride(0), d_out.stride(0), d_out.stride(1)),
            {"D": dim, "DV": d_v, "ATOMIC_DKV": atomic, "BLOCK_H": c.h, "BLOCK_K": c.k, "BLOCK_C": c.c,
             "PREC": _prec(q)}, c.warps, c.stages,
        ),
    ]


def _reduce_launch(partials: Tensor, pairs: Tensor, row_ptr: Tensor, dkv: Tensor) -> KernelLaunch:
    """The key-major fixed-order sum ``dkv[n] += sum_hb sum of partials[hb, pairs[row_ptr[n] : row_ptr[n + 1]]]``."""
    num_rows, dim = dkv.shape
    block_c = _pow2(dim) if dkv.device.type == "cpu" else min(_pow2(dim), 128)
    return KernelLaunch(
        "dkv_reduce", _kernels().dkv_reduce_kernel, (num_rows, triton_cdiv(dim, block_c)),
        (partials, pairs, row_ptr, dkv, partials.shape[0], partials.shape[1]),
        {"D": dim, "BLOCK_P": 16, "BLOCK_C": block_c}, 4, 1,
    )


def _chunk_rows(num_q: int, row_bytes: int, device: torch.device, budget: int = 2 << 30) -> int:
    """Query rows per chunk: their buffers (``row_bytes`` each) stay within ``budget`` bytes (2 GiB; 64 MiB on CPU)."""
    budget = budget if device.type != "cpu" else min(budget, 64 << 20)
    return max(1, min(num_q, budget // max(1, row_bytes)))


def _launch_bwd(
    d_out: Tensor, q: Tensor, kv: Tensor, idx: Tensor, lse: Tensor, delta: Tensor, scale: float, d_v: int,
    deterministic: bool, dkv: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(dq [T, H, D] fp32, dkv [N, D] fp32); ``dkv``: a zeroed contiguous fp32 [N, D] to fill (default: a new one).

    Per chunk of query rows (host sizes from the shapes: no sync), the three passes of
    :func:`_bwd_launches`: ``P`` and ``dS`` into ``[rows, H, K]`` buffers, dq, then the dkv terms,
    added by fp32 atomics, or (deterministic) stored and summed by the key-major reduce in
    (t, k) order; chunks follow each other in order, so the deterministic sums are bitwise
    reproducible.
    """
    (num_q, heads, dim), width = q.shape, idx.shape[1]
    dq = torch.zeros((num_q, heads, dim), dtype=torch.float32, device=q.device)
    if dkv is None:
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    if num_q == 0 or width == 0:
        return dq, dkv
    blocks = triton_cdiv(heads, _tiles("bwd_dkv", q, d_v).h)
    row_bytes = 2 * heads * width * q.element_size() + (0 if not deterministic else blocks * width * dim * 4)
    rows = _chunk_rows(num_q, row_bytes, q.device)
    for t0 in range(0, num_q, rows):
        t1 = min(num_q, t0 + rows)
        p = torch.empty((t1 - t0, heads, width), dtype=q.dtype, device=q.device)
        ds = torch.empty_like(p)
        target = dkv if not deterministic else torch.empty(
            (blocks, (t1 - t0) * width, dim), dtype=torch.float32, device=q.device)
        for launch in _bwd_launches(d_out[t0:t1], q[t0:t1], kv, idx[t0:t1], lse[t0:t1], delta[t0:t1], dq[t0:t1],
                                    p, ds, target, scale, d_v, not deterministic):
            launch()
        if deterministic and kv.shape[0] > 0:
            pairs, row_ptr = inverted_pairs(idx[t0:t1], kv.shape[0])
            _reduce_launch(target, pairs, row_ptr, dkv)()
    return dq, dkv


@torch.library.custom_op("cpkv_triton::sparse_attention_backward", mutates_args=())
def sparse_attention_backward_op(
    d_out: Tensor, d_lse: Tensor, q: Tensor, kv: Tensor, flat_indices: Tensor, out: Tensor, lse: Tensor,
    sinks: Tensor | None, scale: float, d_v: int, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``cpkv_triton::sparse_attention`` (P recomputed from the saved LSE).

    Args:
        d_out: [T, H, d_v], d_lse: [T, H]: upstream gradients. out, lse: the forward's outputs.
        flat_indices: the forward's ``[T, K]`` indices flattened to ``[T * K]``.
        q, kv, sinks, scale, d_v, deterministic: the forward's inputs.

    Returns:
        ``(dq, dkv, dsinks)`` in the dtypes of q, kv, sinks; dsinks is ``[H]``, or ``[0]`` without sinks.
    """
    q, kv, idx = _prepare(q, kv, unflatten_rows(flat_indices, q.shape[0]))
    delta = ((d_out.float() * out.float()).sum(-1) - d_lse.float()).contiguous()
    lse32 = lse.float().contiguous()
    dq, dkv = _launch_bwd(d_out.contiguous(), q, kv, idx, lse32, delta, scale, d_v, deterministic)
    dsinks = q.new_zeros(0)
    if sinks is not None:
        dsinks = -(torch.exp(sinks.float() - lse32) * delta).sum(0).to(sinks.dtype)
    return dq.to(q.dtype), dkv.to(kv.dtype), dsinks


@sparse_attention_backward_op.register_fake
def _(d_out: Tensor, d_lse: Tensor, q: Tensor, kv: Tensor, flat_indices: Tensor, out: Tensor, lse: Tensor,
      sinks: Tensor | None, scale: float, d_v: int, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(kv), dsinks


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, kv, indices, sinks, scale, d_v, deterministic = inputs
    # indices saved flat (a compiled backward's saved [T, K] would have a symbolic stride): unflatten_rows
    ctx.save_for_backward(q, kv, indices.reshape(-1), *output, sinks)
    ctx.scale, ctx.d_v, ctx.deterministic = scale, d_v, deterministic


def _backward(ctx: Any, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor | None, ...]:
    q, kv, flat_indices, out, lse, sinks = ctx.saved_tensors
    dq, dkv, dsinks = sparse_attention_backward_op(
        d_out, d_lse, q, kv, flat_indices, out, lse, sinks, ctx.scale, ctx.d_v, ctx.deterministic
    )
    return dq, dkv, None, None if sinks is None else dsinks, None, None, None


sparse_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("cpkv_triton::sparse_attention_probs", mutates_args=())
def sparse_attention_probs_op(
    q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, scale: float, d_v: int, deterministic: bool,
    probs_from: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``cpkv_triton::sparse_attention`` that also returns the KL target of the columns ``>= probs_from``.

    Args:
        q, kv, indices, sinks, scale, d_v, deterministic: as :func:`sparse_attention_op`.
        probs_from: the first column of ``indices`` whose probabilities are returned (``0 <= probs_from <= K``).

    Returns:
        ``(out, lse, probs)``: ``out`` and ``lse`` as :func:`sparse_attention_op` (the same
        gradients), ``probs`` ``[T, K - probs_from]`` fp32 ``sum_h exp(scale * q[t, h] .
        kv[indices[t, k]] - lse[t, h])`` (0 at padding; no gradient): :func:`selected_probs_op`
        of those columns under this call's LSE, from the forward's own scores (each step's
        ``exp(s - m)`` kept in L2 scratch, then rescaled by the final LSE), not another QK^T.
    """
    q, kv, idx = _prepare(q, kv, indices)
    return _launch_fwd(q, kv, idx, None if sinks is None else sinks.contiguous(), scale, d_v, probs_from)


@sparse_attention_probs_op.register_fake
def _(q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None, scale: float, d_v: int, deterministic: bool,
      probs_from: int) -> tuple[Tensor, Tensor, Tensor]:
    return (q.new_empty((*q.shape[:2], d_v)), q.new_empty(q.shape[:2], dtype=torch.float32),
            q.new_empty((q.shape[0], indices.shape[1] - probs_from), dtype=torch.float32))


def _probs_setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    _setup_context(ctx, inputs[:-1], output[:2])
    ctx.mark_non_differentiable(output[2])


def _probs_backward(ctx: Any, d_out: Tensor, d_lse: Tensor, _d_probs: Tensor | None) -> tuple[Tensor | None, ...]:
    return (*_backward(ctx, d_out, d_lse), None)


sparse_attention_probs_op.register_autograd(_probs_backward, setup_context=_probs_setup_context)


def _probs_launch(q: Tensor, kv: Tensor, idx: Tensor, lse: Tensor, out: Tensor, scale: float) -> KernelLaunch:
    """The KL target's launch: per-head-block sums ``out [cdiv(H, BLOCK_H), T, K]``; grid (T, head blocks).

    The channels split at ``kv.shape[1]`` rounded down to a power of two (V4: all 512 in one tile).
    """
    (num_q, heads, dim), width = q.shape, idx.shape[1]
    split = 1 << (dim.bit_length() - 1)
    b = _tiles("probs", q, split)
    return KernelLaunch(
        "selected_probs", _kernels().selected_probs_kernel, (num_q, triton_cdiv(heads, b.h)),
        (q, kv, idx, lse, out,
         kv.shape[0], heads, width,
         q.stride(0), q.stride(1), kv.stride(0), idx.stride(0),
         scale),
        _channel_constexprs(b, dim, split, q), b.warps, b.stages,
    )


@torch.library.custom_op("cpkv_triton::selected_probs", mutates_args=())
def selected_probs_op(q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, scale: float) -> Tensor:
    """Head-summed probabilities ``P[t, k] = sum_h exp(scale * q[t, h] . kv[indices[t, k]] - lse[t, h])``.

    Args:
        q: [T, H, D]. kv: [N, D]. indices: [T, K] int, -1 padded (any entry outside ``[0, N)``
            is padding). lse: [T, H] (the sparse attention's, sink included). scale: score scale.

    Returns:
        [T, K] fp32, 0 at padding. No autograd: pass detached inputs.
    """
    q, kv, idx = _prepare(q, kv, indices)
    (num_q, heads, _), width = q.shape, idx.shape[1]
    if num_q == 0 or width == 0:
        return torch.zeros((num_q, width), dtype=torch.float32, device=q.device)
    blocks = triton_cdiv(heads, _tiles("probs", q, 1).h)
    parts = torch.empty((blocks, num_q, width), dtype=torch.float32, device=q.device)
    _probs_launch(q, kv, idx, lse.float().contiguous(), parts, scale)()
    return parts.sum(0) if blocks > 1 else parts[0]


@selected_probs_op.register_fake
def _(q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, scale: float) -> Tensor:
    return q.new_empty(indices.shape, dtype=torch.float32)


def aot_launches(case: AOTCase) -> list[KernelLaunch]:
    """The sparse ops' launches at ``case``'s shapes on ``meta`` tensors (GPU tiles), for the sm_90a compile report.

    Built by the same functions the ops call: the Gluon forward (where it fits: opt-in with
    ``CPKV_TRITON_GLUON=1``), the forward, the forward with the KL target (of the columns after
    V4's 128 window rows), the backward's three passes (``P``/``dS``, dq, dkv
    with atomics), the deterministic dkv pass and key-major reduce (one chunk of query rows),
    and the KL target's head-summed
    probabilities. Nothing runs; no device is needed.

    Raises:
        ValueError: ``case.d_v`` above ``case.dim``, or a non-positive size.
    """
    sizes = (case.tokens, case.kv_rows, case.heads, case.dim, case.d_v, case.topk)
    if min(sizes) <= 0 or case.d_v > case.dim:
        raise ValueError(f"case needs positive sizes and d_v <= dim, got {case}")
    meta, f32 = torch.device("meta"), torch.float32
    num_q, rows, heads, dim, d_v, width = sizes
    q = torch.empty((num_q, heads, dim), dtype=case.dtype, device=meta)
    kv = torch.empty((rows, dim), dtype=case.dtype, device=meta)
    idx = torch.empty((num_q, width), dtype=torch.int32, device=meta)
    out = torch.empty((num_q, heads, d_v), dtype=case.dtype, device=meta)
    lse = torch.empty((num_q, heads), dtype=f32, device=meta)
    dq, dkv = torch.empty((num_q, heads, dim), dtype=f32, device=meta), torch.empty((rows, dim), dtype=f32, device=meta)
    scale = dim**-0.5
    blocks = triton_cdiv(heads, _tiles("bwd_dkv", q, d_v).h)
    chunk = _chunk_rows(num_q, 2 * heads * width * q.element_size() + blocks * width * dim * 4, meta)
    partials = torch.empty((blocks, chunk * width, dim), dtype=f32, device=meta)
    p = torch.empty((num_q, heads, width), dtype=case.dtype, device=meta)
    pairs = torch.empty((chunk * width,), dtype=torch.int32, device=meta)
    row_ptr = torch.empty((rows + 1,), dtype=torch.int32, device=meta)
    parts = torch.empty((triton_cdiv(heads, _tiles("probs", q, 1).h), num_q, width), dtype=f32, device=meta)
    sinks = torch.empty((heads,), dtype=f32, device=meta)
    fwd = _fwd_launch(q, kv, idx, sinks, out, lse, scale, d_v)
    gluon = _fwd_gluon_launch(q, kv, idx, sinks, out, lse, scale) if _gluon_fits(q, d_v) else None
    triton_fwd = fwd if fwd.name == "sparse_fwd" else _plain_fwd_launch(q, kv, idx, sinks, out, lse, scale, d_v)
    window = min(128, width)  # V4's window columns come first; the target covers the compressed entries
    fwd_blocks = triton_cdiv(heads, _tiles("fwd_probs", q, d_v).h)
    probs = torch.empty((num_q, fwd_blocks, width - window), dtype=f32, device=meta)
    return [*([gluon] if gluon is not None else []), triton_fwd,
        _plain_fwd_launch(q, kv, idx, sinks, out, lse, scale, d_v, probs, window),
        *_bwd_launches(out, q, kv, idx, lse, lse, dq, p, p, dkv, scale, d_v, True),
        _bwd_launches(out[:chunk], q[:chunk], kv, idx[:chunk], lse[:chunk], lse[:chunk], dq[:chunk], p[:chunk],
                      p[:chunk], partials, scale, d_v, False)[-1],
        _reduce_launch(partials, pairs, row_ptr, dkv),
        _probs_launch(q, kv, idx, lse, parts, scale),
    ]


