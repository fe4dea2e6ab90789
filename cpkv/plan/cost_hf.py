"""The dense work and attention shape of a Hugging Face decoder config: Llama, Qwen2/3 (dense or MoE), DeepSeek-V3.

:meth:`cpkv.plan.cost.CostModel.from_hf_config` reads these; the formulas follow the
modules transformers builds from the config (``models/llama``, ``models/qwen2``,
``models/qwen3``, ``models/qwen2_moe``, ``models/qwen3_moe``, ``models/deepseek_v3``), duck-typed
so that transformers need not be imported.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cpkv.plan.projection_macs import gqa_projection_macs, mla_projection_macs

__all__ = ["HFAttentionShape", "hf_attention_shape", "hf_dense_terms", "hf_moe_layers"]


class HFAttentionShape(NamedTuple):
    """What a query token's attention costs per key, and which layers are windowed.

    Attributes:
        heads: ``H``, query heads. key_dim, value_dim: ``D`` and ``d_v`` per head (MLA:
            ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim``).
        window: the sliding window in keys (own token included; 1 when no layer has one).
        windowed_layers, causal_layers: layers with and without the window.
    """

    heads: int
    key_dim: int
    value_dim: int
    window: int
    windowed_layers: int
    causal_layers: int


def _is_mla(config: Any) -> bool:
    return getattr(config, "kv_lora_rank", None) is not None


def hf_attention_shape(config: Any) -> HFAttentionShape:
    """The attention of every layer of ``config`` (duck-typed transformers ``PretrainedConfig``).

    Windowed layers: ``layer_types`` entries ``"sliding_attention"`` (Qwen2/3's
    ``use_sliding_window``, Gemma-like configs), else every layer when ``sliding_window`` is set
    and no ``layer_types`` exist (Mistral); each attends ``sliding_window`` keys (transformers'
    mask keeps ``q - W < k <= q``).
    """
    heads, layers = int(config.num_attention_heads), int(config.num_hidden_layers)
    if _is_mla(config):
        key_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        value_dim = int(config.v_head_dim)
    else:
        key_dim = value_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    window = getattr(config, "sliding_window", None) or 0
    types = getattr(config, "layer_types", None)
    if not window:
        windowed = 0
    elif types is not None:
        windowed = list(types)[:layers].count("sliding_attention")
    else:
        windowed = layers
    return HFAttentionShape(heads, key_dim, value_dim, int(window) if windowed else 1, windowed, layers - windowed)


def hf_moe_layers(config: Any) -> list[bool]:
    """Which layers of ``config`` hold a mixture of experts, as transformers builds them.

    DeepSeek-V3 (``n_routed_experts``): layers from ``first_k_dense_replace`` on. Qwen2/3-MoE
    (``num_experts``): layers not in ``mlp_only_layers`` with ``(i + 1) % decoder_sparse_step == 0``.
    Dense models: none.
    """
    layers = int(config.num_hidden_layers)
    if getattr(config, "n_routed_experts", None):
        first = int(getattr(config, "first_k_dense_replace", 0) or 0)
        return [i >= first for i in range(layers)]
    if getattr(config, "num_experts", None):
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        dense_only = set(getattr(config, "mlp_only_layers", None) or [])
        return [i not in dense_only and (i + 1) % step == 0 for i in range(layers)]
    return [False] * layers


def hf_dense_terms(config: Any) -> tuple[tuple[str, int], ...]:
    """Forward MACs per token of every dense term of a Hugging Face decoder ``config``, summed over the layers.

    With ``h`` hidden, ``H`` heads, ``L`` layers (``num_hidden_layers``), ``V`` vocab:

    * attention projections, GQA (Llama, Qwen): ``L * (h (H d + 2 G d) + H d h)`` (``d =
      head_dim``, ``G = num_key_value_heads``; biases add no MACs); MLA (DeepSeek-V3,
      ``kv_lora_rank``): ``L * (q + h (r_kv + d_pe) + r_kv H (d_qk + d_v) + H d_v h)`` with
      ``q = h r_q + r_q H (d_qk + d_pe)`` (``q_lora_rank``; ``h H (d_qk + d_pe)`` without one);
    * MLP (dense layers, gated: gate, up, down): ``3 h I`` (``intermediate_size``);
    * routed experts (MoE layers, :func:`hf_moe_layers`): ``k * 3 h I_e``
      (``num_experts_per_tok``, ``moe_intermediate_size``); shared experts: DeepSeek-V3
      ``3 h (S I_e)`` (``n_shared_experts``), Qwen2-MoE ``3 h I_s + h``
      (``shared_expert_intermediate_size`` and its sigmoid gate); router: ``h E``
      (``n_routed_experts`` or ``num_experts``);
    * head: ``h V``.
    """
    h, heads, layers = int(config.hidden_size), int(config.num_attention_heads), int(config.num_hidden_layers)
    if _is_mla(config):
        q_lora = getattr(config, "q_lora_rank", None)
        projections = mla_projection_macs(h, heads, int(config.qk_nope_head_dim), int(config.qk_rope_head_dim),
                                          int(config.v_head_dim), int(config.kv_lora_rank), None if q_lora is None else int(q_lora))
    else:
        projections = gqa_projection_macs(h, heads, int(getattr(config, "head_dim", None) or h // heads),
                                          int(getattr(config, "num_key_value_heads", None) or heads))
    moe = hf_moe_layers(config)
    num_moe = sum(moe)
    dense_mlp = (layers - num_moe) * 3 * h * int(config.intermediate_size)
    routed = shared = router = 0
    if num_moe:
        expert = int(config.moe_intermediate_size)
        experts = int(getattr(config, "n_routed_experts", None) or config.num_experts)
        routed = num_moe * int(config.num_experts_per_tok) * 3 * h * expert
        router = num_moe * h * experts
        if getattr(config, "n_shared_experts", None):
            shared = num_moe * 3 * h * expert * int(config.n_shared_experts)
        elif getattr(config, "shared_expert_intermediate_size", None):
            shared = num_moe * (3 * h * int(config.shared_expert_intermediate_size) + h)
    return (("attention projections", layers * projections), ("mlp", dense_mlp), ("routed experts", routed),
            ("shared experts", shared), ("router", router), ("head", h * int(config.vocab_size)))
