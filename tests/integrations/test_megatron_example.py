"""examples/megatron_core_attention_cp.py runs (2 gloo ranks and one process) and its cp 2 losses equal cp 1's.

The example itself exits 1 when any step's loss at cp 2 differs from cp 1 by more than
1e-12 (float64 losses of order 1, sums of a few thousand terms in other orders: rounding
~1e-15); here its printed losses are read back and compared again, so that a silently
skipped comparison cannot pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core (test extra) is missing")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "megatron_core_attention_cp.py"


def test_example_trains_at_cp2_as_in_one_process() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(r"^step (\d+): loss cp=1 \(one process, unpadded\) (\S+)\s+cp=2 \(padded, zigzag\) (\S+)$",
                       proc.stdout, flags=re.M)
    assert [int(s) for s, _, _ in steps] == [0, 1, 2], proc.stdout
    losses = [(float(one), float(two)) for _, one, two in steps]
    assert all(abs(one - two) <= 1e-12 for one, two in losses), losses
    assert losses[-1][0] < losses[0][0]  # it trains: SGD lowers the loss
