"""Hugging Face's ``Trainer`` running ``DeepseekV4ForCausalLM`` under CP (``pip install 'cpkv[trainer]'``).

:class:`CPTrainerMixin` goes before ``transformers.Trainer`` (or any subclass of it) in a
class's bases; the class then trains a CP-enabled DeepSeek-V4 from ``TrainingArguments``
plus a CP size or group::

    class CPTrainer(CPTrainerMixin, Trainer): ...

    trainer = CPTrainer(model=model, args=args, train_dataset=docs,
                        data_collator=DataCollatorWithFlattening(), cp=2)

What it changes, and nothing else (docs/semantics.md, "Hugging Face's Trainer under CP"):

* **mesh**: the world is ``dp x cp`` ranks (:class:`DataCPMesh`, CP innermost: ranks
  ``g*cp .. g*cp + cp - 1`` are CP group ``g``, as in accelerate's ``ParallelismConfig``
  meshes); ``cp=`` is a size, a CP ``ProcessGroup``, a ``DeviceMesh`` with a ``"cp"``
  dimension or an accelerate ``ParallelismConfig`` (:func:`data_cp_mesh`).
* **sampler**: the training data loader accelerate prepared is re-pointed from the world to
  the data ranks (:func:`shard_over_data_ranks`): every rank of a CP group gets the same
  packed batch, CP groups get different batches, exactly as one process with a ``dp`` times
  larger per-device batch would see them.
* **normaliser**: ``num_items_in_batch`` is the optimizer step's count of valid shifted
  labels over every micro-batch of gradient accumulation and every CP group
  (:func:`global_num_items`), each token counted once.
* **loss and reduction**: :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss`
  with ``grad_reduction="mean"``, times ``dp``: the mean that accelerate's DDP takes over all
  ``dp x cp`` ranks is one process's gradient of the whole step.
* **logging**: each rank's loss is its tokens' share, so the mean over all ranks that
  ``Trainer`` logs is one process's loss of the step.
* **evaluation**: ``evaluate()``, ``predict()`` and ``eval_strategy`` run
  :func:`~cpkv.integrations.causal_lm_eval.deepseek_v4_causal_lm_eval` per eval batch (forward
  only, chunked scores); the evaluation loaders are sharded over the data ranks as the
  training one, and the loop gathers one copy of each CP group's results
  (:meth:`CPTrainerMixin.gather_over_data_ranks`): ``eval_loss`` (the mean over batches of each
  batch's token-weighted loss) is what ``dp`` processes of a plain ``Trainer`` report, the same
  on every rank; with ``prediction_loss_only=False`` the predictions are each token's label
  log-probability and argmax (:meth:`CPTrainerMixin.prediction_step`).
* **checkpoint**: :func:`~cpkv.integrations.transformers_lm.enable_deepseek_v4_cp` renames
  nothing, so ``save_pretrained`` (and ``Trainer``'s checkpoints) hold Hugging Face's keys and
  load into an unwrapped model; resuming restores every tensor in its saved dtype (float64
  included) and continues as the uninterrupted run.

Importing this module imports neither ``transformers`` nor ``accelerate`` (the mixin is a
plain class until it is combined with a ``Trainer``); they are imported when it runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from cpkv.backends.base import AttentionBackend, BackendName
from cpkv.checks import check_int
from cpkv.integrations.causal_lm import shift_labels
from cpkv.integrations.causal_lm_eval import deepseek_v4_causal_lm_eval
from cpkv.integrations.collate import packed_batch
from cpkv.integrations.linear_cross_entropy import DEFAULT_CHUNK_SIZE
from cpkv.integrations.transformers_lm import (
    DeepseekV4CausalLMOutput,
    deepseek_v4_causal_lm_loss,
    enable_deepseek_v4_cp,
)
from cpkv.plan.attention import LAYOUTS, Exchange, Layout
from cpkv.plan.conventions import pad_documents

if TYPE_CHECKING:
    from transformers import Trainer as _TrainerBase
else:
    _TrainerBase = object

__all__ = [
    "CPTrainerMixin",
    "DataCPMesh",
    "data_cp_mesh",
    "global_num_items",
    "shard_over_data_ranks",
]

IGNORE_INDEX = -100
"""The label of tokens without a target: Hugging Face's (``DataCollatorWithFlattening``'s separator)."""


@dataclasses.dataclass(frozen=True, eq=False)
class DataCPMesh:
    """This rank's place in a data x CP mesh of the whole world: ``world = dp_size * cp_size``.

    Attributes:
        dp_size: CP groups (data-parallel replicas), each fed its own batches.
        cp_size: ranks of a CP group, all fed the same packed batch.
        dp_rank: this rank's CP group, ``0 .. dp_size - 1`` (groups ordered by their lowest rank).
        cp_rank: this rank within its CP group.
        cp_group: this rank's CP group.
    """

    dp_size: int
    cp_size: int
    dp_rank: int
    cp_rank: int
    cp_group: ProcessGroup


def _mesh_of_cp_group(group: ProcessGroup) -> DataCPMesh:
    """The mesh whose CP groups are ``group`` and its counterparts on the other ranks (one all-gather)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, tuple(dist.get_process_group_ranks(group)))  # every rank checks every rank's group
    groups = sorted(set(every))
    covered = sorted(r for members in groups for r in members)
    if covered != list(range(world)) or any(r not in every[r] for r in range(world)) or len({len(g) for g in groups}) != 1:
        raise ValueError(
            f"the CP groups must split the {world} ranks into groups of one size, each rank in its own group, got"
            f" {[list(g) for g in every]} (rank r's group at position r)"
        )
    return DataCPMesh(len(groups), len(every[rank]), groups.index(every[rank]), dist.get_rank(group), group)


def data_cp_mesh(cp: int | ProcessGroup | Any, *, device_type: str = "cpu") -> DataCPMesh:
    """The data x CP mesh of the world from a CP size, a CP group, a ``DeviceMesh`` or a ``ParallelismConfig``.

    A collective: every rank calls it, with the same kind of ``cp``, after
    ``torch.distributed`` is initialised (``Trainer``'s ``TrainingArguments`` do it from
    ``torchrun``'s or ``accelerate launch``'s environment).

    Args:
        cp: one of

            * an ``int``: the CP size; the world (``dist.get_world_size()`` ranks, a multiple of
              it) is cut into contiguous CP groups (ranks ``g * cp .. g * cp + cp - 1``);
            * a ``ProcessGroup``: this rank's CP group; the groups of all ranks must split the
              world into groups of one size;
            * a ``torch.distributed.DeviceMesh`` with a ``"cp"`` dimension (its other dimensions
              are data parallel), or its 1-D slice ``mesh["cp"]`` (what every cpkv function
              taking a CP group accepts too: :func:`cpkv.collectives.check_group`);
            * an accelerate ``ParallelismConfig`` (``cp_size``, data-parallel sizes; no tensor or
              sequence parallelism): its device mesh (built for ``device_type`` if it has none).
        device_type: the device type a ``ParallelismConfig`` builds its mesh for (``"cpu"``
            for gloo, ``"cuda"``...).

    Returns:
        :class:`DataCPMesh`.

    Raises:
        ValueError: ``torch.distributed`` not initialised, a size that does not divide the
            world, groups that do not split the world, a mesh without ``"cp"``, a
            ``ParallelismConfig`` with tensor or sequence parallelism.
        TypeError: another kind of ``cp``.

    Example:
        >>> mesh = data_cp_mesh(2)  # 4 ranks: CP groups {0, 1} and {2, 3}  # doctest: +SKIP
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("data_cp_mesh needs torch.distributed initialised (launch with torchrun or accelerate launch)")
    world = dist.get_world_size()
    if isinstance(cp, ProcessGroup):
        return _mesh_of_cp_group(cp)
    if isinstance(cp, int) and not isinstance(cp, bool):
        size = check_int("cp", cp, minimum=1)
        if world % size:
            raise ValueError(f"cp = {size} must divide the world size {world} (dp = world / cp CP groups)")
        groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]  # every rank makes every group
        return _mesh_of_cp_group(groups[dist.get_rank() // size])
    if all(hasattr(cp, a) for a in ("cp_size", "tp_size", "get_device_mesh")):  # accelerate's ParallelismConfig
        sp_size = getattr(cp, "sp_size", 1)  # accelerate >= 1.11; 1.10 has no sequence parallelism
        if cp.tp_size > 1 or sp_size > 1:
            raise ValueError(f"cp (a ParallelismConfig) must have tp_size = sp_size = 1 under cpkv's CP, got {cp.tp_size}, {sp_size}")
        if cp.cp_size == 1:
            return data_cp_mesh(1)
        return data_cp_mesh(cp.get_device_mesh(device_type))
    names = getattr(cp, "mesh_dim_names", None)
    if names is not None and hasattr(cp, "get_group"):  # a DeviceMesh
        if "cp" not in names:
            raise ValueError(f"cp (a DeviceMesh) must have a 'cp' dimension, got dimensions {tuple(names)}")
        return _mesh_of_cp_group(cp["cp"].get_group())
    raise TypeError(f"cp must be an int, a ProcessGroup, a DeviceMesh or an accelerate ParallelismConfig, got {type(cp).__name__}")


def shard_over_data_ranks(dataloader: Any, mesh: DataCPMesh) -> Any:
    """Re-point a data loader that accelerate sharded over the world to the mesh's data ranks.

    ``Trainer`` gets its loader from ``accelerator.prepare``, which gives rank ``r`` of the
    world the batches ``r, r + world, ...`` (a ``BatchSamplerShard``, or an
    ``IterableDatasetShard`` for an iterable dataset). Under CP the ``cp`` ranks of a group
    must see the same batches: the shard is set to ``dp_size`` processes and this rank's
    ``dp_rank`` (in place), so CP group ``g`` gets batches ``g, g + dp, ...``, what one process
    with ``dp`` times the per-device batch reads in the same order. With one CP group
    (``dp = 1``) the shard's ``even_batches`` is turned off: a last partial batch stays as one
    process reads it (accelerate would fill it up with the loader's first samples); with
    ``dp > 1`` accelerate's evening-out stays, as for ``dp`` plain data-parallel processes. A
    world of one rank is returned unchanged.

    Args:
        dataloader: accelerate's ``DataLoaderShard`` (what ``Trainer.get_train_dataloader`` returns).
        mesh: the data x CP mesh.

    Returns:
        ``dataloader`` itself.

    Raises:
        TypeError: a loader without accelerate's shard (e.g. ``dispatch_batches=True``, which
            broadcasts one batch from rank 0 and splits it: not supported under CP).
        ValueError: a shard over another number of processes than the mesh's world.
    """
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard  # type: ignore[import-untyped]

    world = mesh.dp_size * mesh.cp_size
    if world == 1:
        return dataloader
    parts = (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "dataset", None))
    shards = [part for part in parts if isinstance(part, (BatchSamplerShard, IterableDatasetShard))]
    if not shards:
        raise TypeError(
            f"dataloader must be sharded by accelerate (a BatchSamplerShard or IterableDatasetShard), got {type(dataloader).__name__}:"
            " under CP leave accelerator_config's dispatch_batches unset (False)"
        )
    for shard in shards:
        if shard.num_processes not in (world, mesh.dp_size):
            raise ValueError(f"dataloader is sharded over {shard.num_processes} processes, not the mesh's {world} ranks")
        shard.num_processes, shard.process_index = mesh.dp_size, mesh.dp_rank
        if mesh.dp_size == 1 and isinstance(shard, BatchSamplerShard):
            shard.even_batches = False  # one CP group reads one process's batches: no samples repeated to even out ranks
    return dataloader


def global_num_items(batches: Sequence[Mapping[str, Any]], mesh: DataCPMesh, device: torch.device | str) -> Tensor:
    """The loss normaliser of one optimizer step: valid next-token labels over all micro-batches and CP groups.

    Each batch's labels are shifted within its documents (:func:`cpkv.shift_labels`: a
    document's last token predicts nothing, never the next document's first), the targets
    ``!= -100`` counted, summed over ``batches`` (this rank's gradient-accumulation
    micro-batches) and all-reduced over the world (``SUM``); every rank of a CP group counted
    the same batches, so the sum is divided by ``cp_size``: each token counts once. What one
    process with the whole step's batches counts.

    Args:
        batches: this rank's micro-batches of the step (``DataCollatorWithFlattening`` batches).
        mesh: the data x CP mesh (covering the default group's ranks).
        device: where the count lives (the collective's device: the CPU for gloo).

    Returns:
        0-d int64 on ``device``, the same on every rank.

    Raises:
        ValueError: a malformed batch (:func:`~cpkv.integrations.collate.packed_batch`).
    """
    count = torch.zeros((), dtype=torch.int64)
    for inputs in batches:
        batch = packed_batch(inputs)
        shifted = shift_labels(batch.labels, batch.cu_seqlens, ignore_index=IGNORE_INDEX)
        count += (shifted != IGNORE_INDEX).sum().cpu()
    count = count.to(device)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    return count // mesh.cp_size


def _saved_values(loaded: Any, checkpoint: str, rounded: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The checkpoint's own values of the tensors ``from_pretrained`` built in another dtype, as saved.

    Args:
        loaded: the model ``from_pretrained`` read from ``checkpoint``.
        checkpoint: the directory (``model.safetensors``, or shards listed in
            ``model.safetensors.index.json``).
        rounded: model name -> the tensor ``from_pretrained`` gave (in its dtype).

    Returns:
        model name -> the tensor as saved (its dtype), for every name of ``rounded``; empty
        when ``rounded`` is, or when the checkpoint holds no safetensors (a warning: the
        values stay ``from_pretrained``'s).

    Raises:
        RuntimeError: a name that does not map to one checkpoint key, or a saved value that,
            cast to ``from_pretrained``'s dtype, is not the value it gave.
    """
    index = os.path.join(checkpoint, "model.safetensors.index.json")
    single = os.path.join(checkpoint, "model.safetensors")
    if not rounded:
        return {}
    if not os.path.isfile(index) and not os.path.isfile(single):
        warnings.warn(f"{checkpoint} holds no safetensors: {len(rounded)} tensors resume in from_pretrained's dtype", stacklevel=3)
        return {}
    from safetensors import safe_open
    from transformers.core_model_loading import revert_weight_conversion

    files: dict[str, str] | None = None  # sharded: checkpoint key -> its file
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as stream:
            files = json.load(stream)["weight_map"]
    by_file: dict[str, dict[str, str]] = {}  # file -> model name -> checkpoint key (each file opened once)
    for name, tensor in rounded.items():
        keys = list(revert_weight_conversion(loaded, {name: tensor}))  # the checkpoint's name of this tensor
        if len(keys) != 1 or (files is not None and keys[0] not in files):
            raise RuntimeError(f"{name} maps to checkpoint keys {keys}, not to one key of {checkpoint}")
        path = single if files is None else os.path.join(checkpoint, files[keys[0]])
        by_file.setdefault(path, {})[name] = keys[0]
    values: dict[str, Tensor] = {}
    for path, names in by_file.items():
        with safe_open(path, "pt") as saved:
            for name, key in names.items():
                values[name] = saved.get_tensor(key)
                if not torch.equal(values[name].to(rounded[name].dtype), rounded[name]):
                    raise RuntimeError(f"{name}: the checkpoint's {key} is not the value from_pretrained loaded")
    return values


class CPTrainerMixin(_TrainerBase):
    """Put before ``transformers.Trainer`` (or a subclass) in a class's bases to train ``DeepseekV4ForCausalLM`` under CP.

    ``class CPTrainer(CPTrainerMixin, Trainer): ...`` then takes ``Trainer``'s arguments plus
    the ones below; everything else (optimizer, scheduler, gradient accumulation, clipping,
    DDP through accelerate, logging, checkpoints, callbacks) is ``Trainer``'s. Batches must be
    ``DataCollatorWithFlattening``'s packed rows (``input_ids``, ``labels``, ``position_ids``
    restarting at 0): the whole batch on every rank of a CP group, each rank running its
    shard of the tokens. The contiguous and zigzag layouts pad the documents
    (:func:`cpkv.pad_documents`, the padding never a target); the balanced one takes the
    batch as it is.

    Keyword Args:
        cp: the CP size or group, as :func:`data_cp_mesh` takes it (default 1). Do not set
            ``TrainingArguments.parallelism_config`` with ``cp_size > 1``: accelerate would
            shard the inputs itself (torch's SDPA context parallel, under FSDP2).
        layout: ``"balanced"`` (default: any lengths, equal modeled cost per rank),
            ``"contiguous"`` (every document padded to a multiple of ``cp``) or ``"zigzag"``
            (every document padded to a multiple of ``2 * cp``).
        exchange: ``"need"`` (default: only the rows each rank needs) or ``"allgather"``, as in
            :func:`cpkv.plan_attention`. The model's own cost and windows are planned
            (:func:`~cpkv.integrations.transformers.deepseek_v4_plan_options`).
        backend: the attention backend, as in :func:`cpkv.attention_forward`.
        indexer_loss: train the CSA layers' indexers with cpkv's KL loss (default ``False``:
            the indexer gets no gradient, as in Hugging Face). Its KL is summed over the
            step's queries and divided by the step's ``num_items_in_batch`` (the language
            loss's normaliser), so its gradient, like the language loss's, does not depend on
            how the step splits into micro-batches, CP groups or ranks.
        loss_chunk_size: tokens per chunk of the causal-LM loss, computed from the head's
            input and weight without the whole ``[T/cp, V]`` logits (``>= 1``; default
            :data:`~cpkv.integrations.linear_cross_entropy.DEFAULT_CHUNK_SIZE`, 1024), as
            :func:`deepseek_v4_causal_lm_loss`'s ``chunk_size``. A chunk's float32 logits
            and their gradient (``8 * chunk * V`` bytes) live at once; the values do not
            depend on it beyond float round-off.

    Parameters without a gradient: without ``indexer_loss`` the indexers get none, and a
    compressor gets none from a micro-batch without a block of its ratio (as in one process).
    ``Trainer``'s default ``ddp_find_unused_parameters`` (``True`` for a ``PreTrainedModel``
    without activation checkpointing) handles both; with ``False`` freeze the indexers
    (``requires_grad_(False)``, then the optimizer skips them as it skips Hugging Face's)
    and feed every micro-batch a block of every ratio (docs/integrations.md).

    Attributes:
        cp_mesh: the :class:`DataCPMesh`, built in ``__init__`` (after ``Trainer`` set up
            ``torch.distributed``).

    Raises:
        TypeError: a model that is not a DeepSeek-V4 (:func:`enable_deepseek_v4_cp`), ``cp``
            of another kind. ValueError: an unknown layout or exchange,
            ``parallelism_config.cp_size > 1`` in the ``TrainingArguments``, a ``cp`` that
            does not fit the world (:func:`data_cp_mesh`), a batch that differs between the
            ranks of a CP group (on every rank of it, in the step's first forward).
    """

    loss_is_scaled_for_ga = True  # the loss is normalised by the whole step's count: Trainer must not divide it

    def __init__(
        self, model: Any = None, args: Any = None, *more: Any, cp: int | ProcessGroup | Any = 1,
        layout: Layout = "balanced", exchange: Exchange = "need", backend: BackendName | AttentionBackend = "auto",
        indexer_loss: bool = False, loss_chunk_size: int = DEFAULT_CHUNK_SIZE, **kwargs: Any,
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if exchange not in ("allgather", "need"):
            raise ValueError(f"exchange must be 'allgather' or 'need', got {exchange!r}")
        if not isinstance(indexer_loss, bool):
            raise TypeError(f"indexer_loss must be a bool, got {type(indexer_loss).__name__}")
        check_int("loss_chunk_size", loss_chunk_size, minimum=1)
        config = getattr(args, "parallelism_config", None)
        if config is not None and getattr(config, "cp_size", 1) > 1:
            raise ValueError(
                f"args.parallelism_config.cp_size = {config.cp_size}: accelerate would run its own context parallelism"
                " (torch's SDPA context_parallel under FSDP2) on top of cpkv's: leave it unset and pass cp= to the trainer"
                " (a size, a group, a DeviceMesh or that ParallelismConfig)"
            )
        enable_deepseek_v4_cp(model)  # before Trainer wraps it; raises TypeError for another model
        super().__init__(model, args, *more, **kwargs)
        self.cp_layout: Layout = layout
        self.cp_exchange: Exchange = exchange
        self.cp_backend: BackendName | AttentionBackend = backend
        self.cp_indexer_loss = indexer_loss
        self.cp_loss_chunk_size = loss_chunk_size
        self.cp_mesh = data_cp_mesh(cp, device_type=self.args.device.type)

    def get_train_dataloader(self) -> Any:
        """``Trainer``'s loader, sharded over the data ranks: every rank of a CP group gets the same batches."""
        return shard_over_data_ranks(super().get_train_dataloader(), self.cp_mesh)

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list[Any], Any]:
        """The step's ``num_batches`` micro-batches and their :func:`global_num_items` (``Trainer``'s hook)."""
        batches: list[Any] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        return batches, global_num_items(batches, self.cp_mesh, device)

    def cp_loss(self, model: Any, inputs: Mapping[str, Any], num_items_in_batch: Tensor | int | None = None) -> DeepseekV4CausalLMOutput:
        """One micro-batch on this rank: :func:`deepseek_v4_causal_lm_loss` with the layout's padding and ``grad_reduction="mean"``.

        Args:
            model: the model as ``Trainer`` wraps it (DDP, or itself).
            inputs: a ``DataCollatorWithFlattening`` batch (:func:`~cpkv.integrations.collate.packed_batch`).
            num_items_in_batch: the step's normaliser (default: this micro-batch's, over the mesh).

        Returns:
            the call's :class:`~cpkv.integrations.transformers_lm.DeepseekV4CausalLMOutput`
            (its ``loss`` not yet multiplied by ``dp_size``).
        """
        batch = packed_batch(inputs)
        count = global_num_items([inputs], self.cp_mesh, batch.input_ids.device) if num_items_in_batch is None else num_items_in_batch
        # The indexer's KL: the call divides it by this batch's queries; the step's is over its valid labels (x dp: DDP's mean).
        indexer_scale = self.cp_mesh.dp_size * batch.input_ids.numel() / max(int(count), 1) if self.cp_indexer_loss else 1.0
        ids, labels, cu, padding = self.cp_padded(inputs)
        return deepseek_v4_causal_lm_loss(
            model, ids, self.cp_mesh.cp_group, cu_seqlens=cu, labels=labels, layout=self.cp_layout,
            exchange=self.cp_exchange, grad_reduction="mean", num_items_in_batch=count, ignore_index=IGNORE_INDEX,
            backend=self.cp_backend, padding=padding, indexer_loss=self.cp_indexer_loss, grad_scale=indexer_scale,
            chunk_size=self.cp_loss_chunk_size,
        )

    def cp_padded(self, inputs: Mapping[str, Any]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``(input_ids [T'], labels [T'], cu_seqlens [B + 1], padding [B] or None)`` of a batch, padded as the layout needs.

        The contiguous and zigzag layouts pad every document to a multiple of ``cp`` and
        ``2 * cp`` (:func:`cpkv.pad_documents`; the padding is never a target); the balanced
        one takes the batch as it is (``padding`` ``None``).
        """
        batch = packed_batch(inputs)
        ids, labels, cu = batch.input_ids, batch.labels, batch.cu_seqlens
        if self.cp_layout == "balanced":
            return ids, labels, cu, None
        multiple = self.cp_mesh.cp_size * (2 if self.cp_layout == "zigzag" else 1)
        padded = pad_documents(torch.stack([ids, labels], dim=1), cu, multiple)
        return padded.x[:, 0], padded.x[:, 1], padded.cu_seqlens, padded.padding

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Tensor | int | None = None,
    ) -> Any:
        """This rank's loss: :meth:`cp_loss` times ``dp_size`` (``(loss, output)`` with ``return_outputs``).

        Its gradient averaged over all ``dp x cp`` ranks (accelerate's DDP) and summed over
        the step's micro-batches is one process's gradient of the step's mean loss; its mean
        over the ranks (what ``Trainer`` logs) is that loss.
        """
        output = self.cp_loss(model, inputs, num_items_in_batch)
        loss = output.loss * self.cp_mesh.dp_size
        return (loss, output) if return_outputs else loss

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Load a checkpoint's weights into the model as ``from_pretrained`` reads them (``Trainer``'s hook).

        transformers 5.24's ``Trainer`` loads the checkpoint's safetensors into the model with
        ``load_state_dict(strict=False)``, but ``save_pretrained`` wrote DeepSeek-V4's
        checkpoint names (``attn.wq_a``, per-expert ``w1``/``w2``/``w3``...), so every key
        misses and the run resumes from the initial weights with a warning (and it first
        reads ``config.json`` as a base ``PreTrainedConfig``, which rejects DeepSeek-V4's
        ``mlp_layer_types``). Here the model's class reads the checkpoint
        (``from_pretrained``, with the model's config and dtype; for a moment a second copy
        of the weights on the CPU) and the model takes its ``state_dict`` strictly. Where
        ``from_pretrained`` built a tensor in another dtype than the model's (it creates
        DeepSeek-V4's norms, hyper-connection weights, sinks and position biases in float32
        whatever ``dtype`` says), the value is read from the checkpoint itself
        (:func:`_saved_values`) in the dtype it was saved in: a float64 model resumes with
        its float64 values, bit for bit. Other models (PEFT adapters, FSDP, DeepSpeed) go to
        ``Trainer``'s.

        Raises:
            RuntimeError: the checkpoint's weights do not fit the model (``load_state_dict``),
                or a re-read value is not the one ``from_pretrained`` rounded.
        """
        target: Any = self.model if model is None else model
        load = getattr(type(target), "from_pretrained", None)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled or not callable(load) or not hasattr(target, "config"):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        loaded = load(resume_from_checkpoint, config=target.config, dtype=target.dtype)
        state, own = loaded.state_dict(), target.state_dict()
        state.update(_saved_values(loaded, resume_from_checkpoint, {n: t for n, t in state.items() if n in own and t.dtype != own[n].dtype}))
        target.load_state_dict(state)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """``Trainer``'s evaluation loader, sharded over the data ranks (every rank of a CP group gets the same batches)."""
        return shard_over_data_ranks(super().get_eval_dataloader(eval_dataset), self.cp_mesh)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """``Trainer``'s prediction loader, sharded over the data ranks."""
        return shard_over_data_ranks(super().get_test_dataloader(test_dataset), self.cp_mesh)

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer``'s loop (``evaluate``, ``predict``, ``eval_strategy``) with one copy of each CP group's results gathered.

        Every rank of a CP group returns the same values from :meth:`prediction_step`; the
        loop's gathers (``Trainer.gather_function``) take them from the first rank of each
        group (:meth:`gather_over_data_ranks`). The modules' training flags are restored
        afterwards (``Trainer`` puts the model in eval mode for the loop).
        """
        modes = [(module, module.training) for module in self.model.modules()] if isinstance(self.model, torch.nn.Module) else []
        self.gather_function = self.gather_over_data_ranks
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self.gather_function = self.accelerator.gather_for_metrics
            for module, training in modes:
                module.training = training

    def gather_over_data_ranks(self, data: Any) -> Any:
        """accelerate's ``gather_for_metrics`` over the CP groups: one copy per group, the last step's repeats dropped.

        ``data`` (a tensor or nested tuples of them, the same on every rank of a CP group, of
        one shape on every rank: ``Trainer`` pads them first) is gathered over the world and
        the first rank of each CP group is kept, in data-rank order: what ``dp`` processes of
        a plain ``Trainer`` gather. At the end of the loader the samples accelerate repeated
        to even out the last step are dropped (``gradient_state.remainder``, counted over
        ``dp`` shards by :func:`shard_over_data_ranks`), as ``gather_for_metrics`` does.
        """
        from accelerate.utils import recursively_apply  # type: ignore[import-untyped]

        mesh = self.cp_mesh
        if mesh.dp_size * mesh.cp_size == 1:
            return self.accelerator.gather_for_metrics(data)

        def one_per_group(tensor: Tensor) -> Tensor:
            rows = tensor.shape[0] // (mesh.dp_size * mesh.cp_size)
            return tensor.reshape(mesh.dp_size, mesh.cp_size, rows, *tensor.shape[1:])[:, 0].reshape(-1, *tensor.shape[1:])

        gathered = recursively_apply(one_per_group, self.accelerator.gather(data))
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            gathered = recursively_apply(lambda tensor: tensor[: state.remainder], gathered)
        return gathered

    def prediction_step(
        self, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None,
    ) -> tuple[Tensor, Any, Tensor | None]:
        """One evaluation batch on this rank's CP group: its loss and, for metrics, per-token scores (``Trainer``'s hook).

        :func:`~cpkv.integrations.causal_lm_eval.deepseek_v4_causal_lm_eval` on the batch,
        forward only (no gradient, no indexer loss), padded for the layout as in training.

        Returns:
            ``(loss, predictions, labels)``, the same on every rank of the CP group:

            * ``loss``: 0-d float64, the batch's summed cross-entropy over its count of valid
              shifted labels (documents attending separately, padding and ``-100`` excluded):
              a plain ``Trainer``'s loss of the batch. ``eval_loss`` is ``Trainer``'s mean of
              these over the batches (each repeated ``eval_batch_size`` times, the last
              step's repeats dropped), as ``dp`` data-parallel processes of a plain
              ``Trainer`` with the same ``per_device_eval_batch_size`` report it.
            * ``predictions``: ``None`` with ``prediction_loss_only``; else a pair of ``[1, T]``
              tensors in the batch's token order (the padding removed): each token's
              log-probability of its next-token label (float64 for a float64 model, else
              float32; 0 where the label is ``-100``) and its argmax (int64, the predicted
              next token), computed chunk by chunk from the head's input (never the
              ``[T, V]`` logits). ``compute_metrics`` receives them as
              ``EvalPrediction.predictions`` (a pair of arrays, one row per batch, padded with
              ``-100`` to the longest batch).
            * ``labels``: ``None`` with ``prediction_loss_only``; else ``[1, T]`` the shifted
              labels (the target of each token, ``-100`` where none): ``label_ids``; mask
              with ``label_ids != -100``.
        """
        prepared = self._prepare_inputs(inputs)
        ids, labels, cu, padding = self.cp_padded(prepared)
        out = deepseek_v4_causal_lm_eval(
            model, ids, self.cp_mesh.cp_group, cu_seqlens=cu, labels=labels, layout=self.cp_layout,
            exchange=self.cp_exchange, ignore_index=IGNORE_INDEX, backend=self.cp_backend, padding=padding,
            chunk_size=self.cp_loss_chunk_size, return_tokens=not prediction_loss_only,
        )
        loss = out.nll.sum() / out.num_tokens.sum().clamp(min=1)
        if prediction_loss_only or out.log_probs is None or out.predictions is None:
            return loss, None, None
        return loss, (out.log_probs[None], out.predictions[None]), out.labels[None]
