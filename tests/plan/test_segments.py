"""Per-query index plans of segments: window rows, argument errors."""

import pytest
import torch

from cpkv.plan.segments import plan_segments


def test_window_indices_literal() -> None:
    cu = torch.tensor([0, 2, 6])
    seg = plan_segments(cu, cu)
    assert seg.window_indices(3).tolist() == [
        [-1, -1, 0], [-1, 0, 1], [-1, -1, 2], [-1, 2, 3], [2, 3, 4], [3, 4, 5],
    ]


def test_plan_errors_name_arguments() -> None:
    with pytest.raises(ValueError, match="cu_seqlens_kv"):
        plan_segments(torch.tensor([0, 4]), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="compress_ratios"):
        plan_segments(torch.tensor([0, 4]), torch.tensor([0, 4]), compress_ratios=[1])
    with pytest.raises(ValueError, match="not planned"):
        plan_segments(torch.tensor([0, 4]), torch.tensor([0, 4])).compressed_for(4)




def test_kv_offset_keeps_document_positions() -> None:
    """A buffer missing 3 rows of the first document: positions stay document positions."""
    seg = plan_segments(torch.tensor([0, 2, 4]), torch.tensor([0, 2, 6]), kv_offset=3)
    assert seg.q_positions.tolist() == [3, 4, 2, 3]
    assert seg.q_kv_rows.tolist() == [0, 1, 4, 5] and seg.q_doc_rows.tolist() == [-3, -3, 2, 2]
    assert seg.window_indices(2).tolist() == [[-1, 0], [0, 1], [3, 4], [4, 5]]
