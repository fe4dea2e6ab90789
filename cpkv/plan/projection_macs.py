"""Forward MACs per token of one layer's attention projections, GQA or MLA (shared by every config reader of :mod:`cpkv.plan.cost`)."""

from __future__ import annotations

__all__ = ["gqa_projection_macs", "mla_projection_macs"]


def gqa_projection_macs(hidden: int, heads: int, head_dim: int, kv_heads: int) -> int:
    """``h (H d + 2 G d) + H d h``: the q, k, v and output projections of ``H`` query over ``G`` kv heads of ``d``."""
    return hidden * (heads * head_dim + 2 * kv_heads * head_dim) + heads * head_dim * hidden


def mla_projection_macs(hidden: int, heads: int, qk_dim: int, rope_dim: int, v_dim: int, kv_lora_rank: int,
                        q_lora_rank: int | None) -> int:
    """``q + h (r_kv + d_pe) + r_kv H (d_qk + d_v) + H d_v h``, ``q = h r_q + r_q H (d_qk + d_pe)`` (``h H (d_qk + d_pe)`` without ``r_q``).

    Multi-latent attention: the query (through a LoRA of rank ``r_q`` if any), the kv down
    projection with the shared rotary key, the kv up projection and the output projection.
    """
    q_width = heads * (qk_dim + rope_dim)
    q = hidden * q_width if q_lora_rank is None else hidden * q_lora_rank + q_lora_rank * q_width
    return q + hidden * (kv_lora_rank + rope_dim) + kv_lora_rank * heads * (qk_dim + v_dim) + heads * v_dim * hidden
