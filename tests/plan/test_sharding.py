"""Zigzag and contiguous sharding helpers against hand-written expectations."""

import pytest
import torch

from cpkv.plan.sharding import (
    contiguous_shard_range,
    permute_cp_shard,
    shard_contiguous,
    shard_zigzag,
    unshard_contiguous,
    unshard_zigzag,
    zigzag_chunks,
    zigzag_gather_index,
)


def test_gather_index_literal() -> None:
    assert zigzag_gather_index(1) == [0, 1]
    assert zigzag_gather_index(2) == [0, 2, 3, 1]
    assert zigzag_gather_index(4) == [0, 2, 4, 6, 7, 5, 3, 1]


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_gather_index_inverts_rank_major_layout(cp: int) -> None:
    # Independent oracle: build the rank-major chunk ids directly from zigzag_chunks.
    rank_major = [c for r in range(cp) for c in zigzag_chunks(cp, r)]
    index = zigzag_gather_index(cp)
    assert [rank_major[i] for i in index] == list(range(2 * cp))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_zigzag_round_trip(cp: int, dim: int) -> None:
    x = torch.randn(4 * cp, 4 * cp, 4 * cp)
    shards = [shard_zigzag(x, cp, r, dim=dim) for r in range(cp)]
    for r, shard in enumerate(shards):
        chunks = x.chunk(2 * cp, dim=dim)
        a, b = zigzag_chunks(cp, r)
        assert torch.equal(shard, torch.cat([chunks[a], chunks[b]], dim=dim))
    assert torch.equal(unshard_zigzag(shards, dim=dim), x)
    gathered = torch.cat(shards, dim=dim)
    assert torch.equal(permute_cp_shard(gathered, cp, reorder=True, dim=dim), x)


def test_permute_literal_cp2() -> None:
    assert permute_cp_shard(torch.arange(8), 2, reorder=False, rank=0).tolist() == [0, 1, 6, 7]
    assert permute_cp_shard(torch.tensor([0, 1, 6, 7, 2, 3, 4, 5]), 2, reorder=True).tolist() == list(range(8))


def test_permute_is_differentiable() -> None:
    x = torch.randn(8, requires_grad=True)
    permute_cp_shard(x, 2, reorder=True).mul(torch.arange(8.0)).sum().backward()
    assert x.grad is not None
    assert x.grad.tolist() == [0.0, 1.0, 6.0, 7.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_contiguous_round_trip(cp: int) -> None:
    x = torch.randn(6 * cp, 2, 3)
    shards = [shard_contiguous(x, cp, r) for r in range(cp)]
    assert all(s._base is x for s in shards if cp > 1)  # views, no copy
    assert torch.equal(unshard_contiguous(shards), x)
    assert contiguous_shard_range(6 * cp, cp, cp - 1) == (6 * (cp - 1), 6)


def test_zigzag_tnd_literal_and_round_trip() -> None:
    from cpkv.plan.sharding import shard_zigzag_tnd, unshard_zigzag_tnd, zigzag_tnd_index

    cu = torch.tensor([0, 8, 8, 12])  # documents of 8, 0 and 4 tokens, cp 2: chunks of 2 and 1
    assert zigzag_tnd_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_tnd_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    for cp in (1, 2, 3, 4):
        lengths = [24, 0, 48, 72]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        x = torch.randn(sum(lengths), 3)
        shards = [shard_zigzag_tnd(x, cu, cp, r) for r in range(cp)]
        assert all(s.shape[0] == sum(lengths) // cp for s in shards)
        assert torch.equal(unshard_zigzag_tnd(shards, cu), x)


def test_zigzag_tnd_error_names_the_document() -> None:
    from cpkv.plan.sharding import zigzag_tnd_index

    with pytest.raises(ValueError, match=r"document 1 .* has length 6"):
        zigzag_tnd_index(torch.tensor([0, 8, 14, 22]), 2, 0)


def test_pad_documents_keeps_tokens_and_reports_padding() -> None:
    from cpkv.plan.conventions import pad_documents

    x = torch.arange(1.0, 11.0)[:, None]
    padded = pad_documents(x, torch.tensor([0, 5, 5, 10]), 4)
    assert padded.cu_seqlens.tolist() == [0, 8, 8, 16]
    assert padded.padding.tolist() == [3, 0, 3]
    assert torch.equal(padded.x.index_select(0, padded.token_index), x)
    assert float(padded.x.sum()) == float(x.sum())  # padding is zeros
