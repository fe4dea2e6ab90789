"""Ascend's fused DeepSeek-V4 ops (``cann_ops_transformer.ops``): one ``sparse_flash_mla`` call per compressed layer.

The NPU backend's fused path (docs/backends.md, "NPU: fused path"). Schemas: CANN
ops-transformer's ``sparse_flash_mla`` / ``sparse_flash_mla_metadata``,
``sparse_flash_mla_grad`` / ``sparse_flash_mla_grad_metadata`` and
``sparse_lightning_indexer_kl_loss_grad`` / ``..._metadata`` torch API docs; the calling
convention as MindSpeed-LLM's ``npu_sparse_flash_mla`` uses it. cpkv's marshalling:

* TND, ``B`` = the rank's query segments, one batch each, in order. ``cu_seqlens_q`` /
  ``cu_seqlens_ori_kv``: the plan's segments over the window kv buffer (int32, leading 0;
  ``cu_seqlens_q != cu_seqlens_ori_kv``: queries bottom-right aligned to their kv prefix).
* ``cu_seqlens_cmp_kv``: one entry segment per query segment, compressed from the
  full-prefix **kv** lengths (``prefix.visible_for(m).cu_seqlens``; never from the query
  lengths). The need exchange's per-document entry buffer is gathered into that layout
  when a document has several ranges on the rank (:func:`entry_gather`).
* ``cmp_residual_kv`` ``[B]``: the full-prefix kv length mod the ratio, so that
  ``cmp_len * ratio + residual`` recovers the length the compressed mask counts from:
  a query at document position ``p`` then sees the first ``floor((p + 1) / m)`` entries.
  This holds under the need exchange too, where a segment's window kv lacks rows.
* ``ori_mask_mode=4`` (band) with ``ori_win_left=W-1, ori_win_right=0``; ``cmp_mask_mode=3``.
* CSA (INDEXER): ``cmp_sparse_indices`` int32 ``[T, 1, K]``, the indexer's rows relative to
  the segment's first entry, valid first, -1 padded; ``cmp_topk = K``. HCA
  (COMPRESSOR_ONLY): no indices, ``cmp_topk = 0``.
* Values are the full ``D`` channels (``K = V``); cpkv keeps the first ``d_v``.
* ``sinks``: fp32 ``[H]`` (required by the ops; ``-inf`` when the layer has none).
* The metadata calls get exactly the main calls' arguments; LSE ``[1, T, H]`` -> ``[T, H]``.

The indexer KL (:func:`fused_indexer_kl`): ``sparse_lightning_indexer_kl_loss_grad`` with
``mask_mode=3``, ``cmp_ratio=1`` and no residual, over batches built from the selections
themselves (:func:`indexer_kl_plan`): the op reads ``kRealSize = min(K, S2 - S1 + i + 1)``
index slots, softmaxes over all of them and gathers keys only up to the first -1, so every
row must list exactly ``kRealSize`` valid entries. A row with ``K`` of them goes into a batch
over all keys (zero padding rows lift the threshold); a row with ``n < K``, which selects a
document's first ``n`` visible entries ``[s, s + n)``, into a chain of consecutive counts over
keys ``[s, s + n_last)``. At most 256 batches and 8192 queries a call. Rows breaking the
invariant fall back to the composed KL (the backend warns). Called in the forward; its
gradients, times ``grad_factor``, are the backward. (cpkv's first version passed one batch
with ``mask_mode=0``: ``kRealSize = min(K, N_c)`` then polluted every row with fewer than
``K`` selections; issue 46.)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from cpkv.backends.base import CompressedLayer

__all__ = [
    "FusedArgs", "KLCall", "KLPlan", "check_index_count", "entry_gather", "fused_arguments", "fused_indexer_kl",
    "fused_limit_reason", "index_count_ok", "indexer_kl_plan", "kl_limit_reason", "relative_indices", "sparse_flash_mla",
]

FUSED_HEAD_DIM = 512
FUSED_WINDOW = 128
FUSED_RATIOS = {"CSA": 4, "HCA": 128}
FUSED_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
FUSED_MAX_TOPK = 8192
FUSED_MAX_TOPK_MULTIHEAD = 1024
KL_HEAD_DIM = 128
KL_HEADS = (8, 16, 32, 64)
KL_TOPKS = (512, 1024, 2048, 4096, 8192)
KL_MAX_QUERIES = 8192
KL_MAX_BATCHES = 256
KL_MASK_MODE = 3  # rightDownCausal with cmp_ratio 1: the batches of indexer_kl_plan make it exact
FUSED_DTYPES = (torch.float16, torch.bfloat16)


class FusedArgs(NamedTuple):
    """The plan data of one ``sparse_flash_mla`` call (module doc).

    Attributes:
        cu_seqlens_q, cu_seqlens_ori_kv, cu_seqlens_cmp_kv: ``[B + 1]`` int32, leading 0.
        cmp_residual_kv: ``[B]`` int32, ``< cmp_ratio``.
        cmp_sparse_indices: ``[T, 1, K]`` int32 (CSA) or ``None`` (HCA).
        batch_size, max_seqlen_q, max_seqlen_ori_kv, max_seqlen_cmp_kv: host ints.
        cmp_ratio: ``m``. ori_win_left: ``W - 1``.
    """

    cu_seqlens_q: Tensor
    cu_seqlens_ori_kv: Tensor
    cu_seqlens_cmp_kv: Tensor
    cmp_residual_kv: Tensor
    cmp_sparse_indices: Tensor | None
    batch_size: int
    max_seqlen_q: int
    max_seqlen_ori_kv: int
    max_seqlen_cmp_kv: int
    cmp_ratio: int
    ori_win_left: int

    def mask_kwargs(self) -> dict[str, Any]:
        """The keyword arguments every call (main, grad and both metadata calls) shares."""
        return {
            "cu_seqlens_q": self.cu_seqlens_q, "cu_seqlens_ori_kv": self.cu_seqlens_ori_kv,
            "cu_seqlens_cmp_kv": self.cu_seqlens_cmp_kv, "cmp_residual_kv": self.cmp_residual_kv,
            "cmp_ratio": self.cmp_ratio, "ori_mask_mode": 4, "cmp_mask_mode": 3, "ori_win_left": self.ori_win_left,
            "ori_win_right": 0, "layout_q": "TND", "layout_kv": "TND",
        }

    def metadata_kwargs(self) -> dict[str, Any]:
        """The metadata calls' keyword arguments (after ``num_heads_q, num_heads_kv, head_dim``)."""
        topk = 0 if self.cmp_sparse_indices is None else int(self.cmp_sparse_indices.shape[-1])
        return {
            **self.mask_kwargs(), "batch_size": self.batch_size, "max_seqlen_q": self.max_seqlen_q,
            "max_seqlen_ori_kv": self.max_seqlen_ori_kv, "max_seqlen_cmp_kv": self.max_seqlen_cmp_kv,
            "ori_topk": 0, "cmp_topk": topk, "has_ori_kv": True, "has_cmp_kv": True,
        }


def relative_indices(selected: Tensor, first_entry: Tensor) -> Tensor:
    """``[T, 1, K]`` int32: entry rows relative to each query's segment start, valid first, -1 padded.

    Args:
        selected: ``[T, K]`` int entry rows, -1 anywhere. first_entry: ``[T]`` int64 row of
            each query's segment's first entry (``EntryVisibility.visible_start``).
    """
    order = (selected < 0).to(torch.int8).argsort(dim=1, stable=True)
    rows = selected.long().gather(1, order)
    relative = torch.where(rows >= 0, rows - first_entry[:, None], -1)
    return relative.to(torch.int32).unsqueeze(1).contiguous()


def entry_gather(layer: CompressedLayer) -> Tensor | None:
    """Rows of the entry buffer forming the per-segment layout the kernel takes, or ``None`` if it is that layout.

    The all-gather's buffer holds each segment's entries (``prefix.visible_for(m)``'s layout);
    the need exchange's holds each document's once, so a document with two ranges on the
    rank (zigzag, balanced) is gathered once per range (``[N_c']`` int64, no host sync).
    """
    per_segment = layer.prefix.visible_for(layer.visible.ratio)
    if layer.visible.cu_seqlens.numel() == per_segment.cu_seqlens.numel():
        return None
    cu = per_segment.cu_seqlens.long()
    lens, total = cu.diff(), per_segment.num_entries
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=cu.device), lens, output_size=total)
    first_query = layer.prefix.cu_seqlens_q[:-1].long().clamp(max=max(layer.prefix.num_queries - 1, 0))
    start = layer.visible.visible_start.index_select(0, first_query) if layer.prefix.num_queries else torch.zeros_like(lens)
    rows = (start - cu[:-1]).index_select(0, seg) + torch.arange(total, device=cu.device)
    return rows.clamp(0, max(layer.visible.num_entries - 1, 0))  # rows of query-less segments are never read


def fused_arguments(layer: CompressedLayer) -> FusedArgs:
    """The ``sparse_flash_mla`` arguments of a compressed layer (pure; no host sync).

    Example:
        >>> from cpkv.plan.segments import plan_segments
        >>> seg = plan_segments(torch.tensor([0, 3, 5]), torch.tensor([0, 9, 11]), compress_ratios=[4])
        >>> args = fused_arguments(CompressedLayer(seg, seg, seg.visible_for(4), 4, 11, None))
        >>> args.cu_seqlens_cmp_kv.tolist(), args.cmp_residual_kv.tolist(), args.max_seqlen_cmp_kv
        ([0, 2, 2], [1, 2], 2)
    """
    segments, prefix, ratio = layer.segments, layer.prefix, layer.visible.ratio
    per_segment = prefix.visible_for(ratio)
    indices = None if layer.selected is None else relative_indices(layer.selected, layer.visible.visible_start)
    cu_q = segments.cu_seqlens_q.to(torch.int32)
    return FusedArgs(
        cu_seqlens_q=cu_q, cu_seqlens_ori_kv=segments.cu_seqlens_kv.to(torch.int32),
        cu_seqlens_cmp_kv=per_segment.cu_seqlens.to(device=cu_q.device, dtype=torch.int32),
        cmp_residual_kv=(prefix.cu_seqlens_kv.long().diff() % ratio).to(device=cu_q.device, dtype=torch.int32),
        cmp_sparse_indices=indices, batch_size=int(cu_q.shape[0]) - 1, max_seqlen_q=segments.max_seqlen_q,
        max_seqlen_ori_kv=segments.max_seqlen_kv, max_seqlen_cmp_kv=per_segment.max_visible, cmp_ratio=ratio,
        ori_win_left=layer.window - 1,
    )


def fused_limit_reason(q: Tensor, layer: CompressedLayer, check_dtypes: bool, *, needs_grad: bool = False) -> str | None:
    """Why the A2/A3 ``sparse_flash_mla`` (and its grad) cannot serve this layer, or None.

    Its documented limits (dtype, D=512, H a power of two <= 128, window 128, ratio 4/128) and
    two the kernel sources show (docs/backends.md, "NPU fused path: the kernels read"): the
    arch22 CSA kernel re-reads the first 512 indices past 1024 when a query has several heads
    (``sparse_flash_mla_csa_kernel.h``, ``v0S2Start``), so ``K <= 1024`` for ``H > 1``; and
    ``sparse_flash_mla_grad``'s tiling fails with ``deterministic == 1``, so no fused call
    when ``needs_grad`` under ``torch.use_deterministic_algorithms(True)``.
    """
    kind = "HCA" if layer.selected is None else "CSA"
    if check_dtypes and q.dtype not in FUSED_DTYPES:
        return f"sparse_flash_mla with dtype {q.dtype} (the kernel takes float16, bfloat16)"
    if q.shape[-1] != FUSED_HEAD_DIM or q.shape[1] not in FUSED_HEADS:
        return f"sparse_flash_mla with H={q.shape[1]}, D={q.shape[-1]} (it takes D=512, H in {FUSED_HEADS})"
    if layer.window != FUSED_WINDOW or layer.visible.ratio != FUSED_RATIOS[kind]:
        return f"sparse_flash_mla {kind} with window {layer.window}, ratio {layer.visible.ratio} (A2/A3: window 128, ratio {FUSED_RATIOS[kind]})"
    if layer.selected is not None:
        topk = layer.selected.shape[1]
        if topk > FUSED_MAX_TOPK:
            return f"sparse_flash_mla with topk {topk} > {FUSED_MAX_TOPK}"
        if topk > FUSED_MAX_TOPK_MULTIHEAD and q.shape[1] > 1:
            return (f"sparse_flash_mla with topk {topk} > {FUSED_MAX_TOPK_MULTIHEAD} and {q.shape[1]} heads (the A2/A3 CSA "
                    f"kernel re-reads the first 512 indices past {FUSED_MAX_TOPK_MULTIHEAD} when H > 1)")
    if needs_grad and torch.are_deterministic_algorithms_enabled():
        return ("sparse_flash_mla_grad under torch.use_deterministic_algorithms(True) (the A2/A3 grad tiling "
                "refuses deterministic=1)")
    return None


def index_count_ok(indices: Tensor, visible_count: Tensor) -> Tensor:
    """0-d bool on ``indices``' device: every row lists exactly ``min(K, visible_count)`` entries, valid first.

    The invariant both ``sparse_flash_mla`` (CSA) and the KL op rely on: they read the first
    ``min(K, threshold)`` index slots and stop gathering at the first -1. No host sync.

    Args:
        indices: ``[T, K]`` int, -1 padded (as passed to the kernel). visible_count: ``[T]`` int
            entries each row may see (the kernel's threshold).
    """
    valid = indices >= 0
    expected = visible_count.to(valid.device).clamp(max=indices.shape[1])
    ok = (valid.sum(1) == expected).all()
    if indices.shape[1] > 1:
        ok = ok & (valid[:, 1:] <= valid[:, :-1]).all()
    return ok


def check_index_count(selected: Tensor, visible_count: Tensor, out: Tensor) -> Tensor:
    """``out`` unchanged when :func:`index_count_ok`, else all NaN (the status mechanism's poisoning); no host sync.

    On CPU and CUDA it also asserts (``torch._assert_async``: a raise on CPU, a device-side
    assert on CUDA) so that the failure names itself; elsewhere (NPU) the NaN output is the
    report, caught by :class:`~cpkv.status.StepStatus`'s NaN checks or the loss.
    """
    ok = index_count_ok(selected, visible_count)
    if ok.device.type in ("cpu", "cuda"):
        torch._assert_async(ok, "cpkv: index-count invariant broken: a row of the indexer's selections lists other than "
                                "min(K, visible) entries, or a -1 before a valid entry (docs/backends.md, NPU fused path)")
    return out + torch.where(ok, 0.0, float("nan")).to(out.dtype)


class _SparseFlashMLA(torch.autograd.Function):
    """``sparse_flash_mla`` forward, ``sparse_flash_mla_grad`` backward (each after its metadata call)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, ori_kv: Tensor, cmp_kv: Tensor, sinks: Tensor, ops: Any, args: FusedArgs,
                scale: float) -> tuple[Tensor, Tensor]:
        sinks32 = sinks.detach().float().contiguous()
        heads, dim = q.shape[1], q.shape[2]
        metadata = ops.sparse_flash_mla_metadata(heads, 1, dim, **args.metadata_kwargs())
        out, lse = ops.sparse_flash_mla(
            q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=args.cmp_sparse_indices, sinks=sinks32,
            metadata=metadata, softmax_scale=scale, return_softmax_lse=True, **args.mask_kwargs(),
        )
        ctx.save_for_backward(q, ori_kv, cmp_kv, out, lse, sinks32)
        ctx.ops, ctx.args, ctx.scale, ctx.sinks_dtype = ops, args, scale, sinks.dtype
        lse_th = lse[0].detach()
        ctx.mark_non_differentiable(lse_th)
        return out, lse_th

    @staticmethod
    def backward(ctx: Any, d_out: Tensor, _d_lse: Tensor) -> tuple[Tensor | None, ...]:
        q, ori_kv, cmp_kv, out, lse, sinks32 = ctx.saved_tensors
        args: FusedArgs = ctx.args
        metadata = ctx.ops.sparse_flash_mla_grad_metadata(q.shape[1], 1, q.shape[2], **args.metadata_kwargs())
        d_q, d_ori, d_cmp, d_sinks, _, _ = ctx.ops.sparse_flash_mla_grad(
            q, d_out.contiguous(), out, lse, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=args.cmp_sparse_indices,
            sinks=sinks32, metadata=metadata, softmax_scale=ctx.scale, **args.mask_kwargs(),
        )
        return d_q, d_ori, d_cmp, d_sinks.to(ctx.sinks_dtype), None, None, None


def sparse_flash_mla(
    ops: Any, q: Tensor, kv: Tensor, layer: CompressedLayer, *, scale: float, sinks: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """One ``sparse_flash_mla`` call over a compressed layer (module doc), differentiable in q, kv and sinks.

    Args:
        ops: ``cann_ops_transformer.ops`` (or a stand-in with its four attention functions).
        q: ``[T, H, D]``. kv: ``[num_kv + N_c, D]`` window kv, then the entries (``layer``).
        layer: the call's structure. scale: softmax scale. sinks: ``[H]`` or None (``-inf``).

    Returns:
        ``(out [T, H, D] in q's dtype, lse [T, H] fp32 with the sink, no gradient)``. CSA: ``out``
        is all NaN when the selections break the index-count invariant (:func:`check_index_count`;
        on CPU and CUDA a ``RuntimeError`` names it).
    """
    args = fused_arguments(layer)
    if sinks is None:
        sinks = q.new_full((q.shape[1],), float("-inf"), dtype=torch.float32)
    entries = kv[layer.num_kv :]
    rows = entry_gather(layer)
    ori_kv, cmp_kv = kv[: layer.num_kv, None], (entries if rows is None else entries.index_select(0, rows))[:, None]
    out, lse = _SparseFlashMLA.apply(q.contiguous(), ori_kv, cmp_kv, sinks, ops, args, float(scale))  # type: ignore[no-untyped-call]
    if args.cmp_sparse_indices is not None:  # what the kernel read must be what the indexer selected
        out = check_index_count(args.cmp_sparse_indices[:, 0], layer.visible.visible_count, out)
    return out, lse


def kl_limit_reason(q_index: Tensor, selected: Tensor, check_dtypes: bool) -> str | None:
    """Why the A2/A3 ``sparse_lightning_indexer_kl_loss_grad`` cannot serve this call, or None."""
    if check_dtypes and q_index.dtype not in FUSED_DTYPES:
        return f"sparse_lightning_indexer_kl_loss_grad with dtype {q_index.dtype} (it takes float16, bfloat16)"
    if q_index.shape[-1] != KL_HEAD_DIM or q_index.shape[1] not in KL_HEADS or selected.shape[1] not in KL_TOPKS:
        return (f"sparse_lightning_indexer_kl_loss_grad with H_I={q_index.shape[1]}, D_I={q_index.shape[-1]}, "
                f"K={selected.shape[1]} (it takes D_I=128, H_I in {KL_HEADS}, K in {KL_TOPKS})")
    return None


class KLCall(NamedTuple):
    """One ``sparse_lightning_indexer_kl_loss_grad`` call: at most 256 batches, at most 8192 queries.

    Attributes:
        rows: ``[n]`` int64 query rows, in the call's TND order.
        key_rows: ``[n_k]`` int64 rows of ``k_index`` forming the call's key buffer
            (``N_c`` for the zero padding rows of a full batch).
        indices: ``[n, 1, K]`` int32 relative to each row's batch, valid first, -1 padded.
        cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32, leading 0 (on the rows' device).
        max_seqlen_q, max_seqlen_k: host ints.
    """

    rows: Tensor
    key_rows: Tensor
    indices: Tensor
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class KLPlan(NamedTuple):
    """The calls of one indexer KL (:func:`indexer_kl_plan`).

    Attributes:
        calls: the op calls. order: ``[T, K]`` int64 column order putting each row's valid
            selections first (the order of ``KLCall.indices`` and of the target passed).
        fallback_rows: ``[f]`` int64 rows whose selections the op cannot take on its own
            terms (fewer than ``K`` valid, not one contiguous block of entries): the composed KL.
        mask_mode: the op's ``mask_mode`` (3: what the batches are built for).
    """

    calls: list[KLCall]
    order: Tensor
    fallback_rows: Tensor
    mask_mode: int = KL_MASK_MODE


def _group_calls(sizes: list[tuple[int, int, int, int]], max_queries: int, max_batches: int) -> list[tuple[int, int]]:
    """Consecutive batch ranges ``[b0, b1)`` of at most ``max_batches`` batches and ``max_queries`` queries each."""
    groups: list[tuple[int, int]] = []
    b0, queries = 0, 0
    for b, (num_q, _, _, _) in enumerate(sizes):
        if b > b0 and (queries + num_q > max_queries or b - b0 == max_batches):
            groups.append((b0, b))
            b0, queries = b, 0
        queries += num_q
    if sizes:
        groups.append((b0, len(sizes)))
    return groups


def indexer_kl_plan(selected: Tensor, num_keys: int, *, max_queries: int = KL_MAX_QUERIES,
                    max_batches: int = KL_MAX_BATCHES) -> KLPlan:
    """Batches on which ``sparse_lightning_indexer_kl_loss_grad`` (``mask_mode=3``, ``cmp_ratio=1``) is exact.

    The op (arch22 ``GetS2SparseLen`` / ``GetRunInfo``) reads, for query ``i`` of a batch of
    ``S1`` queries over ``S2`` keys, the first ``kRealSize = min(K, S2 - S1 + i + 1)`` index
    slots (mask mode 3, ratio 1, no residual), softmaxes over all ``kRealSize`` columns and
    gathers keys only up to the first -1: a row is computed right iff its first
    ``kRealSize`` slots are exactly its valid selections. So:

    * a row with ``K`` valid selections (full) goes into a batch over all ``N_c`` keys followed
      by ``S1 - 1`` zero rows (never listed): ``kRealSize = K`` for each of its queries;
    * a row with ``0 < n < K`` valid selections that are one contiguous block of entries
      ``[s, s + n)`` (what a top-k over a document's first ``n`` visible entries selects:
      the index-count invariant) needs ``kRealSize = n`` exactly: rows sharing ``s`` are
      chained by consecutive counts ``n, n + 1, ...`` (one row per count; with ratio ``m``
      each count recurs ``m`` times, so ``m`` chains per document), each chain one batch over
      keys ``[s, s + n_last)``: query ``i`` sees ``n_first + i`` of them;
    * a row selecting nothing is left out (its KL term and gradients are 0);
    * any other row (the invariant broken) is returned in ``fallback_rows``.

    Args:
        selected: ``[T, K]`` int rows of the indexer keys, -1 anywhere.
        num_keys: ``N_c``, the number of indexer keys.
        max_queries, max_batches: per call (A2/A3: ``S1 <= 8192``, ``B <= 256``).

    Host reads: the numbers of rows of each kind and the batch sizes (the op takes host-sized
    calls; the KL runs in the forward).

    Raises:
        ValueError: ``selected`` not 2-D, ``max_queries`` or ``max_batches`` below 1.
    """
    if selected.dim() != 2:
        raise ValueError(f"selected must be [T, K], got shape {tuple(selected.shape)}")
    if max_queries < 1 or max_batches < 1:
        raise ValueError(f"max_queries and max_batches must be >= 1, got {max_queries}, {max_batches}")
    device, (num_rows, topk) = selected.device, selected.shape
    rows_long = selected.long()
    valid = rows_long >= 0
    order = (~valid).to(torch.int8).argsort(dim=1, stable=True)
    count = valid.sum(1)
    big = torch.iinfo(torch.int64).max
    ascending = torch.where(valid, rows_long, big).sort(dim=1).values
    slots = torch.arange(topk, device=device)
    steps = ascending[:, 1:] - ascending[:, :-1]
    block = ((steps == 1) | (slots[1:] >= count[:, None])).all(1) if topk > 1 else torch.ones_like(valid[:, 0])
    start = ascending[:, 0]
    full = count == topk
    partial = (count > 0) & (count < topk)
    chained = partial & block
    fallback = partial & ~block
    full_rows = full.nonzero().flatten()
    part_rows = chained.nonzero().flatten()
    # chains: sort by (start, count); the r-th row of each (start, count) goes to chain (start, r)
    key1 = start[part_rows] * (topk + 1) + count[part_rows]
    by1 = key1.argsort(stable=True)
    part_rows, key1 = part_rows[by1], key1[by1]
    first = torch.ones_like(key1, dtype=torch.bool)
    first[1:] = key1[1:] != key1[:-1]
    pos = torch.arange(key1.numel(), device=device)
    rank = pos - torch.cummax(torch.where(first, pos, 0), 0).values
    key2 = (start[part_rows] * (num_rows + 1) + rank) * (topk + 1) + count[part_rows]
    by2 = key2.argsort(stable=True)
    part_rows = part_rows[by2]
    chain_of = (start[part_rows] * (num_rows + 1) + rank[by2])
    n_part = count[part_rows]
    new = torch.ones_like(n_part, dtype=torch.bool)
    new[1:] = (chain_of[1:] != chain_of[:-1]) | (n_part[1:] != n_part[:-1] + 1)
    heads = new.nonzero().flatten()
    lens = torch.diff(torch.cat([heads, heads.new_tensor([n_part.numel()])]))
    last = heads + lens - 1
    info = torch.stack([lens, start[part_rows][heads], n_part[last]], 1) if heads.numel() else heads.new_zeros((0, 3))
    sizes: list[tuple[int, int, int, int]] = []  # (queries, key start, key rows, zero rows)
    for b0 in range(0, int(full_rows.numel()), max_queries):
        num_q = min(max_queries, int(full_rows.numel()) - b0)
        sizes.append((num_q, 0, num_keys, num_q - 1))
    sizes += [(int(q), int(s), int(k), 0) for q, s, k in info.tolist()]
    call_rows = torch.cat([full_rows, part_rows])
    key_start = torch.cat([torch.zeros_like(full_rows), start[part_rows]])
    sorted_rows = rows_long.gather(1, order)
    calls: list[KLCall] = []
    q0 = 0
    for b0, b1 in _group_calls(sizes, max_queries, max_batches):
        batch = sizes[b0:b1]
        num_q = sum(b[0] for b in batch)
        rows = call_rows[q0 : q0 + num_q]
        rel = sorted_rows.index_select(0, rows) - key_start[q0 : q0 + num_q, None]
        indices = torch.where(sorted_rows.index_select(0, rows) >= 0, rel, -1).to(torch.int32).unsqueeze(1).contiguous()
        pieces = [torch.cat([torch.arange(s, s + k, device=device), torch.full((z,), num_keys, device=device)])
                  for _, s, k, z in batch]
        cu_q = torch.tensor([0, *torch.tensor([b[0] for b in batch]).cumsum(0).tolist()], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, *torch.tensor([b[2] + b[3] for b in batch]).cumsum(0).tolist()], dtype=torch.int32,
                            device=device)
        calls.append(KLCall(rows, torch.cat(pieces), indices, cu_q, cu_k, max(b[0] for b in batch),
                            max(b[2] + b[3] for b in batch)))
        q0 += num_q
    return KLPlan(calls, order, fallback.nonzero().flatten())


class _FusedIndexerKL(torch.autograd.Function):
    """The loss in the forward from the op's ``softmax_out``; the op's gradients times ``grad_factor`` (on ctx) as the backward."""

    @staticmethod
    def forward(ctx: Any, q_index: Tensor, k_index: Tensor, weights: Tensor, target: Tensor, plan: KLPlan,
                grad_factor: float, ops: Any) -> tuple[Tensor, Tensor]:
        p = target.gather(1, plan.order).float()
        key = torch.cat([k_index.to(q_index.dtype), k_index.new_zeros((1, k_index.shape[1]), dtype=q_index.dtype)])
        d_q, d_w, kl = torch.zeros_like(q_index), torch.zeros_like(weights, dtype=torch.float32), p.new_zeros(())
        d_k = torch.zeros_like(key)
        topk = plan.order.shape[1]
        for call in plan.calls:
            common: dict[str, Any] = {"cu_seqlens_q": call.cu_seqlens_q, "cu_seqlens_k": call.cu_seqlens_k,
                                      "layout_q": "TND", "layout_k": "TND", "mask_mode": plan.mask_mode, "cmp_ratio": 1}
            metadata = ops.sparse_lightning_indexer_kl_loss_grad_metadata(
                q_index.shape[1], 1, q_index.shape[2], batch_size=int(call.cu_seqlens_q.shape[0]) - 1,
                max_seqlen_q=call.max_seqlen_q, max_seqlen_k=call.max_seqlen_k, topk=topk, **common,
            )
            p_call = torch.where(call.indices[:, 0] >= 0, p.index_select(0, call.rows), 0.0)
            dq, dk, dw, pred = ops.sparse_lightning_indexer_kl_loss_grad(
                q_index.index_select(0, call.rows).contiguous(), key.index_select(0, call.key_rows)[:, None].contiguous(),
                weights.index_select(0, call.rows).float().contiguous(), call.indices, p_call.unsqueeze(1).contiguous(),
                metadata=metadata, **common,
            )
            d_q.index_copy_(0, call.rows, dq)
            d_w.index_copy_(0, call.rows, dw.float())
            d_k.index_add_(0, call.key_rows, dk[:, 0].to(d_k.dtype))
            terms = torch.where(p_call > 0, p_call * (p_call.clamp_min(1e-30).log() - pred[:, 0].clamp_min(1e-30).log()), 0.0)
            kl = kl + terms.sum()
        ctx.save_for_backward(d_q, d_k[:-1], d_w)
        ctx.grad_factor, ctx.dtypes = grad_factor, (k_index.dtype, weights.dtype)
        return kl.float(), q_index.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, _d_loss: Tensor, _d_anchor: Tensor) -> tuple[Tensor | None, ...]:
        d_q, d_k, d_w = ctx.saved_tensors
        factor = ctx.grad_factor
        return d_q * factor, (d_k * factor).to(ctx.dtypes[0]), (d_w * factor).to(ctx.dtypes[1]), None, None, None, None


def fused_indexer_kl(
    ops: Any, q_index: Tensor, k_index: Tensor, weights: Tensor, target: Tensor, plan: KLPlan, grad_factor: float,
) -> tuple[Tensor, Tensor]:
    """``cpkv::indexer_kl``'s contract through ``sparse_lightning_indexer_kl_loss_grad`` for the rows of ``plan``.

    Args:
        ops: ``cann_ops_transformer.ops`` or a stand-in. q_index: ``[T, H_I, D_I]``.
            k_index: ``[N_c, D_I]`` (cast to q's dtype). weights: ``[T, H_I]`` (fp32 to the op).
            target: ``[T, K]`` L1-normalised (0 at padding), in ``selected``'s column order.
            plan: :func:`indexer_kl_plan` of the selections. grad_factor: ``grad_scale / N``,
            kept on the autograd ctx.

    Returns:
        ``(loss, anchor)``: ``sum_t KL(target_t || softmax(I_t))`` over the planned rows (0-d
        fp32) and a 0-d zero whose backward gives ``grad_factor`` times the op's gradients,
        whatever the upstream gradient. The rows in ``plan.fallback_rows`` contribute nothing
        here (the caller computes them on the composed KL). The gradients are computed in the
        forward (the op returns the indexer softmax the loss needs only together with them).
    """
    loss, anchor = _FusedIndexerKL.apply(q_index, k_index, weights, target, plan, float(grad_factor), ops)  # type: ignore[no-untyped-call]
    return loss, anchor
