"""One rank's memory of a whole DeepSeek-V4 training step at 1M tokens, counted on meta tensors.

**What is counted on the real code path** (meta tensors of the true sizes, a fake process
group, this module's :class:`MemoryCounter`):

* **attention layers** (one CSA layer, ratio 4, and one HCA layer, ratio 128, at the model's
  dims; every layer of a kind is the same): Hugging Face's ``DeepseekV4Attention`` through cpkv
  (:func:`count_hf_attention`: :func:`cpkv.integrations.transformers.deepseek_v4_attention`,
  the call of a model under ``enable_deepseek_v4_cp``: low-rank queries and their norms, RoPE,
  the compressor, the indexer with its KL loss, the kv exchange, sparse attention, the inverse
  RoPE and the grouped output projection) forward + backward on this rank's ``T/cp`` tokens,
  with the **CUDA path's** kernels: :class:`~cpkv.backends.cuda.CUDABackend` with the Triton
  kernels forced and torch's ``varlen_attn``; on meta tensors every kernel is its custom op's
  fake implementation, i.e. exactly the tensors the CUDA kernels allocate.
  Columns: tensors saved for backward (``saved_tensors_hooks``, by storage, parameters
  excluded), the peak of live storages made by aten/custom ops over forward + backward (on top
  of the parameters and the input), the largest single tensor (op and shape), the exchange's
  receive buffers (outputs of cpkv's collective ops, forward) and the indexer's scores and
  selections (outputs of its top-k / score ops, forward).
* **loss**: :func:`~cpkv.integrations.causal_lm.causal_lm_loss_from_hidden` forward + backward
  at ``[T/cp, hidden]`` and the ``[V, hidden]`` head, default chunk.
* **the rest of a decoder layer** (:func:`count_decoder_rest`): Hugging Face's
  ``DeepseekV4DecoderLayer`` at the model's dims with its attention replaced by a copy: the mHC
  blocks, norms, router, shared and routed experts (through Hugging Face's ``grouped_mm``
  experts path, whose shapes are static; the eager per-expert loop's are data-dependent).
* **training state** (:func:`fsdp2_states`): ``DeepseekV4ForCausalLM(config)`` built on meta,
  ``fully_shard`` (bf16 parameters, float32 reduction) of each decoder layer and the root over a
  fake group of ``world`` ranks, and an ``AdamW`` step on the shards: the rank's float32
  parameter shards as FSDP2 pads them, as many float32 gradient bytes, AdamW's state, and two
  decoder layers' bf16 all-gather outputs (the running layer and the prefetched one).

**What is arithmetic, not counted** (labelled in the table): with activation checkpointing, the
layer inputs kept (``[T/cp, hc_mult, hidden]`` bf16 per layer) and one layer's activations
recomputed at a time; the gradient shards (the parameter shards' sizes).

The counter is checked on CPU at small sizes (:func:`counter_checks`): the same counter on
meta tensors against the allocator's peak of a real run (``torch.profiler`` memory events:
every CPU allocation and free, kernel temporaries included) with the reference backend.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpkv.backends.base import AttentionBackend
from cpkv.bench.memory import LiveBytes, no_all_to_all, storage_key
from cpkv.bench.traffic import fake_group
from cpkv.integrations.causal_lm import causal_lm_loss, causal_lm_loss_from_hidden
from cpkv.plan.attention import AttentionPlan, plan_attention
from cpkv.v4 import V4Attention, V4Config

__all__ = [
    "CounterCheck",
    "LayerCount",
    "MemoryCounter",
    "StatesCount",
    "StepRow",
    "counter_check_lines",
    "counter_checks",
    "count_decoder_rest",
    "count_layer",
    "fsdp2_states",
    "reading_lines",
    "step_memory_lines",
    "step_memory_table",
]

H200, ASCEND = 141e9, 64e9
"""Device memory in bytes: an H200 (141 GB) and a 64 GB Ascend device."""

_EXCHANGE_OPS = ("exchange", "all_gather", "reduce_scatter", "all_to_all")
_INDEXER_OPS = ("indexer", "selected_scores", "topk")


def _key(t: Tensor) -> tuple[int, int]:
    return storage_key(t), t.untyped_storage().nbytes()


class MemoryCounter(LiveBytes):  # type: ignore[no-untyped-call]
    """:class:`~cpkv.bench.memory.LiveBytes` that also keeps the largest new storage and the bytes of exchange and indexer ops.

    Temporaries inside one kernel (or inside a custom op's implementation) are not seen: on
    meta tensors a custom op is its fake, i.e. the outputs its kernel allocates.
    """

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.largest_op = ""
        self.kinds = {"exchange": 0, "indexer": 0}
        self.forward = True

    def made(self, func: Any, tensor: Tensor, nbytes: int) -> None:
        if nbytes > self.largest:
            self.largest = nbytes
            self.largest_op = f"{func} -> {list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"
        for kind, names in (("exchange", _EXCHANGE_OPS), ("indexer", _INDEXER_OPS)):
            if self.forward and any(n in str(func) for n in names):
                self.kinds[kind] += nbytes


@contextmanager
def saved_bytes(exclude: set[int]) -> Iterator[dict[int, int]]:
    """Storages saved for backward while active (``{storage key: bytes}``), those in ``exclude`` left out."""
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        key, nbytes = _key(t)
        if key not in exclude:
            saved[key] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


@dataclass(frozen=True)
class LayerCount:
    """One attention layer's forward + backward on one rank, in bytes (see the module docstring)."""

    saved: int
    peak: int
    largest: int
    largest_op: str
    exchange: int
    indexer: int


def _count_call(module: torch.nn.Module, x: Tensor, call: Callable[[Tensor], Tensor], cp: int, rank: int) -> LayerCount:
    """Count ``call(x)``'s forward + backward (``module``'s parameters and buffers excluded; ``x`` counted as kept)."""
    params = {_key(t)[0] for t in [*module.parameters(), *module.buffers()]}
    counter = MemoryCounter()
    with fake_group(rank, cp), no_all_to_all():
        with counter, saved_bytes(params | {_key(x)[0]}) as saved:
            out = call(x)
        saved_total = sum(saved.values()) + x.numel() * x.element_size()  # the input is kept too
        counter.forward = False
        with counter:
            out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]
            del out
    return LayerCount(saved_total, counter.peak, counter.largest, counter.largest_op, counter.kinds["exchange"],
                      counter.kinds["indexer"])


def count_layer(config: V4Config, plan: AttentionPlan, cp: int, rank: int, backend: Any, *, device: str = "meta",
                dtype: torch.dtype = torch.bfloat16) -> LayerCount:
    """Count one :class:`~cpkv.v4.V4Attention` forward + backward on ``plan``'s tokens (the plan on ``device``)."""
    with torch.device(device):
        layer = V4Attention(config).to(dtype)
    x = torch.empty(plan.local_len, config.hidden, device=device, dtype=dtype).normal_().requires_grad_()
    return _count_call(layer, x, lambda t: layer(t, plan, None, backend=backend).out, cp, rank)


def _hf_attention(config: Any, layer_index: int, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

    with torch.device(device):
        return DeepseekV4Attention(config, layer_index).to(dtype), DeepseekV4RotaryEmbedding(config)


def count_hf_attention(config: Any, layer_index: int, plan: AttentionPlan, cp: int, rank: int, backend: Any, *,
                       device: str = "meta", dtype: torch.dtype = torch.bfloat16, indexer_loss: bool = True) -> LayerCount:
    """Count Hugging Face's ``DeepseekV4Attention`` (layer ``layer_index`` of ``config``) through cpkv, forward + backward.

    The call a model under :func:`~cpkv.integrations.transformers_lm.enable_deepseek_v4_cp` makes:
    :func:`~cpkv.integrations.transformers.deepseek_v4_attention` (low-rank queries with their
    norms, RoPE, the compressor and indexer, with the indexer's KL loss when ``indexer_loss``,
    the kv exchange, sparse attention, the inverse RoPE and the grouped output projection).
    """
    from cpkv.integrations.transformers import deepseek_v4_attention

    attn, rotary = _hf_attention(config, layer_index, device, dtype)
    x = torch.empty(plan.local_len, int(config.hidden_size), device=device, dtype=dtype).normal_().requires_grad_()

    def call(t: Tensor) -> Tensor:
        return deepseek_v4_attention(attn, t, plan, None, backend=backend, indexer_loss=indexer_loss, rotary_emb=rotary).out

    return _count_call(attn, x, call, cp, rank)


def cuda_path_backend() -> AttentionBackend:
    """The CUDA path on any device: :class:`CUDABackend` with the Triton kernels and torch's ``varlen_attn`` forced."""
    from torch.nn.attention.varlen import varlen_attn

    from cpkv.backends.cuda import CUDABackend

    forced = functools.wraps(varlen_attn)(lambda *a, **k: varlen_attn(*a, **k))  # not torch's own: no device check
    return CUDABackend(forced, triton_kernels=True)


class _NoAttention(torch.nn.Module):
    """Stands in for a decoder layer's attention: its output a new tensor, as the output projection's is."""

    def forward(self, x: Tensor, **_kwargs: Any) -> tuple[Tensor, None]:
        return x.clone(), None


def _decoder_rest(config: Any, tokens: int, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Tensor]:
    """A learned-router decoder layer of ``config`` with :class:`_NoAttention`, and a ``[1, tokens, hc_mult, hidden]`` input."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer

    config = copy.deepcopy(config)
    config._experts_implementation = "grouped_mm"
    with torch.device(device):
        layer = DeepseekV4DecoderLayer(config, list(config.mlp_layer_types).index("moe")).to(dtype)
    layer.self_attn = _NoAttention()  # type: ignore[assignment]
    x = torch.empty(1, tokens, int(config.hc_mult), int(config.hidden_size), device=device, dtype=dtype).normal_()
    return layer, x.requires_grad_()


def count_decoder_rest(config: Any, tokens: int, *, device: str = "meta", dtype: torch.dtype = torch.bfloat16) -> LayerCount:
    """One Hugging Face ``DeepseekV4DecoderLayer`` forward + backward on ``tokens`` tokens, its attention removed.

    What remains is what a decoder layer adds around cpkv's attention: the two mHC blocks (in
    fp32, as Hugging Face computes them), the two RMSNorms, the router, the shared expert and
    the routed experts through Hugging Face's ``grouped_mm`` experts path (static shapes: every
    token's ``k`` expert rows, sorted by expert; the path GPU runs take). The attention is a
    stand-in returning a copy of its input (what the attention itself saves is counted by
    :func:`count_layer`). A learned-router (``"moe"``) layer; hash-routed layers differ only in
    the router. ``peak`` includes the layer's parameter gradients (all its experts: FSDP2
    reduce-scatters them after the layer's backward; expert parallelism would shard them).
    """
    layer, x = _decoder_rest(config, tokens, device, dtype)
    params = {_key(t)[0] for t in [*layer.parameters(), *layer.buffers()]}
    counter = MemoryCounter()
    with counter, saved_bytes(params) as saved:  # the layer input counts: its mHC blocks save it
        out = layer(x)
    counter.forward = False
    with counter:
        out.backward(torch.ones_like(out))
        del out
    return LayerCount(sum(saved.values()), counter.peak, counter.largest, counter.largest_op, 0, 0)


@dataclass(frozen=True)
class StepRow:
    """One (model, cp, checkpointing) row of the whole-step table, bytes."""

    model: str
    cp: int
    tokens: int
    checkpointing: bool
    states: int
    states_experts_on_dim1: int
    attention_saved: int
    rest_saved: int
    checkpoints: int
    largest: str
    transient_in: str
    transient: int
    exchange: int
    indexer: int
    loss: int

    @property
    def activations(self) -> int:
        """Saved activations of the step (all layers; with checkpointing: the kept inputs and one layer's)."""
        return self.checkpoints + self.attention_saved + self.rest_saved

    @property
    def total(self) -> int:
        """States, activations and the larger of the attention's backward transient and the loss."""
        return self.states + self.activations + max(self.transient, self.loss)


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

    with torch.device("meta"):
        model = torch.nn.Module.to(DeepseekV4ForCausalLM(config), torch.float32)  # the fp32 master weights FSDP2 shards
    with fake_group(0, world):
        mesh = init_device_mesh("cpu", (world,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        def placement(p: torch.nn.Parameter) -> Shard | None:
            return Shard(experts_dim) if p.ndim == 3 and p.shape[experts_dim] % world == 0 else None  # FSDP2: even only

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        parameters = [p for p in model.parameters() if p.requires_grad]
        for p in parameters:
            p.grad = torch.empty_like(p)
        optimizer = torch.optim.AdamW(parameters, foreach=False)
        optimizer.step()
        state = sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor))
        # FSDP2 all-gathers world padded shards; rank 0's shard is the padded one (torch.chunk's first)
        layers = sorted(sum(world * local(p).numel() * 2 for p in layer.parameters()) for layer in model.model.layers)
        shards = sum(nbytes(p) for p in model.parameters())
        largest = max(model.model.layers, key=lambda layer: sum(p.numel() for p in layer.parameters()))
        padded = sum(world * local(p).numel() for p in largest.parameters())
        regrouped = sum(p.numel() for p in largest.parameters() if experts_dim != 0 and placement(p) is not None)
        grads = sum(p.numel() for p in largest.parameters())
    return StatesCount(parameters=shards, gradients=sum(nbytes(p) for p in parameters), optimizer=state,
                       gathered=sum(layers[-2:]), reduce_scatter=2 * (grads + regrouped) + 4 * padded + 4 * padded // world,
                       reduce_scatter_input=4 * padded)


def _loss_peak(tokens: int, hidden: int, vocab: int) -> int:
    h = torch.empty(tokens, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    w = torch.empty(vocab, hidden, device="meta", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.zeros(tokens, device="meta", dtype=torch.int64)
    counter = MemoryCounter()
    with fake_group(0, 1), counter:
        causal_lm_loss_from_hidden(h, w, labels, None, num_items_in_batch=tokens).backward()  # type: ignore[no-untyped-call]
    return counter.peak


def tiny_v4_config() -> Any:
    """A two-layer DeepSeek-V4 config (one CSA, one HCA layer; hidden 256, 4 experts, 2 per token) for smoke runs and the counter check."""
    from transformers import DeepseekV4Config

    return DeepseekV4Config(hidden_size=256, num_attention_heads=4, head_dim=64, index_n_heads=2, index_head_dim=32,
                            num_hidden_layers=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
                            mlp_layer_types=["moe", "moe"], n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            vocab_size=1024,
                            q_lora_rank=64, o_lora_rank=64, o_groups=2)


def step_memory_table(tokens: int, cps: list[int], world: int, *, smoke: bool = False) -> list[StepRow]:
    """Every model x cp x (without, with activation checkpointing), balanced layout, need exchange, one document."""
    from transformers import DeepseekV4Config

    from cpkv.bench.layouts import v4_pro_config
    from cpkv.integrations.transformers import deepseek_v4_plan_options

    models = {"V4-Flash": DeepseekV4Config(), "V4-Pro": v4_pro_config()}
    if smoke:
        models = {"tiny": tiny_v4_config()}
    rows: list[StepRow] = []
    backend = cuda_path_backend()
    for name, config in models.items():
        fsdp2 = fsdp2_states(config, world)
        states, experts_on_dim1 = fsdp2.total, fsdp2_states(config, world, experts_dim=1).total
        options = deepseek_v4_plan_options(config)
        types = list(config.layer_types)
        kinds = {int(r): types.count(t) for t, r in dict(config.compress_rates).items()}  # ratio -> layers of it
        first = {int(r): types.index(t) for t, r in dict(config.compress_rates).items()}  # ratio -> its first layer
        for cp in cps:
            rank = cp - 1
            with fake_group(rank, cp):
                plan = plan_attention(torch.tensor([0, tokens]), cp, rank, layout="balanced", exchange="need",
                                      check_ranks=False, **options)
            plan = plan.to(torch.device("meta"))
            counts = {r: count_hf_attention(config, first[r], plan, cp, rank, backend) for r in kinds}
            local = plan.local_len
            rest = count_decoder_rest(config, local)
            loss = _loss_peak(local, int(config.hidden_size), int(config.vocab_size))
            parts = {f"ratio-{r} attention": c for r, c in counts.items()} | {"decoder rest": rest}
            transients = {k: c.peak - c.saved for k, c in parts.items()} | {"FSDP2 reduce-scatter": fsdp2.reduce_scatter}
            where = max(transients, key=lambda k: transients[k])
            tensors = {k: (c.largest, f"{k}: {c.largest_op}") for k, c in parts.items()}
            tensors["FSDP2"] = (fsdp2.reduce_scatter_input, f"FSDP2 reduce-scatter input -> [{fsdp2.reduce_scatter_input // 4}] float32")
            common = {"model": name, "cp": cp, "tokens": local, "states": states, "states_experts_on_dim1": experts_on_dim1,
                      "largest": max(tensors.values())[1], "transient_in": where, "transient": transients[where], "loss": loss,
                      "exchange": max(c.exchange for c in counts.values()), "indexer": max(c.indexer for c in counts.values())}
            layers = sum(kinds.values())
            rows.append(StepRow(checkpointing=False, attention_saved=sum(n * counts[r].saved for r, n in kinds.items()),
                                rest_saved=layers * rest.saved, checkpoints=0, **common))  # type: ignore[arg-type]
            layer_input = local * int(config.hc_mult) * int(config.hidden_size) * 2
            rows.append(StepRow(checkpointing=True, attention_saved=max(c.saved for c in counts.values()),
                                rest_saved=rest.saved - layer_input, checkpoints=layers * layer_input,
                                **common))  # type: ignore[arg-type]
    return rows


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def step_memory_lines(rows: list[StepRow], tokens: int, world: int) -> list[str]:
    """The whole-step table and its header."""
    lines = [
        "", f"## Memory of a whole training step per rank at {tokens:,} tokens (counted on meta tensors)", "",
        f"`python -m cpkv.bench memory` (`cpkv/bench/step_memory.py`): one document of {tokens:,} tokens, balanced layout,"
        " need exchange, bf16, the last rank. GB = 1e9 bytes. Columns and what each counts:", "",
        f"* `states`: counted: FSDP2 over a fake group of {world} ranks on the HF model built on meta (`fully_shard` of each"
        " decoder layer and the root, bf16 parameters, fp32 reduction): the rank's fp32 parameter shards as FSDP2 pads"
        " them, as many fp32 gradient bytes, AdamW's state after a step on the shards, and two decoder layers' bf16"
        " all-gather outputs (the running and the prefetched layer).",
        "* `attention saved`: counted: what the CSA and HCA layers save for backward (Hugging Face's `DeepseekV4Attention`"
        " through cpkv's `deepseek_v4_attention`, the indexer's KL loss on, with the CUDA path's custom-op fakes:"
        " `varlen_attn`, the Triton sparse and indexer ops), summed over the model's layers"
        " (with checkpointing: the one layer recomputed at a time).",
        "* `rest saved`: counted: what the rest of a decoder layer saves (Hugging Face's `DeepseekV4DecoderLayer` with"
        " its attention replaced by a copy: the two mHC blocks, computed in fp32 as Hugging Face does, the RMSNorms, the"
        " router, the shared expert and the routed experts through Hugging Face's `grouped_mm` path; its input"
        " included), all layers (with checkpointing: one layer, its input left to `ckpt inputs`). `ckpt inputs`: with"
        " checkpointing, every layer's `[T/cp, hc_mult, hidden]` bf16 input.",
        "* `transient`: the largest of: the forward+backward peak above what a layer saves (counted) of the CSA and HCA"
        " attention layers and of the decoder rest (whose includes its parameter gradients, every expert's, unsharded"
        " until FSDP2 reduce-scatters them), and FSDP2's reduce-scatter of the largest layer (from the counted shard"
        " sizes: the layer's unsharded bf16 gradients, the fp32 reduce-scatter input they are copied into and its output"
        " shard); which one in brackets. `largest`: the largest single tensor of these. `exchange`: counted: the forward receive buffers of one layer (cpkv's collective ops);"
        " `indexer`: counted: the indexer's scores and selections of a CSA layer (forward outputs of its ops).",
        "* `loss`: counted: the chunked loss's peak (`causal_lm_loss_from_hidden`, 1,024-token chunks, forward + backward).",
        "* `total` = states + activations + max(transient, loss); fits: an H200 (141 GB) / a 64 GB device.", "",
        "| model | cp | T/cp | ckpt | states | attention saved | rest saved | ckpt inputs | transient | largest tensor"
        " (op) | exchange | indexer | loss | total | H200 | 64 GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fits = ["yes" if r.total <= cap else "no" for cap in (H200, ASCEND)]
        lines.append(
            f"| {r.model} | {r.cp} | {r.tokens:,} | {'yes' if r.checkpointing else 'no'} | {_gb(r.states)} |"
            f" {_gb(r.attention_saved)} | {_gb(r.rest_saved)} | {_gb(r.checkpoints)} | {_gb(r.transient)} ({r.transient_in}) |"
            f" `{r.largest}` | {_gb(r.exchange)} | {_gb(r.indexer)} | {_gb(r.loss)} | {_gb(r.total)} | {fits[0]} | {fits[1]} |"
        )
    return lines


def _fits_clause(parts: list[StepRow]) -> str:
    """Which devices the rows' totals fit and from which cp, e.g. "it fits an H200 from cp 32 but no 64 GB device at any of cp 8-64"."""
    span = f"cp {min(r.cp for r in parts)}-{max(r.cp for r in parts)}"
    fit, miss = [], []
    for device, cap in (("H200", H200), ("64 GB device", ASCEND)):
        ok = [r.cp for r in parts if r.total <= cap]
        if ok:
            fit.append(f"{'an' if device[0] == 'H' else 'a'} {device} from cp {min(ok)}")
        else:
            miss.append(device)
    if not fit:
        return f"it fits neither an H200 nor a 64 GB device at any of {span}"
    if not miss:
        return "it fits " + " and ".join(fit)
    return f"it fits {fit[0]} but no {miss[0]} at any of {span}"


def reading_lines(rows: list[StepRow]) -> list[str]:
    """One paragraph read off the rows: what dominates, and the smallest cp that fits each device."""
    sentences = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        for ckpt in (False, True):
            parts = [r for r in mine if r.checkpointing == ckpt]
            if not parts:
                continue
            worst = min(parts, key=lambda r: r.cp)
            terms = {"states": worst.states, "attention activations": worst.attention_saved, "decoder-rest activations (mHC, MoE, norms)": worst.rest_saved,
                     "checkpointed layer inputs": worst.checkpoints}
            top = max(terms, key=lambda k: terms[k])
            sentences.append(
                f"{model} {'with' if ckpt else 'without'} activation checkpointing: {top} dominate"
                f" ({_gb(terms[top])} of {_gb(worst.total)} GB at cp {worst.cp}); {_fits_clause(parts)}."
            )
    for model in dict.fromkeys(r.model for r in rows):
        first = next(r for r in rows if r.model == model)
        if first.states > 1.01 * first.states_experts_on_dim1:
            sentences.append(
                f"FSDP2 pads each rank's shard of dim 0 to the first one's size: {model}'s states are {_gb(first.states)} GB"
                f" a rank, {_gb(first.states_experts_on_dim1)} GB with its 3-d expert weights sharded on dim 1 instead"
                " (`fully_shard(..., shard_placement_fn=lambda p: Shard(1) if p.ndim == 3 else None)`): when the world"
                " does not divide the expert count, the padding is whole experts.")
    largest = max(rows, key=lambda r: r.transient)
    return ["", "Reading: " + " ".join(sentences) + " The loss (chunked) and the exchange's receive buffers stay a few GB"
            f" at every cp. The largest transient is {_gb(largest.transient)} GB ({largest.model}, cp {largest.cp}, in the"
            f" {largest.transient_in}; the largest tensor `{largest.largest}`): without expert parallelism a layer's"
            " backward makes every expert's unsharded gradient, and FSDP2 copies the layer's gradients into one fp32"
            " reduce-scatter input (a bf16 `reduce_dtype` would halve it). Of the decoder rest's"
            " activations, Hugging Face's mHC blocks, computed in fp32 on the flattened `[T/cp, hc_mult * hidden]` streams,"
            " save about as much as the MoE; a fused mHC kernel saving its bf16 input would remove most of it."
            " What the table does not show: expert parallelism (the states and the expert gradients shrink with the"
            " expert-parallel size) and activation offloading."]


@dataclass(frozen=True)
class CounterCheck:
    """The counter on meta tensors and on real CPU tensors, and the CPU allocator's measured peak, bytes."""

    case: str
    counted: int
    counted_cpu: int
    measured: int
    measured_outputs: int


def _profiled_peaks(run: Callable[[], None]) -> tuple[int, int]:
    """Peaks of the CPU allocator's live bytes during ``run()``: as measured, and with cpkv's custom ops as their outputs.

    ``torch.profiler`` memory events (every allocation and free, in time order). The second
    peak replaces the events inside each outermost ``cpkv::`` custom op by one event of their
    net bytes at the op's end: what remains of the op (its outputs, less what it freed), its
    internal temporaries (the reference implementation's) left out.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    results: Any = prof.profiler.kineto_results if prof.profiler is not None else None
    events = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    windows: list[tuple[int, int]] = []
    for start, end in sorted((e.start_ns(), e.end_ns()) for e in results.events() if e.name().startswith("cpkv::")):
        if windows and start <= windows[-1][1]:
            windows[-1] = (windows[-1][0], max(windows[-1][1], end))
        else:
            windows.append((start, end))
    merged: dict[int, int] = {}
    for time_ns, nbytes in events:
        inside = next((end for start, end in windows if start <= time_ns <= end), None)
        key = time_ns if inside is None else inside
        merged[key] = merged.get(key, 0) + nbytes
    return _running_peak(events), _running_peak(sorted(merged.items()))


def _running_peak(events: list[tuple[int, int]]) -> int:
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak


def _counted_peak(run: Callable[[], None]) -> int:
    counter = MemoryCounter()
    with counter:
        run()
    return counter.peak


def _check(case: str, make: Callable[[str], Callable[[], None]]) -> CounterCheck:
    """``make(device)`` builds the inputs on ``device`` and returns the run (forward + backward) to measure."""
    measured, outputs_only = _profiled_peaks(make("cpu"))
    return CounterCheck(case, _counted_peak(make("meta")), _counted_peak(make("cpu")), measured, outputs_only)


def _loss_run(tokens: int, hidden: int, vocab: int, chunked: bool) -> Callable[[str], Callable[[], None]]:
    def make(device: str) -> Callable[[], None]:
        h = torch.empty(tokens, hidden, device=device).normal_().requires_grad_()
        w = torch.empty(vocab, hidden, device=device).normal_().requires_grad_()
        labels = torch.zeros(tokens, device=device, dtype=torch.int64)

        def run() -> None:
            with fake_group(0, 1):
                if chunked:
                    loss = causal_lm_loss_from_hidden(h, w, labels, None, num_items_in_batch=tokens, chunk_size=256)
                else:
                    loss = causal_lm_loss(torch.nn.functional.linear(h, w), labels, None, num_items_in_batch=tokens)
                loss.backward()  # type: ignore[no-untyped-call]

        return run

    return make


def _planned_run(plan: AttentionPlan, cp: int, rank: int,
                 build: Callable[[str, AttentionPlan], Callable[[Tensor], Tensor]], hidden: int) -> Callable[[str], Callable[[], None]]:
    """``make(device)`` for :func:`_check`: ``build(device, plan)`` gives the layer call, run forward + backward on the last rank."""

    def make(device: str) -> Callable[[], None]:
        on_device = plan.to(torch.device(device))
        call = build(device, on_device)
        x = torch.empty(on_device.local_len, hidden, device=device).normal_().requires_grad_()

        def run() -> None:
            with fake_group(rank, cp), no_all_to_all():
                out = call(x)
                out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]

        return run

    return make


def _layer_run(ratio: int, tokens: int, cp: int) -> Callable[[str], Callable[[], None]]:
    config = V4Config(hidden=256, heads=4, head_dim=64, rope_dim=16, window=16, compress_ratio=ratio, topk=16,
                      index_heads=2, index_head_dim=32)
    rank = cp - 1
    with fake_group(rank, cp):
        plan = plan_attention(torch.tensor([0, tokens]), cp, rank, exchange="need", compress_ratios=[ratio],
                              windows=[16], check_ranks=False)

    def build(device: str, on_device: AttentionPlan) -> Callable[[Tensor], Tensor]:
        with torch.device(device):
            layer = V4Attention(config)
        return lambda x: layer(x, on_device, None, backend="reference").out

    return _planned_run(plan, cp, rank, build, config.hidden)


def _hf_attention_run(layer_index: int, tokens: int, cp: int) -> Callable[[str], Callable[[], None]]:
    from cpkv.integrations.transformers import deepseek_v4_attention, deepseek_v4_plan_options

    config, rank = tiny_v4_config(), cp - 1
    with fake_group(rank, cp):
        plan = plan_attention(torch.tensor([0, tokens]), cp, rank, exchange="need", check_ranks=False,
                              **deepseek_v4_plan_options(config))

    def build(device: str, on_device: AttentionPlan) -> Callable[[Tensor], Tensor]:
        attn, rotary = _hf_attention(config, layer_index, device, torch.float32)
        return lambda x: deepseek_v4_attention(attn, x, on_device, None, backend="reference", indexer_loss=True,
                                               rotary_emb=rotary).out

    return _planned_run(plan, cp, rank, build, int(config.hidden_size))


def _rest_run(tokens: int) -> Callable[[str], Callable[[], None]]:
    def make(device: str) -> Callable[[], None]:
        layer, x = _decoder_rest(tiny_v4_config(), tokens, device, torch.bfloat16)  # grouped_mm takes bf16 only

        def run() -> None:
            out = layer(x)
            out.backward(torch.ones_like(out))

        return run

    return make


def counter_checks(*, smoke: bool = False) -> list[CounterCheck]:
    """The counter (meta and CPU tensors) vs the CPU allocator, float32, at small sizes."""
    tokens, vocab = (256, 1024) if smoke else (2048, 8192)
    checks = [_check(f"chunked loss, T {tokens}, V {vocab}, H 64", _loss_run(tokens, 64, vocab, True)),
              _check(f"whole-logits loss, T {tokens}, V {vocab}, H 64", _loss_run(tokens, 64, vocab, False))]
    for ratio in (4, 128):
        checks.append(_check(f"cpkv.v4 attention layer, ratio {ratio}, T/cp {tokens // 4} (cp 4)", _layer_run(ratio, tokens, 4)))
    for index, kind in enumerate(tiny_v4_config().layer_types):
        checks.append(_check(f"Hugging Face attention ({kind}), T/cp {tokens // 4} (cp 4)", _hf_attention_run(index, tokens, 4)))
    checks.append(_check(f"decoder rest, bf16 (hidden 256, 4 experts of 64, 2 per token), T {tokens}", _rest_run(tokens)))
    return checks


def counter_check_lines(checks: list[CounterCheck]) -> list[str]:
    """The check table."""
    lines = [
        "", "Counter check, CPU, float32 (the decoder rest bf16): the counter's peak of a forward + backward on meta tensors and on real CPU"
        " tensors, against the CPU allocator's measured peak of the real run (`torch.profiler` memory events: every"
        " allocation and free, temporaries inside kernels and inside the reference backend's custom ops included), and"
        " the same events with each `cpkv::` custom op's events replaced by their net at the op's end (the op as its"
        " outputs: what its fake, and a kernel keeping its tiles on chip, allocates). cpkv.v4 attention layers: hidden 256,"
        " 4 heads of 64, window 16, top-k 16; Hugging Face attention and decoder rest: `tiny_v4_config()` (hidden 256,"
        " 4 heads of 64, its CSA and HCA layer); last rank of cp 4, need exchange, reference backend.", "",
        "| case | counted on meta MiB | counted on CPU MiB | measured MiB | measured, custom ops as outputs MiB |"
        " meta / measured | meta / measured (outputs) |", "|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(f"| {c.case} | {c.counted / 2**20:.2f} | {c.counted_cpu / 2**20:.2f} | {c.measured / 2**20:.2f} |"
                     f" {c.measured_outputs / 2**20:.2f} | {c.counted / max(c.measured, 1):.3f} |"
                     f" {c.counted / max(c.measured_outputs, 1):.3f} |")
    return lines
