"""cpkv as Megatron-Core's core attention: THD batches under context parallelism.

:class:`CPKVCoreAttention` takes the place of ``DotProductAttention`` /
``TEDotProductAttention`` in a Megatron ``ModuleSpec`` (the ``core_attention`` of
``SelfAttentionSubmodules`` or ``MLASelfAttentionSubmodules``). Megatron builds it and calls it
as it calls any core attention; it runs the rank's shard of a packed (THD) micro-batch, laid
out as Megatron shards it (per-document zigzag over the padded cu_seqlens,
:func:`~cpkv.integrations.megatron.plan_from_packed_seq_params`), through
:func:`cpkv.attention_forward`, with Megatron's sliding window (``config.window_size``) and
softmax offsets (``config.softmax_type``: ``"off-by-one"``, or ``"learnable"`` with the
``softmax_offset`` parameter held here, as Megatron's own core attentions hold it).

Heads. Megatron gives ``ng`` key and value heads (``ng == np`` MHA and MLA, ``1 < ng < np``
GQA, ``ng == 1`` MQA), with keys and values that differ. They go to
:func:`cpkv.attention_forward` as they are, in one call per layer: keys ``[t, ng, hk]`` as
``kv``, values ``[t, ng, hv]`` as ``v`` (query head ``h`` uses kv head ``h // (np / ng)``, as
Megatron's ``repeat_interleave``); the exchange moves all heads' keys and values in one
collective, and the backend attends all heads in one call per segment set.

MLA. In training, Megatron's ``MLASelfAttention`` gives its core attention per-head keys
``[t, np, qk_head_dim + qk_pos_emb_head_dim]`` and values ``[t, np, v_head_dim]`` (up-projected,
RoPE applied): the ``ng == np`` case above, one call, exact. The absorbed form (queries
``[q_nope W_uk, q_pe]`` against one shared head ``[c_kv, k_pe]`` whose first ``kv_lora_rank``
channels are the values, then ``W_uv`` per head) is cpkv's native shared-KV MQA, but Megatron
forms it only in inference decoding (``value=None``) and it needs the up-projections moved
around the core attention: call :func:`cpkv.attention_forward` with that ``q`` and ``kv`` from
your own MLA module; here ``value=None`` raises.

Exchange. ``cp_comm_type`` maps onto cpkv's exchanges (:data:`CP_COMM_TYPES`): ``"allgather"``
/ ``"all_gather"`` -> ``"allgather"`` (every rank gathers the kv of its documents' prefixes);
``"p2p"`` / ``"a2a"`` -> ``"need"`` (each rank receives only the kv rows its queries see, from
the ranks that hold them: cpkv's point-to-point exchange, one ``all_to_all_single`` per layer;
neither TransformerEngine's ring of P2P rounds nor its head-scattering all-to-all, which cpkv
does not implement). ``None`` (Megatron's default) keeps the carried plan's exchange, else
``"allgather"``. ``"a2a+p2p"`` (hierarchical) and anything else raise at build.

The plan. Megatron passes nothing per micro-batch to its core attention but
``packed_seq_params``. By default every call plans from it
(:func:`~cpkv.integrations.megatron.plan_from_packed_seq_params`: a few host reads of the
cu_seqlens per layer call). :func:`with_plan` returns a copy of the micro-batch's
``packed_seq_params`` that carries a plan made once, which every layer then uses: it travels
with the micro-batch through Megatron's forward (and its activation recomputation, which
replays the same ``packed_seq_params``), so there is no global or per-module state that a
second micro-batch could overwrite before the first one's backward.

megatron-core is imported lazily (when the module is built); importing this module needs none.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.status import StepStatus
from cpkv.backends import get_backend
from cpkv.backends.base import AttentionBackend, BackendName
from cpkv.checks import check_ndim, check_tensor
from cpkv.integrations.megatron import PackedPlan, plan_from_packed_seq_params
from cpkv.plan.attention import Exchange

__all__ = [
    "CP_COMM_TYPES", "PLAN_ATTRIBUTE", "STATUS_ATTRIBUTE", "CPKVCoreAttention", "megatron_exchange", "megatron_window", "plan_of",
    "use_cpkv_core_attention", "with_plan",
]

PLAN_ATTRIBUTE = "cpkv_plan"
"""The attribute of ``packed_seq_params`` that :func:`with_plan` sets to a :class:`PackedPlan`."""

STATUS_ATTRIBUTE = "cpkv_status"
"""The attribute of ``packed_seq_params`` that :func:`with_plan` sets to the step's :class:`~cpkv.StepStatus`."""

CP_COMM_TYPES: Mapping[str, Exchange] = MappingProxyType(
    {"allgather": "allgather", "all_gather": "allgather", "p2p": "need", "a2a": "need"}
)
"""Megatron's ``cp_comm_type`` -> cpkv's exchange (module doc, "Exchange"); others raise."""

_CAUSAL_MASKS = ("causal", "padding_causal")
_SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
P = TypeVar("P")


def _planned_field(params: object) -> tuple[str, object]:
    """The cu_seqlens Megatron shards and ropes THD batches by: the padded ones when set."""
    padded = getattr(params, "cu_seqlens_q_padded", None)
    return ("cu_seqlens_q", getattr(params, "cu_seqlens_q", None)) if padded is None else ("cu_seqlens_q_padded", padded)


def with_plan(params: P, packed: PackedPlan, *, status: StepStatus | None = None) -> P:
    """A shallow copy of ``params`` that carries ``packed`` for every :class:`CPKVCoreAttention` call.

    Plan once per micro-batch (``plan_from_packed_seq_params(params, cp_size, cp_rank)``) and
    pass the returned object to the model as its ``packed_seq_params``: the layers then skip
    their own planning. The copy shares every tensor of ``params``; ``packed`` must have been
    made from them.

    Args:
        params: the micro-batch's ``megatron.core.packed_seq_params.PackedSeqParams`` (THD).
        packed: its :class:`~cpkv.integrations.megatron.PackedPlan` on this rank.
        status: the step's :class:`~cpkv.StepStatus` (attribute :data:`STATUS_ATTRIBUTE`):
            every layer reports to it, with no host sync; call ``status.check()`` on every
            rank after the step's forward (e.g. in the loss function) and before
            ``optimizer.step()``. ``None``: a layer's failed check raises at once on its rank.

    Returns:
        A copy of ``params`` (same class) with the attribute :data:`PLAN_ATTRIBUTE` set to ``packed``.

    Raises:
        TypeError: ``packed`` is not a ``PackedPlan``.
        ValueError: ``packed.cu_seqlens`` is not ``params.cu_seqlens_q_padded`` (when set) or
            ``params.cu_seqlens_q`` (the very tensor ``plan_from_packed_seq_params`` planned).

    Example:
        >>> from types import SimpleNamespace
        >>> cu = torch.tensor([0, 4, 8])
        >>> params = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
        ...     cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None)
        >>> carried = with_plan(params, plan_from_packed_seq_params(params, 2, 0))
        >>> plan_of(carried, 2, 0).plan.local_len
        4
    """
    if not isinstance(packed, PackedPlan):
        raise TypeError(f"packed must be a PackedPlan from plan_from_packed_seq_params, got {type(packed).__name__}")
    _check_carried(params, packed)
    if status is not None and not isinstance(status, StepStatus):
        raise TypeError(f"status must be a cpkv.StepStatus or None, got {type(status).__name__}")
    carried = copy.copy(params)
    setattr(carried, PLAN_ATTRIBUTE, packed)
    setattr(carried, STATUS_ATTRIBUTE, status)
    return carried


def _check_carried(params: object, packed: PackedPlan) -> None:
    field, cu_seqlens = _planned_field(params)
    if packed.cu_seqlens is not cu_seqlens:
        raise ValueError(
            f"the plan carried by packed_seq_params was not made from its params.{field}"
            " (plan_from_packed_seq_params(params, ...).cu_seqlens must be that very tensor): plan from the"
            " packed_seq_params of this micro-batch"
        )


def plan_of(
    params: object, cp_size: int, cp_rank: int, *, exchange: Exchange | None = None, window: int | None = None
) -> PackedPlan:
    """The micro-batch's plan: the one :func:`with_plan` attached to ``params``, else planned now.

    Args:
        params: a THD ``PackedSeqParams`` (see :func:`~cpkv.integrations.megatron.plan_from_packed_seq_params`).
        cp_size, cp_rank: the CP group's size and this rank.
        exchange: the layer's exchange (:func:`megatron_exchange`): a carried plan must have it;
            ``None``: any carried plan, ``"allgather"`` when planning now.
        window: the layer's window (planned now with ``exchange="need"``: its halo).

    Returns:
        :class:`~cpkv.integrations.megatron.PackedPlan` (Megatron's layout: zigzag at ``cp_size > 1``).

    Raises:
        TypeError: the attached plan is not a ``PackedPlan``.
        ValueError: the attached plan was made from other cu_seqlens, for another
            ``(cp_size, cp_rank)`` or another exchange; whatever ``plan_from_packed_seq_params`` raises.
    """
    packed = getattr(params, PLAN_ATTRIBUTE, None)
    if packed is None:
        if exchange == "need":
            return plan_from_packed_seq_params(params, cp_size, cp_rank, exchange="need", windows=[window])
        return plan_from_packed_seq_params(params, cp_size, cp_rank)
    if not isinstance(packed, PackedPlan):
        raise TypeError(f"params.{PLAN_ATTRIBUTE} must be a PackedPlan (cpkv.integrations.megatron_attention.with_plan),"
                        f" got {type(packed).__name__}")
    _check_carried(params, packed)
    if (packed.plan.cp_size, packed.plan.cp_rank) != (cp_size, cp_rank):
        raise ValueError(
            f"the plan carried by packed_seq_params is for cp_size={packed.plan.cp_size}, cp_rank={packed.plan.cp_rank};"
            f" this layer's CP group has size {cp_size}, rank {cp_rank}"
        )
    if exchange is not None and packed.plan.exchange != exchange:
        raise ValueError(
            f"the plan carried by packed_seq_params uses exchange={packed.plan.exchange!r} but this layer's"
            f" cp_comm_type asks for {exchange!r}: plan_from_packed_seq_params(params, cp_size, cp_rank,"
            f" exchange={exchange!r}{', windows=[...]' if exchange == 'need' else ''})"
        )
    return packed


def megatron_exchange(cp_comm_type: object) -> Exchange | None:
    """cpkv's exchange for Megatron's ``cp_comm_type`` (:data:`CP_COMM_TYPES`), ``None`` for ``None``.

    ``"allgather"`` / ``"all_gather"`` -> ``"allgather"``; ``"p2p"`` / ``"a2a"`` -> ``"need"``
    (the rows each rank's queries see, point to point; module doc, "Exchange").

    Raises:
        ValueError: any other value (``"a2a+p2p"``, a list: Megatron passes each layer its own string).

    Example:
        >>> megatron_exchange("all_gather"), megatron_exchange("p2p"), megatron_exchange(None)
        ('allgather', 'need', None)
    """
    if cp_comm_type is None:
        return None
    if not isinstance(cp_comm_type, str) or cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r} has no cpkv exchange: use one of {sorted(CP_COMM_TYPES)}"
            " ('allgather'/'all_gather' -> cpkv's all-gather; 'p2p'/'a2a' -> cpkv's need exchange) or None"
        )
    return CP_COMM_TYPES[cp_comm_type]


def use_cpkv_core_attention(spec: P, **params: Any) -> P:
    """A deep copy of a Megatron layer or block spec with :class:`CPKVCoreAttention` as every layer's core attention.

    Takes what Megatron's spec functions return: one layer's ``ModuleSpec``
    (``get_gpt_layer_local_spec()``), a block's ``TransformerBlockSubmodules``
    (``get_gpt_decoder_block_spec(config, ...)``: every entry of its ``layer_specs``), or a list
    of layer specs (``get_gpt_decoder_layer_specs``). A layer's core attention is its
    ``submodules.self_attention.submodules.core_attention`` (``SelfAttention`` and
    ``MLASelfAttention`` alike).

    Args:
        spec: the layer spec, block spec or list of layer specs (not modified).
        **params: :class:`CPKVCoreAttention`'s own options (``backend=...``), passed as the
            ``ModuleSpec``'s ``params``; none: the class itself.

    Returns:
        The copy, of the same type.

    Raises:
        ValueError: no layer of ``spec`` has a core attention to replace.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> layer = NS(submodules=NS(self_attention=NS(submodules=NS(core_attention="dot-product"))))
        >>> block = use_cpkv_core_attention(NS(layer_specs=[layer, layer]))
        >>> [s.submodules.self_attention.submodules.core_attention.__name__ for s in block.layer_specs]
        ['CPKVCoreAttention', 'CPKVCoreAttention']
    """
    copied = copy.deepcopy(spec)
    core: Any = CPKVCoreAttention
    if params:
        from megatron.core.transformer.spec_utils import ModuleSpec  # type: ignore[import-untyped,import-not-found,unused-ignore]

        core = ModuleSpec(module=CPKVCoreAttention, params=dict(params))
    layers = getattr(copied, "layer_specs", copied)
    layers = list(layers) if isinstance(layers, (list, tuple)) else [layers]
    replaced = 0
    for layer in layers:
        attention = getattr(getattr(getattr(layer, "submodules", None), "self_attention", None), "submodules", None)
        if attention is not None and hasattr(attention, "core_attention"):
            attention.core_attention = core
            replaced += 1
    if not replaced:
        raise ValueError(
            f"no layer of the {type(spec).__name__} has submodules.self_attention.submodules.core_attention:"
            " pass a layer ModuleSpec, a TransformerBlockSubmodules or a list of layer specs"
        )
    return copied


def megatron_window(window_size: object, window_attn_skip_freq: object, layer_number: int) -> int | None:
    """cpkv's window ``W`` (own token plus ``W - 1`` earlier) of a Megatron layer, or ``None`` (dense causal).

    Megatron's ``window_size = (left, right)`` lets query ``i`` see keys ``[i - left, i + right]``
    on the layers that ``window_attn_skip_freq`` makes sliding (its ``is_layer_window_attention``:
    an int ``N`` makes every ``N``-th layer dense, a list gives each layer; ``None``: all).
    ``left == -1`` is an infinite window.

    Args:
        window_size: ``config.window_size``: ``None`` or a pair of ints.
        window_attn_skip_freq: ``config.window_attn_skip_freq``: ``None``, an int or a list.
        layer_number: the layer's 1-based number.

    Returns:
        ``left + 1`` on a sliding layer with ``left >= 0``, else ``None``.

    Raises:
        ValueError: ``right != 0`` (cpkv attends causally), ``left < -1``, not a pair.
        TypeError: ``window_attn_skip_freq`` neither ``None``, an int nor a list.

    Example:
        >>> megatron_window((127, 0), None, 1), megatron_window((127, 0), 2, 2), megatron_window(None, None, 1)
        (128, None, None)
    """
    if not window_size:
        return None
    if window_attn_skip_freq is None:
        sliding = True
    elif isinstance(window_attn_skip_freq, int) and not isinstance(window_attn_skip_freq, bool):
        sliding = layer_number % window_attn_skip_freq != 0
    elif isinstance(window_attn_skip_freq, list):
        sliding = bool(window_attn_skip_freq[layer_number - 1])
    else:
        raise TypeError(f"config.window_attn_skip_freq must be None, an int or a list, got {window_attn_skip_freq!r}")
    if not sliding:
        return None
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(
        isinstance(w, int) and not isinstance(w, bool) for w in window_size
    ):
        raise ValueError(f"config.window_size must be None or a pair of ints (left, right), got {window_size!r}")
    left, right = window_size
    if right != 0:
        raise ValueError(
            f"config.window_size={tuple(window_size)}: cpkv attends causally, so the right window must be 0, got {right}"
        )
    if left < -1:
        raise ValueError(f"config.window_size={tuple(window_size)}: the left window must be >= -1 (-1: infinite)")
    return None if left == -1 else left + 1


class CPKVCoreAttention(nn.Module):
    """Megatron core attention through cpkv: THD batches (zigzag, padded documents) under CP.

    Use it as the ``core_attention`` of a Megatron ``ModuleSpec``, e.g.
    ``spec.submodules.self_attention.submodules.core_attention = CPKVCoreAttention`` (extra
    options through ``ModuleSpec(module=CPKVCoreAttention, params={"backend": "reference"})``).
    Megatron's other core attentions take the same arguments.

    Args:
        config: the layer's ``TransformerConfig``. Read: ``num_attention_heads`` and
            ``num_query_groups`` (split over tensor parallelism), ``attention_dropout``,
            ``window_size`` and ``window_attn_skip_freq``, ``softmax_type``,
            ``context_parallel_size``, ``params_dtype``, ``use_cpu_initialization``,
            ``perform_initialization`` and ``init_method`` (the learnable offsets), ``qk_clip``.
            ``apply_query_key_layer_scaling`` changes nothing (Megatron divides the scale by
            the layer number and multiplies it back). ``attention_backend`` is not read.
        layer_number: 1-based (``window_attn_skip_freq`` needs it).
        attn_mask_type: Megatron's ``AttnMaskType``: ``causal`` or ``padding_causal`` (the THD
            documents come from ``packed_seq_params``).
        attention_type: ``"self"``.
        attention_dropout: ``None`` (``config.attention_dropout``) or the probability; must be 0.
        softmax_scale: the logits' scale; ``None``: ``1 / sqrt(query head dim)``.
        k_channels, v_channels: key and value head dims (MLA passes them); checked against
            the tensors when given.
        cp_comm_type: Megatron's CP communication (:func:`megatron_exchange`): ``"allgather"`` /
            ``"all_gather"`` -> cpkv's all-gather, ``"p2p"`` / ``"a2a"`` -> cpkv's need exchange
            (per-call plans then carry this layer's window's halo; a plan from
            :func:`with_plan` must have that exchange); ``None``: the carried plan's, else all-gather.
        pg_collection: Megatron's ``ProcessGroupCollection``; its ``tp`` splits the heads and its
            ``cp`` is the CP group. ``None``: Megatron's ``parallel_state`` groups.
        backend: cpkv's backend (``"auto"``: by the tensors' device), or an
            :class:`~cpkv.backends.base.AttentionBackend`.

    Attributes:
        softmax_offset: ``[np]`` learnable sink logits (``softmax_type == "learnable"``), a
            parameter of this module (Megatron's name); else ``None``.
        window: cpkv's window of this layer (:func:`megatron_window`), ``None`` for dense causal.
        exchange: cpkv's exchange for ``cp_comm_type`` (:func:`megatron_exchange`), or ``None``.

    Raises:
        ValueError: another attention type or mask type, dropout > 0, an unknown
            ``softmax_type``, a ``cp_comm_type`` with no cpkv exchange (``"a2a+p2p"``), a
            non-causal window, ``qk_clip``, heads not divisible by the
            tensor-parallel size, a CP group whose size is not ``config.context_parallel_size``.
    """

    def __init__(
        self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
        attention_dropout: float | None = None, softmax_scale: float | None = None,
        k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | list[str] | None = None,
        pg_collection: Any = None, *, backend: BackendName | AttentionBackend = "auto",
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_number = max(1, layer_number)
        mask = getattr(attn_mask_type, "name", attn_mask_type)
        if mask not in _CAUSAL_MASKS:
            raise ValueError(f"attn_mask_type must be AttnMaskType.causal or padding_causal for cpkv, got {attn_mask_type!r}")
        if attention_type != "self":
            raise ValueError(f"attention_type must be 'self' (cpkv plans self-attention), got {attention_type!r}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"attention dropout must be 0 for cpkv's core attention, got {dropout}: set"
                " TransformerConfig(attention_dropout=0.0)"
            )
        if getattr(config, "qk_clip", False):
            raise ValueError("config.qk_clip needs the core attention's max logits, which cpkv does not return")
        if softmax_scale is not None and (not math.isfinite(softmax_scale) or softmax_scale <= 0):
            raise ValueError(f"softmax_scale must be a finite positive float or None, got {softmax_scale!r}")
        self.softmax_scale = softmax_scale
        self.k_channels, self.v_channels = k_channels, v_channels
        self.cp_comm_type = cp_comm_type
        self.exchange = megatron_exchange(cp_comm_type)
        self.attn_mask_type = attn_mask_type
        self.backend = backend
        self.window = megatron_window(config.window_size, config.window_attn_skip_freq, self.layer_number)
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection  # type: ignore[import-untyped,import-not-found,unused-ignore]

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.cp_group = pg_collection.cp
        tp_size = pg_collection.tp.size()
        cp_size = self.cp_group.size()
        if cp_size != config.context_parallel_size:
            raise ValueError(
                f"the CP group has size {cp_size} but config.context_parallel_size = {config.context_parallel_size}"
            )
        if config.num_attention_heads % tp_size or config.num_query_groups % tp_size:
            raise ValueError(
                f"num_attention_heads ({config.num_attention_heads}) and num_query_groups ({config.num_query_groups})"
                f" must be multiples of the tensor-parallel size {tp_size}"
            )
        self.num_heads = config.num_attention_heads // tp_size
        self.softmax_type = config.softmax_type
        if self.softmax_type not in _SOFTMAX_TYPES:
            raise ValueError(f"config.softmax_type must be one of {_SOFTMAX_TYPES}, got {self.softmax_type!r}")
        self.softmax_offset: nn.Parameter | None = None
        if self.softmax_type == "learnable":
            device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
            self.softmax_offset = nn.Parameter(torch.empty(self.num_heads, device=device, dtype=config.params_dtype))
            if config.perform_initialization:
                with torch.no_grad():
                    config.init_method(self.softmax_offset)
            else:
                with torch.no_grad():
                    self.softmax_offset.zero_()
        self._backends: dict[str, AttentionBackend] = {}

    def _ops(self, device: torch.device) -> AttentionBackend:
        """The backend for ``device``, created once per device type (its fallback warnings once)."""
        if not isinstance(self.backend, str):
            return self.backend
        if device.type not in self._backends:
            self._backends[device.type] = get_backend(self.backend, device)
        return self._backends[device.type]

    def _sinks(self, query: Tensor) -> Tensor | None:
        if self.softmax_type == "learnable":
            return self.softmax_offset
        if self.softmax_type == "off-by-one":
            return query.new_zeros(query.shape[1])
        return None

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor | None, attention_mask: Tensor | None,
        attn_mask_type: Any = None, attention_bias: Tensor | None = None, packed_seq_params: Any = None,
    ) -> Tensor:
        """Causal attention of this rank's THD shard (``t = T/cp`` rows in Megatron's zigzag order).

        Args:
            query: ``[t, np, hk]`` (RoPE applied, as Megatron's attention does before its core attention).
            key: ``[t, ng, hk]`` with ``np % ng == 0``.
            value: ``[t, ng, hv]``; ``None`` (MLA's absorbed inference decoding) raises.
            attention_mask: not read: the documents come from ``packed_seq_params`` (as with
                TransformerEngine's THD attention).
            attn_mask_type: ``None`` (the constructor's) or ``causal`` / ``padding_causal``.
            attention_bias: must be ``None``.
            packed_seq_params: the micro-batch's THD ``PackedSeqParams`` (optionally with a plan
                from :func:`with_plan`).

        Returns:
            ``[t, np * hv]`` in the query's dtype, on its device. Rows of padding tokens hold
            their causal attention (mask their loss, e.g. with ``PackedPlan.real_rows``).

        Raises:
            ValueError, TypeError: no THD ``packed_seq_params``, a bias, a non-causal mask type,
                ``value=None``, shapes other than above, a ``packed_seq_params.cp_group`` other
                than this layer's CP group; whatever :func:`plan_of` and
                :func:`cpkv.attention_forward` raise.
        """
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            got = None if packed_seq_params is None else getattr(packed_seq_params, "qkv_format", None)
            raise ValueError(
                "packed_seq_params with qkv_format='thd' is required: cpkv's core attention runs packed (THD)"
                f" batches, got packed_seq_params={'None' if packed_seq_params is None else f'qkv_format={got!r}'}"
            )
        if attention_bias is not None:
            raise ValueError("attention_bias must be None: cpkv's core attention takes no bias")
        if attn_mask_type is not None and getattr(attn_mask_type, "name", attn_mask_type) not in _CAUSAL_MASKS:
            raise ValueError(f"attn_mask_type must be None, AttnMaskType.causal or padding_causal, got {attn_mask_type!r}")
        if value is None:
            raise ValueError(
                "value=None (MLA's absorbed inference decoding) is not supported: call cpkv.attention_forward with the"
                " absorbed queries and the shared [c_kv, k_pe] head directly"
            )
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            check_ndim(name, check_tensor(name, tensor), 3, f"[t, heads, head_dim] ({name} of a THD batch)")
        t, num_heads, hk = query.shape
        groups, hv = value.shape[1], value.shape[2]
        if key.shape[:2] != (t, groups) or key.shape[2] != hk or value.shape[0] != t:
            raise ValueError(
                f"query [t, np, hk], key [t, ng, hk] and value [t, ng, hv] must agree, got {tuple(query.shape)},"
                f" {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if num_heads % groups:
            raise ValueError(f"query heads ({num_heads}) must be a multiple of the key/value heads ({groups})")
        if (self.k_channels is not None and hk != self.k_channels) or (self.v_channels is not None and hv != self.v_channels):
            raise ValueError(f"key/value head dims ({hk}, {hv}) differ from k_channels={self.k_channels}, v_channels={self.v_channels}")
        if self.softmax_offset is not None and self.softmax_offset.shape[0] != num_heads:
            raise ValueError(f"query has {num_heads} heads but softmax_offset has {self.softmax_offset.shape[0]}")
        params_group = getattr(packed_seq_params, "cp_group", None)
        if params_group is not None and params_group is not self.cp_group:
            raise ValueError("packed_seq_params.cp_group is not this layer's CP group (dynamic CP is not supported)")
        packed = plan_of(packed_seq_params, self.cp_group.size(), self.cp_group.rank(), exchange=self.exchange,
                         window=self.window)
        scale = self.softmax_scale if self.softmax_scale is not None else hk ** -0.5
        spec = AttentionSpec(d_v=hv, window=self.window, scale=scale)
        sinks = self._sinks(query)
        if sinks is not None:
            sinks = sinks.to(query.dtype)
        # All ng kv heads in one call: one exchange of keys and values, one kernel call per segment set.
        out = attention_forward(query, key, packed.plan, self.cp_group, spec=spec, v=value, sinks=sinks,
                                backend=self._ops(query.device), status=getattr(packed_seq_params, STATUS_ATTRIBUTE, None)).out
        return out.reshape(t, num_heads * hv)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple[tuple[int, int, int], ...] = (),
                           metadata: dict[str, Any] | None = None) -> Any:
        """Megatron's distributed-checkpoint state (the learnable ``softmax_offset``, split over TP), as ``DotProductAttention``'s."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint  # type: ignore[import-untyped,import-not-found,unused-ignore]

        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets, tp_group=self.pg_collection.tp,
            dp_cp_group=None if metadata is None else metadata.get("dp_cp_group"),
        )
