"""A data-loader collate function for packed causal-LM batches under CP: each rank's shard and its plan.

Hugging Face's ``DataCollatorWithFlattening`` packs a list of examples into one row: ``input_ids``
concatenated, ``position_ids`` restarting at 0 at every document, ``labels`` (``-100`` at every
document's first token). :class:`PackedCPCollator` does the same and then what a CP step needs
before the forward, in the data-loader worker, off the critical path: the documents'
``cu_seqlens`` (from the positions), this rank's :class:`~cpkv.AttentionPlan`
(:func:`cpkv.plan_attention`, no communication), the labels shifted within each document (the
label of a rank's last token lives on the next rank), and this rank's rows of ids, labels and
positions in the plan's shard order. With ``DataLoader(..., pin_memory=True)`` the batch (plan
included) is pinned, and ``batch.to(device, non_blocking=True)`` moves it without a host sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

import torch.distributed as dist

from cpkv.checks import check_int, check_rank
from cpkv.collectives import Group, check_group
from cpkv.integrations.causal_lm import cu_seqlens_from_position_ids, shift_labels
from cpkv.plan.attention import LAYOUTS, AttentionPlan, Exchange, Layout, plan_attention

__all__ = ["PackedBatch", "PackedCPBatch", "PackedCPCollator", "flatten_examples", "packed_batch"]


@dataclass(frozen=True, eq=False)
class PackedCPBatch:
    """One rank's part of a packed micro-batch, with its plan.

    Attributes:
        input_ids: ``[L_r]`` int64 this rank's ids, in shard order (``plan.shard(ids)``).
        labels: ``[L_r]`` int64 the targets of those tokens: the batch's labels shifted within
            each document, then sharded (``ignore_index`` where a token has no target).
        position_ids: ``[L_r]`` int64 document positions (``plan.q_positions``, for RoPE).
        plan: this rank's :class:`~cpkv.AttentionPlan`.
        cu_seqlens: ``[B + 1]`` int64 the whole batch's documents.
        num_tokens: ``T``, the whole batch's tokens.
    """

    input_ids: Tensor
    labels: Tensor
    position_ids: Tensor
    plan: AttentionPlan
    cu_seqlens: Tensor
    num_tokens: int

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PackedCPBatch:
        """The batch on ``device`` (plan included, :meth:`AttentionPlan.to`; no host sync when pinned and ``non_blocking``)."""
        def move(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        return PackedCPBatch(move(self.input_ids), move(self.labels), move(self.position_ids),
                             self.plan.to(device, non_blocking=non_blocking), move(self.cu_seqlens), self.num_tokens)

    def pin_memory(self) -> PackedCPBatch:
        """The batch in pinned memory (what ``DataLoader(pin_memory=True)`` calls; needs CUDA)."""
        return PackedCPBatch(self.input_ids.pin_memory(), self.labels.pin_memory(), self.position_ids.pin_memory(),
                             self.plan.pin_memory(), self.cu_seqlens.pin_memory(), self.num_tokens)


def _row(name: str, value: Any) -> Tensor:
    tensor = torch.as_tensor(value)
    if tensor.is_floating_point() or tensor.ndim not in (1, 2) or (tensor.ndim == 2 and tensor.shape[0] != 1):
        raise ValueError(f"{name} must be integer [T] or [1, T] (one packed row), got {tensor.dtype} {tuple(tensor.shape)}")
    return tensor.reshape(-1).to(torch.int64)


def flatten_examples(features: Sequence[Mapping[str, Any]], *, ignore_index: int = -100) -> dict[str, Tensor]:
    """``DataCollatorWithFlattening``'s packing: ``input_ids``, ``labels``, ``position_ids``, each ``[T]`` int64.

    Every example is a mapping with ``input_ids`` (a list or 1-D tensor) and optionally
    ``labels`` (default: its ids with ``ignore_index`` at the first token, as Hugging Face).
    Positions restart at 0 per example.

    Raises:
        ValueError: no example, an empty example, labels of another length.
    """
    if not features:
        raise ValueError("features must hold at least one example")
    ids, labels, positions = [], [], []
    for i, example in enumerate(features):
        row = _row(f"features[{i}]['input_ids']", example["input_ids"])
        if row.numel() == 0:
            raise ValueError(f"features[{i}]['input_ids'] is empty: every packed document needs a token")
        if "labels" in example and example["labels"] is not None:
            label = _row(f"features[{i}]['labels']", example["labels"])
            if label.shape != row.shape:
                raise ValueError(f"features[{i}]['labels'] must have its {row.numel()} ids' length, got {label.numel()}")
        else:
            label = torch.cat([torch.full((1,), ignore_index, dtype=torch.int64), row[1:]])
        ids.append(row)
        labels.append(label)
        positions.append(torch.arange(row.numel(), dtype=torch.int64))
    return {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "position_ids": torch.cat(positions)}


class PackedBatch(NamedTuple):
    """One packed row of ``DataCollatorWithFlattening``: ``[T]`` ids, ``[T]`` unshifted labels, ``[B + 1]`` cu_seqlens."""

    input_ids: Tensor
    labels: Tensor
    cu_seqlens: Tensor


def packed_batch(inputs: Mapping[str, Any]) -> PackedBatch:
    """A ``DataCollatorWithFlattening`` batch as ids, labels and ``cu_seqlens`` (one packed row).

    Args:
        inputs: ``input_ids`` ``[1, T]``, ``position_ids`` ``[1, T]`` restarting at 0 at every
            document (or ``cu_seq_lens_q``, the collator's ``return_flash_attn_kwargs=True``
            form), optional ``labels`` ``[1, T]`` (Hugging Face's unshifted convention; default
            the ids). Other keys (``seq_idx``, ``max_length_q``...) are ignored.

    Returns:
        :class:`PackedBatch`, on ``input_ids``' device (``cu_seqlens`` int64).

    Raises:
        ValueError: no ``input_ids``, an ``attention_mask`` (a padded ``[B, L]`` batch: pack it
            with ``DataCollatorWithFlattening``), no document boundaries, or ids, labels and
            boundaries that are not one packed row of one length.
    """
    if "input_ids" not in inputs:
        raise ValueError(f"inputs must hold input_ids, got keys {sorted(inputs)}")
    if inputs.get("attention_mask") is not None:
        raise ValueError(
            "inputs must be one packed row without attention_mask under CP (a padded [B, L] batch"
            " is not supported): collate with transformers' DataCollatorWithFlattening"
        )
    ids = inputs["input_ids"] if isinstance(inputs["input_ids"], Tensor) else torch.as_tensor(inputs["input_ids"])
    if ids.is_floating_point() or ids.ndim not in (1, 2) or (ids.ndim == 2 and ids.shape[0] != 1):
        got = f"{ids.dtype} {tuple(ids.shape)}"
        raise ValueError(f"input_ids must be one packed row [1, T] (DataCollatorWithFlattening), got {got}")
    flat = ids.reshape(-1)
    if inputs.get("position_ids") is not None:
        cu = cu_seqlens_from_position_ids(inputs["position_ids"])
    elif inputs.get("cu_seq_lens_q") is not None:
        cu = torch.as_tensor(inputs["cu_seq_lens_q"], device=flat.device).long()
    else:
        raise ValueError("inputs must hold position_ids (or cu_seq_lens_q): DataCollatorWithFlattening's document boundaries")
    if int(cu[-1]) != flat.numel():
        raise ValueError(f"the document boundaries (position_ids or cu_seq_lens_q) must cover input_ids' {flat.numel()} tokens,"
                         f" got {int(cu[-1])}")
    labels = inputs.get("labels")
    targets = flat if labels is None else torch.as_tensor(labels).reshape(-1).to(flat.device)
    if targets.numel() != flat.numel():
        raise ValueError(f"labels must hold input_ids' {flat.numel()} tokens, got {targets.numel()}")
    return PackedBatch(flat, targets, cu.to(flat.device))


@dataclass(frozen=True)
class PackedCPCollator:
    """``collate_fn`` of a data loader on CP rank ``cp_rank``: examples (or one packed row) in, :class:`PackedCPBatch` out.

    Call it with a list of examples (``{"input_ids": ..., "labels": ...}``, packed as
    ``DataCollatorWithFlattening`` does, :func:`flatten_examples`) or with one packed mapping
    ``{"input_ids": [T] or [1, T], "position_ids": positions restarting at 0, "labels": optional}``
    (:func:`packed_batch`, the parser :mod:`cpkv.integrations.hf_trainer` uses too).

    Attributes:
        cp_size, cp_rank: the CP group and this rank (the data loader of each rank makes its part).
        layout, exchange: as in :func:`cpkv.plan_attention` (default ``"balanced"``: any
            lengths, and ``"need"``).
        plan_options: other keyword options of :func:`cpkv.plan_attention`: the model's
            ``cost_model`` (required by ``layout="balanced"``) and its layers' windows and ratios,
            e.g. :func:`~cpkv.integrations.transformers.deepseek_v4_plan_options` ``(config)``, or
            ``{"cost_model": CostModel.from_hf_config(config), "windows": [None]}``.
        ignore_index: the label of tokens without a target.

    Raises:
        TypeError, ValueError: a bad ``cp_size``/``cp_rank``/``layout``, ``layout="balanced"``
            without ``plan_options["cost_model"]`` (at construction); what
            :func:`flatten_examples`, :func:`packed_batch` and :func:`cpkv.plan_attention` reject
            (at the call).
    """

    cp_size: int
    cp_rank: int
    layout: Layout = "balanced"
    exchange: Exchange = "need"
    plan_options: Mapping[str, Any] = field(default_factory=dict)
    ignore_index: int = -100

    def __post_init__(self) -> None:
        check_rank("cp_rank", self.cp_rank, check_int("cp_size", self.cp_size, minimum=1))
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        for key in ("layout", "exchange", "group"):
            if key in self.plan_options:
                raise ValueError(f"plan_options must not name {key!r} (a collator plans without a group; layout and"
                                 " exchange are its own fields)")
        if self.layout == "balanced" and self.plan_options.get("cost_model") is None:
            raise ValueError("layout='balanced' balances the model's cost: pass plan_options={'cost_model': ...}"
                             " (deepseek_v4_plan_options(config), or CostModel.from_hf_config(config)), or another layout")

    @classmethod
    def for_group(cls, group: Group, **fields: Any) -> PackedCPCollator:
        """The collator of this rank of ``group`` (a ``ProcessGroup``, a 1-D ``DeviceMesh`` such as ``mesh["cp"]``, or ``None``).

        Reads the group's size and this rank's position once, in the calling process; the
        collator itself holds only integers, so data-loader workers (forked or spawned) need
        no process group.

        Args:
            group: the CP group.
            **fields: the other fields (``layout``, ``exchange``, ``plan_options``, ``ignore_index``).

        Raises:
            TypeError, ValueError: what :func:`~cpkv.collectives.check_group` and the constructor reject.

        Example:
            >>> collate = PackedCPCollator.for_group(mesh["cp"], layout="balanced")  # doctest: +SKIP
        """
        resolved = check_group("group", group)
        return cls(dist.get_world_size(resolved), dist.get_rank(resolved), **fields)

    def __call__(self, features: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> PackedCPBatch:
        """This rank's :class:`PackedCPBatch` of the packed examples (CPU tensors)."""
        packed = packed_batch(features if isinstance(features, Mapping) else flatten_examples(features, ignore_index=self.ignore_index))
        ids, labels, cu = packed.input_ids, packed.labels, packed.cu_seqlens
        plan = plan_attention(cu, self.cp_size, self.cp_rank, layout=self.layout, exchange=self.exchange,
                              **dict(self.plan_options))
        shifted = shift_labels(labels, cu, ignore_index=self.ignore_index)
        return PackedCPBatch(plan.shard(ids), plan.shard(shifted), plan.q_positions, plan, cu, int(ids.numel()))
