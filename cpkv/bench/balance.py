"""Causal attention work per rank: contiguous vs per-document zigzag TND sharding.

Work is the number of (query, key) score elements a rank's kernel computes: for a segment
pair with ``Lq`` queries bottom-right aligned on ``Lkv`` keys, ``Lq * (Lkv - Lq) + Lq (Lq + 1) / 2``
(causal, no window). Counted from the real plans, so it is what the kernels would do.
"""

from __future__ import annotations

from torch import Tensor

from cpkv.plan.attention import plan_attention
from cpkv.plan.conventions import pad_documents


def causal_score_elements(cu_seqlens_q: Tensor, cu_seqlens_kv: Tensor) -> int:
    """Visible (query, key) pairs of bottom-right causal segment pairs."""
    lq, lkv = cu_seqlens_q.long().diff(), cu_seqlens_kv.long().diff()
    return int((lq * (lkv - lq) + lq * (lq + 1) // 2).sum())


def rank_work(cu: Tensor, cp: int) -> dict[str, list[int]]:
    """Per rank: score elements and kv rows fed to the kernel, both shardings (``cu`` already padded for zigzag)."""
    result: dict[str, list[int]] = {"contiguous": [], "zigzag": [], "contiguous_kv": [], "zigzag_kv": []}
    for rank in range(cp):
        contiguous = plan_attention(cu, cp, rank).segments
        zigzag = plan_attention(cu, cp, rank, layout="zigzag").segments
        result["contiguous"].append(causal_score_elements(contiguous.cu_seqlens_q, contiguous.cu_seqlens_kv))
        result["zigzag"].append(causal_score_elements(zigzag.cu_seqlens_q, zigzag.cu_seqlens_kv))
        result["contiguous_kv"].append(int(contiguous.cu_seqlens_kv[-1]))
        result["zigzag_kv"].append(int(zigzag.cu_seqlens_kv[-1]))
    return result


def pad_for_zigzag(cu: Tensor, cp: int) -> tuple[Tensor, int]:
    """``cu_seqlens`` with every document padded to a multiple of ``2 * cp`` (the total then
    divisible by ``cp``), and the number of padding tokens."""
    import torch

    padded = pad_documents(torch.zeros(int(cu[-1]), 1), cu, 2 * cp)
    return padded.cu_seqlens, int(padded.padding.sum())
