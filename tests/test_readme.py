"""Every ```python block of README.md, docs/guide.md and docs/integrations.md runs as written, each in a fresh interpreter.

Blocks that need a process group set up their own 1-rank gloo group. The prefix-plan
block's printed values must equal what its comments claim.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "integrations.md"]
BLOCKS = [b for page in PAGES for b in re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.S | re.M)]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240)


def test_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    proc = _run(BLOCKS[index], tmp_path)
    assert proc.returncode == 0, f"README python block {index}:\n{BLOCKS[index]}\n{proc.stderr}"


def test_prefix_plan_block_prints_what_it_claims(tmp_path: Path) -> None:
    block = next(b for b in BLOCKS if "compute_prefix_kv_cu_seqlens(" in b)
    claimed = [line.split("#", 2)[1].split(":")[0].strip() for line in block.splitlines() if line.startswith("print(")]
    proc = _run(block, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == claimed
