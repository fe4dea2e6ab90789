"""One rank's training state under FSDP2, counted on a meta model sharded over a fake process group.

:func:`fsdp2_states` builds a Hugging Face DeepSeek-V4 model on meta, ``fully_shard``-s it as
users configure FSDP2 (each decoder layer, then the root; bf16 parameters, float32
reduction) over a fake group of ``world`` ranks, and runs an ``AdamW`` step on the shards: the
parameter and optimizer bytes are read off the tensors FSDP2 and the optimizer made, the
gather and reduce-scatter buffers computed from FSDP2's shard sizes. The whole-step memory
table (:mod:`cpkv.bench.step_memory`) takes its ``states`` column and one transient from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpkv.bench.traffic import fake_group

__all__ = ["StatesCount", "fsdp2_states"]


@dataclass(frozen=True)
class StatesCount:
    """One rank's training state under FSDP2 (rank 0: with uneven shards the largest), in bytes."""

    parameters: int
    """float32 parameter shards (FSDP2's sharded parameters on the rank)."""
    gradients: int
    """float32 gradient shards (reduce-scattered in float32, kept like the parameters)."""
    optimizer: int
    """AdamW's state on the rank's shards (two float32 moments; the step counters)."""
    gathered: int
    """Two decoder layers' parameters all-gathered in bf16 at once (the running and the prefetched one)."""
    reduce_scatter: int
    """A transient, not in :attr:`total`: the largest layer's gradient reduce-scatter (see :func:`fsdp2_states`)."""
    reduce_scatter_input: int
    """Its largest tensor: the flat float32 reduce-scatter input of the layer (``world`` padded shards)."""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.gathered


def fsdp2_states(config: Any, world: int, *, experts_dim: int = 0) -> StatesCount:
    """FSDP2 over a fake group of ``world`` ranks on the meta model: what rank 0 holds between steps.

    ``DeepseekV4ForCausalLM(config)`` is built on meta in float32, each decoder layer and then
    the root are ``fully_shard``-ed with bf16 parameters and float32 reduction
    (``MixedPrecisionPolicy``), and an ``AdamW`` step runs on the meta shards. Counted: the
    rank's parameter shards (dim 0 split as FSDP2 splits it), the optimizer's state tensors
    after the step, and each layer's all-gather output (``world`` padded shards in bf16) for
    the two largest layers. The gradient shards have the parameters' shapes and dtype (FSDP2
    reduce-scatters into them); they are not materialised here.

    ``reduce_scatter`` is what FSDP2's ``foreach_reduce`` holds after a layer's backward, from
    the same shard sizes: the layer's unsharded bf16 gradients, the float32 reduce-scatter
    input it copies them into (``world`` padded shards; a dim-1 sharded weight's gradient is
    first regrouped by ``torch.cat``, one more bf16 copy) and the float32 output shard.

    FSDP2 splits dim 0 in ``world`` chunks and pads every rank's shard to the first chunk's
    size: V4-Pro's ``[384, ...]`` experts over 256 ranks hold and gather 512 experts' worth.
    ``experts_dim=1`` shards the 3-d expert weights along dim 1 instead (``fully_shard``'s
    ``shard_placement_fn``; FSDP2 shards other dims only evenly, so where ``world`` does not
    divide dim 1 the weight stays on dim 0).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from transformers import DeepseekV4ForCausalLM

    def local(t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(t: Tensor) -> int:
        return local(t).numel() * local(t).element_size()

    def placement(p: torch.nn.Parameter) -> Shard | None:  # FSDP2 shards dims other than 0 only evenly
        return Shard(experts_dim) if p.ndim == 3 and p.shape[experts_dim] % world == 0 else None

    with torch.device("meta"):
        model = torch.nn.Module.to(DeepseekV4ForCausalLM(config), torch.float32)  # the fp32 master weights FSDP2 shards
    with fake_group(0, world):
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        parameters = [p for p in model.parameters() if p.requires_grad]
        for p in parameters:
            p.grad = torch.empty_like(p)
        optimizer = torch.optim.AdamW(parameters, foreach=False)
        optimizer.step()
        state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor))
        # FSDP2 gathers and reduce-scatters world padded shards; rank 0's shard is the padded one (torch.chunk's first)
        padded = [sum(world * local(p).numel() for p in layer.parameters()) for layer in model.model.layers]
        largest = list(model.model.layers)[padded.index(max(padded))]
        grads = sum(p.numel() for p in largest.parameters())
        regrouped = sum(p.numel() for p in largest.parameters() if experts_dim != 0 and placement(p) is not None)
        shards = sum(nbytes(p) for p in model.parameters())
        gradients = sum(nbytes(p.grad) for p in parameters if p.grad is not None)
    top = max(padded)
    return StatesCount(parameters=shards, gradients=gradients, optimizer=state, gathered=2 * sum(sorted(padded)[-2:]),
                       reduce_scatter=2 * (grads + regrouped) + 4 * top + 4 * top // world, reduce_scatter_input=4 * top)


