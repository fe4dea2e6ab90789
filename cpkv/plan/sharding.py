"""How tokens are split over CP ranks, and back (docs/semantics.md).

Three schemes live here:

* **contiguous TND**: rank ``r`` holds packed tokens ``[r*L, (r+1)*L)``,
  ``L = T / cp``; documents may straddle ranks.
* **zigzag** (BSND and the gather order of every zigzag scheme): the sequence is
  cut into ``2*cp`` equal chunks; rank ``r`` holds chunks ``r`` and ``2cp-1-r``.
* **per-document zigzag TND**: every document cut into ``2*cp`` chunks, rank ``r``
  holding chunks ``r`` and ``2cp-1-r`` of each, in document order (load-balanced).

Everything here is pure tensor indexing: no process group is needed, so users
can prepare batches (what Megatron's ``get_batch_on_this_cp_rank`` does) and
tests can build expected values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from cpkv.checks import check_dim, check_int, check_rank, check_tensor


def zigzag_gather_index(cp_size: int) -> list[int]:
    """Gather index from rank-major zigzag chunks to natural order.

    After an all-gather of zigzag shards the buffer holds chunks in the order
    ``[r0c0, r0c1, r1c0, r1c1, ...]``; natural chunk ``n`` is gathered block
    ``index[n]``: ``index = [0, 2, ..., 2cp-2, 2cp-1, 2cp-3, ..., 3, 1]``.

    Example:
        >>> zigzag_gather_index(2)
        [0, 2, 3, 1]
    """
    check_int("cp_size", cp_size, minimum=1)
    return list(range(0, 2 * cp_size, 2)) + list(range(2 * cp_size - 1, 0, -2))


def zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two natural chunk indices held by ``cp_rank``: ``(r, 2*cp - 1 - r)``."""
    check_int("cp_size", cp_size, minimum=1)
    check_rank("cp_rank", cp_rank, cp_size)
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _chunked(x: Tensor, num_chunks: int, dim: int, what: str) -> Tensor:
    """View ``x`` with ``dim`` split into ``[num_chunks, size // num_chunks]``."""
    size = x.shape[dim]
    if size % num_chunks != 0:
        raise ValueError(
            f"{what}: dimension {dim} of x has size {size}, which is not divisible by"
            f" 2*cp_size = {num_chunks}; pad the sequence to a multiple of {num_chunks}"
        )
    return x.reshape(*x.shape[:dim], num_chunks, size // num_chunks, *x.shape[dim + 1 :])


def permute_cp_shard(
    x: Tensor, cp_size: int, *, reorder: bool, rank: int | None = None, dim: int = 0
) -> Tensor:
    """Move between zigzag shards and natural order along ``dim``.

    Args:
        x: any tensor; ``x.shape[dim]`` must be divisible by ``2 * cp_size``.
        cp_size: number of CP ranks.
        reorder: ``True``: ``x`` is the rank-major all-gather of zigzag shards
            ``[r0c0, r0c1, r1c0, ...]``; return it in natural order (a gather with
            :func:`zigzag_gather_index`). ``False``: ``x`` is the full natural-order
            sequence; return ``rank``'s two chunks ``[c_r, c_{2cp-1-r}]``.
        rank: required (and only allowed) when ``reorder=False``.
        dim: the sequence dimension.

    Returns:
        A new tensor (``index_select``); autograd flows back to ``x``.

    Raises:
        ValueError: indivisible length, ``rank`` missing/out of range or given with
            ``reorder=True``, bad ``dim``.

    Example:
        >>> gathered = torch.tensor([0, 3, 1, 2])  # rank 0 holds chunks 0, 3; rank 1 chunks 1, 2
        >>> permute_cp_shard(gathered, 2, reorder=True)
        tensor([0, 1, 2, 3])
        >>> permute_cp_shard(torch.arange(4), 2, reorder=False, rank=1)
        tensor([1, 2])
    """
    check_tensor("x", x)
    check_int("cp_size", cp_size, minimum=1)
    dim = check_dim("dim", dim, x.ndim)
    chunks = _chunked(x, 2 * cp_size, dim, "permute_cp_shard")
    if reorder:
        if rank is not None:
            raise ValueError("rank must be None when reorder=True (the gathered buffer holds all ranks)")
        index = zigzag_gather_index(cp_size)
    else:
        if rank is None:
            raise ValueError("rank is required when reorder=False (which rank's shard to take)")
        index = list(zigzag_chunks(cp_size, rank))
    picked = chunks.index_select(dim, torch.tensor(index, device=x.device))
    return picked.flatten(dim, dim + 1)


def shard_zigzag(x: Tensor, cp_size: int, cp_rank: int, *, dim: int = 1) -> Tensor:
    """This rank's zigzag shard of a full fixed-length batch.

    Args:
        x: ``[B, S, N, D]`` (BSND, ``dim=1``) or any layout with the sequence at ``dim``
            (``[S, B, ...]``: ``dim=0``). ``S % (2*cp_size) == 0``.
        cp_size, cp_rank: CP group size and this rank.
        dim: the sequence dimension (default 1, BSND).

    Returns:
        ``x`` with ``S`` replaced by ``S / cp_size``: chunks ``r`` and ``2cp-1-r``.

    Raises:
        ValueError: ``S`` not divisible by ``2*cp_size``; rank out of range.
    """
    return permute_cp_shard(x, cp_size, reorder=False, rank=cp_rank, dim=dim)


def unshard_zigzag(shards: Sequence[Tensor], *, dim: int = 1) -> Tensor:
    """Inverse of :func:`shard_zigzag`: the full natural-order tensor from all ranks' shards.

    Args:
        shards: one shard per rank, in rank order, each from :func:`shard_zigzag`.
        dim: the sequence dimension.
    """
    if len(shards) == 0:
        raise ValueError("shards must hold one tensor per CP rank, got none")
    return permute_cp_shard(torch.cat(list(shards), dim=dim), len(shards), reorder=True, dim=dim)


def contiguous_shard_range(num_tokens: int, cp_size: int, cp_rank: int) -> tuple[int, int]:
    """``(rank_offset, local_len)`` of ``cp_rank`` under contiguous TND sharding.

    Raises:
        ValueError: ``num_tokens % cp_size != 0`` (never truncates), rank out of range.

    Example:
        >>> contiguous_shard_range(16, 2, 1)
        (8, 8)
    """
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("cp_size", cp_size, minimum=1)
    check_rank("cp_rank", cp_rank, cp_size)
    if num_tokens % cp_size != 0:
        raise ValueError(
            f"contiguous TND sharding needs the packed token count divisible by cp_size:"
            f" num_tokens={num_tokens}, cp_size={cp_size}; pad the micro-batch to a multiple of {cp_size}"
        )
    local_len = num_tokens // cp_size
    return cp_rank * local_len, local_len


def shard_contiguous(x: Tensor, cp_size: int, cp_rank: int, *, dim: int = 0) -> Tensor:
    """This rank's contiguous TND shard ``x[r*L:(r+1)*L]`` along ``dim`` (a view).

    Args:
        x: ``[T, N, D]`` packed tokens (or any layout with tokens at ``dim``).

    Raises:
        ValueError: ``T % cp_size != 0``; rank out of range.
    """
    check_tensor("x", x)
    dim = check_dim("dim", dim, x.ndim)
    start, length = contiguous_shard_range(x.shape[dim], cp_size, cp_rank)
    return x.narrow(dim, start, length)


def unshard_contiguous(shards: Sequence[Tensor], *, dim: int = 0) -> Tensor:
    """Inverse of :func:`shard_contiguous`: concatenate the ranks' shards in rank order."""
    if len(shards) == 0:
        raise ValueError("shards must hold one tensor per CP rank, got none")
    return torch.cat(list(shards), dim=dim)


def check_zigzag_tnd_lengths(cu_seqlens: Tensor, cp_size: int) -> None:
    """Raise ``ValueError`` naming the first document whose length is not a multiple of ``2 * cp_size``.

    Per-document zigzag cuts every document into ``2 * cp_size`` equal chunks; pad the
    documents first (:func:`pad_documents`).
    """
    check_int("cp_size", cp_size, minimum=1)
    lengths = cu_seqlens.detach().to("cpu", torch.int64).diff()
    bad = torch.nonzero(lengths % (2 * cp_size)).flatten()
    if bad.numel():
        doc = int(bad[0])
        raise ValueError(
            f"per-document zigzag needs every document length divisible by 2*cp_size = {2 * cp_size}:"
            f" document {doc} (cu_seqlens[{doc}:{doc + 2}] = {cu_seqlens[doc:doc + 2].tolist()}) has length"
            f" {int(lengths[doc])}; pad the documents with cpkv.pad_documents(x, cu_seqlens, {2 * cp_size})"
        )


def zigzag_tnd_index(cu_seqlens: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """Packed token indices held by ``cp_rank`` under per-document zigzag TND sharding.

    Every document is cut into ``2 * cp`` chunks of ``c = len / (2 cp)`` tokens; rank ``r``
    holds chunks ``r`` and ``2cp-1-r`` of each document, in document order.

    Args:
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens; every length divisible by ``2 * cp_size``.
        cp_size, cp_rank: CP group size and this rank.

    Returns:
        ``[T / cp]`` int64 natural token indices in local order, on ``cu_seqlens.device``.

    Raises:
        ValueError: a document length not divisible by ``2 * cp_size`` (named), rank out of range.

    Example:
        >>> zigzag_tnd_index(torch.tensor([0, 8, 12]), 2, 0).tolist()
        [0, 1, 6, 7, 8, 11]
    """
    check_rank("cp_rank", cp_rank, check_int("cp_size", cp_size, minimum=1))
    check_zigzag_tnd_lengths(cu_seqlens, cp_size)
    starts, lengths = cu_seqlens[:-1].long(), cu_seqlens.long().diff()
    chunk = torch.div(lengths, 2 * cp_size, rounding_mode="floor")
    first, second = zigzag_chunks(cp_size, cp_rank)
    chunk_starts = torch.stack([starts + first * chunk, starts + second * chunk], 1).flatten()
    chunk_lens = chunk.repeat_interleave(2)
    total = int(chunk_lens.sum())
    owner = torch.repeat_interleave(torch.arange(chunk_lens.numel(), device=cu_seqlens.device), chunk_lens, output_size=total)
    offsets = torch.arange(total, device=cu_seqlens.device) - (chunk_lens.cumsum(0) - chunk_lens)[owner]
    return chunk_starts[owner] + offsets


def shard_zigzag_tnd(x: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, dim: int = 0) -> Tensor:
    """This rank's per-document zigzag shard of a packed ``[T, ...]`` tensor (a copy).

    Raises:
        ValueError: as :func:`zigzag_tnd_index`; ``x.shape[dim] != cu_seqlens[-1]``.
    """
    check_tensor("x", x)
    dim = check_dim("dim", dim, x.ndim)
    if x.shape[dim] != int(cu_seqlens[-1]):
        raise ValueError(f"x must hold cu_seqlens[-1] = {int(cu_seqlens[-1])} tokens along dim {dim}, got {x.shape[dim]}")
    return x.index_select(dim, zigzag_tnd_index(cu_seqlens, cp_size, cp_rank).to(x.device))


def zigzag_tnd_gather_index(cu_seqlens: Tensor, cp_size: int) -> Tensor:
    """``[T]`` int64: the position, in the rank-major all-gather of zigzag-TND shards, of each natural token.

    ``natural = gathered.index_select(0, zigzag_tnd_gather_index(cu_seqlens, cp))``.
    """
    order = torch.cat([zigzag_tnd_index(cu_seqlens, cp_size, r) for r in range(cp_size)])
    return torch.argsort(order)


def unshard_zigzag_tnd(shards: Sequence[Tensor], cu_seqlens: Tensor, *, dim: int = 0) -> Tensor:
    """Inverse of :func:`shard_zigzag_tnd`: the natural packed tensor from all ranks' shards."""
    if len(shards) == 0:
        raise ValueError("shards must hold one tensor per CP rank, got none")
    gathered = torch.cat(list(shards), dim=dim)
    return gathered.index_select(dim, zigzag_tnd_gather_index(cu_seqlens, len(shards)).to(gathered.device))
