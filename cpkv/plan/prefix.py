"""The prefix-KV plan of contiguous TND sharding (docs/semantics.md).

A rank's queries cover packed tokens ``[a, b)``. Every non-empty document
``[s, e)`` overlapping ``[a, b)`` contributes one query segment
``[max(s, a), min(e, b))`` and one kv segment ``[s, min(e, b))`` (its whole causal
prefix). The kv segments abut, so the prefix is the contiguous slice
``kv[s_first : b]`` of the gathered natural-order kv. Within each segment pair the
mask is bottom-right aligned causal.

Planning is pure: ``(cu_seqlens, rank_offset, local_len) -> PrefixKVPlan``, with
no process group, computed once per micro-batch and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cpkv.checks import check_dim, check_int, check_tensor
from cpkv.plan.conventions import validate_cu_seqlens
from cpkv.plan.sharding import contiguous_shard_range


@dataclass(frozen=True, eq=False)
class PrefixKVPlan:
    """What one rank attends: its query segments and their causal kv prefixes.

    Attributes:
        cu_seqlens_q: ``[B_r + 1]`` int32, leading 0: the rank's local query segments
            (``B_r`` = documents overlapping the rank's range), on the input's device.
        cu_seqlens_kv: ``[B_r + 1]`` int32, leading 0: the matching kv prefix segments.
        kv_start: first token of the prefix in the gathered natural-order buffer.
        kv_end: one past the last prefix token (equals ``rank_offset + local_len``).
        max_seqlen_q: longest query segment (0 if none).
        max_seqlen_kv: longest kv segment (0 if none).
        actual_seq_qlen: host tuple ``[B_r]``, cumulative query ends **without** the
            leading 0 (Ascend convention, built once here for the NPU backend).
        actual_seq_kvlen: host tuple ``[B_r]``, the same for the kv segments.
        doc_ids: ``[B_r]`` int64: the global document index of each segment.
        rank_offset: first packed token of the rank's queries.
        local_len: number of the rank's query tokens.
        num_tokens: ``T``, packed tokens of the whole micro-batch (all ranks).
    """

    cu_seqlens_q: Tensor
    cu_seqlens_kv: Tensor
    kv_start: int
    kv_end: int
    max_seqlen_q: int
    max_seqlen_kv: int
    actual_seq_qlen: tuple[int, ...]
    actual_seq_kvlen: tuple[int, ...]
    doc_ids: Tensor
    rank_offset: int
    local_len: int
    num_tokens: int

    @property
    def kv_len(self) -> int:
        """Number of prefix kv tokens, ``kv_end - kv_start``."""
        return self.kv_end - self.kv_start

    @property
    def num_segments(self) -> int:
        """``B_r``, the number of segment pairs."""
        return len(self.actual_seq_qlen)


def compute_prefix_kv_cu_seqlens(cu_seqlens: Tensor, rank_offset: int, local_len: int) -> PrefixKVPlan:
    """Plan a rank's query segments and causal kv prefixes over a packed batch.

    Vectorised over documents (no Python loop); one host sync for the scalars and
    the Ascend host lists.

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64, the **global** leading-zero cu_seqlens of
            the micro-batch (all ranks' tokens), any device. Zero-length documents are skipped.
        rank_offset: first packed token of this rank's queries (``r * T/cp`` for contiguous TND).
        local_len: number of query tokens of this rank (``T/cp``).

    Returns:
        :class:`PrefixKVPlan`; its tensors are int32 on ``cu_seqlens.device``.

    Raises:
        TypeError: non-integer ``cu_seqlens`` or non-int offsets.
        ValueError: invalid ``cu_seqlens``, negative ``rank_offset`` / ``local_len``, or a
            local range past the last token.

    Example (the worked example of docs/semantics.md, rank 1 of 2):
        >>> plan = compute_prefix_kv_cu_seqlens(torch.tensor([0, 5, 12, 16]), 8, 8)
        >>> plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist(), (plan.kv_start, plan.kv_end)
        ([0, 4, 8], [0, 7, 11], (5, 16))
    """
    validate_cu_seqlens(cu_seqlens)
    check_int("rank_offset", rank_offset, minimum=0)
    check_int("local_len", local_len, minimum=0)
    num_tokens = int(cu_seqlens[-1])
    end = rank_offset + local_len
    if end > num_tokens:
        raise ValueError(
            f"the local range [rank_offset, rank_offset + local_len) = [{rank_offset}, {end})"
            f" goes past the last packed token {num_tokens} (cu_seqlens[-1])"
        )
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    # Non-empty intersection with [rank_offset, end) (this also skips empty documents).
    overlap = ends.clamp(max=end) > starts.clamp(min=rank_offset)
    doc_ids = torch.nonzero(overlap).flatten()
    seg_start, seg_end = starts[doc_ids], ends[doc_ids].clamp(max=end)
    q_lens = seg_end - seg_start.clamp(min=rank_offset)
    kv_lens = seg_end - seg_start
    zero = cu_seqlens.new_zeros(1, dtype=torch.int32)
    cu_q = torch.cat([zero, q_lens.cumsum(0).to(torch.int32)])
    cu_kv = torch.cat([zero, kv_lens.cumsum(0).to(torch.int32)])
    host = torch.stack([cu_q, cu_kv]).cpu() if doc_ids.numel() else None
    first = int(seg_start[0]) if doc_ids.numel() else end
    return PrefixKVPlan(
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        kv_start=first,
        kv_end=end,
        max_seqlen_q=int(q_lens.max()) if host is not None else 0,
        max_seqlen_kv=int(kv_lens.max()) if host is not None else 0,
        actual_seq_qlen=tuple(host[0, 1:].tolist()) if host is not None else (),
        actual_seq_kvlen=tuple(host[1, 1:].tolist()) if host is not None else (),
        doc_ids=doc_ids,
        rank_offset=rank_offset,
        local_len=local_len,
        num_tokens=num_tokens,
    )


def rearrange_prefix_kv(kv: Tensor, plan: PrefixKVPlan, *, dim: int = 0) -> Tensor:
    """The rank's prefix kv from the gathered natural-order kv.

    Args:
        kv: ``[T, ...]`` (tokens at ``dim``): the whole micro-batch's kv in natural packed
            order, e.g. from ``gather_from_sp_cp(..., tnd=True)``.
        plan: the rank's :class:`PrefixKVPlan`.
        dim: the token dimension.

    Returns:
        ``kv[plan.kv_start : plan.kv_end]`` along ``dim``: a **view** (no copy) whose
        segments are ``plan.cu_seqlens_kv``; autograd flows back into ``kv``.

    Raises:
        ValueError: ``kv.shape[dim] != plan.num_tokens``.
    """
    check_tensor("kv", kv)
    dim = check_dim("dim", dim, kv.ndim)
    if kv.shape[dim] != plan.num_tokens:
        raise ValueError(
            f"kv must hold the whole gathered micro-batch along dim {dim}: expected"
            f" {plan.num_tokens} tokens (plan.num_tokens), got {kv.shape[dim]}"
        )
    return kv.narrow(dim, plan.kv_start, plan.kv_len)


def slice_tnd_kv_prefix(
    kv_gathered: Tensor, cu_seqlens: Tensor, rank: int, cp_size: int
) -> tuple[Tensor, PrefixKVPlan]:
    """Plan and slice the prefix kv of ``rank`` under contiguous TND sharding.

    Args:
        kv_gathered: ``[T, N, D]`` natural-order kv of the whole micro-batch.
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens, ``cu_seqlens[-1] == T``.
        rank: this rank in the CP group.
        cp_size: CP group size; ``T % cp_size == 0``.

    Returns:
        ``(prefix_kv, plan)`` where ``prefix_kv`` is a view ``[plan.kv_len, N, D]``.

    Raises:
        ValueError: ``T`` not divisible by ``cp_size``, rank out of range, ``kv_gathered``
            not holding ``cu_seqlens[-1]`` tokens.

    Example:
        >>> kv = torch.arange(16.0).unsqueeze(-1)
        >>> prefix, plan = slice_tnd_kv_prefix(kv, torch.tensor([0, 5, 12, 16]), 1, 2)
        >>> prefix.flatten().tolist()[:3], plan.cu_seqlens_kv.tolist()
        ([5.0, 6.0, 7.0], [0, 7, 11])
    """
    check_tensor("kv_gathered", kv_gathered)
    validate_cu_seqlens(cu_seqlens)
    num_tokens = int(cu_seqlens[-1])
    if kv_gathered.ndim == 0 or kv_gathered.shape[0] != num_tokens:
        raise ValueError(
            f"kv_gathered must be [T, ...] with T = cu_seqlens[-1] = {num_tokens},"
            f" got shape {tuple(kv_gathered.shape)}"
        )
    rank_offset, local_len = contiguous_shard_range(num_tokens, cp_size, rank)
    plan = compute_prefix_kv_cu_seqlens(cu_seqlens, rank_offset, local_len)
    return rearrange_prefix_kv(kv_gathered, plan), plan
