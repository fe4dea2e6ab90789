"""cu_seqlens conventions, converters and compressed lengths."""

import pytest
import torch

from cpkv.plan.conventions import (
    actual_seq_len_to_cu_seqlens,
    compress_cu_seqlens,
    cu_seqlens_to_actual_seq_len,
    seqlens_to_cu_seqlens,
    validate_cu_seqlens,
)


def test_round_trip_between_conventions() -> None:
    cu = torch.tensor([0, 5, 5, 12, 16], dtype=torch.int32)
    actual = cu_seqlens_to_actual_seq_len(cu)
    assert actual == [5, 5, 12, 16]
    assert all(type(v) is int for v in actual)
    back = actual_seq_len_to_cu_seqlens(actual)
    assert back.dtype == torch.int32 and back.tolist() == cu.tolist()
    assert actual_seq_len_to_cu_seqlens(torch.tensor(actual), dtype=torch.int64).dtype == torch.int64


def test_empty_batch_conventions() -> None:
    assert cu_seqlens_to_actual_seq_len(torch.tensor([0])) == []
    assert actual_seq_len_to_cu_seqlens([]).tolist() == [0]


def test_seqlens_to_cu_seqlens() -> None:
    assert seqlens_to_cu_seqlens([5, 0, 7, 4]).tolist() == [0, 5, 5, 12, 16]


@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 8, 128])
def test_compress_cu_seqlens_matches_per_document_floor(ratio: int) -> None:
    lengths = [0, 1, 3, 4, 5, 17, 128, 131, 0, 255]
    cu = seqlens_to_cu_seqlens(lengths, dtype=torch.int64)
    result = compress_cu_seqlens(cu, ratio)
    expected_blocks = [n // ratio for n in lengths]
    assert result.cu_seqlens.tolist() == [0] + list(torch.tensor(expected_blocks).cumsum(0).tolist())
    assert result.residuals.tolist() == [n % ratio for n in lengths]
    assert result.cu_seqlens.dtype == cu.dtype


def test_compressed_lengths_come_from_kv_not_q() -> None:
    # Rank 1 of the worked example: its q segments are [4, 4], kv segments [7, 4].
    cu_kv = torch.tensor([0, 7, 11])
    assert compress_cu_seqlens(cu_kv, 4).cu_seqlens.tolist() == [0, 1, 2]
    assert compress_cu_seqlens(cu_kv, 4).residuals.tolist() == [3, 0]


def test_validate_accepts_zero_length_documents() -> None:
    validate_cu_seqlens(torch.tensor([0, 0, 3, 3, 3, 9]), num_tokens=9)
