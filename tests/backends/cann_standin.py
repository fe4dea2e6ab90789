"""A stand-in ``cann_ops_transformer.ops``: CANN's fused DeepSeek-V4 ops as documented, recorded and checked.

Sources (read for the facts): CANN ops-transformer's torch API docs of ``sparse_flash_mla``
(+ ``_metadata``), ``sparse_flash_mla_grad`` (+ ``_metadata``) and
``sparse_lightning_indexer_kl_loss_grad`` (+ ``_metadata``), their aclnn docs and the
``sparse_flash_mla`` golden (tests/pytest/sparse_flash_mla_golden.py); MindSpeed-LLM's
``mindspeed_llm/ops/npu_sparse_flash_mla*.py`` for how they are called.

Every call is (1) recorded in ``calls``, (2) checked against the published schema
(argument names through the signatures, dtypes, shapes, layouts, mask modes, leading-zero
non-decreasing int32 ``cu_seqlens_*`` ending at the token counts, the residual's presence and
range, indices valid-first within their batch, fp32 sinks, and that ``metadata`` comes from
a metadata call with exactly the main call's arguments and the true maximum lengths),
raising ``AssertionError`` ("contract violated") on any violation, and (3) computed as
documented with the reference ops in the inputs' dtype (float64 in the tests):

* per batch ``b`` (``S1`` queries, ``S2`` ori kv, ``C`` entries, ``L = C * m + residual``),
  query ``i``: ori rows ``[max(thr - win_left - 1, 0), min(thr + win_right, S2))`` with
  ``thr = S2 - S1 + i + 1``; entries below ``cthr = min(floor((L - S1 + i + 1) / m), C)``:
  all of them (HCA), or the listed ones among the first ``min(K, cthr)`` slots up to the
  first -1 (CSA); one softmax with the sink; LSE ``[1, T, H]`` including the sink;
* the grad as its formula: ``P = exp(S - lse)``, ``dS = P * (dO . kv - rowsum(dO * O))``,
  ``dQ = dS kv * scale``, ``dKV = dS^T Q * scale + P^T dO``, ``dsinks = -sum_t exp(sink - lse) rowsum(dO * O)``;
* the KL grad as the arch22 kernel computes it (``sparse_lightning_indexer_kl_loss_grad_base.h``,
  ``GetS2SparseLen``/``GetRunInfo``; ``..._vector.h``, ``MergeKv``/``CopyPFromInput``): per query
  ``s2SparseLen`` = the batch's key count (``mask_mode=0``) or ``(S2 * ratio + residual - S1 + i + 1)
  / ratio`` (``mask_mode=3``), the row skipped (zeros) when it is <= 0; ``kRealSize = max(1, min(K,
  s2SparseLen))`` columns; keys gathered slot by slot **stopping at the first -1** (indices >=
  ``s2SparseLen`` skipped, the later ones moving up), the columns left over holding stale rows
  (zero rows here); ``I = sum_h w relu(q . k)`` and ``y = softmax(I)`` over **all** ``kRealSize``
  columns (no -1 mask), ``p`` read over the same columns, ``dI = y * sum(p) - p`` chained to ``dq, dw``
  and ``dk`` (scattered by the slot's index, -1 skipped); returns ``y`` as ``softmax_out``. So a row
  is right only when its first ``kRealSize`` slots are exactly its valid selections;
* the arch22 CSA forward (``sparse_flash_mla_csa_block_vector.h``, ``ProcessVec0L``) gathers the
  first ``min(K, cthr)`` index slots the same way, stopping at the first -1, and softmaxes over
  all those columns: the columns left over hold stale rows (zero rows here), the backward too;
* the arch22 CSA forward with several heads (``sparse_flash_mla_csa_kernel.h``, ``CalcParams``):
  compressed index slots are gathered 512 at a time from ``v0S2Start``, which is 512 only for the
  second block when it is the last one, else 0: past 1024 the first 512 indices are read again;
* ``sparse_flash_mla_grad`` fails under ``torch.use_deterministic_algorithms(True)`` (its tiling
  refuses ``deterministic == 1``), a ``RuntimeError`` as the op raises it.

Hardware limits are not modelled (dtypes, D=512, window 127, ratios 4/128, head counts), except
the KL op's at most 256 batches a call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpkv.backends import reference

UNSET: Any = object()
KL_MAX_BATCHES = 256  # sparse_lightning_indexer_kl_loss_grad on A2/A3: B in 1..256 (torch API doc)
CSA_BLOCK = 512  # sparse_flash_mla's arch22 CSA kernel gathers compressed rows 512 index slots at a time
STALE = -2  # _rows: a column whose row the kernel did not gather (its workspace holds an earlier row)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"cann_ops_transformer contract violated: {message}")


def check_cu(name: str, cu: object, total: int, device: torch.device) -> Tensor:
    """1-D int32 ``[B + 1]`` on ``device``, leading 0, non-decreasing, ending at ``total``; returns its int64 lengths."""
    require(isinstance(cu, Tensor), f"{name} must be a tensor, got {type(cu).__name__}")
    assert isinstance(cu, Tensor)
    require(cu.dtype == torch.int32 and cu.dim() == 1 and cu.numel() >= 2, f"{name} must be int32 [B + 1], got {cu.dtype} {tuple(cu.shape)}")
    require(cu.device == device, f"{name} must be on {device}")
    require(int(cu[0]) == 0, f"{name}[0] must be 0, got {int(cu[0])}")
    require(bool((cu.diff() >= 0).all()), f"{name} must be non-decreasing")
    require(int(cu[-1]) == total, f"{name}[-1] must be the token count {total}, got {int(cu[-1])}")
    return cu.long().diff()


def _token(kind: str, store: dict[int, tuple[str, dict[str, Any]]], args: dict[str, Any], size: int, device: Any) -> Tensor:
    key = len(store) + 1
    store[key] = (kind, {k: v.clone() if isinstance(v, Tensor) else v for k, v in args.items()})
    return torch.full((size,), key, dtype=torch.int32, device=device)


def _same(a: object, b: object) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return type(a) is type(b) and a == b


class StandInCannOps:
    """The six ops cpkv calls (module doc). ``calls``: the names, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._metadata: dict[int, tuple[str, dict[str, Any]]] = {}

    # ------------------------------------------------------------------ sparse_flash_mla (+ grad)

    def _attention_metadata(self, kind: str, num_heads_q: int, num_heads_kv: int, head_dim: int, **kw: Any) -> Tensor:
        self.calls.append(f"{kind}_metadata")
        for name in ("num_heads_q", "num_heads_kv", "head_dim"):
            require(type(locals()[name]) is int, f"{kind}_metadata: {name} must be an int")
        args = {"num_heads_q": num_heads_q, "num_heads_kv": num_heads_kv, "head_dim": head_dim, **kw}
        device = kw["cu_seqlens_q"].device if isinstance(kw.get("cu_seqlens_q"), Tensor) else "cpu"
        return _token(kind, self._metadata, args, 1024, device)

    def sparse_flash_mla_metadata(  # the documented signature and defaults
        self, num_heads_q: int, num_heads_kv: int, head_dim: int, *, cu_seqlens_q: Tensor | None = None,
        cu_seqlens_ori_kv: Tensor | None = None, cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
        seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None, cmp_residual_kv: Tensor | None = None,
        ori_topk_length: Tensor | None = None, cmp_topk_length: Tensor | None = None, batch_size: int = 0,
        max_seqlen_q: int = 0, max_seqlen_ori_kv: int = 0, max_seqlen_cmp_kv: int = 0, ori_topk: int = 0, cmp_topk: int = 0,
        cmp_ratio: int = 1, ori_mask_mode: int = 0, cmp_mask_mode: int = 0, ori_win_left: int = -1, ori_win_right: int = -1,
        layout_q: str = "BSND", layout_kv: str = "BSND", has_ori_kv: bool = True, has_cmp_kv: bool = True,
    ) -> Tensor:
        kw = dict(locals())
        del kw["self"], kw["num_heads_q"], kw["num_heads_kv"], kw["head_dim"]
        return self._attention_metadata("sparse_flash_mla", num_heads_q, num_heads_kv, head_dim, **kw)

    def sparse_flash_mla_grad_metadata(
        self, num_heads_q: int, num_heads_kv: int, head_dim: int, *, cu_seqlens_q: Tensor | None = None,
        cu_seqlens_ori_kv: Tensor | None = None, cu_seqlens_cmp_kv: Tensor | None = None, seqused_q: Tensor | None = None,
        seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None, cmp_residual_kv: Tensor | None = None,
        ori_topk_length: Tensor | None = None, cmp_topk_length: Tensor | None = None, batch_size: int | None = None,
        max_seqlen_q: int | None = None, max_seqlen_ori_kv: int | None = None, max_seqlen_cmp_kv: int | None = None,
        ori_topk: int | None = None, cmp_topk: int | None = None, cmp_ratio: int | None = None, ori_mask_mode: int = 0,
        cmp_mask_mode: int = 0, ori_win_left: int = -1, ori_win_right: int = -1, layout_q: str = "BSND",
        layout_kv: str = "BSND", has_ori_kv: bool = True, has_cmp_kv: bool = True,
    ) -> Tensor:
        kw = dict(locals())
        del kw["self"], kw["num_heads_q"], kw["num_heads_kv"], kw["head_dim"]
        return self._attention_metadata("sparse_flash_mla_grad", num_heads_q, num_heads_kv, head_dim, **kw)

    def _check_attention(self, kind: str, q: Tensor, kw: dict[str, Any]) -> dict[str, Any]:
        """Schema of a main or grad call; returns the parsed batch structure."""
        ori_kv, cmp_kv, indices = kw["ori_kv"], kw["cmp_kv"], kw["cmp_sparse_indices"]
        require((kw["layout_q"], kw["layout_kv"]) == ("TND", "TND"), f"layouts must be TND, got {kw['layout_q']!r}, {kw['layout_kv']!r}")
        require(q.dim() == 3, "q must be TND [T1, N1, D]")
        t1, heads, dim = q.shape
        require(isinstance(ori_kv, Tensor) and ori_kv.dim() == 3 and ori_kv.shape[1:] == (1, dim), "ori_kv must be [T2, 1, D]")
        require(ori_kv.dtype == q.dtype, "ori_kv must have q's dtype")
        for name in ("ori_sparse_indices", "ori_block_table", "cmp_block_table", "seqused_q", "seqused_ori_kv",
                     "seqused_cmp_kv", "ori_topk_length", "cmp_topk_length"):
            require(kw.get(name) is None, f"{name} must be None (not used on TND without paging; A2/A3 reject several)")
        require(isinstance(kw["softmax_scale"], float), "softmax_scale must be an explicit float (the default is 1.0)")
        ratio = kw["cmp_ratio"]
        require(type(ratio) is int and 1 <= ratio <= 128, f"cmp_ratio must be an int in 1..128, got {ratio!r}")
        require(kw["ori_mask_mode"] in (0, 3, 4) and kw["cmp_mask_mode"] in (0, 3), "mask modes: ori 0/3/4, cmp 0/3")
        for name in ("ori_win_left", "ori_win_right"):
            require(type(kw[name]) is int and kw[name] >= -1, f"{name} must be -1 or >= 0")
        sinks = kw["sinks"]
        require(isinstance(sinks, Tensor) and sinks.dtype == torch.float32 and tuple(sinks.shape) == (heads,), "sinks: fp32 [N1], required")
        lens_q = check_cu("cu_seqlens_q", kw["cu_seqlens_q"], t1, q.device)
        lens_ori = check_cu("cu_seqlens_ori_kv", kw["cu_seqlens_ori_kv"], ori_kv.shape[0], q.device)
        batch = lens_q.numel()
        require(lens_ori.numel() == batch, "cu_seqlens_ori_kv must have B + 1 entries like cu_seqlens_q")
        parsed: dict[str, Any] = {"lens_q": lens_q, "lens_ori": lens_ori, "lens_cmp": torch.zeros_like(lens_q), "residual": None}
        residual = kw["cmp_residual_kv"]
        if cmp_kv is None:
            require(indices is None and kw["cu_seqlens_cmp_kv"] is None and residual is None, "SWA: no cmp inputs")
        else:
            require(cmp_kv.dim() == 3 and cmp_kv.shape[1:] == (1, dim) and cmp_kv.dtype == q.dtype, "cmp_kv must be [T3, 1, D] in q's dtype")
            lens_cmp = check_cu("cu_seqlens_cmp_kv", kw["cu_seqlens_cmp_kv"], cmp_kv.shape[0], q.device)
            require(lens_cmp.numel() == batch, "cu_seqlens_cmp_kv must have B + 1 entries like cu_seqlens_q")
            parsed["lens_cmp"] = lens_cmp
            if kw["cmp_mask_mode"] == 3 and ratio != 1:
                require(isinstance(residual, Tensor), "cmp_residual_kv is required with cmp_kv, cmp_mask_mode=3 and cmp_ratio != 1")
                assert isinstance(residual, Tensor)
                require(residual.dtype == torch.int32 and tuple(residual.shape) == (batch,), "cmp_residual_kv must be int32 [B]")
                require(bool(((residual >= 0) & (residual < ratio)).all()), "cmp_residual_kv must be in [0, cmp_ratio)")
                parsed["residual"] = residual.long()
            else:
                require(residual is None, "cmp_residual_kv is not allowed with cmp_mask_mode=0 or cmp_ratio=1")
        if indices is not None:
            require(cmp_kv is not None, "cmp_sparse_indices needs cmp_kv (CSA)")
            require(indices.dtype == torch.int32 and indices.dim() == 3 and indices.shape[:2] == (t1, 1), "cmp_sparse_indices must be int32 [T1, 1, K]")
            rows = indices[:, 0].long()
            invalid = rows < 0
            require(bool((rows >= -1).all()), "cmp_sparse_indices must be >= -1")
            require(bool((invalid[:, :-1] <= invalid[:, 1:]).all()), "cmp_sparse_indices: valid first, -1 padding last")
            seg = torch.repeat_interleave(torch.arange(batch, device=q.device), lens_q)
            require(bool((rows < parsed["lens_cmp"][seg][:, None]).all()), "cmp_sparse_indices must be relative to their batch's cmp_kv")
        self._check_metadata(kind, kw["metadata"], {
            "num_heads_q": heads, "num_heads_kv": 1, "head_dim": dim, "cu_seqlens_q": kw["cu_seqlens_q"],
            "cu_seqlens_ori_kv": kw["cu_seqlens_ori_kv"], "cu_seqlens_cmp_kv": kw["cu_seqlens_cmp_kv"],
            "cmp_residual_kv": residual, "batch_size": batch, "max_seqlen_q": int(lens_q.max()),
            "max_seqlen_ori_kv": int(lens_ori.max()), "max_seqlen_cmp_kv": int(parsed["lens_cmp"].max()), "ori_topk": 0,
            "cmp_topk": 0 if indices is None else int(indices.shape[-1]), "cmp_ratio": ratio,
            "ori_mask_mode": kw["ori_mask_mode"], "cmp_mask_mode": kw["cmp_mask_mode"], "ori_win_left": kw["ori_win_left"],
            "ori_win_right": kw["ori_win_right"], "layout_q": "TND", "layout_kv": "TND", "has_ori_kv": True,
            "has_cmp_kv": cmp_kv is not None,
        }, positive=("max_seqlen_q", "max_seqlen_ori_kv"))
        return parsed

    def _check_metadata(self, kind: str, metadata: object, expected: dict[str, Any], positive: tuple[str, ...]) -> None:
        require(isinstance(metadata, Tensor) and metadata.dtype == torch.int32 and metadata.dim() == 1, f"{kind}: metadata is required")
        assert isinstance(metadata, Tensor)
        recorded = self._metadata.get(int(metadata[0]))
        require(recorded is not None and recorded[0] == kind, f"{kind}: metadata must come from {kind}_metadata")
        assert recorded is not None
        for name, value in expected.items():
            got = recorded[1].get(name, UNSET)
            require(_same(got, value), f"{kind}_metadata's {name} must be the main call's {value!r}, got {got!r}")
        require(all(expected[n] > 0 for n in positive), f"{kind}_metadata: {', '.join(positive)} must be > 0")

    def _rows(self, q: Tensor, kw: dict[str, Any], parsed: dict[str, Any], reread: bool = False) -> Tensor:
        """``[T1, W + K]`` int64 rows of ``cat([ori_kv, cmp_kv])`` each query attends (documented masks), -1 padded."""
        lens_q, lens_ori, lens_cmp = parsed["lens_q"], parsed["lens_ori"], parsed["lens_cmp"]
        device = q.device
        seg = torch.repeat_interleave(torch.arange(lens_q.numel(), device=device), lens_q)
        start_q = (lens_q.cumsum(0) - lens_q)[seg]
        i = torch.arange(q.shape[0], device=device) - start_q
        s1, s2 = lens_q[seg], lens_ori[seg]
        thr = s2 - s1 + i + 1
        ori_start = (lens_ori.cumsum(0) - lens_ori)[seg]
        mode, left, right = kw["ori_mask_mode"], kw["ori_win_left"], kw["ori_win_right"]
        lo = torch.zeros_like(thr) if mode == 0 or left == -1 else (thr - left - 1).clamp(min=0)
        hi = s2 if mode == 0 or (mode == 4 and right == -1) else torch.minimum((thr + (right if mode == 4 else 0)).clamp(min=0), s2)
        width = int((hi - lo).max().clamp(min=0)) if q.shape[0] else 0
        slots = torch.arange(width, device=device)
        ori = torch.where(lo[:, None] + slots < hi[:, None], ori_start[:, None] + lo[:, None] + slots, -1)
        if kw["cmp_kv"] is None:
            return ori
        ratio, cmp_len = kw["cmp_ratio"], lens_cmp[seg]
        full = cmp_len * ratio + (parsed["residual"][seg] if parsed["residual"] is not None else 0)
        if kw["cmp_mask_mode"] == 3:
            cthr = torch.div(full - s1 + i + 1, ratio, rounding_mode="floor").clamp(min=0).minimum(cmp_len)
        else:
            cthr = cmp_len
        cmp_start = (lens_cmp.cumsum(0) - lens_cmp)[seg] + kw["ori_kv"].shape[0]
        indices = kw["cmp_sparse_indices"]
        if indices is None:  # HCA: every entry below the threshold
            slots = torch.arange(int(cthr.max()) if cthr.numel() else 0, device=device)
            cmp = torch.where(slots < cthr[:, None], cmp_start[:, None] + slots, -1)
        else:  # CSA: the listed entries among the first min(K, cthr) slots, up to the first -1, below the threshold
            rel = indices[:, 0].long()
            slots = torch.arange(rel.shape[1], device=device)
            if reread and q.shape[1] > 1:  # arch22 CSA kernel, H > 1: block b of 512 slots reads slots from v0S2Start =
                # 512 only for the second block when it is the last one, else 0: past 1024 the first 512 are read again
                blocks = torch.div(torch.minimum(cthr, torch.full_like(cthr, rel.shape[1])) + CSA_BLOCK - 1, CSA_BLOCK,
                                   rounding_mode="floor")
                block = torch.div(slots, CSA_BLOCK, rounding_mode="floor")
                straight = (block[None] == 0) | ((block[None] == 1) & (blocks[:, None] == 2))
                rel = rel.gather(1, torch.where(straight, slots[None], (slots % CSA_BLOCK)[None]).expand_as(rel))
            real = torch.minimum(cthr, torch.full_like(cthr, rel.shape[1]))  # the kernel's columns: min(K, cthr)
            first_pad = torch.where(rel < 0, slots, rel.shape[1]).min(dim=1).values
            keep = (slots < torch.minimum(real, first_pad)[:, None]) & (rel >= 0) & (rel < cthr[:, None])
            # ProcessVec0L stops gathering at the first -1 (and skips rows >= cthr): the columns left up to
            # min(K, cthr) hold stale rows, still in the softmax (a zero row here, index STALE)
            stale = slots < (real - keep.sum(1))[:, None]
            cmp = torch.cat([torch.where(keep, cmp_start[:, None] + rel, -1), torch.where(stale, STALE, -1)], dim=1)
        rows = torch.cat([ori, cmp], dim=1)
        total = kw["ori_kv"].shape[0] + kw["cmp_kv"].shape[0]
        return torch.where(rows == STALE, total, rows)  # the zero row appended after ori_kv and cmp_kv

    def sparse_flash_mla(
        self, q: Tensor, *, ori_kv: Tensor | None = None, cmp_kv: Tensor | None = None, ori_sparse_indices: Tensor | None = None,
        cmp_sparse_indices: Tensor | None = None, ori_block_table: Tensor | None = None, cmp_block_table: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None, cu_seqlens_cmp_kv: Tensor | None = None,
        seqused_q: Tensor | None = None, seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None,
        cmp_residual_kv: Tensor | None = None, ori_topk_length: Tensor | None = None, cmp_topk_length: Tensor | None = None,
        sinks: Tensor | None = None, metadata: Tensor | None = None, softmax_scale: float = UNSET, cmp_ratio: int = 1,
        ori_mask_mode: int = 4, cmp_mask_mode: int = 3, ori_win_left: int = -1, ori_win_right: int = -1,
        layout_q: str = "BSND", layout_kv: str = "BSND", topk_value_mode: int = 1, return_softmax_lse: bool = False,
    ) -> tuple[Tensor, Tensor]:
        kw = dict(locals())
        del kw["self"], kw["q"]
        self.calls.append("sparse_flash_mla")
        require(return_softmax_lse is True and topk_value_mode == 1, "return_softmax_lse=True (cpkv merges by it), topk_value_mode=1")
        parsed = self._check_attention("sparse_flash_mla", q, kw)
        assert ori_kv is not None and sinks is not None
        kv = ori_kv[:, 0] if cmp_kv is None else torch.cat([ori_kv, cmp_kv])[:, 0]
        rows = self._rows(q, kw, parsed, reread=True)
        kv = torch.cat([kv, kv.new_zeros(1, kv.shape[1])])  # row kv.shape[0]: a stale row (_rows)
        out, lse = reference.sparse_attention(q, kv, rows, d_v=q.shape[-1], scale=softmax_scale, sinks=sinks)
        return out, lse.float()[None]

    def sparse_flash_mla_grad(
        self, q: Tensor, dout: Tensor, attn_out: Tensor, softmax_lse: Tensor, *, ori_kv: Tensor | None = None,
        cmp_kv: Tensor | None = None, ori_sparse_indices: Tensor | None = None, cmp_sparse_indices: Tensor | None = None,
        cu_seqlens_q: Tensor | None = None, cu_seqlens_ori_kv: Tensor | None = None, cu_seqlens_cmp_kv: Tensor | None = None,
        seqused_q: Tensor | None = None, seqused_ori_kv: Tensor | None = None, seqused_cmp_kv: Tensor | None = None,
        cmp_residual_kv: Tensor | None = None, ori_topk_length: Tensor | None = None, cmp_topk_length: Tensor | None = None,
        sinks: Tensor | None = None, metadata: Tensor | None = None, softmax_scale: float | None = None,
        cmp_ratio: int | None = None, ori_mask_mode: int = 0, cmp_mask_mode: int = 0, ori_win_left: int = -1,
        ori_win_right: int = -1, layout_q: str = "BSND", layout_kv: str = "BSND",
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor | None, Tensor | None]:
        kw = dict(locals())
        del kw["self"], kw["q"], kw["dout"], kw["attn_out"], kw["softmax_lse"]
        self.calls.append("sparse_flash_mla_grad")
        if torch.are_deterministic_algorithms_enabled():  # the A2/A3 tiling: GetDeterministic() == 1 -> GRAPH_FAILED
            raise RuntimeError("sparse_flash_mla_grad tiling failed: SparseFlashMlaGrad not support deterministic yet")
        parsed = self._check_attention("sparse_flash_mla_grad", q, kw)
        require(dout.shape == q.shape == attn_out.shape and dout.dtype == attn_out.dtype == q.dtype, "dout, attn_out: q's shape and dtype")
        require(softmax_lse.dtype == torch.float32 and tuple(softmax_lse.shape) == (1, q.shape[0], q.shape[1]), "softmax_lse: fp32 [1, T1, N1]")
        assert ori_kv is not None and sinks is not None and softmax_scale is not None
        kv = (ori_kv if cmp_kv is None else torch.cat([ori_kv, cmp_kv]))[:, 0]
        rows = self._rows(q, kw, parsed)
        valid = rows >= 0
        keys = torch.cat([kv, kv.new_zeros(1, kv.shape[1])])[torch.where(valid, rows, kv.shape[0])]  # [T, K, D]
        lse = softmax_lse[0].to(q.dtype)
        probs = torch.where(valid[:, None], torch.exp(torch.einsum("thd,tkd->thk", q, keys) * softmax_scale - lse[..., None]), 0.0)
        row_dot = (dout * attn_out).sum(-1)  # [T, H]
        d_s = probs * (torch.einsum("thd,tkd->thk", dout, keys) - row_dot[..., None])
        d_q = torch.einsum("thk,tkd->thd", d_s, keys) * softmax_scale
        d_rows = torch.einsum("thk,thd->tkd", d_s, q) * softmax_scale + torch.einsum("thk,thd->tkd", probs, dout)
        d_kv = torch.zeros(kv.shape[0] + 1, kv.shape[1], dtype=kv.dtype, device=kv.device)
        d_kv.index_add_(0, torch.where(valid, rows, kv.shape[0]).flatten(), d_rows.flatten(0, 1))
        d_sinks = -(torch.exp(sinks.to(q.dtype) - lse) * row_dot).sum(0)
        d_ori, d_cmp = d_kv[: ori_kv.shape[0], None], None if cmp_kv is None else d_kv[ori_kv.shape[0] : -1, None]
        return d_q, d_ori, d_cmp, d_sinks.float(), None, None

    # ------------------------------------------------------------------ sparse_lightning_indexer_kl_loss_grad

    def sparse_lightning_indexer_kl_loss_grad_metadata(
        self, num_heads_q: int, num_heads_k: int, head_dim: int, *, cu_seqlens_q: Tensor | None = None,
        cu_seqlens_k: Tensor | None = None, seqused_q: Tensor | None = None, seqused_k: Tensor | None = None,
        cmp_residual_k: Tensor | None = None, batch_size: int | None = None, max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None, topk: int | None = None, layout_q: str | None = None, layout_k: str | None = None,
        mask_mode: int | None = None, cmp_ratio: int | None = None,
    ) -> Tensor:
        args = dict(locals())
        del args["self"]
        self.calls.append("sparse_lightning_indexer_kl_loss_grad_metadata")
        device = cu_seqlens_q.device if cu_seqlens_q is not None else "cpu"
        return _token("kl", self._metadata, args, 64, device)

    def sparse_lightning_indexer_kl_loss_grad(
        self, q: Tensor, k: Tensor, w: Tensor, sparse_indices: Tensor, attn_softmax_l1_norm: Tensor, *,
        cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None, seqused_q: Tensor | None = None,
        seqused_k: Tensor | None = None, cmp_residual_k: Tensor | None = None, metadata: Tensor | None = None,
        layout_q: str = "TND", layout_k: str = "TND", mask_mode: int = 3, cmp_ratio: int = 1,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        self.calls.append("sparse_lightning_indexer_kl_loss_grad")
        require((layout_q, layout_k) == ("TND", "TND"), "layouts must be TND")
        require(q.dim() == 3 and k.dim() == 3 and k.shape[1] == 1 and k.shape[2] == q.shape[2], "q [T1, N1, D], k [T2, 1, D]")
        require(k.dtype == q.dtype, "k must have q's dtype")
        require(w.dtype == torch.float32 and tuple(w.shape) == tuple(q.shape[:2]), "w: fp32 [T1, N1]")
        require(sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 3 and sparse_indices.shape[:2] == (q.shape[0], 1),
                "sparse_indices: int32 [T1, 1, K]")
        require(attn_softmax_l1_norm.dtype == torch.float32 and attn_softmax_l1_norm.shape == sparse_indices.shape,
                "attn_softmax_l1_norm: fp32, shaped like sparse_indices")
        require(seqused_q is None and seqused_k is None, "seqused_* unsupported on A2/A3")
        require(mask_mode in (0, 3) and type(cmp_ratio) is int and 1 <= cmp_ratio <= 128, "mask_mode 0/3, cmp_ratio 1..128")
        lens_q = check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
        lens_k = check_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
        require(lens_q.numel() == lens_k.numel(), "cu_seqlens_q and cu_seqlens_k: B + 1 entries each")
        needs_residual = mask_mode == 3 and cmp_ratio != 1
        require((cmp_residual_k is not None) == needs_residual, "cmp_residual_k iff mask_mode=3 and cmp_ratio != 1")
        self._check_metadata("kl", metadata, {
            "num_heads_q": q.shape[1], "num_heads_k": 1, "head_dim": q.shape[2], "cu_seqlens_q": cu_seqlens_q,
            "cu_seqlens_k": cu_seqlens_k, "cmp_residual_k": cmp_residual_k, "batch_size": lens_q.numel(),
            "max_seqlen_q": int(lens_q.max()), "max_seqlen_k": int(lens_k.max()), "topk": sparse_indices.shape[-1],
            "layout_q": "TND", "layout_k": "TND", "mask_mode": mask_mode, "cmp_ratio": cmp_ratio,
        }, positive=("max_seqlen_q", "max_seqlen_k"))
        require(lens_q.numel() <= KL_MAX_BATCHES, f"at most {KL_MAX_BATCHES} batches a call on A2/A3, got {lens_q.numel()}")
        seg = torch.repeat_interleave(torch.arange(lens_q.numel(), device=q.device), lens_q)
        rel = sparse_indices[:, 0].long()
        topk = rel.shape[1]
        require(bool((rel >= -1).all()) and bool((rel < lens_k[seg][:, None]).all()), "sparse_indices within their batch's keys")
        i = torch.arange(q.shape[0], device=q.device) - (lens_q.cumsum(0) - lens_q)[seg]
        if mask_mode == 3:  # GetS2SparseLen: (S2 * ratio + residual - S1 + i + 1) / ratio, C division
            full = lens_k[seg] * cmp_ratio + (cmp_residual_k.long()[seg] if cmp_residual_k is not None else 0)
            thr = torch.div(full - lens_q[seg] + i + 1, cmp_ratio, rounding_mode="trunc")
        else:  # mode 0: every key of the batch
            thr = lens_k[seg]
        live = thr > 0  # s2SparseLen <= 0: the row is skipped, its outputs stay 0
        real = torch.where(live, thr.clamp(max=topk).clamp(min=1), 0)  # kRealSize = max(1, min(K, s2SparseLen))
        slots = torch.arange(topk, device=q.device)
        in_real = slots < real[:, None]
        # MergeKv: slots in order, stopping at the first -1; indices >= s2SparseLen are skipped (the rest move up)
        first_neg = torch.where(in_real & (rel < 0), slots, topk).min(dim=1).values
        kept = in_real & (slots < first_neg[:, None]) & (rel >= 0) & (rel < thr[:, None])
        column = torch.where(kept, kept.long().cumsum(1) - 1, topk)  # where each kept slot's key lands
        base = (lens_k.cumsum(0) - lens_k)[seg]
        key_rows = torch.full((q.shape[0], topk + 1), k.shape[0], dtype=torch.long, device=q.device)
        key_rows.scatter_(1, column, torch.where(kept, rel + base[:, None], k.shape[0]))
        key_rows = key_rows[:, :topk]  # column c's key; columns < kRealSize past the gathered ones are stale (zero rows here)
        keys = torch.cat([k[:, 0], k.new_zeros(1, k.shape[2])])[key_rows]  # [T, K, D]
        dots = torch.einsum("thd,tkd->thk", q, keys)
        weights = w.to(q.dtype)
        scores = torch.einsum("th,thk->tk", weights, dots.relu()).masked_fill(~in_real, float("-inf"))
        pred = torch.where(in_real, torch.softmax(scores.masked_fill(~live[:, None], 0.0), -1), 0.0)  # no -1 mask
        p = torch.where(in_real, attn_softmax_l1_norm[:, 0].to(q.dtype), 0.0)  # CopyPFromInput: kRealSize columns
        d_scores = torch.where(in_real, pred * p.sum(-1, keepdim=True) - p, 0.0)
        d_w = torch.einsum("tk,thk->th", d_scores, dots.relu())
        d_dots = d_scores[:, None] * weights[..., None] * (dots > 0)
        d_q = torch.einsum("thk,tkd->thd", d_dots, keys)
        scatter = torch.where(in_real & (rel >= 0) & (rel < thr[:, None]), rel + base[:, None], k.shape[0])  # by topk slot
        d_k = torch.zeros(k.shape[0] + 1, k.shape[2], dtype=q.dtype, device=q.device)
        d_k.index_add_(0, scatter.flatten(), torch.einsum("thk,thd->tkd", d_dots, q).flatten(0, 1))
        return d_q, d_k[:-1, None], d_w.float(), pred.float()[:, None]
