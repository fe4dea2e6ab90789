"""Sequence-length conventions of packed (TND) batches and their converters.

Two conventions describe the same document boundaries (docs/semantics.md):

* ``cu_seqlens``: cumulative document ends **with** a leading 0, an integer
  tensor ``[B + 1]`` (flash-attention, PyTorch ``varlen_attn``, this library).
* ``actual_seq_len``: the same cumulative ends **without** the leading 0
  (Ascend / MindSpeed, ``actual_seq_qlen`` and ``actual_seq_kvlen`` of
  ``npu_fusion_attention``), usually a host list of ints ``[B]``.

Convert only with :func:`cu_seqlens_to_actual_seq_len` and
:func:`actual_seq_len_to_cu_seqlens`; never guess which one a value is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from cpkv.checks import check_int, check_int_dtype, check_ndim, check_tensor


def validate_cu_seqlens(
    cu_seqlens: Tensor, *, num_tokens: int | None = None, name: str = "cu_seqlens"
) -> None:
    """Check that ``cu_seqlens`` is a valid leading-zero cumulative length tensor.

    Args:
        cu_seqlens: ``[B + 1]`` int32/int64 on any device: leading 0, non-decreasing.
            Repeated values (zero-length documents) are legal.
        num_tokens: if given, the last entry must equal it (the packed token count).
        name: the argument name used in error messages.

    Raises:
        TypeError: not a tensor, or not an integer dtype.
        ValueError: not 1-D, empty, no leading 0, decreasing, or last entry != num_tokens.

    Example:
        >>> validate_cu_seqlens(torch.tensor([0, 5, 12, 16]), num_tokens=16)
    """
    check_tensor(name, cu_seqlens)
    check_int_dtype(name, cu_seqlens)
    check_ndim(name, cu_seqlens, 1, "[B + 1] (1-D, leading 0)")
    if cu_seqlens.numel() == 0:
        raise ValueError(f"{name} must hold at least the leading 0, got an empty tensor")
    values = cu_seqlens.detach().to("cpu", torch.int64)
    if int(values[0]) != 0:
        raise ValueError(
            f"{name} must start with 0 (leading-zero convention), got {values[:4].tolist()}...;"
            " for Ascend actual_seq_len (no leading 0) use actual_seq_len_to_cu_seqlens"
        )
    steps = values.diff()
    if bool((steps < 0).any()):
        bad = int(torch.nonzero(steps < 0)[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing, but entry {bad + 1} ({int(values[bad + 1])})"
            f" < entry {bad} ({int(values[bad])})"
        )
    if num_tokens is not None and int(values[-1]) != num_tokens:
        raise ValueError(
            f"{name}[-1] must equal the number of packed tokens {num_tokens}, got {int(values[-1])}"
        )


def cu_seqlens_to_actual_seq_len(cu_seqlens: Tensor) -> list[int]:
    """Ascend convention from the leading-zero one: drop the 0, return a host list.

    Args:
        cu_seqlens: ``[B + 1]`` int tensor with leading 0.

    Returns:
        ``[B]`` host list of cumulative ends without the leading 0 (what
        ``npu_fusion_attention`` takes as ``actual_seq_qlen`` / ``actual_seq_kvlen``).

    Raises:
        TypeError, ValueError: as :func:`validate_cu_seqlens`.

    Example:
        >>> cu_seqlens_to_actual_seq_len(torch.tensor([0, 5, 12, 16]))
        [5, 12, 16]
    """
    validate_cu_seqlens(cu_seqlens)
    return [int(v) for v in cu_seqlens[1:].tolist()]


def actual_seq_len_to_cu_seqlens(
    actual_seq_len: Sequence[int] | Tensor,
    *,
    dtype: torch.dtype = torch.int32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Leading-zero ``cu_seqlens`` from the Ascend convention (prepend the 0).

    Args:
        actual_seq_len: ``[B]`` cumulative ends without the leading 0, a host list or
            a 1-D int tensor. A leading 0 in the input is rejected: it would create a
            phantom empty first document and usually means the value already is
            ``cu_seqlens``.
        dtype: integer dtype of the result (int32, what fused kernels take).
        device: device of the result (default: the input tensor's, else CPU).

    Returns:
        ``[B + 1]`` tensor, leading 0.

    Raises:
        TypeError: non-integer values.
        ValueError: a leading 0, negative or decreasing values.

    Example:
        >>> actual_seq_len_to_cu_seqlens([5, 12, 16])
        tensor([ 0,  5, 12, 16], dtype=torch.int32)
    """
    if isinstance(actual_seq_len, Tensor):
        check_int_dtype("actual_seq_len", actual_seq_len)
        check_ndim("actual_seq_len", actual_seq_len, 1, "[B] (1-D, no leading 0)")
        ends = [int(v) for v in actual_seq_len.tolist()]
        device = actual_seq_len.device if device is None else device
    else:
        ends = [check_int(f"actual_seq_len[{i}]", v) for i, v in enumerate(actual_seq_len)]
    if ends and ends[0] == 0:
        raise ValueError(
            "actual_seq_len must not start with 0 (Ascend convention has no leading 0);"
            f" got {ends[:4]}... which looks like cu_seqlens already"
        )
    result = torch.tensor([0, *ends], dtype=dtype, device=device)
    validate_cu_seqlens(result, name="actual_seq_len (with a 0 prepended)")
    return result


def seqlens_to_cu_seqlens(
    seqlens: Sequence[int] | Tensor, *, dtype: torch.dtype = torch.int32,
    device: torch.device | str | None = None,
) -> Tensor:
    """Leading-zero ``cu_seqlens`` ``[B + 1]`` from per-document lengths ``[B]``.

    Raises:
        ValueError: a negative length.

    Example:
        >>> seqlens_to_cu_seqlens([5, 7, 4])
        tensor([ 0,  5, 12, 16], dtype=torch.int32)
    """
    lengths = torch.as_tensor(seqlens, dtype=torch.int64, device=device)
    check_ndim("seqlens", lengths, 1, "[B]")
    if bool((lengths < 0).any()):
        raise ValueError(f"seqlens must be non-negative, got {lengths.tolist()[:8]}")
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(dtype)


class CompressedSeqlens(NamedTuple):
    """Compressed-sequence lengths of a packed batch (docs/semantics.md).

    Attributes:
        cu_seqlens: ``[B + 1]`` leading-zero cumulative counts of compressed entries,
            ``[0] + cumsum(len_i // ratio)``, same dtype and device as the input.
        residuals: ``[B]`` tokens per document left after the last full block,
            ``len_i % ratio`` (they produce no entry).
    """

    cu_seqlens: Tensor
    residuals: Tensor


def compress_cu_seqlens(cu_seqlens_kv: Tensor, ratio: int) -> CompressedSeqlens:
    """Compressed cu_seqlens and residuals from the **kv** (prefix) lengths.

    In prefix mode the compressor runs over each document's kv prefix, so the
    compressed lengths must come from ``cu_seqlens_kv``, never from the query
    lengths (those are shorter whenever a document starts on an earlier rank).

    Args:
        cu_seqlens_kv: ``[B + 1]`` int, leading 0: the kv segment boundaries.
        ratio: compress ratio ``m >= 1``; blocks of ``m`` tokens from each document start.

    Returns:
        :class:`CompressedSeqlens` with ``cu_seqlens`` ``[B + 1]`` and ``residuals`` ``[B]``.

    Raises:
        TypeError: non-int ratio or non-integer cu_seqlens_kv.
        ValueError: ratio < 1 or invalid cu_seqlens_kv.

    Example:
        >>> compress_cu_seqlens(torch.tensor([0, 5, 12, 16]), 4)
        CompressedSeqlens(cu_seqlens=tensor([0, 1, 2, 3]), residuals=tensor([1, 3, 0]))
    """
    check_int("ratio", ratio, minimum=1)
    validate_cu_seqlens(cu_seqlens_kv, name="cu_seqlens_kv")
    lengths = cu_seqlens_kv.diff()
    blocks = torch.div(lengths, ratio, rounding_mode="floor")
    cu = torch.cat([cu_seqlens_kv.new_zeros(1), blocks.cumsum(0).to(cu_seqlens_kv.dtype)])
    return CompressedSeqlens(cu_seqlens=cu, residuals=lengths - blocks * ratio)


def token_positions(cu_seqlens: Tensor, start: int, length: int) -> Tensor:
    """Position of each packed token ``start .. start + length - 1`` within its document.

    Args:
        cu_seqlens: ``[B + 1]`` global leading-zero cu_seqlens.
        start, length: the packed token range (e.g. a rank's ``rank_offset``, ``local_len``).

    Returns:
        ``[length]`` int64 on ``cu_seqlens.device``: ``token - start_of_its_document``
        (what RoPE uses; zero-length documents are skipped).

    Example:
        >>> token_positions(torch.tensor([0, 5, 12, 16]), 3, 5).tolist()
        [3, 4, 0, 1, 2]
    """
    tokens = torch.arange(start, start + length, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens[1:].long(), tokens, right=True)
    return tokens - cu_seqlens.long()[doc]


class PaddedDocuments(NamedTuple):
    """A packed batch whose documents were padded at their ends (see :func:`pad_documents`).

    Attributes:
        x: ``[T_padded, ...]`` the padded tensor (zeros in the padding).
        cu_seqlens: ``[B + 1]`` leading-zero cu_seqlens of the padded documents.
        padding: ``[B]`` int64 tokens added to each document.
        token_index: ``[T]`` int64 row of each original token in ``x`` (take outputs back with
            ``out.index_select(0, token_index)``).
    """

    x: Tensor
    cu_seqlens: Tensor
    padding: Tensor
    token_index: Tensor


def pad_documents(x: Tensor, cu_seqlens: Tensor, multiple: int) -> PaddedDocuments:
    """Pad every document of a packed ``[T, ...]`` tensor at its end to a multiple of ``multiple``.

    Causal attention never lets a real token see the padding after it, so outputs of real
    tokens are unchanged; drop padded rows with ``token_index``. Zero-length documents stay empty.

    Example:
        >>> padded = pad_documents(torch.ones(7, 1), torch.tensor([0, 5, 7]), 4)
        >>> padded.cu_seqlens.tolist(), padded.padding.tolist()
        ([0, 8, 12], [3, 2])
    """
    check_int("multiple", multiple, minimum=1)
    validate_cu_seqlens(cu_seqlens, num_tokens=x.shape[0])
    lengths = cu_seqlens.long().diff()
    padding = (-lengths) % multiple
    new_cu = torch.cat([lengths.new_zeros(1), (lengths + padding).cumsum(0)])
    doc = torch.searchsorted(cu_seqlens[1:].long(), torch.arange(x.shape[0], device=cu_seqlens.device), right=True)
    token_index = torch.arange(x.shape[0], device=cu_seqlens.device) - cu_seqlens.long()[doc] + new_cu[doc]
    padded = x.new_zeros((int(new_cu[-1]), *x.shape[1:]))
    padded = padded.index_copy(0, token_index.to(x.device), x)
    return PaddedDocuments(padded, new_cu.to(cu_seqlens.dtype), padding, token_index)


def document_real_lengths(cu_seqlens: Tensor, padding: Tensor) -> Tensor:
    """Real length of every document of a padded batch: its length in ``cu_seqlens`` less its ``padding``.

    Args:
        cu_seqlens: ``[B + 1]`` leading-zero cu_seqlens of the padded documents (any device).
        padding: ``[B]`` int tensor (any device): the tokens at the end of each document that
            are not real (e.g. :func:`pad_documents`' ``padding``).

    Returns:
        ``[B]`` int64 on the CPU (a host read of both tensors).

    Raises:
        TypeError: ``padding`` is not an integer tensor. ValueError: ``padding`` is not ``[B]``,
            or some ``padding[b]`` is outside ``[0, length of document b]`` (the first is named).

    Example:
        >>> document_real_lengths(torch.tensor([0, 8, 12]), torch.tensor([3, 0])).tolist()
        [5, 4]
    """
    check_int_dtype("padding", check_tensor("padding", padding))
    lengths = cu_seqlens.detach().to("cpu", torch.int64).diff()
    if padding.shape != lengths.shape:
        raise ValueError(
            f"padding must be a [B] = [{lengths.numel()}] tensor (one count per document of cu_seqlens), got shape"
            f" {tuple(padding.shape)}"
        )
    pad = padding.detach().to("cpu", torch.int64)
    bad = torch.nonzero((pad < 0) | (pad > lengths)).flatten()
    if bad.numel():
        doc = int(bad[0])
        raise ValueError(
            f"padding[{doc}] = {int(pad[doc])} must be in [0, {int(lengths[doc])}] (document {doc}'s length in"
            " cu_seqlens): padding counts the tokens at a document's end that are not real"
        )
    return lengths - pad
