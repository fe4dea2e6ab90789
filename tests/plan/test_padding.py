"""plan_attention(padding=...): which local rows are real, N over real tokens only, bad padding raises.

The expected rows are enumerated with plain loops over documents and ranks (contiguous:
rank r holds packed tokens [r*T/cp, (r+1)*T/cp); zigzag: chunks r and 2cp-1-r of every
document), independently of cpkv's sharding code. The indexer-loss consequence (padding
queries add nothing, gradients equal the unpadded batch's) is checked at cp 2 in
tests/integrations/test_megatron_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from cpkv.plan import plan_attention
from cpkv.plan.conventions import pad_documents, seqlens_to_cu_seqlens


def _expected(lengths: list[int], padding: list[int], cp: int, rank: int, layout: str) -> list[bool]:
    real = []  # is_real of every packed token, in natural order
    for n, p in zip(lengths, padding):
        real += [i < n - p for i in range(n)]
    if layout == "contiguous":
        size = len(real) // cp
        return real[rank * size:(rank + 1) * size]
    rows, start = [], 0
    for n in lengths:
        chunk = n // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            rows += real[start + c * chunk:start + (c + 1) * chunk]
        start += n
    return rows


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cp", [1, 2, 3])
def test_valid_queries_mark_the_real_rows(layout: str, cp: int) -> None:
    lengths = [2 * cp, 0, 6 * cp, 4 * cp, 2 * cp]
    padding = [1, 0, 2 * cp + 1, 0, 2 * cp]  # the last document is all padding
    cu = seqlens_to_cu_seqlens(lengths)
    for rank in range(cp):
        plan = plan_attention(cu, cp, rank, layout=layout, padding=torch.tensor(padding))  # type: ignore[arg-type]
        assert plan.valid_queries is not None and plan.valid_queries.dtype == torch.bool
        assert plan.valid_queries.tolist() == _expected(lengths, padding, cp, rank, layout)
        assert plan.num_global_queries == sum(lengths) - sum(padding)
        unpadded = plan_attention(cu, cp, rank, layout=layout)  # type: ignore[arg-type]
        assert unpadded.valid_queries is None and unpadded.num_global_queries == sum(lengths)
        assert torch.equal(plan.q_positions, unpadded.q_positions)  # nothing else changes


def test_pad_documents_padding_plans_directly() -> None:
    x = torch.arange(13.0)[:, None]
    padded = pad_documents(x, torch.tensor([0, 5, 13]), 4)
    plans = [plan_attention(padded.cu_seqlens, 2, r, padding=padded.padding) for r in range(2)]
    valid = torch.cat([p.valid_queries for p in plans if p.valid_queries is not None])
    assert torch.nonzero(valid).flatten().tolist() == padded.token_index.tolist()  # contiguous: natural order
    assert plans[0].num_global_queries == 13


def test_all_padding_counts_one_query() -> None:
    """N stays >= 1 (the indexer loss divides by it); every row is padding, so no query adds anything."""
    plan = plan_attention(torch.tensor([0, 4]), 2, 0, padding=torch.tensor([4]))
    assert plan.num_global_queries == 1 and plan.valid_queries is not None and not plan.valid_queries.any()


@pytest.mark.parametrize(
    ("padding", "error", "match"),
    [
        ([1, 2], TypeError, "padding must be a torch.Tensor"),
        (torch.tensor([1.0, 2.0]), TypeError, "padding must be an integer tensor"),
        (torch.tensor([1, 2, 3]), ValueError, r"padding must be a \[B\] = \[2\] tensor"),
        (torch.tensor([[1, 2]]), ValueError, r"padding must be a \[B\] = \[2\] tensor"),
        (torch.tensor([5, 0]), ValueError, r"padding\[0\] = 5 must be in \[0, 4\]"),
        (torch.tensor([0, -1]), ValueError, r"padding\[1\] = -1 must be in \[0, 4\]"),
    ],
)
def test_bad_padding_raises(padding: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        plan_attention(torch.tensor([0, 4, 8]), 2, 0, padding=padding)  # type: ignore[arg-type]
