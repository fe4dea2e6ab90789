"""The prefix-KV plan against a brute-force document-causal oracle."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.plan.prefix import PrefixKVPlan, compute_prefix_kv_cu_seqlens, rearrange_prefix_kv, slice_tnd_kv_prefix


def oracle_pairs(lengths: list[int], start: int, stop: int) -> set[tuple[int, int]]:
    """(query, key) global positions allowed by the document-causal mask, queries in [start, stop)."""
    doc_of, pos = [], 0
    for d, n in enumerate(lengths):
        doc_of += [d] * n
        pos += n
    return {(q, k) for q in range(start, stop) for k in range(q + 1) if doc_of[k] == doc_of[q]}


def plan_pairs(plan: PrefixKVPlan) -> set[tuple[int, int]]:
    """(query, key) global positions allowed by the plan's segments + bottom-right causal mask."""
    cu_q, cu_kv = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist()
    pairs = set()
    for b in range(len(cu_q) - 1):
        lq, lkv = cu_q[b + 1] - cu_q[b], cu_kv[b + 1] - cu_kv[b]
        for i in range(lq):
            for j in range(lkv):
                if j <= i + (lkv - lq):
                    pairs.add((plan.rank_offset + cu_q[b] + i, plan.kv_start + cu_kv[b] + j))
    return pairs


def check_plan(lengths: list[int], start: int, stop: int) -> None:
    cu = seqlens_to_cu_seqlens(lengths)
    plan = compute_prefix_kv_cu_seqlens(cu, start, stop - start)
    assert plan_pairs(plan) == oracle_pairs(lengths, start, stop)
    assert int(plan.cu_seqlens_q[-1]) == stop - start
    assert plan.kv_end == stop
    assert int(plan.cu_seqlens_kv[-1]) == plan.kv_len
    q_lens, kv_lens = plan.cu_seqlens_q.diff(), plan.cu_seqlens_kv.diff()
    assert bool((q_lens > 0).all()) and bool((kv_lens >= q_lens).all())
    assert plan.max_seqlen_q == (int(q_lens.max()) if q_lens.numel() else 0)
    assert plan.max_seqlen_kv == (int(kv_lens.max()) if kv_lens.numel() else 0)
    assert list(plan.actual_seq_qlen) == plan.cu_seqlens_q[1:].tolist()
    assert list(plan.actual_seq_kvlen) == plan.cu_seqlens_kv[1:].tolist()
    assert plan.cu_seqlens_q.dtype == torch.int32 and plan.cu_seqlens_kv.dtype == torch.int32


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=0, max_value=12), min_size=1, max_size=12),
    cp=st.integers(min_value=1, max_value=8),
)
def test_plan_matches_document_causal_mask_on_every_rank(lengths: list[int], cp: int) -> None:
    pad = -sum(lengths) % cp
    lengths = [*lengths, pad] if pad else lengths
    local = sum(lengths) // cp
    for rank in range(cp):
        check_plan(lengths, rank * local, (rank + 1) * local)


@settings(max_examples=80, deadline=None)
@given(lengths=st.lists(st.integers(min_value=0, max_value=9), min_size=1, max_size=8), data=st.data())
def test_plan_for_arbitrary_ranges(lengths: list[int], data: st.DataObject) -> None:
    total = sum(lengths)
    start = data.draw(st.integers(min_value=0, max_value=total))
    stop = data.draw(st.integers(min_value=start, max_value=total))
    check_plan(lengths, start, stop)


def test_worked_example_of_semantics() -> None:
    cu = torch.tensor([0, 5, 12, 16])
    kv = torch.arange(16.0)
    prefix0, plan0 = slice_tnd_kv_prefix(kv, cu, 0, 2)
    assert plan0.cu_seqlens_q.tolist() == [0, 5, 8] and plan0.cu_seqlens_kv.tolist() == [0, 5, 8]
    assert torch.equal(prefix0, kv[0:8])
    prefix1, plan1 = slice_tnd_kv_prefix(kv, cu, 1, 2)
    assert plan1.cu_seqlens_q.tolist() == [0, 4, 8] and plan1.cu_seqlens_kv.tolist() == [0, 7, 11]
    assert torch.equal(prefix1, kv[5:16])
    assert plan1.doc_ids.tolist() == [1, 2]
    assert plan1.actual_seq_qlen == (4, 8) and plan1.actual_seq_kvlen == (7, 11)


@pytest.mark.parametrize(
    ("lengths", "cp"),
    [
        ([64], 4),  # one document spanning all ranks
        ([8, 8, 8, 8], 4),  # ranks start and end exactly on boundaries
        ([1] * 64, 4),  # many tiny documents
        ([0, 0, 16, 0, 16, 0], 2),  # zero-length documents everywhere
    ],
)
def test_named_edge_cases(lengths: list[int], cp: int) -> None:
    local = sum(lengths) // cp
    for rank in range(cp):
        check_plan(lengths, rank * local, (rank + 1) * local)


def test_single_document_prefix_grows_with_rank() -> None:
    cu = torch.tensor([0, 64])
    for rank in range(4):
        plan = compute_prefix_kv_cu_seqlens(cu, rank * 16, 16)
        assert (plan.kv_start, plan.kv_end) == (0, 16 * (rank + 1))
        assert plan.cu_seqlens_q.tolist() == [0, 16]


def test_prefix_is_a_view_and_gradients_flow() -> None:
    kv = torch.randn(16, 2, 3, requires_grad=True)
    prefix, plan = slice_tnd_kv_prefix(kv, torch.tensor([0, 5, 12, 16]), 1, 2)
    assert prefix._base is kv and prefix.data_ptr() == kv[plan.kv_start].data_ptr()
    prefix.sum().backward()
    assert kv.grad is not None
    expected = torch.zeros(16, 2, 3)
    expected[5:16] = 1
    assert torch.equal(kv.grad, expected)


def test_rearrange_along_other_dim() -> None:
    kv = torch.randn(2, 16, 3)
    plan = compute_prefix_kv_cu_seqlens(torch.tensor([0, 5, 12, 16]), 8, 8)
    assert torch.equal(rearrange_prefix_kv(kv, plan, dim=1), kv[:, 5:16])


def test_empty_local_range() -> None:
    plan = compute_prefix_kv_cu_seqlens(torch.tensor([0, 5, 12]), 12, 0)
    assert plan.cu_seqlens_q.tolist() == [0] and plan.kv_len == 0 and plan.num_segments == 0


def test_plan_keeps_device_and_is_frozen() -> None:
    plan = compute_prefix_kv_cu_seqlens(torch.tensor([0, 5, 12, 16], dtype=torch.int64), 0, 8)
    assert plan.cu_seqlens_q.device == torch.device("cpu")
    with pytest.raises(AttributeError):
        plan.kv_start = 3  # type: ignore[misc]


def test_a_rank_holding_no_document_gets_an_empty_prefix() -> None:
    """MindSpeed-LLM gives such a rank ``cu_kv = [0]`` and the whole gathered kv (docs/mindspeed.md); cpkv an empty
    slice, and a local range past the batch's last token raises instead of planning it as no document."""
    cu = torch.tensor([0, 5, 12])
    kv = torch.randn(12, 3)
    plan = compute_prefix_kv_cu_seqlens(cu, 12, 0)  # the rank's range holds no token of any document
    assert plan.cu_seqlens_kv.tolist() == [0] and rearrange_prefix_kv(kv, plan).shape == (0, 3)
    with pytest.raises(ValueError, match="goes past the last packed token"):
        compute_prefix_kv_cu_seqlens(cu, 12, 4)  # padding after the last document: declare it (pad_documents)
