"""The modeled cost of one token in a training step: the model's dense work plus its attention at position ``p``.

A CP step is as slow as its busiest rank, and a rank's time is all the work of its tokens.
:class:`CostModel` states it per token, in multiply-accumulates (MACs) of a training step
(forward and backward), as two parts (docs/semantics.md, "The cost model"):

* **dense** work, the same for every token: projections, compressors, the indexer's projections,
  the MoE's routed and shared experts, the router, hyper-connections and the head. One number
  per term, the forward MACs per token of that term summed over the layers
  (:attr:`CostModel.dense`), each from one formula over the model's shape
  (:func:`deepseek_v4_dense_terms`, :func:`v4_layer_dense_terms`, :func:`megatron_dense_terms`);
  a step costs ``1 + backward`` times the forward (``backward = 2``: the input and weight
  gradients are one GEMM each of the forward's size).
* **attention** work, growing with the document position ``p`` (0-based): every windowed layer
  attends ``min(W, p + 1)`` keys, a dense causal layer ``p + 1``, a CSA layer (ratio ``m``)
  also its top-k ``min(k, (p + 1) // m)`` entries and its indexer scores all ``(p + 1) // m``,
  an HCA layer (ratio ``m'``) attends all ``(p + 1) // m'`` entries. An attended key costs
  ``H * (D + d_v)`` forward MACs, a scored entry ``H_I * D_I``; a step costs
  ``1 + attention_backward`` times the forward (``2.5``: the backward of a fused attention
  recomputes the scores and runs four products, against the forward's two).

``token_costs(p) = (1 + attention_backward) * attention(p) + (1 + backward) * sum(dense) + per_token``.

The default :class:`CostModel` ``()`` is the whole DeepSeek-V4-Flash model (transformers'
``DeepseekV4Config()``): about 13.26 G forward MACs of dense work per token, 1.46 G of attention
at position 8K and 56 G at 1M. Build one for your model with :meth:`CostModel.from_deepseek_v4`
(a transformers ``DeepseekV4Config``), :meth:`CostModel.from_hf_config` (a transformers Llama,
Qwen2/3, Qwen-MoE or DeepSeek-V3 config), :meth:`CostModel.from_v4` (:class:`cpkv.v4.V4Config`
layers) or :meth:`CostModel.from_megatron` (a Megatron ``TransformerConfig``).
``plan_attention(layout="balanced")`` requires one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from cpkv.checks import check_int, check_int_dtype, check_tensor
from cpkv.plan.cost_hf import hf_attention_shape, hf_dense_terms
from cpkv.plan.projection_macs import gqa_projection_macs, mla_projection_macs

__all__ = ["CostModel", "DenseTerms", "deepseek_v4_dense_terms", "megatron_dense_terms", "v4_layer_dense_terms"]

DenseTerms = tuple[tuple[str, int], ...]
"""Named dense terms: ``((name, forward MACs per token summed over the layers), ...)``."""

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def deepseek_v4_dense_terms(config: Any) -> DenseTerms:
    """Forward MACs per token of every dense term of a transformers ``DeepseekV4Config`` (duck-typed).

    With ``h`` hidden, ``r_q`` ``q_lora_rank``, ``H`` heads of ``D``, ``g`` ``o_groups`` of
    ``r_o`` ``o_lora_rank``, ``H_I`` x ``D_I`` the indexer, ``n`` ``hc_mult``, ``k`` experts per
    token of ``I`` channels, ``S`` shared experts, ``E`` routed experts, ``V`` vocab, ``L``
    layers of which ``L_csa`` CSA and ``L_hca`` HCA (``config.layer_types``):

    * attention projections: ``L * (h r_q + r_q H D + h D + H D r_o + g r_o h)`` (``q_a``,
      ``q_b``, ``kv``, the grouped ``o_a``: ``g`` blocks of ``H D / g -> r_o``, and ``o_b``);
    * compressors: ``L_csa * 2 h (2 D) + L_hca * 2 h D`` (``kv_proj`` and ``gate_proj``; CSA's
      overlapping compressor is ``2 D`` wide);
    * indexer projections: ``L_csa * (2 h (2 D_I) + r_q H_I D_I + h H_I)`` (its compressor,
      ``q_b_proj``, ``weights_proj``);
    * routed experts: ``L * k * 3 h I`` (gate, up, down); shared experts: ``L * S * 3 h I``;
    * router: ``L * h E``;
    * hyper-connections: ``L * 2 ((2 + n) n * n h + n n h) + n n h`` (each block's mixing
      projection and stream product, the head's collapse);
    * head: ``h V``.
    """
    h, q_lora, heads, dim = (int(config.hidden_size), int(config.q_lora_rank), int(config.num_attention_heads),
                             int(config.head_dim))
    groups, o_lora = int(config.o_groups), int(config.o_lora_rank)
    ih, idim = int(config.index_n_heads), int(config.index_head_dim)
    n, experts, inter = int(config.hc_mult), int(config.num_experts_per_tok), int(config.moe_intermediate_size)
    types = list(config.layer_types)
    layers, csa, hca = len(types), types.count(CSA), types.count(HCA)
    return (
        ("attention projections", layers * (h * q_lora + q_lora * heads * dim + h * dim + heads * dim * o_lora + groups * o_lora * h)),
        ("compressors", csa * 2 * h * 2 * dim + hca * 2 * h * dim),
        ("indexer projections", csa * (2 * h * 2 * idim + q_lora * ih * idim + h * ih)),
        ("routed experts", layers * experts * 3 * h * inter),
        ("shared experts", layers * int(config.n_shared_experts) * 3 * h * inter),
        ("router", layers * h * int(config.n_routed_experts)),
        ("hyper-connections", layers * 2 * ((2 + n) * n * n * h + n * n * h) + n * n * h),
        ("head", h * int(config.vocab_size)),
    )


def v4_layer_dense_terms(config: Any, layers: int = 1) -> DenseTerms:
    """Forward MACs per token of ``layers`` :class:`cpkv.v4.V4Attention` layers of ``config`` (a ``V4Config``).

    With ``h`` hidden, ``H`` heads of ``D`` (``d_v = D - rope_dim``), ``H_I`` x ``D_I`` the
    indexer and ``w`` the compressor width (``2 D`` at ratio 4, the overlapping compressor,
    else ``D``; the indexer's ``2 D_I`` or ``D_I`` likewise):

    * attention projections: ``wq`` ``h H D`` + ``wkv`` ``h D`` + ``wo`` ``H d_v h``;
    * compressors (compressing modes): ``wkv`` and ``wgate``, ``2 h w``;
    * indexer projections (INDEXER mode): ``wq`` ``h H_I D_I`` + ``wweights`` ``h H_I`` + its
      compressor ``2 h w_I``.
    """
    h, heads, dim, ratio = int(config.hidden), int(config.heads), int(config.head_dim), int(config.compress_ratio)
    mode = config.mode
    overlap = 2 if ratio == 4 else 1
    compressors = 2 * h * dim * overlap if mode.compresses else 0
    indexer = 0
    if mode.name == "INDEXER":
        ih, idim = int(config.index_heads), int(config.index_head_dim)
        indexer = h * ih * idim + h * ih + 2 * h * idim * overlap
    projections = h * heads * dim + h * dim + heads * int(config.d_v) * h
    return (("attention projections", layers * projections), ("compressors", layers * compressors),
            ("indexer projections", layers * indexer))


def _moe_layers(config: Any) -> list[bool]:
    """Which of Megatron's layers are MoE: ``moe_layer_freq`` an int ``k`` (every ``k``-th from 0) or a 0/1 list."""
    layers = int(config.num_layers)
    if not getattr(config, "num_moe_experts", None):
        return [False] * layers
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    return [bool(f) for f in list(freq)[:layers]]


def megatron_dense_terms(config: Any, vocab_size: int = 0) -> DenseTerms:
    """Forward MACs per token of every dense term of a Megatron ``TransformerConfig`` (duck-typed).

    With ``h`` hidden, ``H`` heads, ``L`` layers:

    * attention projections, GQA: ``L * (h (H d + 2 G d) + H d h)`` (``d = kv_channels``,
      ``G = num_query_groups``); MLA (``multi_latent_attention``): ``L * (q + h (r_kv + d_pe) +
      r_kv H (d_qk + d_v) + H d_v h)`` with ``q = h r_q + r_q H (d_qk + d_pe)`` (``q_lora_rank``
      ``r_q``; ``h H (d_qk + d_pe)`` without one);
    * MLP (dense layers): ``c h F`` (``c = 3`` with ``gated_linear_unit``, else 2, ``F =
      ffn_hidden_size``); routed experts (MoE layers, ``moe_layer_freq``): ``k c h F_e``
      (``moe_router_topk``, ``moe_ffn_hidden_size``); shared experts: ``c h F_s``
      (``moe_shared_expert_intermediate_size``); router: ``h E``;
    * head: ``h V`` (``vocab_size``: the model's, not in the config; 0 leaves it out).
    """
    check_int("vocab_size", vocab_size, minimum=0)
    h, heads, layers = int(config.hidden_size), int(config.num_attention_heads), int(config.num_layers)
    if getattr(config, "multi_latent_attention", False):
        q_lora = getattr(config, "q_lora_rank", None)
        projections = mla_projection_macs(h, heads, int(config.qk_head_dim), int(config.qk_pos_emb_head_dim),
                                          int(config.v_head_dim), int(config.kv_lora_rank), None if q_lora is None else int(q_lora))
    else:
        projections = gqa_projection_macs(h, heads, int(config.kv_channels or h // heads), int(config.num_query_groups or heads))
    c = 3 if getattr(config, "gated_linear_unit", False) else 2
    moe = _moe_layers(config)
    num_moe = sum(moe)
    dense_mlp = (layers - num_moe) * c * h * int(config.ffn_hidden_size or 4 * h)
    routed = shared = router = 0
    if num_moe:
        expert = int(getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size)
        routed = num_moe * int(config.moe_router_topk) * c * h * expert
        shared = num_moe * c * h * int(getattr(config, "moe_shared_expert_intermediate_size", None) or 0)
        router = num_moe * h * int(config.num_moe_experts)
    return (("attention projections", layers * projections), ("mlp", dense_mlp), ("routed experts", routed),
            ("shared experts", shared), ("router", router), ("head", h * vocab_size))


_FLASH: dict[str, Any] = dict(  # transformers' DeepseekV4Config() defaults (DeepSeek-V4-Flash)
    hidden_size=4096, q_lora_rank=1024, num_attention_heads=64, head_dim=512, o_groups=8, o_lora_rank=1024,
    index_n_heads=64, index_head_dim=128, hc_mult=4, num_experts_per_tok=6, moe_intermediate_size=2048,
    n_shared_experts=1, n_routed_experts=256, vocab_size=129280,
    layer_types=[HCA, HCA] + [CSA if i % 2 else HCA for i in range(41)],
)


class _Shape:
    """Attribute access to a dict (the V4-Flash defaults, without importing transformers)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


FLASH_DENSE: DenseTerms = deepseek_v4_dense_terms(_Shape(_FLASH))
"""V4-Flash's dense terms (:data:`_FLASH`, transformers' ``DeepseekV4Config()`` defaults)."""


def _factor(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"CostModel.{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"CostModel.{name} must be finite and >= 0, got {value}")
    return float(value)


@dataclass(frozen=True)
class CostModel:
    """Modeled cost (MACs of a training step) of one token at document position ``p`` in a whole model.

    Defaults are DeepSeek-V4-Flash, transformers' ``DeepseekV4Config()``
    (``models/deepseek_v4/configuration_deepseek_v4.py``): ``num_attention_heads`` 64,
    ``head_dim`` 512 (one shared kv head, so values are the same 512-dim rows: ``value_dim``
    512), ``sliding_window`` 128, ``index_topk`` 512, ``index_n_heads`` 64, ``index_head_dim``
    128, ``compress_rates`` 4 (CSA) and 128 (HCA), ``num_hidden_layers`` 43 whose default
    ``layer_types`` count 0 sliding-only, 20 CSA and 23 HCA layers, and its dense terms
    (:func:`deepseek_v4_dense_terms`: 13.26 G forward MACs per token).

    ``attention(p) = H*(D + d_v) * (L_w * min(W, p+1) + L_c * (p+1) + L_csa * min(k, (p+1)//m_csa)
    + L_hca * (p+1)//m_hca) + H_I*D_I * L_csa * (p+1)//m_csa``, with ``L_w = swa_layers +
    csa_layers + hca_layers`` (every V4 layer attends its window) and ``L_c = causal_layers``;
    ``token_costs(p) = (1 + attention_backward) * attention(p) + (1 + backward) * dense_macs + per_token``.

    Attributes:
        heads, head_dim, value_dim: ``H``, ``D``, ``d_v`` of the attention.
        window: ``W``, the sliding window (own token included).
        index_topk: ``k``, entries a CSA query attends. index_heads, index_head_dim: ``H_I``, ``D_I``.
        csa_ratio, hca_ratio: compress ratios of the CSA and HCA layers.
        swa_layers, csa_layers, hca_layers: layers of each kind (sliding-only, CSA, HCA).
        causal_layers: dense causal layers (no window: ``p + 1`` keys; Megatron without
            ``window_size``).
        dense: the dense terms, ``((name, forward MACs per token over all layers), ...)``.
        backward: backward MACs per forward MAC of the dense work (2).
        attention_backward: backward MACs per forward MAC of the attention (2.5).
        per_token: any other position-independent cost of a token, already per step (0).

    Raises:
        TypeError: a field of the wrong type. ValueError: a negative count, a zero dimension,
            a ratio below 2, a negative or non-finite factor or ``per_token``, a negative dense
            term, a model that costs nothing.
    """

    heads: int = 64
    head_dim: int = 512
    value_dim: int = 512
    window: int = 128
    index_topk: int = 512
    index_heads: int = 64
    index_head_dim: int = 128
    csa_ratio: int = 4
    hca_ratio: int = 128
    swa_layers: int = 0
    csa_layers: int = 20
    hca_layers: int = 23
    causal_layers: int = 0
    dense: DenseTerms = FLASH_DENSE
    backward: float = 2.0
    attention_backward: float = 2.5
    per_token: float = 0.0

    def __post_init__(self) -> None:
        minimum = {"csa_ratio": 2, "hca_ratio": 2, "window": 1, "heads": 1, "head_dim": 1, "value_dim": 1,
                   "index_heads": 1, "index_head_dim": 1}
        floats = ("backward", "attention_backward", "per_token")
        for field in fields(self):
            if field.name not in (*floats, "dense"):
                check_int(f"CostModel.{field.name}", getattr(self, field.name), minimum=minimum.get(field.name, 0))
        for name in floats:
            _factor(name, getattr(self, name))
        if not isinstance(self.dense, tuple) or not all(
            isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], str) for t in self.dense
        ):
            raise TypeError(f"CostModel.dense must be a tuple of (name, MACs) pairs, got {self.dense!r}")
        for name, macs in self.dense:
            check_int(f"CostModel.dense[{name!r}]", macs, minimum=0)
        if self.attention_layers == 0 and self.dense_macs == 0 and self.per_token == 0:
            raise ValueError("CostModel must cost something: no layers, no dense work and per_token 0")

    @classmethod
    def from_deepseek_v4(cls, config: Any, *, backward: float = 2.0, attention_backward: float = 2.5) -> CostModel:
        """The whole model of a transformers ``DeepseekV4Config`` (or any object with its fields).

        Reads ``hidden_size``, ``q_lora_rank``, ``o_lora_rank``, ``o_groups``,
        ``num_attention_heads``, ``head_dim``, ``index_n_heads``, ``index_head_dim``,
        ``index_topk``, ``sliding_window``, ``compress_rates``, ``layer_types``, ``hc_mult``,
        ``num_experts_per_tok``, ``n_shared_experts``, ``n_routed_experts``,
        ``moe_intermediate_size`` and ``vocab_size`` (:func:`deepseek_v4_dense_terms`).
        """
        types, rates = list(config.layer_types), dict(config.compress_rates)
        return cls(
            heads=int(config.num_attention_heads), head_dim=int(config.head_dim), value_dim=int(config.head_dim),
            window=int(config.sliding_window), index_topk=int(config.index_topk), index_heads=int(config.index_n_heads),
            index_head_dim=int(config.index_head_dim), csa_ratio=int(rates.get(CSA, 4)), hca_ratio=int(rates.get(HCA, 128)),
            swa_layers=types.count(SLIDING), csa_layers=types.count(CSA), hca_layers=types.count(HCA),
            dense=deepseek_v4_dense_terms(config), backward=backward, attention_backward=attention_backward,
        )

    @classmethod
    def from_v4(cls, configs: Any | Sequence[Any], *, backward: float = 2.0, attention_backward: float = 2.5) -> CostModel:
        """A stack of :class:`cpkv.v4.V4Attention` layers, one :class:`cpkv.v4.V4Config` per layer (or one for all).

        The layers must share heads, head and indexer dims, window and top-k (one attention
        shape); their kinds and ratios set the layer counts (:func:`v4_layer_dense_terms`).

        Raises:
            ValueError: no layer, layers of different shapes, two CSA or two HCA ratios.
        """
        layers: list[Any] = list(configs) if isinstance(configs, (list, tuple)) else [configs]
        if not layers:
            raise ValueError("configs must hold at least one V4Config")
        first = layers[0]
        shape = ("heads", "head_dim", "d_v", "topk", "index_heads", "index_head_dim")
        if any(tuple(getattr(c, a) for a in shape) != tuple(getattr(first, a) for a in shape) for c in layers):
            raise ValueError(f"every V4Config must share {shape} (one attention shape)")
        windows = {c.window for c in layers if c.window is not None}
        if len(windows) > 1:
            raise ValueError(f"every windowed V4Config must share its window, got {sorted(windows)}")
        counts = {"swa": 0, "causal": 0, "csa": 0, "hca": 0}
        ratios: dict[str, set[int]] = {"csa": set(), "hca": set()}
        for c in layers:
            kind = {"INDEXER": "csa", "COMPRESSOR_ONLY": "hca"}.get(c.mode.name, "swa" if c.window is not None else "causal")
            counts[kind] += 1
            if kind in ratios:
                ratios[kind].add(int(c.compress_ratio))
        if len(ratios["csa"]) > 1 or len(ratios["hca"]) > 1:
            raise ValueError(f"the layers must share one CSA and one HCA ratio, got {ratios}")
        terms: dict[str, int] = {}
        for c in layers:
            for name, macs in v4_layer_dense_terms(c):
                terms[name] = terms.get(name, 0) + macs
        return cls(
            heads=int(first.heads), head_dim=int(first.head_dim), value_dim=int(first.d_v),
            window=windows.pop() if windows else 1, index_topk=int(first.topk), index_heads=int(first.index_heads),
            index_head_dim=int(first.index_head_dim), csa_ratio=min(ratios["csa"], default=4),
            hca_ratio=min(ratios["hca"], default=128), swa_layers=counts["swa"], csa_layers=counts["csa"],
            hca_layers=counts["hca"], causal_layers=counts["causal"], dense=tuple(terms.items()), backward=backward,
            attention_backward=attention_backward,
        )

    @classmethod
    def from_hf_config(cls, config: Any, *, backward: float = 2.0, attention_backward: float = 2.5) -> CostModel:
        """The whole model of a Hugging Face decoder config: dense or MoE, GQA or MLA attention.

        Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE (GQA: ``num_key_value_heads``,
        ``head_dim``) and DeepSeek-V3 (MLA: ``kv_lora_rank``, ``q_lora_rank``,
        ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) configs, or any object with
        their fields (:func:`cpkv.plan.cost_hf.hf_dense_terms`,
        :func:`cpkv.plan.cost_hf.hf_attention_shape`). Sliding layers (``layer_types``,
        ``sliding_window``) attend ``min(W, p + 1)`` keys, the others ``p + 1``. A
        ``DeepseekV4Config`` takes :meth:`from_deepseek_v4`.

        Raises:
            ValueError: a ``DeepseekV4Config`` (it has compressed layers: use :meth:`from_deepseek_v4`).

        Example:
            >>> from transformers import LlamaConfig
            >>> model = CostModel.from_hf_config(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            ...                                              num_attention_heads=4, num_key_value_heads=2, vocab_size=100))
            >>> model.causal_layers, model.key_cost, model.dense_macs
            (2, 128, 80128)
        """
        if hasattr(config, "compress_rates"):
            raise ValueError("config is a DeepseekV4Config (compressed layers): use CostModel.from_deepseek_v4(config)")
        shape = hf_attention_shape(config)
        return cls(
            heads=shape.heads, head_dim=shape.key_dim, value_dim=shape.value_dim, window=shape.window,
            swa_layers=shape.windowed_layers, csa_layers=0, hca_layers=0, causal_layers=shape.causal_layers,
            dense=hf_dense_terms(config), backward=backward, attention_backward=attention_backward,
        )

    @classmethod
    def from_megatron(cls, config: Any, *, vocab_size: int = 0, backward: float = 2.0,
                      attention_backward: float = 2.5) -> CostModel:
        """A Megatron ``TransformerConfig`` (GQA or MLA attention, dense or MoE MLP, sliding window or causal).

        Windowed layers are those Megatron's ``is_layer_window_attention`` picks
        (``window_size``, ``window_attn_skip_freq``), each attending ``left + 1`` keys; the
        others are dense causal. ``vocab_size``: the head's (:func:`megatron_dense_terms`).
        """
        heads, layers = int(config.num_attention_heads), int(config.num_layers)
        if getattr(config, "multi_latent_attention", False):
            key_dim = int(config.qk_head_dim) + int(config.qk_pos_emb_head_dim)
            value_dim = int(config.v_head_dim)
        else:
            key_dim = value_dim = int(config.kv_channels or int(config.hidden_size) // heads)
        window_size = getattr(config, "window_size", None)
        skip = getattr(config, "window_attn_skip_freq", None)
        windowed = 0
        if window_size:
            for number in range(1, layers + 1):  # Megatron's is_layer_window_attention (1-based layer numbers)
                windowed += 1 if skip is None else (number % skip != 0 if isinstance(skip, int) else bool(skip[number - 1]))
        return cls(
            heads=heads, head_dim=key_dim, value_dim=value_dim, window=int(window_size[0]) + 1 if window_size else 1,
            swa_layers=windowed, csa_layers=0, hca_layers=0, causal_layers=layers - windowed,
            dense=megatron_dense_terms(config, vocab_size), backward=backward, attention_backward=attention_backward,
        )

    @property
    def attention_layers(self) -> int:
        """Layers with attention work: sliding, CSA, HCA and causal."""
        return self.swa_layers + self.csa_layers + self.hca_layers + self.causal_layers

    @property
    def dense_macs(self) -> int:
        """Forward MACs of a token's dense work: the sum of :attr:`dense`."""
        return sum(macs for _, macs in self.dense)

    @property
    def token_dense_cost(self) -> float:
        """Step cost of a token's position-independent work: ``(1 + backward) * dense_macs + per_token``."""
        return (1.0 + self.backward) * self.dense_macs + self.per_token

    @property
    def key_cost(self) -> int:
        """Forward MACs of one attended key or entry, ``H * (D + d_v)``."""
        return self.heads * (self.head_dim + self.value_dim)

    @property
    def index_cost(self) -> int:
        """Forward MACs of one entry scored by the indexer, ``H_I * D_I``."""
        return self.index_heads * self.index_head_dim

    def _combine(self, window: Tensor, causal: Tensor, topk: Tensor, scored: Tensor, hca: Tensor, tokens: Tensor) -> Tensor:
        windowed = self.swa_layers + self.csa_layers + self.hca_layers
        attended = windowed * window + self.causal_layers * causal + self.csa_layers * topk + self.hca_layers * hca  # int64
        forward = self.key_cost * attended.double() + (self.index_cost * self.csa_layers) * scored.double()
        return (1.0 + self.attention_backward) * forward + self.token_dense_cost * tokens.double()

    def attention_macs(self, positions: Tensor) -> Tensor:
        """Forward attention MACs of a query token at each document position (``attention(p)``), float64."""
        check_tensor("positions", positions)
        check_int_dtype("positions", positions)
        p1 = positions.to(torch.int64) + 1
        if p1.numel() and int(p1.min()) < 1:
            raise ValueError("positions must be >= 0 (0-based positions within documents)")
        csa = torch.div(p1, self.csa_ratio, rounding_mode="floor")
        windowed = self.swa_layers + self.csa_layers + self.hca_layers
        attended = (windowed * p1.clamp(max=self.window) + self.causal_layers * p1 + self.csa_layers * csa.clamp(max=self.index_topk)
                    + self.hca_layers * torch.div(p1, self.hca_ratio, rounding_mode="floor"))
        return self.key_cost * attended.double() + (self.index_cost * self.csa_layers) * csa.double()

    def token_costs(self, positions: Tensor) -> Tensor:
        """Modeled step cost of a query token at each document position.

        Args:
            positions: any shape, integer, ``>= 0``: 0-based positions within their documents
                (any device).

        Returns:
            float64, the shape and device of ``positions``.

        Raises:
            TypeError: not an integer tensor. ValueError: a negative position.
        """
        return (1.0 + self.attention_backward) * self.attention_macs(positions) + self.token_dense_cost

    def prefix_costs(self, counts: Tensor) -> Tensor:
        """Modeled cost of the first ``n`` tokens of a document (positions ``0..n-1``), in closed form.

        ``prefix_costs(n) == token_costs(arange(n)).sum()`` (up to float64 rounding), without
        materialising the tokens.

        Args:
            counts: any shape, integer, ``>= 0`` (any device).

        Returns:
            float64, the shape and device of ``counts``.

        Raises:
            TypeError: not an integer tensor. ValueError: a negative count.
        """
        check_tensor("counts", counts)
        check_int_dtype("counts", counts)
        n = counts.to(torch.int64)
        if n.numel() and int(n.min()) < 0:
            raise ValueError("counts must be >= 0 (tokens of a document prefix)")
        return self.prefix(n)

    def prefix(self, n: Tensor) -> Tensor:
        """:meth:`prefix_costs` of an int64 tensor, unchecked (the partitioners' inner loop)."""
        w = self.window
        window = torch.where(n <= w, n * (n + 1) // 2, w * (w + 1) // 2 + w * (n - w))
        capped = (self.csa_ratio * self.index_topk - 1)  # from j = m*k on, floor(j / m) >= k
        topk = floor_sum(n.clamp(max=max(capped, 0)), self.csa_ratio) + self.index_topk * (n - capped).clamp(min=0)
        return self._combine(window, n * (n + 1) // 2, topk, floor_sum(n, self.csa_ratio), floor_sum(n, self.hca_ratio), n)


def floor_sum(n: Tensor, m: int) -> Tensor:
    """``sum_{j=1..n} floor(j / m)`` (int64): ``m * a(a-1)/2 + a(n - a*m + 1)``, ``a = n // m``."""
    a = torch.div(n, m, rounding_mode="floor")
    return m * (a * (a - 1) // 2) + a * (n - a * m + 1)
