"""A user's file type-checks against the installed cpkv, and mypy catches a mistyped option.

mypy runs in a subprocess from a temporary directory (not the repository root), so it sees
cpkv as a user does: through the install's ``py.typed``, not the source tree.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mypy", reason="mypy (the test extra) is not installed")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the module: analysing torch once is most of the time (~40 s cold).

    The repository's own ``.mypy_cache`` when there is one (CI's mypy step leaves it, with
    torch analysed under the same strict options, as .ci/run's typed-user step also reuses);
    a cache holds analyses, not verdicts, so the user file is still checked afresh.
    """
    repo_cache = ROOT / ".mypy_cache"
    return repo_cache if repo_cache.is_dir() else tmp_path_factory.mktemp("mypy_cache")


def _mypy(tmp_path: Path, cache_dir: Path, source: str) -> subprocess.CompletedProcess[str]:
    user = tmp_path / "user.py"
    user.write_text(textwrap.dedent(source), encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--warn-unreachable", "--no-error-summary", "--cache-dir", str(cache_dir),
         str(user)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )


def test_mypy_catches_a_mistyped_exchange(tmp_path: Path, cache_dir: Path) -> None:
    proc = _mypy(tmp_path, cache_dir, """\
        import torch
        from cpkv import AttentionPlan, plan_attention

        def plan() -> AttentionPlan:
            return plan_attention(torch.tensor([0, 8]), 2, 0, exchange="allgather")

        def typo() -> AttentionPlan:
            return plan_attention(torch.tensor([0, 8]), 2, 0, exchange="neeed")
        """)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1, proc.stdout + proc.stderr
    assert "user.py:8:" in errors[0] and "'neeed'" in errors[0] and "[arg-type]" in errors[0], errors[0]


def test_typed_user_example_passes_strict(tmp_path: Path, cache_dir: Path) -> None:
    proc = _mypy(tmp_path, cache_dir, (ROOT / "examples" / "typed_user.py").read_text(encoding="utf-8"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
