"""Labels and loss of a packed causal LM under CP, framework-free.

A causal LM predicts token ``t + 1`` of a document from tokens ``<= t``. Under CP the label of
a rank's last token lives on the next rank, so the labels are shifted on the whole packed
batch, **before** sharding, within each document (:func:`shift_labels`: the last token of a
document has no label), and then sharded like the tokens (:func:`shard_by_plan`). The mean
over valid labels needs the count of the whole CP group: a rank dividing by its own count
gets the wrong loss and gradients whenever the ranks' counts differ
(:func:`global_valid_count`, :func:`causal_lm_loss`).

Gradients of the replicated parameters (everything but what CP shards) come out of each
rank partial; ``grad_reduction`` says how the user reduces them over the CP group (see
docs/semantics.md, "A whole causal LM under CP"):

* ``"sum"`` (default): each rank's loss is ``sum of its tokens' CE / N`` (``N`` the group's
  valid count), so the SUM of the ranks' gradients is the single-process gradient: an
  ``all_reduce(SUM)`` of the gradients over the CP group, as docs/design.md describes.
* ``"mean"``: the rank's loss is multiplied by the CP size, so the MEAN of the ranks'
  gradients is the single-process one: what DDP over a data x CP mesh computes (FSDP2: see
  docs/integrations.md).

Hugging Face's position-id convention (``DataCollatorWithFlattening``: positions restart at 0
at every document) converts with :func:`cu_seqlens_from_position_ids`.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from cpkv.checks import check_int, check_int_dtype, check_ndim, check_tensor
from cpkv.collectives import Group, check_group
from cpkv.integrations.linear_cross_entropy import DEFAULT_CHUNK_SIZE, linear_cross_entropy
from cpkv.plan.attention import AttentionPlan
from cpkv.plan.conventions import document_real_lengths, validate_cu_seqlens

__all__ = [
    "GradReduction",
    "batch_fingerprint",
    "check_given_plan",
    "causal_lm_loss",
    "causal_lm_loss_from_hidden",
    "cu_seqlens_from_position_ids",
    "global_valid_count",
    "grad_reduction_scale",
    "padding_mask",
    "shard_by_plan",
    "shift_labels",
]

GradReduction = Literal["sum", "mean"]
"""How the replicated parameters' gradients are reduced over the CP group: ``"sum"`` or ``"mean"``."""

GRAD_REDUCTIONS: tuple[GradReduction, ...] = ("sum", "mean")


def _tokens(name: str, x: object) -> Tensor:
    """``x`` as ``[T]``: a 1-D integer tensor, or ``[1, T]`` (Hugging Face's packed batch of one row)."""
    tensor = check_tensor(name, x)
    check_int_dtype(name, tensor)
    check_ndim(name, tensor, (1, 2), "[T] or [1, T] (one packed row)")
    if tensor.ndim == 2:
        if tensor.shape[0] != 1:
            raise ValueError(f"{name} must be [T] or [1, T] (one packed row), got shape {tuple(tensor.shape)}")
        tensor = tensor[0]
    return tensor


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """Leading-zero ``cu_seqlens`` of a packed row whose positions restart at 0 at every document.

    ``DataCollatorWithFlattening`` (Hugging Face) packs documents into one row with
    ``position_ids = [0, 1, .., n_0 - 1, 0, 1, .., n_1 - 1, ..]``; a document starts wherever
    the position is 0. Every other position must be its predecessor plus 1: anything else
    (a document not starting at 0, a jump) raises instead of being read as some other batch.
    Zero-length documents cannot be expressed in this form. A host sync.

    Args:
        position_ids: ``[T]`` or ``[1, T]`` int32/int64, ``T >= 1``.

    Returns:
        ``[B + 1]`` int64 on ``position_ids.device``.

    Raises:
        TypeError: not an integer tensor. ValueError: another shape, empty, or not the
            restart-at-0 form (the first offending token is named).

    Example:
        >>> cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
        [0, 3, 5, 6]
    """
    positions = _tokens("position_ids", position_ids).long()
    if positions.numel() == 0:
        raise ValueError("position_ids must hold at least one token, got an empty tensor")
    host = positions.detach().cpu()
    expected = torch.cat([host.new_zeros(1), host[:-1] + 1])
    bad = torch.nonzero((host != 0) & (host != expected)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            "position_ids must restart at 0 at every document and count up by 1 within it"
            f" (DataCollatorWithFlattening's form): token {i} has position {int(host[i])},"
            f" expected 0 or {int(expected[i])}"
        )
    starts = torch.nonzero(host == 0).flatten()
    cu = torch.cat([starts, torch.tensor([host.numel()])])
    return cu.to(positions.device)


def shift_labels(labels: Tensor, cu_seqlens: Tensor, *, ignore_index: int = -100, padding: Tensor | None = None) -> Tensor:
    """Next-token labels of a packed batch, shifted within each document (before sharding).

    ``shifted[t] = labels[t + 1]`` when ``t + 1`` is in ``t``'s document, else ``ignore_index``
    (the last token of every document predicts nothing, never the next document's first
    token). ``labels`` follow Hugging Face's convention: unshifted, ``labels[t]`` is token
    ``t``'s own id (or ``ignore_index``), e.g. the input ids.

    With ``padding`` (documents padded at their ends, e.g. by :func:`cpkv.pad_documents`) the
    padding tokens are no targets whatever ``labels`` holds there: they and the last real token
    of each document get ``ignore_index``, so the valid labels are exactly the unpadded batch's.

    Args:
        labels: ``[T]`` or ``[1, T]`` integer labels of the whole packed batch (all ranks' tokens).
        cu_seqlens: ``[B + 1]`` leading-zero cu_seqlens of the batch, last entry ``T``.
        ignore_index: the label of tokens without a target.
        padding: ``[B]`` int tensor: the padding tokens at the end of each document of
            ``cu_seqlens``; default ``None`` (every token is real).

    Returns:
        ``[T]`` the shifted labels, ``labels``' dtype and device.

    Raises:
        TypeError, ValueError: not an integer ``[T]`` / ``[1, T]`` tensor, invalid
            ``cu_seqlens``, ``labels`` of another length than ``cu_seqlens[-1]`` (both named),
            ``padding`` not ``[B]`` or outside ``[0, document length]``.

    Example:
        >>> shift_labels(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 3, 5])).tolist()
        [6, 7, -100, 9, -100]
    """
    flat = _tokens("labels", labels)
    check_int("ignore_index", ignore_index)
    validate_cu_seqlens(cu_seqlens)
    if int(cu_seqlens[-1]) != flat.shape[0]:
        raise ValueError(f"labels must hold the batch's {int(cu_seqlens[-1])} tokens (cu_seqlens[-1]), got {flat.shape[0]}")
    if padding is not None:
        flat = flat.masked_fill(padding_mask(cu_seqlens, padding).to(flat.device), ignore_index)
    shifted = torch.cat([flat[1:], flat.new_full((1,), ignore_index)]) if flat.numel() else flat.clone()
    ends = cu_seqlens[1:].to(flat.device).long()
    ends = ends[ends > cu_seqlens[:-1].to(flat.device).long()] - 1  # last token of each non-empty document
    return shifted.index_fill(0, ends, ignore_index)


def padding_mask(cu_seqlens: Tensor, padding: Tensor) -> Tensor:
    """``[T]`` bool, ``True`` at the padding tokens of a batch padded at its documents' ends.

    Args:
        cu_seqlens: ``[B + 1]`` leading-zero cu_seqlens of the padded batch.
        padding: ``[B]`` int tensor, the padding tokens at the end of each document.

    Returns:
        ``[T]`` bool on ``cu_seqlens.device``.

    Raises:
        TypeError, ValueError: invalid ``cu_seqlens``; ``padding`` not ``[B]`` or outside
            ``[0, document length]`` (:func:`cpkv.plan.conventions.document_real_lengths`).

    Example:
        >>> padding_mask(torch.tensor([0, 4, 7]), torch.tensor([1, 2])).tolist()
        [False, False, False, True, False, True, True]
    """
    validate_cu_seqlens(cu_seqlens)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    real_end = cu[:-1] + document_real_lengths(cu, padding)
    per_token = torch.repeat_interleave(real_end, cu.diff())
    return (torch.arange(int(cu[-1])) >= per_token).to(cu_seqlens.device)


_FINGERPRINT_PRIME = 2**31 - 1


def batch_fingerprint(*tensors: Tensor) -> Tensor:
    """Two int64 sums of each tensor's values, cheap to compare across ranks (no host sync).

    For each tensor ``x`` (flattened, integer values ``v_t = x_t mod p``, ``p = 2^31 - 1``) the
    sums ``sum_t v_t (t + 1) mod p`` and ``sum_t v_t (t + 1)^2 mod p``. Two tensors of the same
    length that differ in one or two entries always give other sums (``p`` is prime and the
    weights are distinct and nonzero below ``p``; two changes would solve a nonsingular 2x2
    system mod ``p``); more changes collide only by coincidence. Fold it into
    :func:`cpkv.plan_attention`'s ``fingerprint`` to have every rank raise when any rank's
    token ids or labels differ.

    Args:
        tensors: integer tensors of fewer than ``2^31 - 1`` entries each, on one device.

    Returns:
        ``[2 * len(tensors)]`` int64 on the tensors' device (CPU when none is given).

    Raises:
        TypeError: a tensor that is not an integer tensor. ValueError: too many entries.

    Example:
        >>> batch_fingerprint(torch.tensor([1, 2])).tolist()
        [5, 9]
    """
    sums = []
    for i, x in enumerate(tensors):
        check_int_dtype(f"tensors[{i}]", check_tensor(f"tensors[{i}]", x))
        if x.numel() >= _FINGERPRINT_PRIME:
            raise ValueError(f"tensors[{i}] must hold fewer than 2^31 - 1 entries, got {x.numel()}")
        values = x.detach().reshape(-1).long().remainder(_FINGERPRINT_PRIME)
        weight = torch.arange(1, values.numel() + 1, device=values.device, dtype=torch.int64)
        for w in (weight, weight * weight % _FINGERPRINT_PRIME):  # each product < 2^62; each sum < 2^62
            sums.append((values * w % _FINGERPRINT_PRIME).sum() % _FINGERPRINT_PRIME)
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def shard_by_plan(x: Tensor, cu_seqlens: Tensor, plan: AttentionPlan, *, dim: int = 0) -> Tensor:
    """This rank's tokens of a packed ``x`` in the plan's shard order (any layout; ``plan.shard`` with checks).

    Args:
        x: ``[T, ...]`` (tokens at ``dim``) of the whole packed batch.
        cu_seqlens: the ``[B + 1]`` cu_seqlens the plan was made from.
        plan: this rank's plan.

    Returns:
        ``[plan.local_len, ...]``: a view (contiguous) or a copy (other layouts), ``x``'s device.

    Raises:
        ValueError: ``x`` does not hold ``plan.num_tokens`` tokens at ``dim``, or ``cu_seqlens``
            has another token count.
    """
    check_tensor("x", x)
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan from cpkv.plan_attention, got {type(plan).__name__}")
    validate_cu_seqlens(cu_seqlens, num_tokens=plan.num_tokens)
    if x.ndim == 0 or x.shape[dim] != plan.num_tokens:
        raise ValueError(f"x must hold the plan's {plan.num_tokens} tokens (plan.num_tokens) along dim {dim}, got shape {tuple(x.shape)}")
    if plan.layout == "contiguous":
        return x.narrow(dim, plan.cp_rank * plan.local_len, plan.local_len)
    return plan.shard(x, dim=dim)


def global_valid_count(labels: Tensor, group: Group, *, ignore_index: int = -100) -> Tensor:
    """Labels ``!= ignore_index`` over the whole CP group (an ``all_reduce(SUM)``, no host sync).

    Args:
        labels: this rank's shifted labels ``[T/cp]`` (any shape), an integer tensor.
        group: the CP group (``None``: the default group).
        ignore_index: the label that does not count.

    Returns:
        0-d int64 on ``labels.device``, the same on every rank.

    Raises:
        TypeError: not an integer tensor, or ``group`` not a process group.
    """
    check_int_dtype("labels", check_tensor("labels", labels))
    group = check_group("group", group)
    count = (labels != ignore_index).sum().to(torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count


def grad_reduction_scale(grad_reduction: GradReduction, group: Group) -> int:
    """The factor on a rank's loss (and indexer ``grad_scale``) for ``grad_reduction``: 1 (``"sum"``) or the CP size (``"mean"``).

    Raises:
        ValueError: another ``grad_reduction``.
    """
    if grad_reduction not in GRAD_REDUCTIONS:
        raise ValueError(f"grad_reduction must be one of {list(GRAD_REDUCTIONS)}, got {grad_reduction!r}")
    return 1 if grad_reduction == "sum" else dist.get_world_size(check_group("group", group))


def causal_lm_loss(
    logits: Tensor, labels: Tensor, group: Group, *, num_items_in_batch: int | Tensor | None = None,
    ignore_index: int = -100, grad_reduction: GradReduction = "sum",
) -> Tensor:
    """This rank's share of the CP group's mean next-token cross-entropy.

    ``loss = scale * sum_{t local, labels[t] valid} CE(logits[t], labels[t]) / N`` with ``N`` =
    ``num_items_in_batch`` or the group's valid count (:func:`global_valid_count`) and
    ``scale`` = 1 for ``grad_reduction="sum"``, the CP size for ``"mean"``. The sum of the
    ranks' losses (``"sum"``) is the single-process loss of the packed batch, each document on
    its own. The cross-entropy is computed in ``promote_types(logits.dtype, float32)`` (as
    Hugging Face: float32 for bf16/fp16/fp32 logits). ``N = 0`` gives a zero loss.

    Args:
        logits: ``[T/cp, V]`` this rank's logits, in the shard order of ``labels``.
        labels: ``[T/cp]`` this rank's labels, already shifted (:func:`shift_labels` on the
            whole batch, then :func:`shard_by_plan`).
        group: the CP group (``None``: the default group).
        num_items_in_batch: the normaliser when it spans more than this micro-batch (gradient
            accumulation, data parallelism), as Hugging Face's argument of that name; default:
            this micro-batch's global valid count (one all-reduce).
        ignore_index: labels that do not count.
        grad_reduction: how the gradients will be reduced over the CP group: ``"sum"`` or ``"mean"``.

    Returns:
        0-d loss, the compute dtype, differentiable w.r.t. ``logits``.

    Raises:
        TypeError, ValueError: logits not a float ``[T/cp, V]``, labels not an integer
            ``[T/cp]`` of the same length, a non-positive ``num_items_in_batch``, an unknown
            ``grad_reduction``.

    Example:
        >>> loss = causal_lm_loss(logits_local, labels_local, cp_group)  # doctest: +SKIP
    """
    check_ndim("logits", check_tensor("logits", logits), 2, "[T/cp, V]")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    _check_labels(labels, logits.shape[0], "logits'")
    scale, count = _normaliser(labels, group, num_items_in_batch, ignore_index, grad_reduction, logits.device)
    compute = torch.promote_types(logits.dtype, torch.float32)
    total = F.cross_entropy(logits.to(compute), labels.to(logits.device).long(), ignore_index=ignore_index, reduction="sum")
    return total * scale / count.clamp(min=1).to(compute)


def causal_lm_loss_from_hidden(
    hidden: Tensor, weight: Tensor, labels: Tensor, group: Group, *, num_items_in_batch: int | Tensor | None = None,
    ignore_index: int = -100, grad_reduction: GradReduction = "sum", chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """:func:`causal_lm_loss` of the logits ``hidden @ weight^T``, never holding them whole.

    The same loss, normaliser, ``ignore_index`` and ``grad_reduction`` as
    ``causal_lm_loss(F.linear(hidden, weight), labels, group, ...)``, with the cross-entropy
    sum computed ``chunk_size`` tokens at a time, forward and backward
    (:func:`cpkv.integrations.linear_cross_entropy.linear_cross_entropy`): the rank holds one
    chunk's ``[chunk_size, V]`` logits at a time instead of ``[T/cp, V]`` logits, their float32
    copy and their gradient.

    Args:
        hidden: ``[T/cp, H]`` this rank's final hidden states (after the last norm), in the
            shard order of ``labels``.
        weight: ``[V, H]`` the head's weight (no bias), ``hidden``'s dtype and device. Where the
            head is its own FSDP2 unit, its ``weight`` outside the head's call is the sharded
            ``DTensor``: call this from inside the head's call, with its returned loss an output
            of that call, as :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss`
            does (its hooks), or leave the head in its parent's unit.
        labels, group, num_items_in_batch, ignore_index, grad_reduction: as in :func:`causal_lm_loss`.
        chunk_size: tokens per chunk, ``>= 1`` (default
            :data:`~cpkv.integrations.linear_cross_entropy.DEFAULT_CHUNK_SIZE`, 1024: 0.5 GB of
            float32 logits at V = 129,280).

    Returns:
        0-d loss in ``promote_types(hidden.dtype, float32)``, differentiable w.r.t. ``hidden``
        and ``weight``.

    Raises:
        TypeError, ValueError: as :func:`causal_lm_loss` and
            :func:`~cpkv.integrations.linear_cross_entropy.linear_cross_entropy` (shapes,
            dtypes, ``chunk_size < 1``).

    Example:
        >>> loss = causal_lm_loss_from_hidden(hidden_local, model.lm_head.weight, labels_local, cp_group)  # doctest: +SKIP
    """
    check_ndim("hidden", check_tensor("hidden", hidden), 2, "[T/cp, H]")
    _check_labels(labels, hidden.shape[0], "hidden's")
    scale, count = _normaliser(labels, group, num_items_in_batch, ignore_index, grad_reduction, hidden.device)
    total = linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index, chunk_size=chunk_size)
    return total * scale / count.clamp(min=1).to(total.dtype)


def _check_labels(labels: Tensor, rows: int, of: str) -> None:
    check_int_dtype("labels", check_tensor("labels", labels))
    if labels.ndim != 1 or labels.shape[0] != rows:
        raise ValueError(f"labels must be [T/cp] = [{rows}] ({of} rows), got shape {tuple(labels.shape)}")


def _normaliser(
    labels: Tensor, group: Group, num_items_in_batch: int | Tensor | None, ignore_index: int,
    grad_reduction: GradReduction, device: torch.device,
) -> tuple[int, Tensor]:
    """``(scale, N)`` of the loss: the ``grad_reduction`` factor and the normaliser (given, or the group's valid count)."""
    scale = grad_reduction_scale(grad_reduction, group)
    if num_items_in_batch is None:
        return scale, global_valid_count(labels, group, ignore_index=ignore_index)
    if isinstance(num_items_in_batch, Tensor):
        return scale, num_items_in_batch.to(device)
    return scale, torch.tensor(check_int("num_items_in_batch", num_items_in_batch, minimum=1), device=device)


def check_given_plan(plan: object, cu_seqlens: Tensor, group: Group, *, padding: Tensor | None = None) -> AttentionPlan:
    """``plan``, checked to be this rank's plan of the batch ``cu_seqlens`` (made beforehand, e.g. in a data loader).

    Local checks only (no collective): its group position and token count must be this rank's
    and the batch's, and it must know the batch's ``padding`` (its real-query count). Compare the
    ranks' plans with :func:`~cpkv.collectives.check_same_on_all_ranks` and
    ``plan.comparison_options()``, as :func:`cpkv.plan_attention` does.

    Raises:
        TypeError: not an :class:`~cpkv.AttentionPlan`. ValueError: a plan of another rank,
            group size, batch or padding.
    """
    if not isinstance(plan, AttentionPlan):
        raise TypeError(f"plan must be an AttentionPlan (cpkv.plan_attention), got {type(plan).__name__}")
    group = check_group("group", group)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if (plan.cp_size, plan.cp_rank) != (size, rank):
        raise ValueError(f"plan is rank {plan.cp_rank} of {plan.cp_size}, but this is rank {rank} of the group's {size}")
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if plan.num_tokens != int(cu[-1]) or not torch.equal(plan.layout_ranges.cu_seqlens, cu):
        raise ValueError(f"plan was made for other documents ({plan.num_tokens} tokens) than this batch ({int(cu[-1])} tokens)")
    real = plan.num_tokens if padding is None else int(document_real_lengths(cu, padding).sum())
    if plan.num_global_queries != max(real, 1) or (plan.valid_queries is None) != (padding is None):
        raise ValueError(
            f"plan was made for other padding ({plan.num_global_queries} real tokens) than this batch's ({real}):"
            " plan with the same padding= (or none)"
        )
    return plan
