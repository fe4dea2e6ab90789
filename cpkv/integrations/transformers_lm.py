"""A whole Hugging Face ``DeepseekV4ForCausalLM`` under CP: one call per micro-batch, ids to loss.

:func:`enable_deepseek_v4_cp` gives every ``DeepseekV4Attention`` of a model a forward that
runs through :func:`cpkv.integrations.transformers.deepseek_v4_attention` when the call
carries a :class:`DeepseekV4CPContext` in its keyword arguments (``cpkv_context=``), and is
Hugging Face's own forward otherwise. Nothing is renamed or re-parented: the module keeps
its class and parameters (``state_dict``, ``save_pretrained`` and name-based optimizer groups
see the unwrapped model), and the model's embeddings, hyper-connections, MoE (hash-routed
and learned), norms and head run as Hugging Face wrote them, on this rank's tokens.

The plan travels in the forward's keyword arguments, which Hugging Face hands to every
layer: no global state and no plan on a module, so activation checkpointing (which replays a
layer with the keyword arguments of its own forward) recomputes each micro-batch with its
own plan, however many forwards run before a backward.

What the layers hand back (their indexer losses, and the count of layers that ran under CP)
goes into the context's :class:`LayerRecords`, one object per call that wrappers pass
through by reference. FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` (through
``torch.distributed.utils._apply_to_tensors``) rebuilds every dataclass and dict of the
forward's arguments, at the root and again at each wrapped layer; DDP's device move rebuilds
dicts, lists and tuples; activation checkpointing replays a layer with the arguments it saw.
Each copy of the (frozen) context keeps the same :class:`LayerRecords`, which is neither a
dict nor a dataclass, so every layer writes into the call's one record.

:func:`deepseek_v4_causal_lm_loss` is the one call: packed ids with ``cu_seqlens`` (or
Hugging Face's restart-at-0 ``position_ids``) to this rank's loss, with the labels shifted
before sharding and the loss normalised by the CP group's valid-label count
(:mod:`cpkv.integrations.causal_lm`). It passes ``attention_mask={"cpkv": None}``, which
Hugging Face's ``DeepseekV4Model`` takes as an already-built mask: no ``[T/cp, T/cp]`` mask
is made (cpkv's plan is the mask).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.backends.base import AttentionBackend, BackendName
from cpkv.checks import check_int
from cpkv.agreement import agree
from cpkv.collectives import Group, check_group, check_same_on_all_ranks
from cpkv.integrations.causal_lm import (
    GradReduction,
    batch_fingerprint,
    check_given_plan,
    causal_lm_loss_from_hidden,
    cu_seqlens_from_position_ids,
    global_valid_count,
    grad_reduction_scale,
    shard_by_plan,
    shift_labels,
)
from cpkv.integrations.hf_v4_forms import check_deepseek_v4_forms
from cpkv.integrations.linear_cross_entropy import DEFAULT_CHUNK_SIZE
from cpkv.integrations.transformers import deepseek_v4_attention, deepseek_v4_plan_options
from cpkv.plan.attention import AttentionPlan, Exchange, Layout, plan_attention
from cpkv.plan.conventions import validate_cu_seqlens
from cpkv.status import StepStatus

__all__ = [
    "CONTEXT_KWARG",
    "DeepseekV4CPContext",
    "LayerRecords",
    "DeepseekV4Batch",
    "DeepseekV4CausalLMOutput",
    "deepseek_v4_causal_lm_loss",
    "enable_deepseek_v4_cp",
    "plan_deepseek_v4_batch",
    "run_deepseek_v4_batch",
]

Result = TypeVar("Result")

CONTEXT_KWARG = "cpkv_context"
"""The keyword argument of a model's forward that carries the :class:`DeepseekV4CPContext`."""


class _Record:
    """One entry of a :class:`LayerRecords`: the layer (index or module) that recorded, its loss, the entry before it."""

    def __init__(self, layer: Any, loss: Tensor | None, before: _Record | None) -> None:
        self.layer = layer
        self.loss = loss
        self.before = before


class LayerRecords(Mapping[int, "Tensor | None"]):
    """What the attention layers of one forward under CP wrote: layer index -> its indexer loss.

    A read-only mapping to its readers; the layers write with :meth:`record`. On purpose
    neither a ``dict`` nor a dataclass: wrappers that rebuild a forward's arguments (FSDP2's
    input casting, DDP's ``_to_kwargs``) copy those and pass any other object through, so
    every copy of a :class:`DeepseekV4CPContext` holds this same object and the call reads
    what every layer wrote. One per forward; never shared between calls.

    Held as a chain of entries, each pointing to the one before, that a layer extends by
    replacing one attribute: a layer compiled with ``torch.compile`` writes without reading
    what the layers before it wrote and without a layer index of its own in the graph
    (Dynamo guards on the keys and values of a dict it writes into, and on a module's integer
    attributes it reads: with a dict keyed by layer index every layer compiled a graph of its
    own, and a model of many layers hit Dynamo's recompile limit). cpkv's layers record
    themselves (the module), whose ``layer_idx`` is read when the mapping is read.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = _Record(None, None, None)  # a root entry: every layer finds an entry, not None, before its own

    def record(self, layer: int | torch.nn.Module, loss: Tensor | None) -> None:
        """Layer ``layer`` ran under CP; ``loss``: its indexer loss (detached), ``None`` when it has none.

        ``layer``: the layer index, or the attention module itself (its ``layer_idx`` is read
        when the mapping is read: what a compiled layer passes, so that no index enters its
        graph). A layer recomputed by activation checkpointing records again; the last record counts.
        """
        self._last = _Record(layer, loss, self._last)

    def _losses(self) -> dict[int, Tensor | None]:
        """Layer index -> its last recorded loss (read outside any compiled region)."""
        losses: dict[int, Tensor | None] = {}
        entry: _Record | None = self._last
        while entry is not None and entry.layer is not None:
            layer = entry.layer
            losses.setdefault(layer if isinstance(layer, int) else int(layer.layer_idx), entry.loss)
            entry = entry.before
        return losses

    def __getitem__(self, layer: int) -> Tensor | None:
        return self._losses()[layer]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._losses()))

    def __len__(self) -> int:
        return len(self._losses())

    def __repr__(self) -> str:
        return f"LayerRecords(layers={sorted(self._losses())})"


@dataclasses.dataclass(frozen=True, eq=False)
class DeepseekV4CPContext:
    """What one forward of a CP-enabled DeepSeek-V4 model needs, passed as ``model(..., cpkv_context=ctx)``.

    Made once per forward (micro-batch); never stored on a module.

    Attributes:
        plan: this rank's :class:`~cpkv.AttentionPlan` of the micro-batch, planned with
            :func:`~cpkv.integrations.transformers.deepseek_v4_plan_options`.
        group: the CP group (a ``ProcessGroup`` or a 1-D ``DeviceMesh``; ``None``: the default group).
        backend: as in :func:`cpkv.attention_forward`.
        indexer_loss: CSA layers: train the indexer with cpkv's KL loss.
        grad_scale: multiplies the indexer-loss gradients.
        records: filled by the forward (:class:`LayerRecords`): layer index -> its indexer
            loss (``sum_t KL_t`` over this rank's queries, detached; ``None`` when the layer
            has none). Copies of the context made by wrappers share it.
        status: the :class:`~cpkv.StepStatus` every layer call reports to (no host sync in
            a layer); check it after the forward. ``None``: each layer checks at once.
        longest_document: tokens of the micro-batch's longest document, padding included (a
            host int: which compressors one process trains). ``None``: read from ``plan`` in
            every layer call (a host read per call when the plan is on an accelerator).
    """

    plan: AttentionPlan
    group: Group = None
    backend: BackendName | AttentionBackend = "auto"
    indexer_loss: bool = False
    grad_scale: float = 1.0
    records: LayerRecords = dataclasses.field(default_factory=LayerRecords)
    status: StepStatus | None = None
    longest_document: int | None = None


def _is_attention(module: Any) -> bool:
    """A ``DeepseekV4Attention`` by its class name, or (a subclass renamed) by the submodules cpkv first reads."""
    return type(module).__name__ == "DeepseekV4Attention" or all(
        hasattr(module, a) for a in ("q_a_proj", "kv_proj", "o_a_proj", "sinks", "layer_type", "compressor"))


def _longest_document(plan: AttentionPlan) -> int:
    """Tokens of the longest document of ``plan``'s micro-batch, padding included (one host read of ``[B + 1]``)."""
    lengths = torch.diff(plan.layout_ranges.cu_seqlens)
    return int(lengths.max()) if lengths.numel() else 0


def _gradient_tie(module: Any, context: DeepseekV4CPContext) -> Tensor | None:
    """A 0-d zero that depends on the layer's parameters one process gives a gradient but this rank may not run.

    One process (Hugging Face's model, each document alone) runs a compressed layer's
    compressor on every document, and its parameters get a gradient when some document holds
    a complete block of the layer's ratio. The indexer returns integer indices: its
    parameters get a gradient only from cpkv's indexer loss. Under CP a rank whose shard
    holds no block does not run the compressor (nor the indexer), so the parameters one
    process trains are tied to the layer's output with a zero: every rank of the CP group
    gives them a gradient (zeros here), or none does. Tied: the compressor's own parameters
    when a document of the micro-batch (``plan.layout_ranges.cu_seqlens``, padding included)
    has at least ``ratio`` tokens; the indexer's too with ``context.indexer_loss``. Never the
    indexer's without it: ``None`` there, as in Hugging Face, so an optimizer skips them (no
    weight decay, no moment update). Empty slices give exact zeros (no ``0 * x``, so no NaN
    from an inf).

    Under ``torch.compile`` the compressor's parameters are tied in every micro-batch: a
    compiled layer runs its pooling on zero blocks too (no branch on the block count), so they
    get a gradient (zeros) also when no document reaches the ratio, where eager gives ``None``;
    deciding here would add a graph per compressed layer type for such micro-batches (and guard
    on ``longest_document``, a new integer every step).
    """
    compressor = module.compressor
    if compressor is None or not torch.is_grad_enabled():
        return None
    if not torch.compiler.is_compiling():
        longest = context.longest_document
        if longest is None:
            longest = _longest_document(context.plan)
        if longest < int(compressor.compress_rate):
            return None  # no block in the micro-batch: one process's compressor gets no gradient either
    indexer = getattr(compressor, "indexer", None)
    untrained = set() if context.indexer_loss or indexer is None else {id(p) for p in indexer.parameters()}
    terms = [p.reshape(-1)[:0].sum() for p in compressor.parameters() if p.requires_grad and id(p) not in untrained]
    return torch.stack(terms).sum() if terms else None


def _cp_attention_forward(
    module: Any, rotary_emb: Any, hidden_states: Tensor, position_embeddings: Any = None, position_ids: Any = None,
    attention_mask: Any = None, cache: Any = None, **kwargs: Any,
) -> tuple[Tensor, None]:
    """The forward :func:`enable_deepseek_v4_cp` installs: cpkv with a context, else Hugging Face's (same arguments)."""
    context = kwargs.pop(CONTEXT_KWARG, None)
    if context is None:
        result: tuple[Tensor, None] = type(module).forward(
            module, hidden_states, position_embeddings, position_ids, attention_mask, cache=cache, **kwargs
        )
        return result
    if not isinstance(context, DeepseekV4CPContext):
        raise TypeError(f"{CONTEXT_KWARG} must be a DeepseekV4CPContext, got {type(context).__name__}")
    if hidden_states.ndim != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be [1, T/cp, hidden] (one packed row) under CP, got {tuple(hidden_states.shape)}")
    if cache is not None or kwargs.get("past_key_values") is not None:
        raise ValueError("a decoding cache is not supported under CP: call the model with use_cache=False")
    if isinstance(attention_mask, Tensor):
        raise ValueError(
            "attention_mask must be None under CP (the plan is the mask): call the model with"
            ' attention_mask={"cpkv": None} so that Hugging Face builds none'
        )
    if module.training and float(module.config.attention_dropout) > 0:
        raise ValueError(f"attention dropout is not supported under CP, got config.attention_dropout={module.config.attention_dropout}")
    out, indexer_loss = deepseek_v4_attention(
        module, hidden_states[0], context.plan, context.group, backend=context.backend,
        indexer_loss=context.indexer_loss, grad_scale=context.grad_scale, rotary_emb=rotary_emb, status=context.status,
    )
    context.records.record(module, indexer_loss)
    tie = _gradient_tie(module, context)
    return (out if tie is None else out + tie.to(out.dtype))[None], None


def _has_cp_forward(module: Any) -> bool:
    forward = vars(module).get("forward")
    return isinstance(forward, functools.partial) and forward.func is _cp_attention_forward


def _check_enabled(model: Any) -> None:
    """Raise ``TypeError`` unless every attention module of ``model`` (or of what it wraps) has cpkv's forward."""
    attention = [m for m in model.modules() if _is_attention(m)] if isinstance(model, torch.nn.Module) else []
    if not attention:
        raise TypeError(f"model must be a DeepseekV4ForCausalLM (or wrap one), got {type(model).__name__} without"
                        " DeepseekV4Attention modules")
    missing = sum(not _has_cp_forward(m) for m in attention)
    if missing:
        raise TypeError(
            f"{missing} of the model's {len(attention)} DeepseekV4Attention modules have Hugging Face's forward:"
            " call enable_deepseek_v4_cp(model) once before training (before wrapping it)"
        )


def enable_deepseek_v4_cp(model: Any) -> Any:
    """Let every ``DeepseekV4Attention`` of ``model`` run under CP when a forward carries a context.

    Each attention module gets an instance ``forward`` that, given ``cpkv_context=`` (a
    :class:`DeepseekV4CPContext`), runs the layer through cpkv on this rank's tokens (RoPE
    from the model's ``rotary_emb`` at ``plan.q_positions``), and otherwise calls Hugging
    Face's forward unchanged. The modules keep their class, names and parameters, so
    ``state_dict`` keys are those of the model as loaded. A parameter gets a gradient on
    every rank of the CP group or on none, and exactly when one process gives it one: a
    compressor's on ranks that hold no block of its layer too (zeros), when the micro-batch
    has a block of its ratio; the indexer's only with ``indexer_loss=True`` (as in Hugging
    Face, which never trains it). Parameters without a gradient need the wrapper's option
    for them (docs/integrations.md: DDP's ``find_unused_parameters=True``, or freeze the
    indexer). Call it once, before wrapping the model (DDP, FSDP, ``torch.compile``);
    calling it again changes nothing.

    Compiled per decoder layer as torchtitan does (``layer.compile(fullgraph=True)`` for
    each of ``model.model.layers``): use Hugging Face's ``"grouped_mm"`` experts (its default;
    its ``"eager"`` experts stop the graph at a data-dependent size) and set
    ``torch.fx.experimental._config.backed_size_oblivious = True``; each decoder layer type then
    keeps at most 2 graphs as packings change (tests/integrations/test_hf_compile_layers.py,
    ``python -m cpkv.bench.hf_compile``). The layers share one code object, so Dynamo's
    ``recompile_limit`` (8) counts the graphs of every type together: raise it to at least twice
    the number of layer types (attention type x MLP type) when that is above 8. Compiled, a
    compressor's parameters get a gradient (zeros) also in a micro-batch where no document
    reaches its ratio (eager: ``None``).

    Args:
        model: a ``DeepseekV4ForCausalLM`` or ``DeepseekV4Model`` (any module holding one).

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` holds no ``DeepseekV4Attention`` or no ``rotary_emb``.
        RuntimeError: the installed ``transformers`` changed a piece cpkv reads
            (:func:`~cpkv.integrations.hf_v4_forms.check_deepseek_v4_forms`: the version, the
            tested range and the piece, on every rank before any collective).

    Example:
        >>> model = enable_deepseek_v4_cp(DeepseekV4ForCausalLM(config))  # doctest: +SKIP
    """
    named = list(model.named_modules()) if isinstance(model, torch.nn.Module) else []
    rotary = next((m.rotary_emb for _, m in named if hasattr(m, "rotary_emb") and hasattr(m, "layers")), None)
    attention = [(name, m) for name, m in named if _is_attention(m)]
    if rotary is None or not attention:
        raise TypeError(f"model must be a transformers DeepseekV4ForCausalLM or DeepseekV4Model, got {type(model).__name__}")
    check_deepseek_v4_forms(attention, rotary)  # before any forward: one error naming the release and the piece
    for _, module in attention:
        module.forward = functools.partial(_cp_attention_forward, module, rotary)
    return model


class DeepseekV4CausalLMOutput(NamedTuple):
    """Result of :func:`deepseek_v4_causal_lm_loss`.

    Attributes:
        loss: 0-d, this rank's loss: call ``loss.backward()``, then reduce the gradients over
            the CP group as ``grad_reduction`` said (sum, or the wrapper's mean).
        lm_loss: 0-d, detached: the CP group's cross-entropy sum over ``N`` (with the default
            ``N``, what one process gets for the whole micro-batch), the same on every rank, for
            logging.
        num_tokens: 0-d int64: the group's count of valid labels (the normaliser when
            ``num_items_in_batch`` is not given).
        indexer_losses: with ``indexer_loss=True``: CSA layer index -> the group's mean KL
            over its query tokens (``sum_t KL_t / plan.num_global_queries``), detached, the same
            on every rank; else empty.
        logits: ``[T/cp, V]`` this rank's logits, in shard order, the head's output (differentiable),
            with ``return_logits=True``; else ``None`` (the loss never held them whole).
        labels: ``[T/cp]`` this rank's shifted labels, in shard order.
        plan: this rank's plan of the micro-batch.
    """

    loss: Tensor
    lm_loss: Tensor
    num_tokens: Tensor
    indexer_losses: dict[int, Tensor]
    logits: Tensor | None
    labels: Tensor
    plan: AttentionPlan


def _unwrapped(model: Any) -> Any:
    """``model`` or what it wraps (DDP's ``module``, ``torch.compile``'s ``_orig_mod``): the one with a DeepSeek-V4 ``config``."""
    inner = model
    for _ in range(8):
        config = getattr(inner, "config", None)
        if config is not None and hasattr(config, "layer_types"):
            return inner
        wrapped = getattr(inner, "module", None)
        inner = wrapped if wrapped is not None else getattr(inner, "_orig_mod", None)
        if inner is None:
            break
    raise TypeError(f"model must be a DeepseekV4ForCausalLM (or wrap one), got {type(model).__name__} without a DeepseekV4Config")


def _config(model: Any) -> Any:
    """The ``config`` of ``model`` or of what it wraps."""
    return _unwrapped(model).config


def _head(model: Any) -> torch.nn.Module:
    """The output head (``lm_head``, a ``Linear`` without bias) of ``model`` or of what it wraps."""
    inner = _unwrapped(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(head, torch.nn.Module) or not isinstance(weight, Tensor) or weight.ndim != 2 or getattr(head, "bias", None) is not None:
        raise TypeError(f"model must be a DeepseekV4ForCausalLM (with its bias-free lm_head), got {type(inner).__name__}")
    return head


def _forward_with_head_loss(
    model: Any, head: torch.nn.Module, loss_of: Callable[[Tensor, Tensor], Result], inputs: dict[str, Any],
    return_logits: bool,
) -> tuple[Any, Result]:
    """``model(**inputs)`` with the loss taken from the head's input: ``(output, loss_of(hidden [T/cp, H], head.weight))``.

    Three hooks of ``head``, registered for this call only, make the loss part of the head's
    call: a forward pre-hook computes it where the head runs (its input and weight as the
    head's forward sees them, e.g. cast and gathered by FSDP2, whose own pre-hook comes first)
    and, unless ``return_logits``, hands the head zero tokens, so no ``[T/cp, V]`` logits are
    made; a forward hook put first returns ``(logits, loss)``, so that the hooks of a wrapper
    that come after it (FSDP2's post-forward: resharding the weight, and a pre-backward hook on
    every output that gathers the weight again before its gradient) treat the loss as an output
    of the head; a forward hook put last returns the logits alone to the model. (With only the
    pre-hook, a head that is its own FSDP2 unit freed its gathered weight after the forward and
    the loss's backward read an empty storage.)
    """
    losses: list[Result] = []

    def take_hidden(head: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Tensor] | None:
        hidden = args[0]
        weight = head.weight
        if not isinstance(weight, Tensor):
            raise TypeError(f"the head's weight must be a tensor, got {type(weight).__name__}")
        losses.append(loss_of(hidden.reshape(-1, hidden.shape[-1]), weight))
        return None if return_logits else (hidden[..., :0, :],)

    def expose_loss(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> tuple[Any, Result]:
        return output, losses[-1]

    def hide_loss(module: torch.nn.Module, args: tuple[Any, ...], output: tuple[Any, Result]) -> Any:
        return output[0]

    handles = [head.register_forward_pre_hook(take_hidden), head.register_forward_hook(expose_loss, prepend=True),
               head.register_forward_hook(hide_loss)]
    try:
        output = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    if len(losses) != 1:
        raise TypeError(f"model must be a DeepseekV4ForCausalLM whose forward runs its lm_head once, it ran {len(losses)} times")
    return output, losses[0]


def _flat_ids(name: str, x: Tensor) -> Tensor:
    if not isinstance(x, Tensor) or x.is_floating_point() or x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be an integer [T] or [1, T] tensor (one packed row), got {got}")
    return x.reshape(-1)


def _cu_seqlens(input_ids: Tensor, cu_seqlens: Tensor | None, position_ids: Tensor | None) -> Tensor:
    """The batch's cu_seqlens from ``cu_seqlens`` or ``position_ids`` (the same documents when both are given)."""
    if cu_seqlens is None and position_ids is None:
        raise ValueError("pass the document boundaries: cu_seqlens=[B + 1] or position_ids restarting at 0 per document")
    derived = None if position_ids is None else cu_seqlens_from_position_ids(position_ids)
    if derived is not None and int(derived[-1]) != input_ids.numel():
        raise ValueError(f"position_ids must hold input_ids' {input_ids.numel()} tokens, got {int(derived[-1])}")
    if cu_seqlens is None:
        assert derived is not None
        return derived
    validate_cu_seqlens(cu_seqlens, num_tokens=input_ids.numel())
    if derived is not None and torch.unique_consecutive(cu_seqlens.long().cpu()).tolist() != derived.cpu().tolist():
        raise ValueError("position_ids and cu_seqlens describe different documents: pass one of them")
    return cu_seqlens


def deepseek_v4_causal_lm_loss(
    model: Any, input_ids: Tensor, group: Group, *, cu_seqlens: Tensor | None = None,
    position_ids: Tensor | None = None, labels: Tensor | None = None, layout: Layout = "balanced",
    exchange: Exchange = "need", grad_reduction: GradReduction = "sum",
    num_items_in_batch: int | Tensor | None = None, ignore_index: int = -100, indexer_loss: bool = False,
    grad_scale: float = 1.0, backend: BackendName | AttentionBackend = "auto", check_ranks: bool = True,
    padding: Tensor | None = None, plan: AttentionPlan | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
    return_logits: bool = False,
) -> DeepseekV4CausalLMOutput:
    """One micro-batch of a CP-enabled ``DeepseekV4ForCausalLM``: the whole packed batch in, this rank's loss out.

    Every rank of the CP group passes the same packed batch. The call checks its arguments
    and agrees on the outcome with the group (a rank's bad argument raises on every rank),
    plans the batch (:func:`cpkv.plan_attention` with ``group=``; with ``check_ranks`` every
    rank raises when any rank's ``cu_seqlens``, ``padding``, token ids or labels differ:
    :func:`~cpkv.integrations.causal_lm.batch_fingerprint`), shifts the labels within each document on the whole batch, shards ids and
    labels by the plan, runs ``model`` on this rank's tokens (positions ``plan.q_positions``,
    no mask, no cache) and returns this rank's loss: ``scale * sum of its tokens' CE / N``
    (:func:`cpkv.integrations.causal_lm.causal_lm_loss_from_hidden`: the cross-entropy is
    computed from the head's input and weight ``chunk_size`` tokens at a time, forward and
    backward, so the ``[T/cp, V]`` logits, their float32 copy and their gradient never exist
    unless ``return_logits``). After ``loss.backward()`` the
    gradients reduced over the CP group as ``grad_reduction`` says equal those of one
    process running every document alone (Hugging Face's model, batch 1, positions from 0),
    and ``lm_loss`` is that process's loss. Hugging Face's router auxiliary loss is not
    added (``output_router_logits=False``; DeepSeek-V4 balances experts without it).

    Args:
        model: a ``DeepseekV4ForCausalLM`` after :func:`enable_deepseek_v4_cp` (or a DDP /
            FSDP2 ``fully_shard`` / ``torch.compile`` wrapper of one; any ``MixedPrecisionPolicy``).
        input_ids: ``[T]`` or ``[1, T]`` the whole packed batch, on the model's device.
        group: the CP group: a ``ProcessGroup``, a 1-D ``DeviceMesh`` (``mesh["cp"]``), or
            ``None`` (the default group).
        cu_seqlens: ``[B + 1]`` leading-zero document boundaries; or
        position_ids: ``[T]`` / ``[1, T]`` positions restarting at 0 per document
            (``DataCollatorWithFlattening``); only the boundaries are read from them (the
            positions used are the plan's, the same for well-formed ids).
        labels: ``[T]`` / ``[1, T]`` unshifted labels (Hugging Face's convention, ``ignore_index``
            where a token is no target); default ``input_ids``.
        layout, exchange: as in :func:`cpkv.plan_attention` (default ``"balanced"`` by the
            model's own cost and ``"need"`` with its windows, from
            :func:`~cpkv.integrations.transformers.deepseek_v4_plan_options`). Zigzag needs every document
            length to be a multiple of ``2 * cp``: pad with :func:`cpkv.pad_documents` and
            pass its ``padding`` (below).
        grad_reduction: ``"sum"`` if you all-reduce (SUM) the gradients over the CP group,
            ``"mean"`` if DDP / FSDP2 averages them (over a data x CP mesh, FSDP2's default):
            the loss and the indexer's ``grad_scale`` are then multiplied by the CP size.
        num_items_in_batch: the loss normaliser when it spans several micro-batches (default:
            this batch's valid labels over the group).
        ignore_index: the label of tokens without a target.
        indexer_loss, grad_scale, backend: as in
            :func:`~cpkv.integrations.transformers.deepseek_v4_attention`.
        check_ranks: compare the ranks' batches in the plan (``cu_seqlens``, options, padding
            and a fingerprint of the ids and labels: two small all-reduces and a host read).
        padding: ``[B]`` int tensor: the padding tokens at the end of each document of the
            (padded) batch, e.g. ``pad_documents(ids[:, None], cu_seqlens, 2 * cp).padding``;
            default ``None`` (every token is real). Padding tokens are no targets whatever
            ``labels`` holds there (nor is the last real token of a document), and they are
            no indexer queries (``plan.num_global_queries`` counts real tokens): loss, logged
            losses and every gradient equal the unpadded batch's.
        plan: this rank's plan of this batch made beforehand (e.g. by
            :class:`~cpkv.integrations.collate.PackedCPCollator` in a data-loader worker, with
            :func:`~cpkv.integrations.transformers.deepseek_v4_plan_options` and the same
            ``padding``), used instead of planning here (``layout`` and ``exchange`` are then the
            plan's); ``check_ranks`` still compares the ranks' ``cu_seqlens``, plan options and
            fingerprints.
        chunk_size: tokens per chunk of the loss (``>= 1``; default 1024: one chunk's float32
            logits are ``4 * 1024 * V`` bytes, 0.5 GB at V = 129,280).
        return_logits: also run the head on every token and return its ``[T/cp, V]`` logits
            (``DeepseekV4CausalLMOutput.logits``, else ``None``); the loss is the same chunked one.

    Returns:
        :class:`DeepseekV4CausalLMOutput`.

    Raises:
        TypeError, ValueError: malformed ids, labels (another length than ``input_ids``),
            boundaries, padding or options, or a model without :func:`enable_deepseek_v4_cp`
            (before any collective), on every rank when any rank's are; ranks whose batches
            differ (``check_ranks``).
        RuntimeError: after the forward, when some attention layer did not receive the
            context (a wrapper dropped the ``cpkv_context`` keyword argument on its way).

    Example:
        >>> out = deepseek_v4_causal_lm_loss(model, input_ids, cp_group, cu_seqlens=cu_seqlens)  # doctest: +SKIP
        >>> out.loss.backward()  # doctest: +SKIP
    """
    group = check_group("group", group)

    def loss_checks() -> None:
        grad_reduction_scale(grad_reduction, group)
        check_int("chunk_size", chunk_size, minimum=1)

    batch = plan_deepseek_v4_batch(model, input_ids, group, cu_seqlens=cu_seqlens, position_ids=position_ids, labels=labels,
                                   layout=layout, exchange=exchange, ignore_index=ignore_index, check_ranks=check_ranks,
                                   padding=padding, plan=plan, more_checks=loss_checks)
    scale = grad_reduction_scale(grad_reduction, group)
    count = global_valid_count(batch.labels_local, group, ignore_index=ignore_index)
    normaliser = count if num_items_in_batch is None else num_items_in_batch

    def loss_of(hidden: Tensor, weight: Tensor) -> Tensor:
        return causal_lm_loss_from_hidden(hidden, weight, batch.labels_local, group, num_items_in_batch=normaliser,
                                          ignore_index=ignore_index, grad_reduction=grad_reduction, chunk_size=chunk_size)

    learn_indexer = indexer_loss and torch.is_grad_enabled()  # forward only: no KL (nothing would train the indexer)
    output, loss, context = run_deepseek_v4_batch(model, batch, loss_of, backend=backend, indexer_loss=learn_indexer,
                                                  grad_scale=grad_scale * scale, return_logits=return_logits)
    logits = output.logits[0] if return_logits else None
    config = _config(model)
    csa = [i for i in sorted(context.records) if config.layer_types[i] == "compressed_sparse_attention"] if learn_indexer else []
    kl = [context.records[i] for i in csa]
    logged = torch.stack([loss.detach() / scale] + [loss.new_zeros(()) if v is None else v.detach().to(loss.dtype) for v in kl])
    dist.all_reduce(logged, op=dist.ReduceOp.SUM, group=group)
    indexer = {i: logged[k + 1] / batch.plan.num_global_queries for k, i in enumerate(csa)}
    return DeepseekV4CausalLMOutput(loss, logged[0], count, indexer, logits, batch.labels_local, batch.plan)


@dataclasses.dataclass(frozen=True, eq=False)
class DeepseekV4Batch:
    """A packed micro-batch checked, planned and sharded on this rank (:func:`plan_deepseek_v4_batch`).

    Attributes:
        cu_seqlens: ``[B + 1]`` leading-zero document boundaries of the whole (padded) batch.
        labels: ``[T]`` the whole batch's shifted labels (:func:`~cpkv.integrations.causal_lm.shift_labels`:
            ``ignore_index`` at each document's last real token and at the padding).
        padding: ``[B]`` padding tokens at the end of each document, or ``None``.
        plan: this rank's :class:`~cpkv.AttentionPlan` of the batch.
        input_ids: ``[T/cp]`` this rank's token ids, in shard order.
        labels_local: ``[T/cp]`` this rank's shifted labels, in shard order.
        group: the CP group, as the call resolved it.
    """

    cu_seqlens: Tensor
    labels: Tensor
    padding: Tensor | None
    plan: AttentionPlan
    input_ids: Tensor
    labels_local: Tensor
    group: Group


def plan_deepseek_v4_batch(
    model: Any, input_ids: Tensor, group: Group, *, cu_seqlens: Tensor | None = None, position_ids: Tensor | None = None,
    labels: Tensor | None = None, layout: Layout = "balanced", exchange: Exchange = "need", ignore_index: int = -100,
    check_ranks: bool = True, padding: Tensor | None = None, plan: AttentionPlan | None = None,
    more_checks: Callable[[], None] | None = None,
) -> DeepseekV4Batch:
    """Check, plan and shard one packed micro-batch of a CP-enabled DeepSeek-V4: the first half of every call on it.

    What :func:`deepseek_v4_causal_lm_loss` and
    :func:`~cpkv.integrations.causal_lm_eval.deepseek_v4_causal_lm_eval` do before the model
    runs: the arguments are checked (and ``more_checks()``, the caller's own) and the group
    agrees on the outcome (a rank's bad argument raises on every rank, before any other
    collective); the labels are shifted within each document on the whole batch; the batch is
    planned (or ``plan`` checked) with the model's own options; ids and labels are sharded by
    the plan. Arguments as in :func:`deepseek_v4_causal_lm_loss`.

    Returns:
        :class:`DeepseekV4Batch`.

    Raises:
        TypeError, ValueError: as :func:`deepseek_v4_causal_lm_loss`, on every rank when any rank's are.
    """
    config = _config(model)
    group = check_group("group", group)
    try:  # every rank learns of a bad argument on any rank, before the plan's collectives
        _check_enabled(model)
        ids = _flat_ids("input_ids", input_ids)
        cu = _cu_seqlens(ids, cu_seqlens, position_ids)
        targets = ids if labels is None else _flat_ids("labels", labels)
        if targets.numel() != ids.numel():
            raise ValueError(f"labels must hold input_ids' {ids.numel()} tokens, got {targets.numel()}")
        shifted = shift_labels(targets, cu, ignore_index=ignore_index, padding=padding)
        _head(model)
        if more_checks is not None:
            more_checks()
        if plan is not None:
            check_given_plan(plan, cu, group, padding=padding)
    except Exception as error:  # noqa: BLE001 - agreed, then raised
        agree(error, group)
        raise
    agree(None, group)
    cp_group = dist.group.WORLD if group is None else group
    fingerprint = batch_fingerprint(ids, shifted) if check_ranks else None
    if plan is None:
        plan = plan_attention(
            cu, dist.get_world_size(group), dist.get_rank(group), layout=layout, exchange=exchange, group=cp_group,
            check_ranks=check_ranks, padding=padding, fingerprint=fingerprint, **deepseek_v4_plan_options(config),
        )
    elif check_ranks:
        check_same_on_all_ranks(cu, cp_group, options=plan.comparison_options(), fingerprint=fingerprint)
    return DeepseekV4Batch(cu, shifted, padding, plan, shard_by_plan(ids, cu, plan), shard_by_plan(shifted, cu, plan), group)


def run_deepseek_v4_batch(
    model: Any, batch: DeepseekV4Batch, of_hidden: Callable[[Tensor, Tensor], Result], *,
    backend: BackendName | AttentionBackend = "auto", indexer_loss: bool = False, grad_scale: float = 1.0,
    return_logits: bool = False,
) -> tuple[Any, Result, DeepseekV4CPContext]:
    """Run the model on this rank's tokens of ``batch``; ``of_hidden(hidden [T/cp, H], head weight [V, H])`` where the head runs.

    The second half of every call on a batch: positions ``plan.q_positions``, no mask, no
    cache, no router loss, a :class:`DeepseekV4CPContext` for the attention layers; the head
    gets zero tokens unless ``return_logits`` (``of_hidden`` computes what is wanted from its
    input and weight chunk by chunk instead, inside the head's call: FSDP2's hooks gather its
    weight around it). Every layer's failure raises on every rank after the forward.

    Returns:
        ``(the model's output, of_hidden's result, the context)`` (the context's ``records``:
        layer index -> its indexer loss).

    Raises:
        RuntimeError: some attention layer did not receive the context (a wrapper dropped the
            ``cpkv_context`` keyword argument). TypeError: a head that did not run once.
    """
    group, plan = batch.group, batch.plan
    status = StepStatus(group)  # the layers report to it; checked once, after the forward
    context = DeepseekV4CPContext(plan, group, backend, indexer_loss, grad_scale, status=status,
                                  longest_document=_longest_document(plan))
    ids = batch.input_ids
    inputs = {"input_ids": ids[None], "position_ids": plan.q_positions.to(ids.device)[None],
              "attention_mask": {"cpkv": None}, "use_cache": False, "output_router_logits": False, CONTEXT_KWARG: context}
    output, result = _forward_with_head_loss(model, _head(model), of_hidden, inputs, return_logits)
    expected = int(_config(model).num_hidden_layers)
    if len(context.records) != expected:
        raise RuntimeError(
            f"only {len(context.records)} of the model's {expected} attention layers ran under CP, though every one"
            f" has cpkv's forward: the {CONTEXT_KWARG}= keyword argument did not reach the others (a wrapper or custom"
            " forward between the model and its decoder layers dropped it, or deep-copied the context so that those"
            " layers wrote into another LayerRecords)"
        )
    status.check()  # a layer call that failed on any rank raises on every rank, before any backward
    return output, result, context
