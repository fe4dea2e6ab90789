"""The V4-style attention layer: projections, RoPE, sinks and the CP entry point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.backends.base import AttentionBackend, BackendName
from cpkv.checks import check_ndim, check_tensor
from cpkv.collectives import Group
from cpkv.plan.attention import AttentionPlan
from cpkv.status import StepStatus
from cpkv.compress_mode import LayerCompressMode
from cpkv.v4.compressor import Compressor
from cpkv.v4.indexer import Indexer
from cpkv.v4.rope import apply_rope


@dataclass(frozen=True)
class V4Config:
    """Dimensions of the small V4-style layer (defaults: hidden 64, 4 heads of 32, rope 8).

    ``compress_ratio`` picks the mode unless ``compress_mode`` is given (0/1: NO_COMPRESS, 4: INDEXER, other > 1:
    COMPRESSOR_ONLY). Compressed layers use ``compress_rope_base`` (V4 uses a different
    base for them). ``window=None`` gives dense causal attention (NO_COMPRESS only).
    """

    hidden: int = 64
    heads: int = 4
    head_dim: int = 32
    rope_dim: int = 8
    window: int | None = 16
    compress_ratio: int = 0
    topk: int = 4
    index_heads: int = 2
    index_head_dim: int = 16
    rope_base: float = 10000.0
    compress_rope_base: float = 160000.0
    sinks: bool = True
    index_key_dtype: torch.dtype | None = None
    compress_mode: LayerCompressMode | None = None
    index_query_dtype: torch.dtype | None = None

    @property
    def d_v(self) -> int:
        """Value channels: the non-rope part of the shared kv."""
        return self.head_dim - self.rope_dim

    @property
    def mode(self) -> LayerCompressMode:
        """The layer's compress mode: ``compress_mode``, else from the ratio."""
        return self.spec.mode

    @property
    def spec(self) -> AttentionSpec:
        """The :class:`AttentionSpec` the pipeline runs with."""
        return AttentionSpec(
            d_v=self.d_v, compress_ratio=self.compress_ratio, window=self.window, topk=self.topk,
            index_key_dtype=self.index_key_dtype, compress_mode=self.compress_mode,
            index_query_dtype=self.index_query_dtype,
        )


class LayerOutput(NamedTuple):
    """``out`` ``[T, hidden]``; ``indexer_loss``: ``sum_t KL_t`` (INDEXER layers, for logging) or ``None``."""

    out: Tensor
    indexer_loss: Tensor | None


class V4Attention(nn.Module):
    """Shared-KV MQA with sliding window, sinks, compressor and indexer (random init)."""

    def __init__(self, config: V4Config, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        config.spec.validate()
        torch.manual_seed(seed)
        c = config
        self.rope_base = c.compress_rope_base if c.mode.compresses else c.rope_base
        self.wq = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.wkv = nn.Linear(c.hidden, c.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * c.d_v, c.hidden, bias=False)
        self.sinks = nn.Parameter(torch.randn(c.heads) * 0.5) if c.sinks else None
        self.compressor = (
            Compressor(c.hidden, c.head_dim, c.compress_ratio, rope_dim=c.rope_dim, rope_base=self.rope_base)
            if c.mode.compresses else None
        )
        self.indexer = (
            Indexer(c.hidden, c.index_heads, c.index_head_dim, rope_dim=c.rope_dim, rope_base=self.rope_base,
                    ratio=c.compress_ratio)
            if c.mode is LayerCompressMode.INDEXER else None
        )

    def project(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Queries ``[T, H, head_dim]`` and shared kv ``[T, head_dim]``, RoPE at ``positions``."""
        c = self.config
        q = self.wq(x).unflatten(-1, (c.heads, c.head_dim))
        q = apply_rope(q, positions, rope_dim=c.rope_dim, base=self.rope_base)
        kv = apply_rope(self.wkv(x), positions, rope_dim=c.rope_dim, base=self.rope_base)
        return q, kv

    def forward(
        self, x: Tensor, plan: AttentionPlan, group: Group, *,
        backend: BackendName | AttentionBackend = "auto", grad_scale: float = 1.0, status: StepStatus | None = None,
    ) -> LayerOutput:
        """The layer on this rank's shard ``x`` ``[T/cp, hidden]`` (in shard order) under CP.

        ``plan`` comes from :func:`cpkv.plan_attention` (once per micro-batch, with this
        layer's ``compress_ratio`` among ``compress_ratios`` and, for ``exchange="need"``, its
        window among ``windows``); it fixes the layout, exchange and rounds. For zigzag BSND,
        pass ``x.flatten(0, 1)`` with a plan of :func:`cpkv.bsnd_cu_seqlens`. ``status``: the
        step's :class:`~cpkv.status.StepStatus`, as in :func:`cpkv.attention_forward` (no host
        sync in the call; a check that fails on this rank raises on every rank at
        ``status.check()``).
        """
        check_ndim("x", check_tensor("x", x), 2, "[T/cp, hidden]")
        if x.shape[-1] != self.config.hidden:
            raise ValueError(f"x must be [T/cp, hidden] with hidden = {self.config.hidden}, got {tuple(x.shape)}")
        if x.dtype != self.wq.weight.dtype or x.device != self.wq.weight.device:
            raise TypeError(
                f"x must have the layer's dtype and device ({self.wq.weight.dtype}, {self.wq.weight.device}),"
                f" got {x.dtype}, {x.device}"
            )
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be an AttentionPlan from cpkv.plan_attention, got {type(plan).__name__}")
        if x.shape[0] != plan.local_len:
            raise ValueError(f"x must hold this rank's {plan.local_len} tokens (plan.local_len), got {x.shape[0]}")
        q, kv = self.project(x, plan.q_positions)
        result = attention_forward(
            q, kv, plan, group, spec=self.config.spec, sinks=self.sinks, hidden=x,
            compressor=self.compressor, indexer=self.indexer, backend=backend, grad_scale=grad_scale, status=status,
        )
        out: Tensor = self.wo(result.out.flatten(1))
        return LayerOutput(out, result.indexer_loss)
