"""The figures the docs quote match their one home, and the homes label what they measured.

Bench figures live in docs/benchmarks.md (written by ``python -m cpkv.bench``), GPU figures
in docs/gpu_check.md. The README and docs/guide.md quote a few bench figures; these tests recompute each
quoted figure from the table it comes from, so a regenerated docs/benchmarks.md that changes
one fails here until the quoting page is updated. Nothing is timed or re-measured: the tests read
the Markdown tables, and render the bench's captions from dummy rows.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from cpkv.bench.__main__ import parse_args, render
from cpkv.bench.heads import LayerCalls
from cpkv.bench.memory import LayerDims
from cpkv.bench.traffic import Dims
from cpkv.bench.walltime import WALL_WINDOW
from cpkv.plan import plan_attention

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
GUIDE = DOCS / "guide.md"  # the README's depth: the sharding and exchange figures
Row = dict[str, str]


def _text(path: Path) -> str:
    """The page with every run of whitespace as one space (quoted phrases may wrap)."""
    return " ".join(path.read_text(encoding="utf-8").split())


def _tables(path: Path) -> dict[str, list[list[Row]]]:
    """Per ``## `` section of a Markdown page, its tables as rows of ``{header: cell}``."""
    sections: dict[str, list[list[Row]]] = {}
    section, header = "", None
    rows: list[Row] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header, rows = cells, []
            sections.setdefault(section, []).append(rows)
        elif not set("".join(cells)) <= set("-:"):
            rows.append(dict(zip(header, cells)))
    return sections


def _table(path: Path, section_start: str, index: int = 0) -> list[Row]:
    matches = [tables for name, tables in _tables(path).items() if name.startswith(section_start)]
    assert len(matches) == 1, f"{path.name}: one section starting {section_start!r}"
    return matches[0][index]


def _one(rows: list[Row], **where: str) -> Row:
    found = [r for r in rows if all(r[k] == v for k, v in where.items())]
    assert len(found) == 1, where
    return found[0]


def _two_significant(x: float) -> int:
    """``x`` rounded to two significant digits (how the README quotes 1/N shares)."""
    return int(round(x, 1 - int(math.floor(math.log10(abs(x))))))


BENCH = DOCS / "benchmarks.md"


def _need_shares() -> str:
    """The README's need/allgather sentence from the bytes table: one document, cp 8, busiest ranks, fwd+bwd."""
    rows = _table(BENCH, "Bytes received per rank per layer")
    share = {label: float(_one(rows, scenario="one document", cp="8", layer=label)["need/allgather (fwd+bwd)"])
             for label in ("NO_COMPRESS (window 128)", "COMPRESSOR_ONLY (ratio 128)", "INDEXER (ratio 4)")}
    d = {k: _two_significant(1 / v) for k, v in share.items()}
    return (f"forward + backward, 1/{d['NO_COMPRESS (window 128)']} (window 128), 1/{d['COMPRESSOR_ONLY (ratio 128)']}"
            f" (ratio 128) and 1/{d['INDEXER (ratio 4)']} (ratio 4) of what it receives under the all-gather")


def _balance() -> list[Row]:
    return _table(BENCH, "Load balance")


def test_readme_need_exchange_shares_match_the_bench() -> None:
    assert _need_shares() in _text(GUIDE)


def test_readme_load_balance_figures_match_the_bench() -> None:
    text = _text(GUIDE)
    one_doc = _one(_balance(), scenario="one document", cp="8")
    assert f"one document at cp 8 gives max/mean work {one_doc['contiguous max/mean']}" in text
    # One document, contiguous: rank r does 2r + 1 units of causal work (mean cp), so the last
    # rank does (max/mean * cp) times rank 0's; the bench's 3-digit max/mean rounds it exactly.
    assert f"(rank 7 does {round(float(one_doc['contiguous max/mean']) * 8)} times rank 0's work)" in text
    zigzag = {r["zigzag max/mean"] for r in _balance()}
    assert zigzag == {"1.000"} and "max/mean work is 1.000 at every cp" in text
    packed = _one(_balance(), scenario="log-normal docs", cp="4")
    contiguous, zig = (int(v.replace(",", "")) for v in packed["kv rows max: contiguous / zigzag"].split(" / "))
    assert f"at cp 4 the busiest rank reads {zig / contiguous:.2f}x the kv rows of contiguous sharding's busiest rank" in text
    assert "mean length 8,192" in text and "(mean 8,192)" in _text(BENCH)


def _balanced_figures() -> dict[str, str]:
    """The layouts table's figures the README and semantics.md quote (max over cp 8-64 and the batch families)."""
    rows = _table(BENCH, "Layouts")
    balanced = [r for r in rows if r["layout"] == "balanced"]

    def most(sel: list[Row], *keys: str) -> str:
        return f"{max(float(r[k]) for r in sel for k in keys):.3f}x"

    def contiguous(batch: str) -> str:
        return most([r for r in rows if r["layout"] == "contiguous" and r["batch"].startswith(batch)], "V4-Flash cost max/mean")

    return {
        "cost": most(balanced, "V4-Flash cost max/mean", "V4-Pro cost max/mean"),
        "tokens": most(balanced, "V4-Flash tokens max/mean"), "pro tokens": most(balanced, "V4-Pro tokens max/mean"),
        "bytes": most(balanced, "need / contiguous", "V4-Pro need / contiguous"),
        "one document": contiguous("one document"), "log-normal": contiguous("log-normal"), "short": contiguous("short"),
    }


def test_readme_and_semantics_balanced_figures_match_the_bench() -> None:
    f = _balanced_figures()
    assert (f"its busiest rank costs at most {f['cost']} the mean on one document, log-normal packs and short documents"
            f" (contiguous: up to {f['one document']} on one document), on at most {f['tokens']} the mean tokens, and receives"
            f" at most {f['bytes']} contiguous's need-exchange bytes") in _text(GUIDE)
    semantics = _text(DOCS / "semantics.md")
    assert (f"the balanced layout's busiest rank costs at most {f['cost']} the mean for V4-Flash and V4-Pro on one document, log-normal packs"
            f" and short documents, where contiguous's costs up to {f['one document']} (one document), {f['log-normal']}"
            f" (log-normal) and {f['short']} (short); its tokens are at most {f['tokens']} the mean (log-normal, V4-Flash;"
            f" {f['pro tokens']} V4-Pro); its busiest rank's need bytes are at most {f['bytes']} contiguous's") in semantics
    assert f"costs at most {f['cost']} the mean on one document, log-normal and short-document packs, on at most {f['tokens']}" in semantics
    assert all(r["targets"] == "met" for r in _table(BENCH, "Layouts", 1))  # the targets table: every family, cp, model


def test_readme_quotes_no_other_ratio_figures() -> None:
    """Every ``1/N`` and ``N.NNx`` figure of the README and the guide is one the tests above check."""
    text = _text(README) + " " + _text(GUIDE)
    assert set(re.findall(r"\b1/\d{2,}\b", text)) == set(re.findall(r"\b1/\d{2,}\b", _need_shares()))
    f = _balanced_figures()
    packed = _one(_balance(), scenario="log-normal docs", cp="4")
    contiguous, zig = (int(v.replace(",", "")) for v in packed["kv rows max: contiguous / zigzag"].split(" / "))
    quoted = {f["cost"], f["one document"], f["tokens"], f["bytes"], f"{zig / contiguous:.2f}x"}  # and the zigzag kv rows
    assert set(re.findall(r"\b\d+\.\d+x\b", text)) <= quoted


def test_semantics_zigzag_kv_rows_match_the_bench() -> None:
    """docs/semantics.md: one document, each zigzag rank reads (2cp+1)/(2cp) of the batch's kv rows."""
    assert "`(2cp+1)/(2cp)` of the micro-batch's kv rows" in _text(DOCS / "semantics.md")
    tokens_per_rank = 131_072
    assert f"{tokens_per_rank:,} tokens per rank" in _text(BENCH)
    for row in (r for r in _balance() if r["scenario"] == "one document"):
        cp = int(row["cp"])
        zig = int(row["kv rows max: contiguous / zigzag"].split(" / ")[1].replace(",", ""))
        assert zig * 2 * cp == (2 * cp + 1) * cp * tokens_per_rank, row


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md") if p.name not in ("gpu_check.md", "api.md")) + ["README"])
def test_gpu_figures_live_in_gpu_check_md(page: str) -> None:
    """No other page quotes a GPU measurement (a ratio or TFLOP/s next to the GPU): it links to gpu_check.md."""
    text = _text(README if page == "README" else DOCS / page)
    sentences = [s for s in re.split(r"(?<=[.])\s", text) if re.search(r"\bH200\b|\bGPU\b|gpu_check", s)]
    quoted = [s for s in sentences if re.search(r"\b\d+(\.\d+)?x\b|TFLOP", s)]
    assert not quoted


def test_gpu_check_notes_match_its_table() -> None:
    """docs/gpu_check.md: the ratio ranges its notes quote are those of its varlen table."""
    path = DOCS / "gpu_check.md"
    rows = _table(path, "Varlen attention")

    def span(key: str, windowed: bool | None) -> str:
        values = [float(r[key].rstrip("x")) for r in rows if windowed is None or (r["W"] != "-") == windowed]
        return f"{min(values):.2f}x-{max(values):.2f}x"

    text = _text(path)
    dense, windowed = span("cpkv/bare fwd", False), span("cpkv/bare fwd", True)
    assert f"cpkv/bare forward is {dense} on the dense rows and {windowed} on the windowed rows" in text
    assert f"Forward + backward, cpkv/bare is {span('cpkv/bare fwd+bwd', None)} on every row" in text
    smallest = min(float(r["bare fwd ms"]) for r in rows if r["W"] != "-")
    assert f"({smallest:.2f} ms at the smallest shape)" in text
    assert "No 0.2 code has run on a GPU yet" in text and "attend_prefix calls it" not in text


def _render_dummy() -> str:
    """The bench report at the default options from one dummy row per table (captions and headers are real)."""
    args = parse_args([])
    traffic = [{"scenario": "s", "cp": 8, "ratio": 0, **{f"{s}_{k}": 1 for s in ("allgather", "need")
               for k in ("max", "mean", "fwd_max", "total", "copied")}, "limit_fwd_max": 1, "limit_total": 1}]
    balance = [{"scenario": "s", "cp": 2, "padding": 0, "tokens": 1, **{f"{k}_{m}": 1 for k in ("contiguous", "zigzag")
                for m in ("max", "mean")}, "contiguous_kv_max": 1, "zigzag_kv_max": 1}]
    rings = {f"{r}/{k}": 1.0 for r in (1, 2, 4) for k in ("round_rows", "round_bytes", "seconds")}
    scaling = [{"scenario": "s", "cp": 8, "ratio": 0, "seeds": 1, "need": [1], "limit": [1], "allgather": 1}]
    memory = {f"{r}/{e}": (1, 1) for r in args.ratios for e in ("allgather", "need")}
    walls = {f"{r}/{e}": 1.0 for r in args.ratios for e in ("allgather", "need")}
    plans = {"b": {k: (1.0, 1.0) for k in ("mindspeed", "prefix", "allgather", "need")}}
    keys = [{"key_dtype": "float32", "need": 1, "limit": 1, "allgather": 1}]
    heads = [{"case": "c", "exchange": "need", "cp": 8, "before": LayerCalls(1, 1, 1), "after": LayerCalls(1, 1, 1)}]
    return render(traffic, (1.0, 1.0, 1.0), walls, args, balance, rings, scaling, memory, plans, keys, heads)


def _structure(text: str) -> list[str]:
    """The non-empty lines of a report except table bodies (rows after a header's separator) and the date line."""
    kept, in_table = [], 0
    for line in text.splitlines():
        in_table = in_table + 1 if line.startswith("|") else 0
        if line and in_table <= 2 and not line.startswith("Measured "):
            kept.append(line)
    return kept


def test_benchmarks_md_has_the_generators_captions_and_headers() -> None:
    """Captions and table headers of docs/benchmarks.md are what ``python -m cpkv.bench`` writes now,
    so hand edits of its labels survive the next regeneration."""
    page = set(BENCH.read_text(encoding="utf-8").splitlines())
    missing = [line for line in _structure(_render_dummy()) if line not in page]
    assert not missing


def test_benchmark_labels_state_the_measured_window() -> None:
    """Each table's NO_COMPRESS label names the window its layer ran with (memory: LayerDims, bytes: Dims, wall)."""
    windows = {"Bytes received per rank per layer": Dims().window, "Scaling": Dims().window,
               "Bytes copied and peak memory": LayerDims().window, "Wall time": WALL_WINDOW}
    for section, window in windows.items():
        labels = {r["layer"] for r in _table(BENCH, section) if r["layer"].startswith("NO_COMPRESS")}
        assert labels == {f"NO_COMPRESS (window {window})"}, section
    assert f"window {LayerDims().window}, fp32" in _text(BENCH)


def test_global_num_seqs_examples_use_real_plan_fields() -> None:
    """Each ``global_num_seqs(plan.<expr>, ...)`` the docs show evaluates on an AttentionPlan to this rank's queries."""
    plan = plan_attention(torch.tensor([0, 5, 12, 16]), 2, 1)
    calls = [m for page in [README, *DOCS.glob("*.md")] if page.name != "api.md"
             for m in re.findall(r"global_num_seqs\((plan\.[\w.]+(?:\[-?\d+\])?)", _text(page))]
    assert calls
    for expr in calls:
        value = eval(expr, {"plan": plan})  # noqa: S307 - the docs' own expression on a real plan
        assert int(value) * plan.cp_size == plan.num_global_queries, expr
