"""Every ```python block of README.md, docs/guide.md and docs/integrations.md runs as written, each in a fresh interpreter.

The blocks run two at a time, each in its own empty directory, once per session (a module fixture).

Blocks that need a process group set up their own 1-rank gloo group. The prefix-plan
block's printed values must equal what its comments claim.
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "docs" / "guide.md", ROOT / "docs" / "integrations.md"]
BLOCKS = [b for page in PAGES for b in re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), flags=re.S | re.M)]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def block_runs(tmp_path_factory: pytest.TempPathFactory) -> list[subprocess.CompletedProcess[str]]:
    """Every block's run, two at a time (each one interpreter, mostly imports: two cores halve the wait)."""
    dirs = [tmp_path_factory.mktemp(f"block{index}") for index in range(len(BLOCKS))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(_run, BLOCKS, dirs))


def test_readme_has_python_blocks() -> None:
    assert len(BLOCKS) >= 3


@pytest.mark.timeout(600)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index: int, block_runs: list[subprocess.CompletedProcess[str]]) -> None:
    proc = block_runs[index]
    assert proc.returncode == 0, f"README python block {index}:\n{BLOCKS[index]}\n{proc.stderr}"


def test_prefix_plan_block_prints_what_it_claims(block_runs: list[subprocess.CompletedProcess[str]]) -> None:
    index = next(i for i, b in enumerate(BLOCKS) if "compute_prefix_kv_cu_seqlens(" in b)
    claimed = [line.split("#", 2)[1].split(":")[0].strip() for line in BLOCKS[index].splitlines() if line.startswith("print(")]
    proc = block_runs[index]
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == claimed
