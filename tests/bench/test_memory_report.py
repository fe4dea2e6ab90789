"""``python -m cpkv.bench memory``: its section, and the counter against the CPU allocator.

The counter (:class:`cpkv.bench.step_memory.MemoryCounter`) must agree with the allocator's
measured peak (``torch.profiler`` memory events, custom ops taken as their outputs) within
10% (the issue's bound; measured: exact to the byte for the loss and the attention layers at the
smoke sizes and at hidden 256; the decoder rest 0.95 of the allocator: CPU ``grouped_mm`` temporaries).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpkv.bench.__main__ import main
from cpkv.bench.memory_report import BEGIN, END, kept_section
from cpkv.bench.step_memory import MemoryCounter, StepRow, reading_lines, saved_bytes


def test_counter_counts_new_storages_not_views_and_drops_freed_ones() -> None:
    x = torch.empty(100, device="meta")  # made before: its views count zero
    with MemoryCounter() as counter:
        view = x[:10]
        y = x + 1  # 400 bytes
        del y
        z = x * 2  # 400 bytes, after y is freed: the peak stays 400
        view.add_(1)  # in place: nothing new
    assert counter.peak == 400 and counter.now == 400 and counter.largest == 400 and "add" in counter.largest_op  # the first of the two
    del z
    with saved_bytes(exclude=set()) as saved:
        w = torch.ones(10, requires_grad=True)
        (w * w.exp()).sum()
    assert sorted(saved.values()) == [40, 40]  # w and exp(w), each once


@pytest.mark.timeout(120)
def test_memory_smoke_run_writes_its_section_and_the_counter_matches_the_allocator(tmp_path: Path) -> None:
    out = tmp_path / "b.md"
    out.write_text("# Benchmarks\n\nother tables\n")
    assert main(["memory", "--smoke", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nother tables\n") and text.count(BEGIN) == text.count(END) == 1
    assert kept_section(text).startswith(BEGIN)
    rows = [line.split("|")[1:-1] for line in kept_section(text).splitlines() if line.startswith("| ")]
    loss = [r for r in rows if r[2].strip() in ("float32", "bfloat16")]
    assert loss and all(float(r[8]) >= 2.5 and float(r[5]) < float(r[8]) for r in loss)  # whole logits: ~3x their size
    step = [r for r in rows if r[0].strip() == "tiny"]
    assert len(step) == 2 and all("(decoder rest)" in r[8] or "attention)" in r[8] for r in step)  # where the transient is
    checks = [r for r in rows if "loss, T" in r[0] or "attention" in r[0] or "decoder rest" in r[0]]
    assert len(checks) == 7
    assert all(0.9 <= float(r[-1]) <= 1.1 for r in checks), checks  # counted on meta / measured (custom ops as outputs)


def test_reading_names_the_smallest_cp_each_device_fits_and_the_devices_none_fits() -> None:
    def row(cp: int, states_gb: float) -> StepRow:
        return StepRow(model="M", cp=cp, tokens=1 << 20, checkpointing=True, states=states_gb * 1e9, attention_saved=0.0,
                       rest_saved=0.0, checkpoints=0.0, largest="t", transient_in="decoder rest", transient=0.0,
                       exchange=0.0, indexer=0.0, loss=0.0)

    def reading(states_gb: list[float]) -> str:
        return " ".join(reading_lines([row(cp, gb) for cp, gb in zip((8, 16, 32), states_gb, strict=True)]))

    assert "it fits an H200 from cp 16 and a 64 GB device from cp 32." in reading([200.0, 100.0, 50.0])
    assert "it fits an H200 from cp 32 but no 64 GB device at any of cp 8-32." in reading([300.0, 200.0, 100.0])
    assert "it fits neither an H200 nor a 64 GB device at any of cp 8-32." in reading([300.0, 200.0, 150.0])
