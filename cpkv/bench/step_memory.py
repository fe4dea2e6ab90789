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
* **training state** (:func:`cpkv.bench.fsdp2_states.fsdp2_states`): ``DeepseekV4ForCausalLM(config)`` built on meta,
  ``fully_shard`` (bf16 parameters, float32 reduction) of each decoder layer and the root over a
  fake group of ``world`` ranks, and an ``AdamW`` step on the shards: the rank's float32
  parameter shards as FSDP2 pads them, as many float32 gradient bytes, AdamW's state, and two
  decoder layers' bf16 all-gather outputs (the running layer and the prefetched one); and, as a
  transient, FSDP2's reduce-scatter of the largest layer's gradients.

**What is arithmetic, not counted** (labelled in the table): with activation checkpointing, the
layer inputs kept (``[T/cp, hc_mult, hidden]`` bf16 per layer) and one layer's activations
recomputed at a time; the gradient shards (the parameter shards' sizes).

The counter is checked on CPU at small sizes (:func:`cpkv.bench.memory_check.counter_checks`): the same counter on
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
from cpkv.bench.fsdp2_states import fsdp2_states
from cpkv.bench.traffic import fake_group
from cpkv.integrations.causal_lm import causal_lm_loss_from_hidden
from cpkv.plan.attention import AttentionPlan, plan_attention
from cpkv.v4 import V4Attention, V4Config

__all__ = [
    "LayerCount",
    "MemoryCounter",
    "StepRow",
    "count_decoder_rest",
    "count_layer",
    "cuda_path_backend",
    "decoder_rest",
    "hf_attention_module",
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


def hf_attention_module(config: Any, layer_index: int, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Any]:
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

    attn, rotary = hf_attention_module(config, layer_index, device, dtype)
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


def decoder_rest(config: Any, tokens: int, device: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Tensor]:
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
    layer, x = decoder_rest(config, tokens, device, dtype)
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
        """States, activations and the larger of the transient (a layer's backward or FSDP2's reduce-scatter) and the loss."""
        return self.states + self.activations + max(self.transient, self.loss)


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
            tensors["FSDP2"] = (fsdp2.reduce_scatter_input,
                                f"FSDP2 reduce-scatter input -> [{fsdp2.reduce_scatter_input // 4}] float32")
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
        f"* `states`: counted (`cpkv/bench/fsdp2_states.py`): FSDP2 over a fake group of {world} ranks on the HF model"
        " built on meta (`fully_shard` of each decoder layer and the root, bf16 parameters, fp32 reduction): the rank's fp32 parameter shards as FSDP2 pads"
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
        " shard); which one in brackets. `largest`: the largest single tensor of these. `exchange`: counted: the forward"
        " receive buffers of one layer (cpkv's collective ops);"
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
    fit: list[str] = []
    miss: list[str] = []
    for article, device, cap in (("an", "H200", H200), ("a", "64 GB device", ASCEND)):
        ok = [r.cp for r in parts if r.total <= cap]
        (fit if ok else miss).append(f"{article} {device} from cp {min(ok)}" if ok else device)
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
