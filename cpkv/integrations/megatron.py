"""Megatron-core's ``PackedSeqParams`` as a cpkv plan.

Megatron describes a packed (THD) micro-batch with ``PackedSeqParams`` (megatron-core
0.16: ``megatron.core.packed_seq_params``): global leading-zero ``cu_seqlens_q`` /
``cu_seqlens_kv`` of the real tokens, and, when TransformerEngine's context parallelism
needs it, ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded``: every document padded at its
end to a multiple of ``2 * cp``, and the packed tensor laid out in those padded documents.
At ``cp > 1`` Megatron always shards THD per document in zigzag, padded or not: rank ``r``
holds chunks ``r`` and ``2cp-1-r`` of every document of the padded cu_seqlens if set, else
of ``cu_seqlens_q`` (TransformerEngine's ``thd_get_partitioned_indices`` in
``get_thd_batch_on_this_cp_rank``; the THD RoPE positions likewise), which is cpkv's
``layout="zigzag"`` over those cu_seqlens.

:func:`plan_from_packed_seq_params` returns that plan together with the rows of this
rank's shard that hold real tokens (:class:`PackedPlan`); nothing here imports Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpkv.checks import check_int, check_int_dtype, check_rank, check_tensor
from cpkv.plan.cost import CostModel
from cpkv.plan.attention import LAYOUTS, AttentionPlan, Layout, plan_attention
from cpkv.plan.conventions import validate_cu_seqlens

__all__ = ["PackedPlan", "plan_from_packed_seq_params"]


@dataclass(frozen=True, eq=False)
class PackedPlan:
    """A plan over Megatron's packed batch and the rows of this rank's shard that are real tokens.

    Attributes:
        plan: the :class:`~cpkv.AttentionPlan` of the batch as laid out in memory (over the
            padded cu_seqlens when they are set); pass it to :func:`cpkv.attention_forward`.
        cu_seqlens: ``[B + 1]`` the global leading-zero cu_seqlens the plan was made from
            (``cu_seqlens_q_padded`` if set, else ``cu_seqlens_q``), on their device.
        real_rows: ``[T_real_local]`` int64, ascending: the rows of this rank's ``[T/cp, ...]``
            shard that hold real tokens (the others are TransformerEngine's per-document
            padding; every row when nothing is padded). Select them with
            ``out.index_select(0, real_rows)``, e.g. to mask the loss.
    """

    plan: AttentionPlan
    cu_seqlens: Tensor
    real_rows: Tensor


def _cu_seqlens(params: object, field: str) -> Tensor | None:
    """``params.<field>`` checked as leading-zero integer cu_seqlens, or ``None`` if unset."""
    if not hasattr(params, field):
        raise TypeError(f"params must have a {field!r} attribute like megatron.core.packed_seq_params.PackedSeqParams")
    value = getattr(params, field)
    if value is None:
        return None
    tensor = check_tensor(f"params.{field}", value)
    check_int_dtype(f"params.{field}", tensor)
    validate_cu_seqlens(tensor, name=f"params.{field}")
    return tensor


def _required_cu_seqlens(params: object, field: str) -> Tensor:
    tensor = _cu_seqlens(params, field)
    if tensor is None:
        raise ValueError(f"params.{field} must be set (a [B + 1] integer tensor), got None")
    return tensor


def _same(q_field: str, kv_field: str, q: Tensor | None, kv: Tensor | None) -> None:
    """Self-attention only: the kv cu_seqlens must equal the query ones (both unset counts as equal)."""
    if q is None and kv is None:
        return
    if q is None or kv is None or q.shape != kv.shape or not torch.equal(q.long().cpu(), kv.long().cpu()):
        shown = "None" if kv is None else kv.tolist()
        raise ValueError(
            f"params.{kv_field} must equal params.{q_field} (cpkv plans self-attention), got"
            f" {q_field}={None if q is None else q.tolist()}, {kv_field}={shown}"
        )


def plan_from_packed_seq_params(
    params: object, cp_size: int, cp_rank: int, *, layout: Layout | None = None, config: Any = None,
    vocab_size: int = 0, **plan_options: Any
) -> PackedPlan:
    """cpkv's plan for the micro-batch Megatron describes with ``PackedSeqParams``.

    Defaults to zigzag, not the recommended balanced layout: Megatron's data pipeline has
    already cut the batch in zigzag when this plan is made (pass ``layout="balanced"`` when
    you shard the whole batch yourself with ``packed.plan.shard``).

    The plan is over ``cu_seqlens_q_padded`` if set, else over ``cu_seqlens_q``. At
    ``cp_size > 1`` the default layout is Megatron's: per-document zigzag (rank ``r`` holds
    chunks ``r`` and ``2cp-1-r`` of every document, in document order), so every planned
    document length must be a multiple of ``2 * cp_size``. With ``cu_seqlens_q_padded`` set
    (TransformerEngine's THD context parallelism) the batch is laid out in padded documents
    (real tokens first, padding at each document's end) and ``real_rows`` names the shard's
    real tokens; causal attention never lets a real token see the padding after it, so real
    tokens' outputs equal the unpadded batch's. The plan knows the padding
    (:func:`cpkv.plan_attention`'s ``padding``): padding queries take no part in the indexer
    loss and ``plan.num_global_queries`` counts real tokens only, so with the loss of the
    padding rows masked every gradient equals the unpadded batch's. At ``cp_size == 1``
    nothing is sharded: the default is ``"contiguous"`` (the same token order as zigzag,
    without its length requirement). ``layout="contiguous"`` at ``cp > 1`` (rank ``r`` holds packed tokens
    ``[r*T/cp, (r+1)*T/cp)``) is not what Megatron does; ask for it explicitly.

    Args:
        params: a ``megatron.core.packed_seq_params.PackedSeqParams`` or any object with its
            attributes: ``qkv_format == "thd"``; ``cu_seqlens_q``, ``cu_seqlens_kv``: ``[B + 1]``
            int32/int64 global leading-zero cu_seqlens of the real tokens (equal: self-attention);
            ``cu_seqlens_q_padded``, ``cu_seqlens_kv_padded``: ``[B + 1]`` or ``None`` (equal).
            ``max_seqlen_*`` are not read. ``local_cp_size``, if present and set, must equal ``cp_size``.
        cp_size, cp_rank: CP group size and this rank.
        layout: ``None`` (default): ``"zigzag"`` at ``cp_size > 1`` (padded or not, as Megatron),
            ``"contiguous"`` at ``cp_size == 1``; or ``"zigzag"`` / ``"contiguous"`` explicitly, or
            ``"balanced"`` (any lengths; shard the batch with ``packed.plan.shard``; needs
            ``config`` or a ``cost_model``).
        config: the model's Megatron ``TransformerConfig``: its cost
            (:meth:`cpkv.CostModel.from_megatron`, with ``vocab_size``) is the plan's
            ``cost_model`` (what ``"balanced"`` balances, ``plan.rank_costs``) unless
            ``plan_options`` names one.
        **plan_options: the other keyword options of :func:`cpkv.plan_attention`
            (``exchange``, ``ring_degree``, ``compress_ratios``, ``windows``), passed through.

    Returns:
        :class:`PackedPlan`: ``plan``, ``cu_seqlens`` (what was planned) and ``real_rows``.

    Shapes:
        ``B`` documents, ``T`` packed tokens of all ranks (padding included), ``T/cp`` per rank.

    Raises:
        TypeError: a missing attribute, a non-tensor or non-integer cu_seqlens (the field is named);
            a ``padding=`` plan option (the padded cu_seqlens give it).
        ValueError: ``qkv_format != "thd"``; ``layout`` not ``None``, ``"zigzag"``,
            ``"contiguous"`` or ``"balanced"``; ``"balanced"`` with neither ``config`` nor a
            ``cost_model`` (the message names ``cost_model``); a cu_seqlens field that is not leading-zero, non-decreasing and
            1-D; kv cu_seqlens differing from the query ones; a padded document shorter than
            its real length; with the zigzag layout, a planned document length that is not a
            multiple of ``2 * cp_size`` (the message names ``params.cu_seqlens_q`` or
            ``params.cu_seqlens_q_padded``, the document and its length, and the fix: pad and
            set the padded cu_seqlens, or pass ``layout="contiguous"``); with the contiguous
            layout, a packed token count not divisible by ``cp_size``; ``local_cp_size !=
            cp_size``; anything else :func:`cpkv.plan_attention` rejects (its options).
            Every cu_seqlens error names its ``params.<field>``.

    Example:
        >>> from types import SimpleNamespace
        >>> params = SimpleNamespace(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 3, 8]),
        ...     cu_seqlens_kv=torch.tensor([0, 3, 8]), cu_seqlens_q_padded=torch.tensor([0, 4, 12]),
        ...     cu_seqlens_kv_padded=torch.tensor([0, 4, 12]), max_seqlen_q=5, max_seqlen_kv=5)
        >>> packed = plan_from_packed_seq_params(params, 2, 1)
        >>> packed.plan.layout, packed.real_rows.tolist()   # rank 1 holds rows 1, 2, 6, 7, 8, 9 (9 pads)
        ('zigzag', [0, 1, 2, 3, 4])
    """
    check_rank("cp_rank", cp_rank, check_int("cp_size", cp_size, minimum=1))
    qkv_format = getattr(params, "qkv_format", None)
    if qkv_format != "thd":
        raise ValueError(f"params.qkv_format must be 'thd' (packed documents), got {qkv_format!r}")
    local_cp_size = getattr(params, "local_cp_size", None)
    if local_cp_size is not None and local_cp_size != cp_size:
        raise ValueError(f"params.local_cp_size={local_cp_size} differs from cp_size={cp_size}")
    cu_q = _required_cu_seqlens(params, "cu_seqlens_q")
    cu_kv = _required_cu_seqlens(params, "cu_seqlens_kv")
    _same("cu_seqlens_q", "cu_seqlens_kv", cu_q, cu_kv)
    cu_q_padded = _cu_seqlens(params, "cu_seqlens_q_padded")
    cu_kv_padded = _cu_seqlens(params, "cu_seqlens_kv_padded")
    _same("cu_seqlens_q_padded", "cu_seqlens_kv_padded", cu_q_padded, cu_kv_padded)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be None or one of {LAYOUTS}, got {layout!r}")
    if layout is None:  # Megatron shards THD per document in zigzag at cp > 1; at cp 1 nothing is sharded
        layout = "zigzag" if cp_size > 1 else "contiguous"
    field, cu_seqlens = ("cu_seqlens_q", cu_q) if cu_q_padded is None else ("cu_seqlens_q_padded", cu_q_padded)
    real_len = cu_q.detach().to("cpu", torch.int64).diff()
    padding: Tensor | None = None
    if cu_q_padded is not None:
        padded_len = cu_q_padded.detach().to("cpu", torch.int64).diff()
        if padded_len.shape != real_len.shape or bool((padded_len < real_len).any()):
            raise ValueError(
                "params.cu_seqlens_q_padded must pad every document of cu_seqlens_q (same count, each"
                f" padded length >= the real one), got cu_seqlens_q={cu_q.tolist()},"
                f" cu_seqlens_q_padded={cu_q_padded.tolist()}"
            )
        padding = padded_len - real_len
    if layout == "zigzag":
        _check_zigzag_lengths(field, cu_seqlens, cp_size)
    elif layout == "contiguous" and int(cu_seqlens[-1]) % cp_size:
        raise ValueError(
            f"params.{field}: layout='contiguous' needs the packed token count divisible by cp_size = {cp_size},"
            f" got {field}[-1] = {int(cu_seqlens[-1])}"
        )
    if "padding" in plan_options:
        raise TypeError("plan_from_packed_seq_params takes no padding= option: it is what the padded cu_seqlens say")
    if config is not None and plan_options.get("cost_model") is None:
        plan_options["cost_model"] = CostModel.from_megatron(config, vocab_size=vocab_size)
    plan = plan_attention(cu_seqlens, cp_size, cp_rank, layout=layout, padding=padding, **plan_options)
    if plan.valid_queries is None:
        real_rows = torch.arange(plan.local_len, device=cu_seqlens.device)
    else:
        real_rows = torch.nonzero(plan.valid_queries).flatten()
    return PackedPlan(plan, cu_seqlens, real_rows)


def _check_zigzag_lengths(field: str, cu_seqlens: Tensor, cp_size: int) -> None:
    """Raise ``ValueError`` naming ``params.<field>`` and its first document not a multiple of ``2 * cp_size``."""
    lengths = cu_seqlens.detach().to("cpu", torch.int64).diff()
    bad = torch.nonzero(lengths % (2 * cp_size)).flatten()
    if bad.numel():
        doc, multiple = int(bad[0]), 2 * cp_size
        if field == "cu_seqlens_q":
            fix = (f"pad every document at its end to a multiple of {multiple} and set params.cu_seqlens_q_padded"
                   " / cu_seqlens_kv_padded (as TransformerEngine's THD context parallelism expects)")
        else:
            fix = f"pad every document of params.{field} / cu_seqlens_kv_padded to a multiple of {multiple}"
        raise ValueError(
            f"params.{field}: layout='zigzag' (Megatron's THD sharding: rank r holds chunks r and 2cp-1-r of"
            f" every document) needs every document length to be a multiple of 2*cp_size = {multiple}, but"
            f" document {doc} ({field}[{doc}:{doc + 2}] = {cu_seqlens[doc:doc + 2].tolist()}) has length"
            f" {int(lengths[doc])}; {fix}, or pass layout='contiguous' explicitly"
        )
