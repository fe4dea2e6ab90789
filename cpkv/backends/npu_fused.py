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

The indexer KL (:func:`fused_indexer_kl`): ``sparse_lightning_indexer_kl_loss_grad`` over one
batch with ``mask_mode=0`` (the selection is already causal, rows are absolute entry rows),
called in the forward; its gradients, times ``grad_factor``, are the backward.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from cpkv.backends.base import CompressedLayer

__all__ = [
    "FusedArgs", "entry_gather", "fused_arguments", "fused_indexer_kl", "fused_limit_reason", "kl_limit_reason", "relative_indices",
    "sparse_flash_mla",
]

FUSED_HEAD_DIM = 512
FUSED_WINDOW = 128
FUSED_RATIOS = {"CSA": 4, "HCA": 128}
FUSED_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
FUSED_MAX_TOPK = 8192
KL_HEAD_DIM = 128
KL_HEADS = (8, 16, 32, 64)
KL_TOPKS = (512, 1024, 2048, 4096, 8192)
KL_MAX_QUERIES = 8192
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


def fused_limit_reason(q: Tensor, layer: CompressedLayer, check_dtypes: bool) -> str | None:
    """Why the A2/A3 ``sparse_flash_mla`` cannot serve this layer (its documented limits), or None."""
    kind = "HCA" if layer.selected is None else "CSA"
    if check_dtypes and q.dtype not in FUSED_DTYPES:
        return f"sparse_flash_mla with dtype {q.dtype} (the kernel takes float16, bfloat16)"
    if q.shape[-1] != FUSED_HEAD_DIM or q.shape[1] not in FUSED_HEADS:
        return f"sparse_flash_mla with H={q.shape[1]}, D={q.shape[-1]} (it takes D=512, H in {FUSED_HEADS})"
    if layer.window != FUSED_WINDOW or layer.visible.ratio != FUSED_RATIOS[kind]:
        return f"sparse_flash_mla {kind} with window {layer.window}, ratio {layer.visible.ratio} (A2/A3: window 128, ratio {FUSED_RATIOS[kind]})"
    if layer.selected is not None and layer.selected.shape[1] > FUSED_MAX_TOPK:
        return f"sparse_flash_mla with topk {layer.selected.shape[1]} > {FUSED_MAX_TOPK}"
    return None


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
        ``(out [T, H, D] in q's dtype, lse [T, H] fp32 with the sink, no gradient)``.
    """
    args = fused_arguments(layer)
    if sinks is None:
        sinks = q.new_full((q.shape[1],), float("-inf"), dtype=torch.float32)
    entries = kv[layer.num_kv :]
    rows = entry_gather(layer)
    ori_kv, cmp_kv = kv[: layer.num_kv, None], (entries if rows is None else entries.index_select(0, rows))[:, None]
    out, lse = _SparseFlashMLA.apply(q.contiguous(), ori_kv, cmp_kv, sinks, ops, args, float(scale))  # type: ignore[no-untyped-call]
    return out, lse


def kl_limit_reason(q_index: Tensor, selected: Tensor, check_dtypes: bool) -> str | None:
    """Why the A2/A3 ``sparse_lightning_indexer_kl_loss_grad`` cannot serve this call, or None."""
    if check_dtypes and q_index.dtype not in FUSED_DTYPES:
        return f"sparse_lightning_indexer_kl_loss_grad with dtype {q_index.dtype} (it takes float16, bfloat16)"
    if q_index.shape[-1] != KL_HEAD_DIM or q_index.shape[1] not in KL_HEADS or selected.shape[1] not in KL_TOPKS:
        return (f"sparse_lightning_indexer_kl_loss_grad with H_I={q_index.shape[1]}, D_I={q_index.shape[-1]}, "
                f"K={selected.shape[1]} (it takes D_I=128, H_I in {KL_HEADS}, K in {KL_TOPKS})")
    return None


class _FusedIndexerKL(torch.autograd.Function):
    """The loss in the forward from the op's ``softmax_out``; the op's gradients times ``grad_factor`` (on ctx) as the backward."""

    @staticmethod
    def forward(ctx: Any, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor,
                grad_factor: float, ops: Any) -> tuple[Tensor, Tensor]:
        order = (selected < 0).to(torch.int8).argsort(dim=1, stable=True)  # valid first, -1 padded
        rows = selected.long().gather(1, order)
        p = torch.where(rows >= 0, target.gather(1, order).float(), 0.0)
        key = k_index.to(q_index.dtype)[:, None].contiguous()
        d_q, d_w, kl = torch.zeros_like(q_index), torch.zeros_like(weights, dtype=torch.float32), p.new_zeros(())
        d_k = torch.zeros_like(key)
        num_k = torch.tensor([0, key.shape[0]], dtype=torch.int32, device=q_index.device)
        for t0 in range(0, q_index.shape[0], KL_MAX_QUERIES):
            block = slice(t0, t0 + KL_MAX_QUERIES)
            num_q = torch.tensor([0, int(rows[block].shape[0])], dtype=torch.int32, device=q_index.device)
            common: dict[str, Any] = {"cu_seqlens_q": num_q, "cu_seqlens_k": num_k, "layout_q": "TND", "layout_k": "TND",
                                      "mask_mode": 0, "cmp_ratio": 1}
            metadata = ops.sparse_lightning_indexer_kl_loss_grad_metadata(
                q_index.shape[1], 1, q_index.shape[2], batch_size=1, max_seqlen_q=int(num_q[1]),
                max_seqlen_k=key.shape[0], topk=rows.shape[1], **common,
            )
            dq, dk, dw, pred = ops.sparse_lightning_indexer_kl_loss_grad(
                q_index[block].contiguous(), key, weights[block].float().contiguous(),
                rows[block].to(torch.int32).unsqueeze(1).contiguous(), p[block].unsqueeze(1).contiguous(),
                metadata=metadata, **common,
            )
            d_q[block], d_w[block], d_k = dq, dw, d_k + dk
            terms = torch.where(p[block] > 0, p[block] * (p[block].clamp_min(1e-30).log() - pred[:, 0].clamp_min(1e-30).log()), 0.0)
            kl = kl + terms.sum()
        ctx.save_for_backward(d_q, d_k[:, 0], d_w)
        ctx.grad_factor, ctx.dtypes = grad_factor, (k_index.dtype, weights.dtype)
        return kl.float(), q_index.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, _d_loss: Tensor, _d_anchor: Tensor) -> tuple[Tensor | None, ...]:
        d_q, d_k, d_w = ctx.saved_tensors
        factor = ctx.grad_factor
        return d_q * factor, (d_k * factor).to(ctx.dtypes[0]), (d_w * factor).to(ctx.dtypes[1]), None, None, None, None


def fused_indexer_kl(
    ops: Any, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
) -> tuple[Tensor, Tensor]:
    """``cpkv::indexer_kl``'s contract through ``sparse_lightning_indexer_kl_loss_grad`` (module doc).

    Args:
        ops: ``cann_ops_transformer.ops`` or a stand-in. q_index: ``[T, H_I, D_I]``.
            k_index: ``[N_c, D_I]`` (cast to q's dtype). weights: ``[T, H_I]`` (fp32 to the op).
            selected: ``[T, K]`` rows of k_index, -1 anywhere. target: ``[T, K]`` L1-normalised
            (0 at padding). grad_factor: ``grad_scale / N``, kept on the autograd ctx.

    Returns:
        ``(loss, anchor)``: ``sum_t KL(target_t || softmax(I_t))`` (0-d fp32) and a 0-d zero whose
        backward gives ``grad_factor`` times the op's gradients, whatever the upstream gradient.
        The gradients are computed in the forward (the op returns the indexer softmax the loss
        needs only together with them) and kept until the backward.
    """
    loss, anchor = _FusedIndexerKL.apply(q_index, k_index, weights, selected, target, float(grad_factor), ops)  # type: ignore[no-untyped-call]
    return loss, anchor
