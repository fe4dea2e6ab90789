"""Evaluation of a CP-enabled ``DeepseekV4ForCausalLM``: per-document log-likelihoods, forward only.

:func:`deepseek_v4_causal_lm_eval` is the evaluation counterpart of
:func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss`: the same packed batch
on every rank of the CP group, the same plan and shards, but no loss to differentiate. It runs
the model under ``torch.no_grad()`` (nothing is saved for backward, the indexer's KL loss is
skipped), computes each token's log-probability of its next-token label from the head's input
and weight chunk by chunk (:func:`~cpkv.integrations.linear_cross_entropy.linear_token_scores`:
never the whole ``[T/cp, V]`` logits) and returns, for every document of the batch, its summed
negative log-likelihood and its count of valid labels, reduced over the CP group (one
all-reduce): the same on every rank, what one process running each document alone gets.

Perplexity of a document (or of a set of them, summed over documents, micro-batches and
data-parallel replicas first) is ``exp(nll / count)``. Over a data x CP mesh each CP group
evaluates its own batches; sum ``nll`` and ``count`` over the data-parallel ranks (one rank per
CP group, or all ranks divided by ``cp``) before dividing: docs/integrations.md shows it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.backends.base import AttentionBackend, BackendName
from cpkv.checks import check_int
from cpkv.collectives import Group
from cpkv.integrations.causal_lm import padding_mask, shard_by_plan
from cpkv.integrations.linear_cross_entropy import DEFAULT_CHUNK_SIZE, TokenScores, linear_token_scores
from cpkv.integrations.transformers_lm import DeepseekV4Batch, plan_deepseek_v4_batch, run_deepseek_v4_batch
from cpkv.plan.attention import AttentionPlan, Exchange, Layout

__all__ = ["DeepseekV4EvalOutput", "deepseek_v4_causal_lm_eval"]


class DeepseekV4EvalOutput(NamedTuple):
    """Result of :func:`deepseek_v4_causal_lm_eval`; every tensor the same on every rank of the CP group.

    Attributes:
        nll: ``[B]`` float64: per document of ``cu_seqlens`` (empty ones included), the summed
            negative log-likelihood of its valid next-token labels.
        num_tokens: ``[B]`` int64: each document's count of valid next-token labels (``!=
            ignore_index``; a document's last real token and its padding have none).
        log_probs: with ``return_tokens``: ``[T_real]`` the compute dtype
            (``promote_types(model dtype, float32)``): each real token's log-probability of its
            shifted label, in the batch's own token order with the padding removed, 0 where
            ``labels`` is ``ignore_index``; else ``None``.
        predictions: with ``return_tokens``: ``[T_real]`` int64, each real token's argmax
            (the model's next-token prediction), in the same order; else ``None``.
        labels: ``[T_real]`` the shifted labels in that order (``ignore_index`` where none).
        plan: this rank's plan of the batch.
    """

    nll: Tensor
    num_tokens: Tensor
    log_probs: Tensor | None
    predictions: Tensor | None
    labels: Tensor
    plan: AttentionPlan

    def perplexity(self) -> float:
        """``exp(sum of nll / sum of num_tokens)`` over the batch's documents (``nan`` with no label; a host read)."""
        count = int(self.num_tokens.sum())
        return float(torch.exp(self.nll.sum() / count)) if count else float("nan")


def deepseek_v4_causal_lm_eval(
    model: Any, input_ids: Tensor, group: Group, *, cu_seqlens: Tensor | None = None,
    position_ids: Tensor | None = None, labels: Tensor | None = None, layout: Layout = "balanced",
    exchange: Exchange = "need", ignore_index: int = -100, backend: BackendName | AttentionBackend = "auto",
    check_ranks: bool = True, padding: Tensor | None = None, plan: AttentionPlan | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE, return_tokens: bool = False,
) -> DeepseekV4EvalOutput:
    """Per-document negative log-likelihoods of a packed batch under CP, forward only: the whole batch in, the group's sums out.

    Every rank of the CP group passes the same packed batch; the call checks, plans and shards
    it as :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss` does (the
    same arguments, the same errors on every rank), runs the model on this rank's tokens under
    ``torch.no_grad()`` (nothing saved for backward; no indexer loss) and scores each token's
    shifted label from the head's input, ``chunk_size`` tokens at a time. The model's
    weights, gradients and training mode are left as they are: call ``model.eval()`` first
    for evaluation semantics (DeepSeek-V4 has no dropout under CP; the call does not switch).

    ``nll[b] / num_tokens[b]`` is document ``b``'s mean cross-entropy as one process running it
    alone computes it (Hugging Face's model, batch 1, positions from 0);
    ``nll.sum() / num_tokens.sum()`` is what
    :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss` returns as ``lm_loss``.

    Args:
        model: a ``DeepseekV4ForCausalLM`` after :func:`~cpkv.integrations.transformers_lm.enable_deepseek_v4_cp`
            (or a wrapper of one), as in :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss`.
        input_ids: ``[T]`` or ``[1, T]`` the whole packed (padded) batch, on the model's device.
        group: the CP group (a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``None``: the default group).
        cu_seqlens, position_ids, labels, layout, exchange, ignore_index, backend, check_ranks,
            padding, plan, chunk_size: as in :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss`.
        return_tokens: also return every real token's label log-probability and argmax, in
            the batch's order, on every rank (two all-reduces of ``[T]``).

    Returns:
        :class:`DeepseekV4EvalOutput`.

    Raises:
        TypeError, ValueError: as :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss`
            (before any collective, on every rank when any rank's are).
        RuntimeError: an attention layer that did not receive the CP context.

    Example:
        >>> out = deepseek_v4_causal_lm_eval(model, input_ids, cp_group, cu_seqlens=cu_seqlens)  # doctest: +SKIP
        >>> math.exp(out.nll.sum() / out.num_tokens.sum())  # the batch's perplexity  # doctest: +SKIP
    """
    def eval_checks() -> None:
        check_int("chunk_size", chunk_size, minimum=1)
        if not isinstance(return_tokens, bool):
            raise TypeError(f"return_tokens must be a bool, got {type(return_tokens).__name__}")

    with torch.no_grad():
        batch = plan_deepseek_v4_batch(model, input_ids, group, cu_seqlens=cu_seqlens, position_ids=position_ids,
                                       labels=labels, layout=layout, exchange=exchange, ignore_index=ignore_index,
                                       check_ranks=check_ranks, padding=padding, plan=plan, more_checks=eval_checks)

        def scores_of(hidden: Tensor, weight: Tensor) -> TokenScores:
            return linear_token_scores(hidden, weight, batch.labels_local, ignore_index=ignore_index, chunk_size=chunk_size)

        scores = run_deepseek_v4_batch(model, batch, scores_of, backend=backend)[1]
        return _reduced(batch, scores, ignore_index, return_tokens)


def _reduced(batch: DeepseekV4Batch, scores: TokenScores, ignore_index: int, return_tokens: bool) -> DeepseekV4EvalOutput:
    """Per-document sums (and, with ``return_tokens``, the tokens in batch order) over the CP group."""
    cu, plan, device = batch.cu_seqlens, batch.plan, scores.log_probs.device
    total = int(cu[-1])
    documents = cu.numel() - 1
    token_doc = torch.repeat_interleave(torch.arange(documents, device=cu.device), cu.diff().long()).to(device)
    local_doc = shard_by_plan(token_doc, cu, plan)
    valid = batch.labels_local.to(device) != ignore_index
    sums = torch.zeros(2, documents, dtype=torch.float64, device=device)  # nll, count (exact in float64 below 2^53)
    sums[0].index_add_(0, local_doc, torch.where(valid, -scores.log_probs.double(), 0))
    sums[1].index_add_(0, local_doc, valid.double())
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=batch.group)
    real = torch.ones(total, dtype=torch.bool) if batch.padding is None else ~padding_mask(cu, batch.padding).cpu()
    real_index = torch.nonzero(real).flatten().to(device)
    labels = batch.labels.to(device).index_select(0, real_index)
    log_probs = predictions = None
    if return_tokens:
        position = shard_by_plan(torch.arange(total, device=device), cu, plan)  # each local token's place in the batch
        whole = torch.zeros(2, total, dtype=torch.float64, device=device)
        whole[0].index_copy_(0, position, scores.log_probs.double())
        whole[1].index_copy_(0, position, scores.argmax.double())  # ids < 2^53: exact
        dist.all_reduce(whole, op=dist.ReduceOp.SUM, group=batch.group)
        log_probs = whole[0].index_select(0, real_index).to(scores.log_probs.dtype)
        predictions = whole[1].index_select(0, real_index).long()
    return DeepseekV4EvalOutput(sums[0], sums[1].long(), log_probs, predictions, labels, plan)
