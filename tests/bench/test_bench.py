"""The benchmark: its traffic model counts what a real run sends, and a smoke run works."""

from pathlib import Path
from typing import Any

import pytest
import torch

from cpkv.bench.__main__ import main
from cpkv.bench.heads import HeadsCase, layer_calls
from cpkv.bench.layouts import BEGIN, END, StackRows, allgather_bytes, existing_section, limit_rows, make_layout, replace_section
from cpkv.bench.planning import attention_planning_times, loop_plan, planning_times, random_documents, tensor_loop_plan
from cpkv.bench.traffic import Dims, layer_traffic, physical_limit
from cpkv.bench.walltime import largest_round_rows
from cpkv.commstats import count_bytes
from cpkv.plan.attention import plan_attention
from cpkv.plan.balance import CostModel
from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.plan.layouts import ShardLayout, contiguous_layout
from cpkv.plan.sharding import shard_contiguous
from cpkv.v4 import V4Attention, V4Config
from tests.shared_spawn import shared_spawn

LENGTHS = [5, 0, 70, 3, 2, 60, 21, 0, 1, 30]  # 192 tokens
SMALL = Dims(hidden=64, kv_dim=32, index_dim=16, window=16, element_bytes=4)  # V4Config defaults, fp32


def _real_bytes(rank: int, world: int) -> dict[str, int]:
    cu = seqlens_to_cu_seqlens(LENGTHS)
    x = torch.randn(int(cu[-1]), 64, generator=torch.Generator().manual_seed(0))
    counts = {}
    for ratio in (0, 8, 4):
        layer = V4Attention(V4Config(compress_ratio=ratio, window=16), seed=0)
        for exchange in ("allgather", "need"):
            ratios = [ratio] if ratio > 1 else []
            plan = plan_attention(cu, world, rank, exchange=exchange, compress_ratios=ratios, windows=[16])
            x_local = shard_contiguous(x, world, rank).clone().requires_grad_(True)
            with count_bytes() as counter:
                out = layer(x_local, plan, None).out
                torch.autograd.backward(out, torch.ones_like(out))
            counts[f"{ratio}/{exchange}"] = counter.total
    return counts


REAL_BYTES = shared_spawn(_real_bytes, 3, timeout=100.0)


@pytest.mark.timeout(120)
def test_traffic_model_counts_what_a_real_run_receives(request: pytest.FixtureRequest) -> None:
    world = REAL_BYTES.world
    real = REAL_BYTES.run(request)
    cu = seqlens_to_cu_seqlens(LENGTHS, dtype=torch.int64)
    for rank in range(world):
        for key, received in real[rank].items():
            ratio, exchange = key.split("/")
            assert layer_traffic(cu, world, rank, int(ratio), exchange, SMALL)[0] == received, (rank, key)
    assert all(real[r]["0/need"] < real[r]["0/allgather"] for r in range(1, world))


def test_planning_loops_agree_with_the_planner() -> None:
    cu = random_documents(64, 4, seed=3)
    total = int(cu[-1])
    assert loop_plan(cu.tolist(), 0, total // 4) == tensor_loop_plan(cu, 0, total // 4)
    vec, host, tensor = planning_times(cu, 4, repeats=1)
    assert min(vec, host, tensor) > 0


@pytest.mark.timeout(120)
def test_smoke_run_writes_report_and_plot(tmp_path: Path, capsys: Any) -> None:
    out, png = tmp_path / "b.md", tmp_path / "b.png"
    assert main(["--smoke", "--out", str(out), "--plot", str(png)]) == 0
    text = out.read_text()
    assert "## Bytes received per rank per layer" in text and "## Planning time" in text and "## Wall time" in text
    assert "| one document | 3 | INDEXER (ratio 4) |" in text
    assert "## Scaling" in text and "## Bytes copied and peak memory" in text and "MindSpeed loop" in text


def test_traffic_is_at_the_physical_limit_computed_from_document_lengths() -> None:
    """The need exchange moves exactly the independent minimum when keys travel as the limit assumes (fp32 today)."""
    cu = seqlens_to_cu_seqlens([300, 5, 700, 19, 0, 256], dtype=torch.int64)  # 1280 tokens
    for ratio in (0, 4, 8):
        counts = [layer_traffic(cu, 4, rank, ratio, "need", SMALL) for rank in range(4)]
        assert [c.forward for c in counts] == [physical_limit(cu, 4, rank, ratio, SMALL) for rank in range(4)], ratio
        assert sum(c.received for c in counts) == 2 * sum(c.forward for c in counts)  # each row's gradient returns


def test_mindspeed_loop_matches_the_planner() -> None:
    cu = random_documents(64, 4, seed=5)
    times = attention_planning_times(cu, 4, repeats=1)
    assert set(times) == {"mindspeed", "prefix", "allgather", "need"} and all(w > 0 for w, _ in times.values())


def test_ring_rounds_split_the_halo() -> None:
    cu = seqlens_to_cu_seqlens([300, 5, 700, 19], dtype=torch.int64)  # 1024 tokens
    for rank in range(4):
        halo = largest_round_rows(plan_attention(cu, 4, rank, exchange="need", windows=[None]), None)
        for ring in (2, 4):
            plan = plan_attention(cu, 4, rank, exchange="need", ring_degree=ring, windows=[None])
            rounds = [r.routes.num_recv for r in plan.kv_source(None).rounds]
            assert sum(rounds) == halo and largest_round_rows(plan, None) == max(rounds) <= -(-halo // ring)


def _set_limit(layout: ShardLayout, rank: int, window: int, prev: dict[int, int]) -> StackRows:
    """limit_rows by Python sets, token by token: what the rank's queries read that it does not hold."""
    cu = layout.cu_seqlens.tolist()
    mine = set(layout.local_tokens(rank).tolist())
    doc_of = {t: (s, e) for s, e in zip(cu, cu[1:]) for t in range(s, e)}
    keys = {k for q in mine for k in range(max(doc_of[q][0], q - window + 1), q + 1)} - mine
    hidden, entries = {}, {}
    for ratio, before in prev.items():
        blocks = [(s, s + (j + 1) * ratio - 1) for s, e in zip(cu, cu[1:]) for j in range((e - s) // ratio)]
        entries[ratio] = len({b for b in blocks if b[1] not in mine and any(doc_of[q][0] == b[0] and q >= b[1] for q in mine)})
        reads = {t for s, last in blocks if last in mine for t in range(max(s, last + 1 - (before + 1) * ratio), last + 1)}
        hidden[ratio] = len(reads - mine)
    return StackRows(len(keys), hidden, entries)


@pytest.mark.parametrize("name", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("lengths", [[37, 0, 130, 3, 64, 9, 1, 140], [400], [5, 300, 17, 2, 60]])
def test_layout_limit_is_the_set_of_remote_rows(name: str, lengths: list[int]) -> None:
    cu = seqlens_to_cu_seqlens(lengths, dtype=torch.int64)
    if int(cu[-1]) % 12:  # contiguous needs T % cp == 0: the last document absorbs the rest
        cu[-1] += 12 - int(cu[-1]) % 12
    for cp in (3, 4):
        layout, _, _ = make_layout(name, cu, cp, CostModel())
        for rank in range(cp):
            assert limit_rows(layout, rank, 16, {4: 1, 8: 0}) == _set_limit(layout, rank, 16, {4: 1, 8: 0}), (cp, rank)


def test_layout_limit_and_allgather_match_the_per_layer_model_on_contiguous() -> None:
    """Two independent limits agree (traffic.physical_limit from document lengths), and the all-gather formula counts
    what layer_traffic counts on the real collective calls."""
    cu = seqlens_to_cu_seqlens([300, 5, 700, 19, 0, 256], dtype=torch.int64)  # 1280 tokens
    layout = contiguous_layout(cu, 4)
    kv, hidden = SMALL.kv_dim * SMALL.element_bytes, SMALL.hidden * SMALL.element_bytes
    one_layer = {0: CostModel(swa_layers=1, csa_layers=0, hca_layers=0, window=16),
                 4: CostModel(swa_layers=0, csa_layers=1, hca_layers=0, window=16)}
    for rank in range(4):
        rows = limit_rows(layout, rank, 16, {4: 1, 8: 0})
        assert rows.window * kv == physical_limit(cu, 4, rank, 0, SMALL)
        for ratio in (4, 8):
            entry = kv + (SMALL.key_row_bytes() if ratio == 4 else 0)
            per_layer = rows.window * kv + rows.entries[ratio] * entry + rows.hidden[ratio] * hidden
            assert per_layer == physical_limit(cu, 4, rank, ratio, SMALL), (rank, ratio)
        for ratio, model in one_layer.items():
            assert allgather_bytes(layout, rank, model, SMALL) == layer_traffic(cu, 4, rank, ratio, "allgather", SMALL).forward


def test_layouts_smoke_run_writes_its_section_and_keeps_the_rest(tmp_path: Path) -> None:
    out, png = tmp_path / "b.md", tmp_path / "l.png"
    out.write_text("# Benchmarks\n\nother tables\n")
    for _ in range(2):  # the second run replaces the section
        assert main(["layouts", "--smoke", "--out", str(out), "--plot", str(png)]) == 0
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nother tables\n") and text.count(BEGIN) == 1 and text.count(END) == 1
    assert "| one document | 4 | contiguous | 0 |" in text
    balanced = next(line for line in text.splitlines() if line.startswith("| one document | 4 | balanced | 0 |"))
    flash, pro = float(balanced.split("|")[5]), float(balanced.split("|")[7])  # cost max/mean, V4-Flash and V4-Pro
    assert flash <= 1.02 and pro <= 1.02
    assert "| short (64-128), 2 seeds | 4 | balanced |" in text and "| custom | need |" in text
    assert existing_section(text).startswith(BEGIN) and png.exists()
    assert replace_section("# B\n", existing_section(text)) == "# B\n\n" + existing_section(text)


@pytest.mark.parametrize("exchange", ["allgather", "need"])
def test_kv_heads_move_in_one_collective_and_one_kernel_call(exchange: str) -> None:
    """The kv-heads table's counts: one kernel call and one collective pair for all kv heads, the per-group
    baseline one of each per group, the same bytes (all heads' keys and values either way)."""
    case = HeadsCase("gqa", 8, 4, 16, 8)
    cu = torch.tensor([0, 64 * 2])
    before = layer_calls(case, cu, 2, 1, exchange, per_group=True, window=16)  # type: ignore[arg-type]
    after = layer_calls(case, cu, 2, 1, exchange, per_group=False, window=16)  # type: ignore[arg-type]
    assert (after.collectives, after.kernels) == (2, 1) and (before.collectives, before.kernels) == (8, 4)
    assert before.bytes == after.bytes > 0


def test_help_lists_every_subcommand_the_docs_run(capsys: Any) -> None:
    """``python -m cpkv.bench --help`` names every subcommand, and every ``python -m cpkv.bench NAME`` of the docs is one."""
    import re

    from cpkv.bench.__main__ import SUBCOMMANDS

    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    names = [name for name, _, _ in SUBCOMMANDS]
    listed = [line.split()[0] for line in lines[lines.index(next(x for x in lines if x.startswith("subcommands"))) + 1:] if line.strip()]
    assert listed == names
    root = Path(__file__).resolve().parents[2]
    pages = [root / "README.md", root / "examples" / "README.md", *sorted((root / "docs").glob("*.md"))]
    run = {name for page in pages for name in re.findall(r"python -m cpkv\.bench ([a-z]\w*)", page.read_text())}
    assert run and run <= set(names), run - set(names)


@pytest.mark.timeout(120)
def test_runs_without_out_write_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    """Every command's ``--out`` / ``--plot`` default to none, and smoke runs in an empty directory leave it empty."""
    from cpkv.bench import layouts, memory_report
    from cpkv.bench.__main__ import parse_args

    for args in (parse_args([]), layouts.parse_args([]), memory_report.parse_args([])):
        assert args.out is None and getattr(args, "plot", None) is None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()  # where the old defaults wrote
    assert main(["mindspeed", "--smoke"]) == 0 and main(["layouts", "--smoke"]) == 0
    assert "## " in capsys.readouterr().out  # the tables were printed
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")] == ["docs"]
