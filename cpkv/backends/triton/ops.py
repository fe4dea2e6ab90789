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
the atomic dkv adds), and ``indexer_topk`` clamps ``start``/``end`` to ``[0, N_c]``. The
reference's validated entry points raise ``ValueError`` for such input instead.

Inputs: fp16, bf16 or fp32 (fp32 accumulation; fp32 dot products run in IEEE precision, not
TF32), on a CUDA device, or on CPU when the kernels were imported under ``TRITON_INTERPRET=1``.

dkv: by default the backward accumulates it with fp32 atomics from query-major programs
(the summation order varies run to run). With ``deterministic=True`` the query-major pass
skips dkv and a key-major pass over an inverted index (``kv`` row -> the query rows listing
it, in (t, k) order) sums each row's terms in a fixed order: bitwise reproducible, slower.

Shapes legend: ``T`` query tokens, ``H`` query heads, ``D`` query/key dim, ``d_v`` value dim
(the first ``d_v`` channels of kv), ``N`` kv rows, ``K`` entries per query row, ``H_I``,
``D_I`` indexer heads and dim, ``N_c`` indexer key rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["selected_probs_op", "sparse_attention_backward_op", "sparse_attention_op"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class _Blocks:
    """Tile sizes of one launch (powers of two, at least 16 where they feed ``tl.dot``)."""

    h: int
    k: int
    d: int
    dv: int
    dc: int
    warps: int


def _pow2(n: int, low: int = 16) -> int:
    return max(low, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _blocks(q: Tensor, d_v: int) -> _Blocks:
    """GPU tiles (registers bound the fp32 accumulators), or whole-dim tiles for the CPU interpreter (fewer steps)."""
    heads, dim = q.shape[1], q.shape[2]
    if q.device.type == "cpu":  # TRITON_INTERPRET=1: numpy per tile op, so big tiles are fast
        return _Blocks(_pow2(heads), 64, _pow2(dim), _pow2(d_v), _pow2(dim), 4)
    return _Blocks(min(64, _pow2(heads)), 32, 64, min(256, _pow2(d_v)), min(128, _pow2(dim)), 8)


def _prec(q: Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _kernels() -> Any:
    from cpkv.backends.triton import kernels  # lazy: triton is imported only when a kernel runs

    return kernels


def _launch_fwd(q: Tensor, kv: Tensor, idx: Tensor, sinks: Tensor | None, scale: float, d_v: int) -> tuple[Tensor, Tensor]:
    (num_q, heads, dim), width = q.shape, idx.shape[1]
    out = q.new_zeros((num_q, heads, d_v))
    if sinks is None:
        lse = q.new_full((num_q, heads), NEG_INF, dtype=torch.float32)
    else:
        lse = sinks.to(torch.float32).expand(num_q, heads).contiguous()
    if num_q == 0 or width == 0:
        return out, lse
    b = _blocks(q, d_v)
    grid = (num_q, triton_cdiv(heads, b.h), triton_cdiv(d_v, b.dv))
    _kernels().sparse_fwd_kernel[grid](
        q, kv, idx, sinks if sinks is not None else lse, out, lse,
        kv.shape[0], heads, dim, d_v, width,
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1),
        scale,
        HAS_SINK=sinks is not None, BLOCK_H=b.h, BLOCK_K=b.k, BLOCK_D=b.d, BLOCK_DV=b.dv, PREC=_prec(q),
        num_warps=b.warps,
    )
    return out, lse


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
    return _launch_fwd(q, kv, idx, None if sinks is None else sinks.contiguous(), scale, d_v)


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
    flat = indices.reshape(-1).long()
    key = torch.where((flat < 0) | (flat >= num_rows), num_rows, flat)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_rows + 1)[:num_rows]
    row_ptr = torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
    pair_t = (order // max(indices.shape[1], 1)).to(torch.int32)
    return pair_t, row_ptr


def _launch_bwd(
    d_out: Tensor, q: Tensor, kv: Tensor, idx: Tensor, lse: Tensor, delta: Tensor, scale: float, d_v: int,
    deterministic: bool, dkv: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(dq [T, H, D] fp32, dkv [N, D] fp32); ``dkv``: a zeroed contiguous fp32 [N, D] to fill (default: a new one)."""
    (num_q, heads, dim), width = q.shape, idx.shape[1]
    dq = torch.zeros((num_q, heads, dim), dtype=torch.float32, device=q.device)
    if dkv is None:
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
    if num_q == 0 or width == 0:
        return dq, dkv
    b, k = _blocks(q, d_v), _kernels()
    grid = (num_q, triton_cdiv(heads, b.h), triton_cdiv(dim, b.dc))
    k.sparse_bwd_kernel[grid](
        q, kv, idx, d_out, lse, delta, dq, dkv,
        kv.shape[0], heads, dim, d_v, width,
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), d_out.stride(0), d_out.stride(1),
        scale,
        ATOMIC_DKV=not deterministic, BLOCK_H=b.h, BLOCK_K=b.k, BLOCK_D=b.d, BLOCK_DC=b.dc, PREC=_prec(q),
        num_warps=b.warps,
    )
    if deterministic and kv.shape[0] > 0:
        pair_t, row_ptr = inverted_index(idx, kv.shape[0])
        block_h = _pow2(heads, 1)
        block_p = max(1, (64 if q.device.type == "cpu" else 16) // block_h)
        k.sparse_dkv_keymajor_kernel[(kv.shape[0], triton_cdiv(dim, b.dc))](
            q, kv, d_out, lse, delta, pair_t, row_ptr, dkv,
            heads, dim, d_v,
            q.stride(0), q.stride(1), kv.stride(0), d_out.stride(0), d_out.stride(1),
            scale,
            BLOCK_P=block_p, BLOCK_H=block_h, BLOCK_D=b.d, BLOCK_DC=b.dc, num_warps=4,
        )
    return dq, dkv


@torch.library.custom_op("cpkv_triton::sparse_attention_backward", mutates_args=())
def sparse_attention_backward_op(
    d_out: Tensor, d_lse: Tensor, q: Tensor, kv: Tensor, indices: Tensor, out: Tensor, lse: Tensor,
    sinks: Tensor | None, scale: float, d_v: int, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of ``cpkv_triton::sparse_attention`` (P recomputed from the saved LSE).

    Args:
        d_out: [T, H, d_v], d_lse: [T, H]: upstream gradients. out, lse: the forward's outputs.
        q, kv, indices, sinks, scale, d_v, deterministic: the forward's inputs.

    Returns:
        ``(dq, dkv, dsinks)`` in the dtypes of q, kv, sinks; dsinks is ``[H]``, or ``[0]`` without sinks.
    """
    q, kv, idx = _prepare(q, kv, indices)
    delta = ((d_out.float() * out.float()).sum(-1) - d_lse.float()).contiguous()
    lse32 = lse.float().contiguous()
    dq, dkv = _launch_bwd(d_out.contiguous(), q, kv, idx, lse32, delta, scale, d_v, deterministic)
    dsinks = q.new_zeros(0)
    if sinks is not None:
        dsinks = -(torch.exp(sinks.float() - lse32) * delta).sum(0).to(sinks.dtype)
    return dq.to(q.dtype), dkv.to(kv.dtype), dsinks


@sparse_attention_backward_op.register_fake
def _(d_out: Tensor, d_lse: Tensor, q: Tensor, kv: Tensor, indices: Tensor, out: Tensor, lse: Tensor,
      sinks: Tensor | None, scale: float, d_v: int, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(kv), dsinks


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, kv, indices, sinks, scale, d_v, deterministic = inputs
    ctx.save_for_backward(q, kv, indices, *output, sinks)
    ctx.scale, ctx.d_v, ctx.deterministic = scale, d_v, deterministic


def _backward(ctx: Any, d_out: Tensor, d_lse: Tensor) -> tuple[Tensor | None, ...]:
    q, kv, indices, out, lse, sinks = ctx.saved_tensors
    dq, dkv, dsinks = sparse_attention_backward_op(
        d_out, d_lse, q, kv, indices, out, lse, sinks, ctx.scale, ctx.d_v, ctx.deterministic
    )
    return dq, dkv, None, None if sinks is None else dsinks, None, None, None


sparse_attention_op.register_autograd(_backward, setup_context=_setup_context)


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
    (num_q, heads, dim), width = q.shape, idx.shape[1]
    out = torch.zeros((num_q, width), dtype=torch.float32, device=q.device)
    if num_q == 0 or width == 0:
        return out
    b = _blocks(q, kv.shape[1])
    _kernels().selected_probs_kernel[(num_q, triton_cdiv(width, b.k))](
        q, kv, idx, lse.float().contiguous(), out,
        kv.shape[0], heads, dim, width,
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0),
        scale,
        BLOCK_H=b.h, BLOCK_K=b.k, BLOCK_D=b.d, PREC=_prec(q), num_warps=b.warps,
    )
    return out


@selected_probs_op.register_fake
def _(q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, scale: float) -> Tensor:
    return q.new_empty(indices.shape, dtype=torch.float32)

