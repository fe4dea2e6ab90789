"""Hugging Face DeepSeek-V4 attention under CP (``pip install 'cpkv[transformers]'``).

:func:`deepseek_v4_attention_forward` runs a ``transformers`` ``DeepseekV4Attention`` (any of
its three layer types: ``sliding_attention``, ``compressed_sparse_attention`` (CSA, with the
lightning indexer) and ``heavily_compressed_attention`` (HCA)) on this rank's shard of a
packed batch through :func:`cpkv.attention.attention_forward`, with the module's own
parameters. The module's compressor and indexer become a :class:`~cpkv.attention.CompressorFn`
and an :class:`~cpkv.attention.IndexerFn` that reproduce its math on cpkv's block plans, so
every entry is computed once by the rank that owns its block (``exchange="need"``) or on the
gathered prefix (``"allgather"``), including CSA blocks whose previous block lives on an
earlier rank.

Numerics: the module's casts to float32 (its RMSNorms, RoPE, the compressors' gate softmax)
are done here in ``promote_types(dtype, float32)``: the same as Hugging Face for bf16/fp16/fp32
modules, float64 throughout for a float64 module. The semantic differences from Hugging Face
(top-k tie order, the optional indexer loss) are in docs/semantics.md, "Hugging Face
DeepSeek-V4". ``transformers`` is imported lazily, only for a sliding layer without a given
``rotary_emb``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, TypedDict

import torch
from torch import Tensor

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.status import StepStatus
from cpkv.backends.base import AttentionBackend, BackendName
from cpkv.checks import check_ndim, check_tensor
from cpkv.collectives import Group
from cpkv.compress_mode import LayerCompressMode
from cpkv.integrations.hf_v4_forms import check_deepseek_v4_forms, rms_norm_eps
from cpkv.plan.cost import CostModel
from cpkv.plan.attention import AttentionPlan
from cpkv.plan.segments import CompressedPlan
from cpkv.v4.norms import unweighted_rms_norm
from cpkv.v4.rope import rotate_tail

__all__ = [
    "DeepseekV4AttentionOutput",
    "DeepseekV4Compressor",
    "DeepseekV4Indexer",
    "DeepseekV4PlanOptions",
    "deepseek_v4_attention",
    "deepseek_v4_attention_forward",
    "deepseek_v4_plan_options",
    "deepseek_v4_spec",
]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_DYNAMIC_ROPE = ("dynamic", "longrope")  # inv_freq changes with the sequence length


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where Hugging Face computes in float32: float32, or float64 for float64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``DeepseekV4RMSNorm`` (``weight``) / ``DeepseekV4UnweightedRMSNorm`` (``None``) in the compute dtype."""
    if weight is None:
        return unweighted_rms_norm(x, eps)
    xc = x.to(_compute_dtype(x.dtype))
    normed = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * normed).to(x.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class _Rope:
    """One rope type (``"main"`` / ``"compress"``) of a ``DeepseekV4RotaryEmbedding``: interleaved pairs, trailing channels."""

    inv_freq: Tensor
    scaling: float

    @classmethod
    def of(cls, rotary_emb: Any, rope_type: str) -> _Rope:
        kind = rotary_emb.rope_type[rope_type]
        if kind in _DYNAMIC_ROPE:
            raise NotImplementedError(f"rope_type {kind!r} ({rope_type} rope) depends on the sequence length; use a static one")
        return cls(getattr(rotary_emb, f"{rope_type}_inv_freq"), float(getattr(rotary_emb, f"{rope_type}_attention_scaling")))

    def __call__(self, x: Tensor, positions: Tensor, *, inverse: bool = False) -> Tensor:
        """Rotate the last ``2 * len(inv_freq)`` channels of ``x`` ``[N, D]`` or ``[N, H, D]`` by ``positions`` ``[N]``."""
        c = _compute_dtype(x.dtype)
        freqs = positions.to(device=x.device, dtype=c)[:, None] * self.inv_freq.to(device=x.device, dtype=c)
        # Hugging Face rounds cos and sin to x's dtype before rotating in the compute dtype
        cos, sin = ((f * self.scaling).to(x.dtype).to(c) for f in (freqs.cos(), freqs.sin()))
        return rotate_tail(x, cos, -sin if inverse else sin, interleaved=True)


class _Pooler:
    """The gated pooling of a DeepSeek-V4 compressor (its ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``)."""

    def __init__(self, module: Any, ratio: int, head_dim: int, rope: _Rope) -> None:
        self.module, self.ratio, self.head_dim, self.rope = module, ratio, head_dim, rope
        self.overlap = module.kv_proj.out_features == 2 * head_dim
        self.input_dim = int(module.kv_proj.in_features)

    def __call__(self, x: Tensor, plan: CompressedPlan) -> Tensor | None:
        """Entries ``[N_c, head_dim]`` of the blocks of ``plan`` in ``x`` ``[N_in, hidden]``, or ``None``."""
        if plan.ratio != self.ratio:
            raise ValueError(f"plan.ratio ({plan.ratio}) must equal the compressor's ratio ({self.ratio})")
        if not torch.compiler.is_compiling() and plan.num_entries == 0:  # compiled: [0, head_dim], no branch
            return None
        m, hd = self.ratio, self.head_dim
        rows = plan.block_starts.to(x.device)[:, None] + torch.arange(m, device=x.device)  # [N_c, m]
        kv, gate = self.module.kv_proj(x), self.module.gate_proj(x)
        slot_kv, slot_gate = kv[rows], gate[rows] + self.module.position_bias  # [N_c, m, W]
        if self.overlap:  # entry j pools block j-1's first-half channels and block j's second half
            has_prev = (plan.entry_positions.to(x.device) > 0)[:, None, None]
            prev = (rows - m).clamp(min=0)
            # halves by split, not slices: a slice's backward scatters, and inductor's reinplacing of
            # that scatter guards on N_c < 2 (cpkv.v4.compressor does the same)
            (prev_kv, _), (prev_gate, _), (_, slot_kv), (_, slot_gate) = (
                torch.split(t, hd, dim=-1) for t in (kv[prev], gate[prev] + self.module.position_bias, slot_kv, slot_gate)
            )
            prev_kv = torch.where(has_prev, prev_kv, 0.0)
            prev_gate = torch.where(has_prev, prev_gate, float("-inf"))
            slot_kv = torch.cat([prev_kv, slot_kv], dim=1)
            slot_gate = torch.cat([prev_gate, slot_gate], dim=1)
        weights = slot_gate.softmax(dim=1, dtype=_compute_dtype(slot_gate.dtype)).to(slot_kv.dtype)
        pooled = (slot_kv * weights).sum(dim=1)
        normed = _rms_norm(pooled, self.module.kv_norm.weight, rms_norm_eps(self.module.kv_norm))
        return self.rope(normed, plan.entry_positions[: normed.shape[0]])  # compiled: the rows' own size


class _PooledBlocks:
    """The declarations of a :class:`~cpkv.attention.BlockReader` read off its pooler."""

    _pool: _Pooler

    @property
    def ratio(self) -> int:
        """Tokens per block."""
        return self._pool.ratio

    @property
    def prev_blocks(self) -> int:
        """Earlier blocks each entry reads: 1 for the overlapping (CSA) layout, 0 otherwise."""
        return int(self._pool.overlap)

    @property
    def input_dim(self) -> int:
        """Width of the input rows (the hidden size)."""
        return self._pool.input_dim


class DeepseekV4Compressor(_PooledBlocks):
    """A ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` as a :class:`~cpkv.attention.CompressorFn`.

    Entry ``j`` of a document pools block ``j`` (tokens ``j*m .. j*m+m-1``):
    ``RoPE(RMSNorm(sum_i softmax_i(gate_i + position_bias_i) * kv_i), j*m)``; the CSA layout
    (``kv_proj`` of twice the head dim) also pools block ``j-1``'s first-half channels
    (``prev_blocks = 1``; none for ``j = 0``). Trailing partial blocks give no entry.

    Args:
        module: the Hugging Face compressor (``DeepseekV4Attention.compressor``).
        rotary_emb: a ``DeepseekV4RotaryEmbedding`` (default: the compressor's own).
    """

    def __init__(self, module: Any, rotary_emb: Any = None) -> None:
        self.module = module
        self._pool = _Pooler(module, int(module.compress_rate), int(module.head_dim), _Rope.of(rotary_emb or module.rotary_emb, "compress"))

    def __call__(self, x: Tensor, plan: CompressedPlan, /) -> Tensor | None:
        """``[N_c, head_dim]`` entries of the blocks of ``plan`` in ``x`` ``[N_in, hidden]`` (``None`` without one)."""
        return self._pool(x, plan)


class DeepseekV4Indexer(_PooledBlocks):
    """A ``DeepseekV4Indexer`` as a :class:`~cpkv.attention.IndexerFn`.

    Its queries come from the query path's ``q_residual`` and its weights from the hidden
    states, so the features cpkv hands it are ``[q_residual | hidden]`` ``[T/cp, q_lora_rank + hidden]``.
    Scores ``I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j])`` with Hugging Face's two scales
    (``index_head_dim^-1/2`` and ``index_n_heads^-1/2``) folded into ``w``.

    Args:
        module: the Hugging Face indexer (``DeepseekV4Attention.compressor.indexer``).
        q_lora_rank: width of ``q_residual``.
        rotary_emb: a ``DeepseekV4RotaryEmbedding`` (default: the indexer's own).
        learn: build the autograd graph of keys and queries (``indexer_loss=True``).
    """

    def __init__(self, module: Any, q_lora_rank: int, rotary_emb: Any = None, *, learn: bool = False) -> None:
        self.module, self.q_lora_rank, self.learn = module, q_lora_rank, learn
        self.rope = _Rope.of(rotary_emb or module.rotary_emb, "compress")
        self._pool = _Pooler(module, int(module.compress_rate), int(module.head_dim), self.rope)
        self.scale = float(module.scorer.softmax_scale) * float(module.scorer.weights_scaling)
        self.key_dim = int(module.head_dim)
        self.feature_dim = q_lora_rank + self._pool.input_dim

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``q`` ``[T, H_I, D_I]`` (compress RoPE at ``positions``) and weights ``[T, H_I]`` from ``[q_residual | hidden]``."""
        with torch.set_grad_enabled(self.learn and torch.is_grad_enabled()):
            q_residual, hidden = torch.split(x, [self.q_lora_rank, x.shape[-1] - self.q_lora_rank], dim=-1)
            q = self.module.q_b_proj(q_residual).unflatten(-1, (self.module.num_heads, self.module.head_dim))
            weights = self.module.scorer.weights_proj(hidden)
            return self.rope(q, positions), weights.to(_compute_dtype(weights.dtype)) * self.scale

    def keys(self, x: Tensor, plan: CompressedPlan) -> Tensor | None:
        """``[N_c, D_I]`` keys of the blocks of ``plan`` in ``x`` ``[N_in, hidden]`` (``None`` without one)."""
        with torch.set_grad_enabled(self.learn and torch.is_grad_enabled()):
            return self._pool(x, plan)


class DeepseekV4PlanOptions(TypedDict):
    """Keyword options of :func:`cpkv.plan_attention` for a DeepSeek-V4 model's layers (and its cost model)."""

    compress_ratios: list[int]
    windows: list[int | None]
    prev_blocks: dict[int, int]
    cost_model: CostModel


def deepseek_v4_plan_options(config: Any) -> DeepseekV4PlanOptions:
    """The ratios, window and earlier blocks a ``DeepseekV4Config``'s layers need planned, and the model's cost.

    ``cost_model`` is :meth:`CostModel.from_deepseek_v4` ``(config)``: the whole model's step
    cost, which ``layout="balanced"`` balances and every plan reports (``plan.rank_costs``).

    Example:
        >>> plan = plan_attention(cu_seqlens, cp_size, cp_rank, **deepseek_v4_plan_options(config))  # doctest: +SKIP
    """
    rates, types = dict(config.compress_rates), list(config.layer_types)
    prev: dict[int, int] = {}
    for t in types:  # CSA's overlapping layout reads one earlier block; a ratio shared with HCA keeps it
        if t != SLIDING:
            prev[int(rates[t])] = max(prev.get(int(rates[t]), 0), int(t == CSA))
    return DeepseekV4PlanOptions(compress_ratios=sorted(prev), windows=[int(config.sliding_window)], prev_blocks=prev,
                                 cost_model=CostModel.from_deepseek_v4(config))


def deepseek_v4_spec(module: Any, *, indexer_loss: bool = False) -> AttentionSpec:
    """The :class:`~cpkv.attention.AttentionSpec` of a ``DeepseekV4Attention``.

    The layer type fixes the mode (``compress_mode``), whatever its compress rate: a CSA layer
    is INDEXER and an HCA layer COMPRESSOR_ONLY at any rate.

    Raises:
        ValueError: an unknown ``layer_type``.
    """
    config, layer_type = module.config, module.layer_type
    ratio = 0 if module.compressor is None else int(module.compressor.compress_rate)
    wanted = {SLIDING: LayerCompressMode.NO_COMPRESS, CSA: LayerCompressMode.INDEXER, HCA: LayerCompressMode.COMPRESSOR_ONLY}
    if layer_type not in wanted:
        raise ValueError(f"module.layer_type must be one of {list(wanted)}, got {layer_type!r}")
    options: dict[str, Any] = dict(
        d_v=int(module.head_dim), compress_ratio=ratio, window=int(module.sliding_window),
        scale=float(module.scaling), topk=int(config.index_topk), indexer_loss=indexer_loss,
        compress_mode=wanted[layer_type],
    )
    return AttentionSpec(**options)


def _check(module: Any, hidden_states: Tensor, plan: AttentionPlan) -> None:
    if not all(hasattr(module, a) for a in ("q_a_proj", "kv_proj", "o_a_proj", "sinks", "layer_type", "compressor")):
        raise TypeError(f"module must be a transformers DeepseekV4Attention, got {type(module).__name__}")
    check_deepseek_v4_forms([(type(module).__name__, module)], forward=False)
    check_ndim("hidden_states", check_tensor("hidden_states", hidden_states), 2, "[T/cp, hidden]")
    weight = module.q_a_proj.weight
    if hidden_states.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden_states must be [T/cp, hidden] with hidden = {weight.shape[1]}, got {tuple(hidden_states.shape)}")
    if hidden_states.dtype != weight.dtype or hidden_states.device != weight.device:
        raise TypeError(f"hidden_states must have the module's dtype and device ({weight.dtype}, {weight.device}), got {hidden_states.dtype}, {hidden_states.device}")
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan from cpkv.plan_attention, got {type(plan).__name__}")
    if hidden_states.shape[0] != plan.local_len:
        raise ValueError(f"hidden_states must hold this rank's {plan.local_len} tokens (plan.local_len), got {hidden_states.shape[0]}")


def _rotary(module: Any, rotary_emb: Any) -> Any:
    if rotary_emb is not None:
        return rotary_emb
    if module.compressor is not None:
        return module.compressor.rotary_emb
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    return DeepseekV4RotaryEmbedding(module.config, device=module.q_a_proj.weight.device)


class DeepseekV4AttentionOutput(NamedTuple):
    """Result of :func:`deepseek_v4_attention`.

    Attributes:
        out: ``[T/cp, hidden]`` the module's output for this rank's tokens, module dtype.
        indexer_loss: ``sum_t KL_t`` over this rank's queries (0-d float32 or float64, detached,
            for logging) for a CSA layer with ``indexer_loss=True`` and entries on this rank,
            else ``None``; the gradient is normalised by ``plan.num_global_queries``.
    """

    out: Tensor
    indexer_loss: Tensor | None


def deepseek_v4_attention(
    module: Any, hidden_states: Tensor, plan: AttentionPlan, group: Group, *,
    backend: BackendName | AttentionBackend = "auto", indexer_loss: bool = False, grad_scale: float = 1.0,
    rotary_emb: Any = None, status: StepStatus | None = None,
) -> DeepseekV4AttentionOutput:
    """:func:`deepseek_v4_attention_forward` with the layer's indexer loss (for logging) beside its output.

    Args and raises: as :func:`deepseek_v4_attention_forward`; ``status``: the step's
    :class:`~cpkv.status.StepStatus`, as in :func:`cpkv.attention_forward`.

    Returns:
        :class:`DeepseekV4AttentionOutput`: ``out`` ``[T/cp, hidden]`` and ``indexer_loss``.

    Example:
        >>> out, kl = deepseek_v4_attention(layer.self_attn, x_local, plan, group, indexer_loss=True)  # doctest: +SKIP
    """
    _check(module, hidden_states, plan)
    spec = deepseek_v4_spec(module, indexer_loss=indexer_loss)
    rotary = _rotary(module, rotary_emb)
    rope = _Rope.of(rotary, "main" if module.compressor is None else "compress")
    positions = plan.q_positions.to(hidden_states.device)
    num, heads, head_dim = hidden_states.shape[0], int(module.num_heads), int(module.head_dim)
    q_residual = _rms_norm(module.q_a_proj(hidden_states), module.q_a_norm.weight, rms_norm_eps(module.q_a_norm))
    q = _rms_norm(module.q_b_proj(q_residual).view(num, heads, head_dim), None, rms_norm_eps(module.q_b_norm))
    q = rope(q, positions)
    kv = rope(_rms_norm(module.kv_proj(hidden_states), module.kv_norm.weight, rms_norm_eps(module.kv_norm)), positions)
    compressor = indexer = index_features = None
    if module.compressor is not None:
        compressor = DeepseekV4Compressor(module.compressor, rotary)
        if getattr(module.compressor, "indexer", None) is not None:
            q_lora_rank = int(module.q_a_proj.out_features)
            indexer = DeepseekV4Indexer(module.compressor.indexer, q_lora_rank, rotary, learn=indexer_loss)
            index_features = torch.cat([q_residual, hidden_states], dim=-1)
    result = attention_forward(
        q, kv, plan, group, spec=spec, sinks=module.sinks, hidden=hidden_states if compressor is not None else None,
        compressor=compressor, indexer=indexer, index_features=index_features, backend=backend, grad_scale=grad_scale,
        status=status,
    )
    out = rope(result.out, positions, inverse=True)
    grouped = module.o_a_proj(out.reshape(num, int(module.config.o_groups), -1)).flatten(1)
    return DeepseekV4AttentionOutput(module.o_b_proj(grouped), result.indexer_loss)


def deepseek_v4_attention_forward(
    module: Any, hidden_states: Tensor, plan: AttentionPlan, group: Group, *,
    backend: BackendName | AttentionBackend = "auto", indexer_loss: bool = False, grad_scale: float = 1.0,
    rotary_emb: Any = None,
) -> Tensor:
    """A ``DeepseekV4Attention`` on this rank's shard of a packed batch, under CP.

    Equal to running ``module`` on every document separately (batch 1, positions from 0, a
    sliding-window causal mask), restricted to this rank's tokens.

    Args:
        module: a ``transformers`` ``DeepseekV4Attention`` of any layer type.
        hidden_states: ``[T/cp, hidden]`` this rank's tokens in the plan's shard order
            (``plan.local_len`` rows), the module's dtype and device.
        plan: this rank's :class:`~cpkv.plan.attention.AttentionPlan`, planned with
            :func:`deepseek_v4_plan_options` (the layer's compress rate, window and earlier
            blocks). RoPE positions: ``plan.q_positions``.
        group: the CP group (``None``: the default group).
        backend: as in :func:`cpkv.attention.attention_forward`.
        indexer_loss: CSA layers: train the indexer with cpkv's KL loss (docs/semantics.md).
            ``False`` (default) leaves its parameters without gradient, as Hugging Face does.
        grad_scale: multiplies the indexer-loss gradients.
        rotary_emb: the model's ``DeepseekV4RotaryEmbedding`` (default: the compressor's, or
            one built from ``module.config`` for sliding layers).

    Returns:
        ``[T/cp, hidden]`` the module's output for this rank's tokens, module dtype.

    Shapes:
        ``T``: packed tokens of all ranks; ``hidden``: the config's hidden size.

    Raises:
        TypeError, ValueError: a module that is no ``DeepseekV4Attention``, wrong shapes,
            dtype or device, a plan without the layer's ratio or window.
        NotImplementedError: a sequence-length-dependent rope type.

    Example:
        >>> plan = plan_attention(cu_seqlens, cp, rank, **deepseek_v4_plan_options(config))  # doctest: +SKIP
        >>> out = deepseek_v4_attention_forward(layer.self_attn, x_local, plan, group)  # doctest: +SKIP
    """
    return deepseek_v4_attention(
        module, hidden_states, plan, group, backend=backend, indexer_loss=indexer_loss, grad_scale=grad_scale,
        rotary_emb=rotary_emb,
    ).out
