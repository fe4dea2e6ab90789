"""What a layer attends to: :class:`AttentionSpec` (the per-layer options of
:func:`cpkv.attention.attention_forward`) and the protocols of the modules it calls,
:class:`CompressorFn` and :class:`IndexerFn` (both :class:`BlockReader`). Re-exported by
:mod:`cpkv.attention`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from cpkv.checks import check_finite, check_int
from cpkv.compress_mode import LayerCompressMode
from cpkv.index_keys import check_index_key_dtype
from cpkv.plan.segments import CompressedPlan

@dataclass(frozen=True)
class AttentionSpec:
    """What a layer attends to (the per-layer, not per-batch, options).

    Attributes:
        d_v: value channels: the first ``d_v`` channels of each shared kv head, or the width of
            the separate values ``v`` (:func:`attention_forward`).
        compress_ratio: the layer's ratio; its :class:`LayerCompressMode` follows from it unless
            ``compress_mode`` says otherwise.
        window: sliding window ``W`` (own token plus ``W - 1`` earlier), or ``None`` (the
            default): dense causal, ``NO_COMPRESS`` only. Compressed layers must name their
            window (DeepSeek-V4's is 128); ``validate`` raises otherwise.
        scale: softmax scale; ``None`` means ``1/sqrt(D)``.
        topk: entries the indexer selects per query (INDEXER).
        indexer_loss: INDEXER layers: attach the indexer's KL loss (its only gradient; see
            docs/semantics.md). ``False`` leaves the indexer without gradient (as Hugging Face's
            DeepSeek-V4 attention does). Under ``torch.no_grad()`` / ``torch.inference_mode()`` the
            loss is skipped (no KL target, no KL): nothing could train the indexer.
        index_key_dtype: INDEXER layers: the dtype the indexer keys are rounded to and travel in
            (``None``: the compute dtype; ``torch.float32``, ``torch.bfloat16``, or
            ``torch.float8_e4m3fn`` with one fp32 scale per key, as DeepSeek's indexer);
            :mod:`cpkv.index_keys`.
        index_query_dtype: INDEXER layers: the dtype the indexer queries are rounded to, per
            token and head, for the selection and the KL loss (the same options; gradient
            straight through). With both dtypes ``torch.float8_e4m3fn`` (DeepSeek's
            indexer) a backend may score the fp8 payloads on fp8 tensor cores (CUDA does).
        compress_mode: the layer's mode when it does not follow DeepSeek-V4's rule (an indexer
            only at ratio 4): e.g. ``LayerCompressMode.INDEXER`` at ratio 8 or
            ``COMPRESSOR_ONLY`` at ratio 4 (Hugging Face's config allows both).
    """

    d_v: int
    compress_ratio: int = 0
    window: int | None = None
    scale: float | None = None
    topk: int = 512
    indexer_loss: bool = True
    index_key_dtype: torch.dtype | None = None
    compress_mode: LayerCompressMode | None = None
    index_query_dtype: torch.dtype | None = None

    @property
    def scores_in_fp8(self) -> bool:
        """Whether the indexer's keys and queries are both rounded to fp8 e4m3 (backends may score their payloads)."""
        return self.index_key_dtype is torch.float8_e4m3fn and self.index_query_dtype is torch.float8_e4m3fn

    @property
    def mode(self) -> LayerCompressMode:
        """The layer's :class:`LayerCompressMode`: ``compress_mode``, else from ``compress_ratio`` (4: INDEXER)."""
        if self.compress_mode is not None:
            return self.compress_mode
        return LayerCompressMode.from_compress_ratio(self.compress_ratio)

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for inconsistent options."""
        check_int("spec.d_v", self.d_v, minimum=1)
        check_int("spec.topk", self.topk, minimum=1)
        check_int("spec.compress_ratio", self.compress_ratio, minimum=0)
        check_index_key_dtype("spec.index_key_dtype", self.index_key_dtype)
        check_index_key_dtype("spec.index_query_dtype", self.index_query_dtype)
        if self.compress_mode is not None:
            if not isinstance(self.compress_mode, LayerCompressMode):
                raise TypeError(f"spec.compress_mode must be a LayerCompressMode or None, got {type(self.compress_mode).__name__}")
            if self.compress_mode.compresses != (self.compress_ratio > 1):
                raise ValueError(
                    f"spec.compress_mode={self.compress_mode.name} does not fit spec.compress_ratio={self.compress_ratio}"
                    " (compressed modes need a ratio > 1, NO_COMPRESS a ratio <= 1)"
                )
        if not isinstance(self.indexer_loss, bool):
            raise TypeError(f"spec.indexer_loss must be a bool, got {type(self.indexer_loss).__name__}")
        if self.scale is not None:
            check_finite("spec.scale", self.scale, positive=True)
        if self.window is not None:
            check_int("spec.window", self.window, minimum=1)
        elif self.mode.compresses:
            raise ValueError(f"spec.window is required for compressed layers ({self.mode.name}), got None")


class BlockReader(Protocol):
    """What a compressor or indexer declares it reads, so that cpkv can plan the rows it needs and
    check every call on every rank before any collective (docs/semantics.md, "Compression"):
    ``ratio`` (tokens per block), ``prev_blocks`` (earlier blocks of the same document each entry
    also reads: 1 for DeepSeek-V4's overlapping ratio-4 compressor, else 0) and ``input_dim``
    (width of its input rows)."""

    @property
    def ratio(self) -> int: ...

    @property
    def prev_blocks(self) -> int: ...

    @property
    def input_dim(self) -> int: ...


class CompressorFn(BlockReader, Protocol):
    """Maps compressor inputs ``[N_in, input_dim]`` and a :class:`CompressedPlan` to entries ``[N_c, D]`` (or ``None``)."""

    def __call__(self, x: Tensor, plan: CompressedPlan, /) -> Tensor | None: ...


class IndexerFn(BlockReader, Protocol):
    """The lightning indexer: queries from local features, keys from a compressor input buffer.

    ``queries(features [T/cp, feature_dim], positions [T/cp]) -> (q_index [T/cp, H_I, key_dim],
    weights [T/cp, H_I])``; ``keys(x [N_in, input_dim], plan) -> [N_c, key_dim] | None``. Besides
    :class:`BlockReader`'s declarations it declares ``key_dim`` (``D_I``, the width of its keys
    and query heads) and ``feature_dim`` (the width of the features its queries come from:
    ``index_features``, or ``hidden`` when that is not given), so that every rank can check them
    and size the key buffers before any collective. Its inputs are detached by cpkv.
    """

    @property
    def key_dim(self) -> int: ...

    @property
    def feature_dim(self) -> int: ...

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]: ...

    def keys(self, x: Tensor, plan: CompressedPlan) -> Tensor | None: ...
