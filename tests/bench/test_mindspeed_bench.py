"""``python -m cpkv.bench mindspeed``: MindSpeed-LLM's all-gather bytes counted on the collective calls, and its section."""

from __future__ import annotations

from pathlib import Path

from cpkv.bench.mindspeed import BEGIN, END, ROPE_DIM, bytes_table, main, mindspeed_forward_bytes
from cpkv.bench.traffic import Dims


def test_mindspeed_bytes_are_the_gathers_of_csa_py() -> None:
    """Each rank receives the other ranks' rows of every gathered tensor: kv; + hidden and the rotary table
    (compressed layers); + hidden again (ratio 4). Counted, not computed: this is the oracle of the count."""
    dims, local, cp = Dims(), 16, 3
    row = {0: dims.kv_dim * 2, 128: dims.kv_dim * 2 + dims.hidden * 2 + ROPE_DIM * 4,
           4: dims.kv_dim * 2 + 2 * dims.hidden * 2 + ROPE_DIM * 4}
    for ratio, per_row in row.items():
        assert mindspeed_forward_bytes(local * cp, cp, 1, ratio, dims) == (cp - 1) * local * per_row, ratio


def test_need_receives_no_more_and_the_section_is_rewritten(tmp_path: Path) -> None:
    rows = bytes_table(64, [2], 16, Dims())
    assert len(rows) == 6 and all(int(r["need"]) <= int(r["mindspeed"]) for r in rows)  # type: ignore[call-overload]
    page = tmp_path / "mindspeed.md"
    page.write_text(f"# head\n\n{BEGIN}\nold\n{END}\n\ntail\n", encoding="utf-8")
    assert main(["--smoke", "--out", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("# head\n") and text.endswith("\ntail\n") and "old" not in text
    assert "| one document | 3 | CSA (INDEXER, ratio 4) |" in text
