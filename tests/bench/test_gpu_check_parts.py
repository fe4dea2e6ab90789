"""The parts of benchmarks/gpu_check.py that need no GPU: its inputs, FLOP counts and C compiler check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_check  # noqa: E402
import v4_sparse_section as grid  # noqa: E402


def test_grid_inputs_are_the_window_then_visible_compressed_entries() -> None:
    num_q, heads, topk = 64, 2, 160
    x = grid.inputs(num_q, heads, topk, torch.device("cpu"), dim=32, d_v=32)
    idx = x["idx"]
    assert idx.shape == (num_q, topk) and idx.dtype == torch.int32
    t = torch.arange(num_q)
    window = t[:, None] - torch.arange(grid.WINDOW - 1, -1, -1)
    assert torch.equal(idx[:, : grid.WINDOW], torch.where(window >= 0, window, -1).int())
    picked = idx[:, grid.WINDOW :].long()
    visible = (t + 1) // 4
    ok = (picked == -1) | ((picked >= num_q) & (picked < num_q + visible[:, None]))
    assert ok.all() and (picked >= 0).any()
    assert x["kv"].shape == (num_q + num_q // 4, 32) and x["q"].dtype == torch.bfloat16


def test_grid_counts_flops_as_cudnn() -> None:
    fwd, bwd = grid.flops(8192, 64, 640)
    assert fwd == 2 * 8192 * 64 * 640 * 1024 and bwd == 2 * 8192 * 64 * 640 * (3 * 512 + 2 * 512)


def test_c_compiler_is_found_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    assert gpu_check.c_compiler() is None
    monkeypatch.delenv("CC")
    found = gpu_check.c_compiler()
    assert found is None or Path(found).exists()
