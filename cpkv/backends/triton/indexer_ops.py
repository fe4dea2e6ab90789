"""The lightning indexer's top-k as the custom op ``cpkv_triton::indexer_topk``: one kernel launch, no host sync.

``indexer_topk_op(q, k, weights, k_scale, start, count, topk)`` -> ``(indices, scores)``:
query ``t`` picks the ``topk`` highest scores
``I[t, j] = scale[j] * sum_h weights[t, h] * relu(q[t, h] . k[j])`` among the entries
``[start[t], start[t] + count[t])`` (clamped to ``[0, N_c]``), ties to the earlier entry,
``-1`` / ``-inf`` padded, by descending score; the reference op's selection
(:func:`cpkv.backends.reference.indexer.indexer_topk_op`). ``scale`` is ``k_scale`` (fp8
keys, DeepSeek's per-key fp32 scale; the reference multiplies it into the key before the
dot, which is the same value up to rounding since ``relu(s x) = s relu(x)`` for ``s > 0``)
or 1.

The op is :func:`indexer_topk_launches` (a function of its tensors that returns the
:class:`~cpkv.backends.triton.launches.KernelLaunch` list and the outputs) followed by
calling the launches: one launch of ``indexer_kernels.indexer_topk_kernel``, plus a copy
for any input that is not contiguous or not of the kernel's dtype. No ``.item()``, no
``int()`` of a device tensor: the loop bounds are read on the device, so a layer call is
capturable in a CUDA graph. :func:`aot_launches` builds the same launches on ``meta``
tensors of an :class:`~cpkv.backends.triton.launches.AOTCase` for the sm_90a compile report.

Dtypes: q and k both fp16, bf16 or fp32 (fp32 dot products in IEEE precision), or both
``float8_e4m3fn`` (fp8 tensor cores; fold the queries' scales into ``weights``, as DeepSeek
does) with ``k_scale`` ``[N_c]`` fp32. Shapes legend: ``T`` query tokens, ``H_I`` indexer
heads, ``D_I`` indexer dim, ``N_c`` key rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpkv.backends.triton.launches import AOTCase, KernelLaunch
from cpkv.index_keys import FP8_MAX
from cpkv.indexer_loss import kl_terms

__all__ = [
    "IndexerTiles", "LaunchRunner", "SelectedTiles", "aot_launches", "fp8_rows", "indexer_kl_backward",
    "indexer_kl_backward_op", "indexer_kl_forward", "indexer_kl_op", "indexer_tiles", "indexer_topk_launches",
    "indexer_topk_op", "run_launches", "selected_grads_op", "selected_launches", "selected_scores_op", "selected_tiles",
]

FP8 = torch.float8_e4m3fn
SCORE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)
LaunchRunner = Callable[[list[KernelLaunch]], None]
"""What the op bodies hand their launches to: :func:`run_launches`, or a bench's counter."""
META_SMS = 132  # programs of a meta-tensor (compile-only) launch: an H100/H200's SM count


@dataclass(frozen=True)
class IndexerTiles:
    """Tile sizes of one indexer launch.

    Attributes:
        block_t: queries per tile (the MMA's M). block_n: entries per chunk (the MMA's N).
        block_d: channels (``D_I`` rounded up to a power of two, at least 16).
        k_pad: best slots per query (``topk`` rounded up to a power of two).
        sort: scratch slots per query (a power of two, ``>= k_pad + 2 * block_n``).
        warps, stages: Triton launch options.
    """

    block_t: int
    block_n: int
    block_d: int
    k_pad: int
    sort: int
    warps: int
    stages: int


def run_launches(launches: list[KernelLaunch]) -> None:
    """Run each launch in order (what the ops do with the launches they build)."""
    for launch in launches:
        launch()


def _pow2(n: int, low: int = 1) -> int:
    return max(low, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def indexer_tiles(
    device: torch.device, dim: int, topk: int, block_t: int | None = None, block_n: int | None = None,
    *, dtype: torch.dtype = torch.bfloat16,
) -> IndexerTiles:
    """The tiles for a device type and score dtype.

    CUDA and ``meta``: 64 x 64 tiles on 8 warps for fp8/bf16/fp16 (wgmma; 64 x 128 spills at V4-Pro's
    top-1024), 32 x 32 on 4 warps
    for fp32 (IEEE dot products on CUDA cores: bigger tiles spill); the CPU interpreter: 16 x 16.
    ``block_t`` / ``block_n`` override them (powers of two >= 16; tests use small chunks to run
    many merges). Raises ``ValueError`` for other overrides.
    """
    for name, value in (("block_t", block_t), ("block_n", block_n)):
        if value is not None and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if device.type == "cpu":  # TRITON_INTERPRET=1: numpy per tile op
        bt, bn, warps, stages = 16, 16, 4, 1
    elif dtype == torch.float32:
        bt, bn, warps, stages = 32, 32, 4, 2
    else:
        bt, bn, warps, stages = 64, 64, 8, 2
    bt, bn = block_t or bt, block_n or bn
    k_pad = _pow2(topk)
    return IndexerTiles(bt, bn, _pow2(dim, 16), k_pad, _pow2(k_pad + 2 * bn), warps, stages)


def _programs(device: torch.device, tiles: int) -> int:
    """Persistent programs: every tile on CPU, two per SM on CUDA (a cached host attribute, no sync)."""
    if device.type == "cuda":
        return max(1, min(tiles, 2 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(tiles, META_SMS if device.type == "meta" else tiles))


def fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """fp8 e4m3 payload and fp32 scale per row of the last dim: ``scale = amax(|x|) / 448`` (1 for a zero row).

    DeepSeek's format, as :mod:`cpkv.index_keys` rounds the keys: ``payload * scale`` is that
    rounding. For queries ``[T, H_I, D_I]`` the scales ``[T, H_I]`` fold into the weights
    (``weights * scale``) before :func:`indexer_topk_op` (exact: ``relu(s x) = s relu(x)``, ``s > 0``).

    Args:
        x: float tensor ``[..., D]``.

    Returns:
        ``(payload [..., D] float8_e4m3fn, scale [...] fp32)``.
    """
    amax = x.detach().float().abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.detach().float() / scale).to(FP8), scale.squeeze(-1)


def _check(q: Tensor, k: Tensor, k_scale: Tensor | None) -> None:
    if q.dtype not in SCORE_DTYPES or (k.dtype == FP8) != (q.dtype == FP8) or (q.dtype != FP8 and k.dtype != q.dtype):
        raise TypeError(f"q and k must share one of {SCORE_DTYPES} (both fp8 or neither), got {q.dtype} and {k.dtype}")
    if k_scale is None and k.dtype == FP8:
        raise ValueError("k_scale ([N_c] fp32, the keys' per-row scales) is required with float8_e4m3fn keys")


def indexer_topk_launches(
    q: Tensor, k: Tensor, weights: Tensor, k_scale: Tensor | None, start: Tensor, count: Tensor, topk: int,
    *, block_t: int | None = None, block_n: int | None = None, programs: int | None = None, select: bool = True,
) -> tuple[list[KernelLaunch], Tensor, Tensor]:
    """The launches of one indexer top-k call and the outputs they fill (nothing runs yet).

    Args:
        q: [T, H_I, D_I] fp16/bf16/fp32/fp8. k: [N_c, D_I], dtype of q (fp8 with fp8 q).
        weights: [T, H_I] float. k_scale: [N_c] positive float per-key scale (required with fp8
            keys, optional otherwise) or None.
        start, count: [T] int on q's device: query ``t`` sees entries ``[start[t], start[t] + count[t])``.
        topk: entries per query (>= 1). block_t, block_n: tile overrides (:func:`indexer_tiles`).
        programs: persistent programs (default: two per SM on CUDA, one per query tile
            elsewhere); each program takes every ``programs``-th tile, reusing its scratch rows.
        select: False runs the scores without the selection (benchmarks: the selection's share
            of the time); ``scores[:, 0]`` is then each query's best visible score, the rest unset.

    Returns:
        ``(launches, indices [T, topk] int64, scores [T, topk] fp32)``: running the launches
        fills both outputs (``[]`` when ``T = 0``). Works on ``meta`` tensors (no data is read).

    Raises:
        TypeError: unsupported or mismatched dtypes. ValueError: k_scale given without fp8
            keys or missing with them; bad tile overrides.
    """
    _check(q, k, k_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    weights = weights.contiguous()
    num_q, heads, dim = q.shape
    indices = torch.empty((num_q, topk), dtype=torch.int64, device=q.device)
    scores = torch.empty((num_q, topk), dtype=torch.float32, device=q.device)
    if num_q == 0:
        return [], indices, scores
    b = indexer_tiles(q.device, dim, topk, block_t, block_n, dtype=q.dtype)
    tiles = -(-num_q // b.block_t)
    if programs is not None and programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    programs = min(programs, tiles) if programs is not None else _programs(q.device, tiles)
    scratch = torch.empty((programs * b.block_t, b.sort), dtype=torch.int64, device=q.device)
    scale = k_scale.float().contiguous() if k_scale is not None else scores  # unused without HAS_SCALE
    from cpkv.backends.triton import indexer_kernels  # lazy: triton is imported only when a kernel runs

    launch = KernelLaunch(
        name="indexer_topk",
        kernel=indexer_kernels.indexer_topk_kernel,
        grid=(programs,),
        args=(
            q, k, scale, weights, start.contiguous(), count.contiguous(), scratch, indices, scores,
            num_q, k.shape[0], heads, dim, topk, tiles,
            q.stride(0), q.stride(1), k.stride(0), weights.stride(0),
        ),
        constexprs={
            "HAS_SCALE": k_scale is not None, "BLOCK_T": b.block_t, "BLOCK_N": b.block_n, "BLOCK_D": b.block_d,
            "K_PAD": b.k_pad, "SORT": b.sort, "PREC": "ieee" if q.dtype == torch.float32 else "tf32",
            "SELECT": select,
        },
        num_warps=b.warps,
        num_stages=b.stages,
    )
    return [launch], indices, scores


@torch.library.custom_op("cpkv_triton::indexer_topk", mutates_args=())
def indexer_topk_op(
    q: Tensor, k: Tensor, weights: Tensor, k_scale: Tensor | None, start: Tensor, count: Tensor, topk: int
) -> tuple[Tensor, Tensor]:
    """Top-k lightning-indexer entries in one Triton launch (scores on tensor cores, running top-k per query tile).

    Args:
        q: [T, H_I, D_I] fp16/bf16/fp32, or fp8 e4m3 (its scales folded into ``weights``).
        k: [N_c, D_I], dtype of q (fp8 keys with fp8 queries). weights: [T, H_I] float.
        k_scale: [N_c] positive float per-key scale (of fp8 keys; optional for others), or None.
        start, count: [T] int on q's device: query ``t`` picks among entries
            ``[start[t], start[t] + count[t])``, both ends clamped to ``[0, N_c]`` (no key row
            past k's end is scored).
        topk: entries per query.

    Returns:
        ``(indices [T, topk] int64 -1 padded, scores [T, topk] fp32 -inf at padding)``, by
        descending score, ties to the earlier entry. No autograd, no host sync, no validation
        beyond dtypes (``TypeError``/``ValueError`` as :func:`indexer_topk_launches`).
    """
    launches, indices, scores = indexer_topk_launches(q, k, weights, k_scale, start, count, topk)
    run_launches(launches)
    return indices, scores


@indexer_topk_op.register_fake
def _(q: Tensor, k: Tensor, weights: Tensor, k_scale: Tensor | None, start: Tensor, count: Tensor,
      topk: int) -> tuple[Tensor, Tensor]:
    shape = (q.shape[0], topk)
    return q.new_empty(shape, dtype=torch.int64), q.new_empty(shape, dtype=torch.float32)


@dataclass(frozen=True)
class SelectedTiles:
    """Tile sizes of the KL path's launches (:func:`selected_launches`).

    Attributes:
        block_h: heads (``H_I`` rounded up to a power of two, at least 16: the MMA's M).
        block_d: channels (``D_I`` rounded up, at least 16).
        scores_k, grads_k: selected entries per chunk of the scores and of the query-major gradient launch.
        block_r: entries per step of the deterministic key-major dk launch.
        scores_warps, grads_warps, dk_warps: their Triton warps.
    """

    block_h: int
    block_d: int
    scores_k: int
    grads_k: int
    block_r: int
    scores_warps: int
    grads_warps: int
    dk_warps: int


def selected_tiles(device: torch.device, heads: int, dim: int, dtype: torch.dtype) -> SelectedTiles:
    """The KL path's tiles for a device type and dtype.

    fp16/bf16 on CUDA and ``meta``: one warpgroup (4 warps), so the chained dots of the
    gradients are not computed twice by two warpgroups; 64 entries a chunk for the scores,
    32 for the gradients (64 spills with the atomic dk). fp32 there: IEEE dot products on
    CUDA cores, 16 entries a chunk on 8 warps (bigger chunks or fewer warps spill). The CPU
    interpreter: 32 entries, 4 warps.
    """
    block_h, block_d = _pow2(heads, 16), _pow2(dim, 16)
    if device.type == "cpu":
        return SelectedTiles(block_h, block_d, 32, 32, 4, 4, 4, 4)
    if dtype == torch.float32:
        return SelectedTiles(block_h, block_d, 16, 16, 2, 8, 8, 8)
    return SelectedTiles(block_h, block_d, 64, 32, 2, 4, 4, 4)


def selected_launches(
    q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, d_scores: Tensor | None = None, *,
    deterministic: bool = False,
) -> tuple[list[KernelLaunch], tuple[Tensor, ...]]:
    """Launches of the indexer KL path's kernels over the selected entries, and the outputs they fill.

    ``d_scores`` None: ``indexer_selected_scores_kernel``, output ``(scores [T, K] fp32,)``
    (``-inf`` at padding). Else ``[T, K]`` fp32 upstream gradients of those scores:
    ``indexer_selected_grads_kernel``, outputs ``(dq [T, H_I, D_I], dk [N_c, D_I], dw [T, H_I])``
    fp32. dk: one memset and fp32 atomics in the query-major launch (the summation order
    varies run to run), or with ``deterministic`` a second, key-major launch
    (``indexer_dk_kernel``) over the inverted selection (:func:`~cpkv.backends.triton.ops.inverted_pairs`:
    a stable sort, no host sync) that sums each key's terms in ``(t, k)`` order: bitwise
    reproducible. q: [T, H_I, D_I], k: [N_c, D_I] (dtype of q), weights: [T, H_I],
    selected: [T, K] int (outside ``[0, N_c)``: padding). Works on ``meta`` tensors. Raises
    ``TypeError`` when k's dtype is not q's or not fp16/bf16/fp32.
    """
    if k.dtype != q.dtype or q.dtype not in SCORE_DTYPES[:3]:
        raise TypeError(f"q and k must share one of {SCORE_DTYPES[:3]}, got {q.dtype} and {k.dtype}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    k, weights, selected = k.contiguous(), weights.contiguous(), selected.contiguous()
    (num_q, heads, dim), (rows, width) = q.shape, (k.shape[0], selected.shape[1])
    b = selected_tiles(q.device, heads, dim, q.dtype)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    constexprs = {"BLOCK_H": b.block_h, "BLOCK_D": b.block_d, "PREC": prec}
    strides = (q.stride(0), q.stride(1), k.stride(0), weights.stride(0))
    shape_args = (rows, heads, dim, width, *strides, selected.stride(0))
    from cpkv.backends.triton import indexer_kernels  # lazy: triton is imported only when a kernel runs

    if d_scores is None:
        scores = torch.empty((num_q, width), dtype=torch.float32, device=q.device)
        if num_q == 0 or width == 0:
            return [], (scores,)
        launch = KernelLaunch("indexer_selected_scores", indexer_kernels.indexer_selected_scores_kernel,
                              (num_q, -(-width // b.scores_k)), (q, k, weights, selected, scores, *shape_args),
                              {**constexprs, "BLOCK_K": b.scores_k}, b.scores_warps)
        return [launch], (scores,)
    dq = torch.empty((num_q, heads, dim), dtype=torch.float32, device=q.device)
    dk = torch.zeros((rows, dim), dtype=torch.float32, device=q.device)
    dw = torch.empty((num_q, heads), dtype=torch.float32, device=q.device)
    if num_q == 0 or width == 0:
        return [], (dq.zero_(), dk, dw.zero_())
    ds = d_scores.float().contiguous()
    launches = [KernelLaunch("indexer_selected_grads" + ("" if deterministic else "_atomic"),
                             indexer_kernels.indexer_selected_grads_kernel, (num_q,),
                             (q, k, weights, selected, ds, dq, dk, dw, *shape_args),
                             {**constexprs, "BLOCK_K": b.grads_k, "ATOMIC_DK": not deterministic}, b.grads_warps)]
    if deterministic and rows > 0:
        from cpkv.backends.triton.ops import inverted_pairs

        pairs, row_ptr = inverted_pairs(selected, rows)
        launches.append(KernelLaunch(
            "indexer_dk_keymajor", indexer_kernels.indexer_dk_kernel, (rows,),
            (q, k, weights, ds, pairs, row_ptr, dk, heads, dim, width, *strides),
            {"BLOCK_R": b.block_r, "BLOCK_H": b.block_h, "BLOCK_D": b.block_d}, b.dk_warps,
        ))
    return launches, (dq, dk, dw)


@torch.library.custom_op("cpkv_triton::indexer_selected_scores", mutates_args=())
def selected_scores_op(q: Tensor, k: Tensor, weights: Tensor, selected: Tensor) -> Tensor:
    """``I[t, k] = sum_h weights[t, h] relu(q[t, h] . k[selected[t, k]])`` ``[T, K]`` fp32, -inf at padding (Triton)."""
    launches, (scores,) = selected_launches(q, k, weights, selected)
    run_launches(launches)
    return scores


@selected_scores_op.register_fake
def _(q: Tensor, k: Tensor, weights: Tensor, selected: Tensor) -> Tensor:
    return q.new_empty(selected.shape, dtype=torch.float32)


@torch.library.custom_op("cpkv_triton::indexer_selected_grads", mutates_args=())
def selected_grads_op(
    q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, d_scores: Tensor, deterministic: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``sum(d_scores * I)`` w.r.t. q, k, weights (their dtypes), ``I`` as :func:`selected_scores_op`.

    ``deterministic``: dk summed key-major in a fixed order (bitwise reproducible), else fp32 atomics.
    """
    launches, (dq, dk, dw) = selected_launches(q, k, weights, selected, d_scores, deterministic=deterministic)
    run_launches(launches)
    return dq.to(q.dtype), dk.to(k.dtype), dw.to(weights.dtype)


@selected_grads_op.register_fake
def _(q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, d_scores: Tensor,
      deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights)


def _valid(selected: Tensor, rows: int) -> Tensor:
    return (selected >= 0) & (selected < rows)  # any other index is padding, as in the kernels


def indexer_kl_forward(
    q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, target: Tensor, run: LaunchRunner | None = None,
) -> Tensor:
    """The body of ``cpkv_triton::indexer_kl``: ``sum_t KL(target_t || softmax(I_t))`` (0-d fp32).

    One launch for the selected scores (handed to ``run``), then torch ops on ``[T, K]``.
    ``run`` (default :func:`run_launches`) lets the bench collect the launches instead, to
    count launches and torch kernels on ``meta`` tensors. Arguments as :func:`indexer_kl_op`.
    """
    run = run or run_launches
    launches, (scores,) = selected_launches(q, k, weights, selected)
    run(launches)
    kl, _ = kl_terms(scores, target.float(), _valid(selected, k.shape[0]))
    return kl.sum()


def indexer_kl_backward(
    q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float, deterministic: bool,
    run: LaunchRunner | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The body of ``cpkv_triton::indexer_kl_backward``: the gradients w.r.t. q, k, weights (their dtypes).

    The scores are recomputed (one launch), ``dI = (softmax(I_t) - target) * grad_factor`` on
    valid entries (``[T, K]`` torch ops), then one launch for dq, dw and dk (two with
    ``deterministic``, after the inverted selection's sort). ``run`` as :func:`indexer_kl_forward`.
    """
    run = run or run_launches
    launches, (scores,) = selected_launches(q, k, weights, selected)
    run(launches)
    valid = _valid(selected, k.shape[0])
    tgt = target.float()
    _, pred = kl_terms(scores, tgt, valid)
    d_scores = torch.where(valid, (pred - tgt) * grad_factor, 0.0)
    launches, (dq, dk, dw) = selected_launches(q, k, weights, selected, d_scores, deterministic=deterministic)
    run(launches)
    return dq.to(q.dtype), dk.to(k.dtype), dw.to(weights.dtype)


@torch.library.custom_op("cpkv_triton::indexer_kl", mutates_args=())
def indexer_kl_op(
    q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float, deterministic: bool,
) -> tuple[Tensor, Tensor]:
    """``cpkv::indexer_kl`` (:func:`cpkv.indexer_loss.indexer_kl_op`) on the Triton kernels: ``[T, K]`` intermediates only.

    Args:
        q: [T, H_I, D_I] fp16/bf16/fp32. k: [N_c, D_I] (dtype of q). weights: [T, H_I] float.
        selected: [T, K] int rows of k (outside ``[0, N_c)``: padding). target: [T, K] float
            ``p_t`` (0 at padding, rows sum to 1 or 0). grad_factor: ``grad_scale / N``.
        deterministic: the backward sums dk in a fixed order (bitwise reproducible).

    Returns:
        ``(loss, anchor)``: ``sum_t KL(target_t || softmax(I_t))`` (0-d fp32) and a 0-d fp32
        zero; the backward ignores the upstream gradients and returns those of
        ``grad_factor * sum_t KL_t`` (:func:`indexer_kl_backward_op`).
    """
    return indexer_kl_forward(q, k, weights, selected, target), q.new_zeros((), dtype=torch.float32)


@indexer_kl_op.register_fake
def _(q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
      deterministic: bool) -> tuple[Tensor, Tensor]:
    return q.new_empty((), dtype=torch.float32), q.new_empty((), dtype=torch.float32)


@torch.library.custom_op("cpkv_triton::indexer_kl_backward", mutates_args=())
def indexer_kl_backward_op(
    q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float, deterministic: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``grad_factor * sum_t KL_t`` w.r.t. q, k, weights (their dtypes): :func:`indexer_kl_backward`."""
    return indexer_kl_backward(q, k, weights, selected, target, grad_factor, deterministic)


@indexer_kl_backward_op.register_fake
def _(q: Tensor, k: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
      deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(weights)


def _kl_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    *tensors, ctx.grad_factor, ctx.deterministic = inputs
    ctx.save_for_backward(*tensors)


def _kl_backward(ctx: Any, _grad_loss: Tensor, _grad_anchor: Tensor) -> tuple[Tensor | None, ...]:
    d_q, d_k, d_w = indexer_kl_backward_op(*ctx.saved_tensors, ctx.grad_factor, ctx.deterministic)
    return d_q, d_k, d_w, None, None, None, None


indexer_kl_op.register_autograd(_kl_backward, setup_context=_kl_setup)


def aot_launches(case: AOTCase) -> list[KernelLaunch]:
    """The indexer launches of ``case`` on ``meta`` tensors, for the sm_90a compile report.

    bf16 (and fp16) cases: the top-k's fp8 launch (fp8 queries and keys with per-key scales,
    as DeepSeek scores) and its bf16 one; an fp32 case: the fp32 launch. Then the KL path's
    launches in the case's dtype (:func:`selected_launches`: the selected scores, the
    gradients with atomic dk, and the deterministic pair). ``T = case.tokens`` queries over
    ``case.index_rows`` keys, ``H_I = case.index_heads``, ``D_I = case.index_dim``,
    ``topk = case.index_topk``.
    """
    meta = torch.device("meta")
    num_q, heads, dim, rows = case.tokens, case.index_heads, case.index_dim, case.index_rows
    start = torch.empty(num_q, dtype=torch.int64, device=meta)
    count = torch.empty(num_q, dtype=torch.int64, device=meta)
    weights = torch.empty((num_q, heads), dtype=torch.float32, device=meta)
    dtypes = [case.dtype] if case.dtype == torch.float32 else [FP8, case.dtype]
    out: list[KernelLaunch] = []
    for dtype in dtypes:
        q = torch.empty((num_q, heads, dim), dtype=dtype, device=meta)
        k = torch.empty((rows, dim), dtype=dtype, device=meta)
        scale = torch.empty(rows, dtype=torch.float32, device=meta) if dtype == FP8 else None
        launches, _, _ = indexer_topk_launches(q, k, weights, scale, start, count, case.index_topk)
        out += [KernelLaunch(f"indexer_topk {str(dtype).removeprefix('torch.')}", x.kernel, x.grid, x.args,
                             x.constexprs, x.num_warps, x.num_stages) for x in launches]
    q = torch.empty((num_q, heads, dim), dtype=case.dtype, device=meta)
    k = torch.empty((rows, dim), dtype=case.dtype, device=meta)
    selected = torch.empty((num_q, case.index_topk), dtype=torch.int64, device=meta)
    d_scores = torch.empty((num_q, case.index_topk), dtype=torch.float32, device=meta)
    out += selected_launches(q, k, weights, selected)[0]
    out += selected_launches(q, k, weights, selected, d_scores)[0]
    out += selected_launches(q, k, weights, selected, d_scores, deterministic=True)[0]
    return out
