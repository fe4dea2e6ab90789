"""Claims the pages make about the code and the examples stay true: defaults, figures, script counts, run times.

* README's entry-point defaults table against the real signature defaults;
* README's zigzag need-bytes figures against the layouts table of docs/benchmarks.md;
* examples/README.md's count of scripts and of those CI runs against the examples and the tests;
* every run time the examples state is a measured range with the machine it was measured on.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8}


def _read(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def _defaults_table() -> dict[str, tuple[str, str]]:
    """README's ``| entry point | layout | exchange | cost model |`` rows: ``{entry: (layout, exchange)}``."""
    table = _read("README.md").split("| entry point | layout | exchange | cost model |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0].strip("`")] = (cells[1].split("`")[1].strip('"'), cells[2].split("`")[1].strip('"'))
    return rows


def _signature_defaults(fn: object, *names: str) -> tuple[object, ...]:
    params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    return tuple(params[n].default for n in names)


def test_readme_defaults_table_is_the_signatures() -> None:
    """Each entry point's documented layout and exchange are its real defaults (the demo: its parser's)."""
    pytest.importorskip("transformers")
    from cpkv import plan_attention
    from cpkv.demo import _parser
    from cpkv.integrations.collate import PackedCPCollator
    from cpkv.integrations.hf_trainer import CPTrainerMixin
    from cpkv.integrations.megatron import plan_from_packed_seq_params
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss

    table = _defaults_table()
    fields = {f.name: f.default for f in dataclasses.fields(PackedCPCollator)}
    demo = _parser().parse_args([])
    megatron_layout = _signature_defaults(plan_from_packed_seq_params, "layout")[0]
    actual = {
        "deepseek_v4_causal_lm_loss": _signature_defaults(deepseek_v4_causal_lm_loss, "layout", "exchange"),
        "CPTrainerMixin": _signature_defaults(CPTrainerMixin.__init__, "layout", "exchange"),
        "PackedCPCollator": (fields["layout"], fields["exchange"]),
        "python -m cpkv.demo": (demo.layout, demo.exchange),
        "plan_from_packed_seq_params": ("zigzag" if megatron_layout is None else megatron_layout,
                                        _signature_defaults(plan_attention, "exchange")[0]),
        "plan_attention": _signature_defaults(plan_attention, "layout", "exchange"),
    }
    assert table == actual
    assert all(table[e] == ("balanced", "need") for e in list(actual)[:4])  # the recommended default


def _zigzag_need_ratios() -> dict[str, dict[str, list[float]]]:
    """``{batch: {"flash"|"pro": [need / contiguous of zigzag at each cp]}}`` from docs/benchmarks.md's layouts table."""
    out: dict[str, dict[str, list[float]]] = {}
    for line in _read("docs/benchmarks.md").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 15 and cells[2] == "zigzag":
            batch = "log-normal" if cells[0].startswith("log-normal") else "short" if cells[0].startswith("short") else cells[0]
            entry = out.setdefault(batch, {"flash": [], "pro": []})
            entry["flash"].append(float(cells[13]))
            entry["pro"].append(float(cells[14]))
    return out


def test_readme_zigzag_need_bytes_are_the_benchmarks() -> None:
    """The README's zigzag row quotes both model families' need / contiguous bytes range from the layouts table."""
    ratios = _zigzag_need_ratios()

    def span(values: list[float]) -> str:
        return f"{round(min(values))}-{round(max(values))}x"

    log, short = ratios["log-normal"], ratios["short"]
    claim = (f"{span(log['flash'])} contiguous's bytes on log-normal packs and {span(short['flash'])} on short"
             f" documents for V4-Flash (V4-Pro: {span(log['pro'])} and {span(short['pro'])};")
    assert claim in _read("README.md")


def _tested_scripts() -> set[str]:
    """The examples/*.py scripts some test runs (named in a test file)."""
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py"))
    return {p.name for p in (ROOT / "examples").glob("*.py") if re.search(rf"\b{re.escape(p.stem)}\.py\b", tests)}


def test_examples_readme_counts_the_scripts_and_what_ci_runs() -> None:
    """examples/README.md's "N scripts ... (CI runs M of them: ...)" names every script and exactly the tested ones."""
    text = _read("examples/README.md")
    section = text.split("## Scripts", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"(\w+) scripts run whole integrations.*?\(CI runs (\w+)\s+of\s+them", section, flags=re.S)
    assert match, section[:300]
    listed = re.findall(r"^- \[`(\w+\.py)`\]", section, flags=re.M)
    assert NUMBERS[match.group(1)] == len(listed)
    run = {name for name in listed if "CI runs it" in section.split(f"[`{name}`]", 1)[1].split("\n- ", 1)[0]}
    assert NUMBERS[match.group(2)] == len(run)
    assert run == _tested_scripts() & set(listed), "the scripts marked 'CI runs it' are those a test runs"


TIME_PAGES = ["examples/README.md", *(f"examples/{p.name}" for p in sorted((ROOT / "examples").glob("*.py")))]


@pytest.mark.parametrize("page", TIME_PAGES)
def test_run_times_are_measured_ranges_with_the_machine(page: str) -> None:
    """A stated run time is a range ("30-100 s on 2 CPU cores"), never a single guess ("~20 s", "well under a minute")."""
    text = " ".join(_read(page).split())
    assert not re.search(r"~\s?\d+ ?s\b|under (half )?a minute|about (half a minute|\d+ s)|in \d+ s\b", text), page
    for match in re.finditer(r"\b(\d+)-(\d+) s\b", text):
        low, high = int(match.group(1)), int(match.group(2))
        assert low < high, (page, match.group(0))
        assert re.match(r"\s(on|with) \d+ (CPU cores|gloo ranks)", text[match.end():]), (page, text[match.start():match.end() + 60])


def test_mindspeed_page_cites_tests_that_exist() -> None:
    """Every ``tests/...py::name`` (and ``::name`` after it in the same cell) docs/mindspeed.md cites is a test function."""
    text = _read("docs/mindspeed.md")
    cited = 0
    for cell in re.findall(r"`tests/[^`]+`(?:, `::\w+`)*", text):
        path = re.match(r"`(tests/[\w/]+\.py)::", cell)
        assert path, cell
        source = _read(path.group(1))
        for name in re.findall(r"::(\w+)", cell):
            assert re.search(rf"^def {name}\(", source, flags=re.M), (path.group(1), name)
            cited += 1
    assert cited >= 12


MATRIX_ROWS = ["HF model", "HF Trainer", "FSDP2", "memory", "Megatron core attention", "Megatron DeepSeek-V4 layers",
               "MindSpeed-LLM", "torchtitan", "DeepSpeed", "TP/SP x CP", "MTP", "torch.compile", "inference / prefill", "GPU", "NPU"]


def test_readme_support_matrix_has_every_row_and_column() -> None:
    """The README's support matrix: one row per framework or feature, each with its three cells filled."""
    table = _read("README.md").split("| | supported | tested how | missing |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    assert [r[0] for r in rows] == MATRIX_ROWS
    assert all(len(r) == 4 and all(r[1:]) for r in rows), rows
