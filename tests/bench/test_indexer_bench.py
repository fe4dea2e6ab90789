"""``python -m cpkv.bench indexer``: counted and executed indexer work, launches and host syncs, against hand counts."""

from __future__ import annotations

from typing import Any

import torch

from cpkv.bench.__main__ import main
from cpkv.bench.indexer import indexer_work


def test_one_document_counts_by_hand() -> None:
    """cp 1, one document of L tokens: query p sees floor((p + 1) / 4) entries; 64-query tiles, 64-entry chunks."""
    length = 256
    work = indexer_work(torch.tensor([0, length]), 1, 0, heads=4, dim=32, topk=8)
    assert work.queries == length and work.entries == length // 4
    assert work.counted_pairs == sum((p + 1) // 4 for p in range(length))
    # Tile i (queries 64i .. 64i + 63) streams the entries [0, 16(i + 1)): ceil(16(i + 1) / 64) = 1 chunk of 64 each.
    assert work.executed_pairs == 4 * 64 * 64
    assert work.counted_flops == work.counted_pairs * 4 * 32 * 2
    assert (work.triton_launches, work.torch_kernels, work.host_syncs) == (1, 0, 0)


def test_fp8_and_the_subcommand(capsys: Any) -> None:
    work = indexer_work(torch.tensor([0, 300, 1024]), 2, 1, dtype=torch.float8_e4m3fn)
    assert work.executed_pairs >= work.counted_pairs > 0 and work.host_syncs == 0
    assert main(["indexer", "--smoke"]) == 0
    out = capsys.readouterr().out
    assert "| one document, float8_e4m3fn | 2,048 |" in out and "host syncs |" in out


def test_kl_loss_launches_and_no_host_sync() -> None:
    """The KL loss's bodies on meta tensors: 1 launch forward, 2 backward (3 with the key-major dk), never a sync."""
    from cpkv.bench.indexer import kl_calls

    calls = kl_calls(96, 40, heads=4, dim=32, topk=8)
    assert [c[0] for c in (calls.forward, calls.backward, calls.backward_deterministic)] == [1, 2, 3]
    assert calls.forward[2] == calls.backward[2] == calls.backward_deterministic[2] == 0
    assert calls.backward_deterministic[1] > calls.backward[1] > 0  # the inverted selection's sort
