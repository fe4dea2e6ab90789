"""examples/quickstart_torchrun.py, the README's multi-rank quick start, run as a user runs it: under torchrun.

``torch.distributed.run`` is the module behind the ``torchrun`` command (the same launcher
path: env:// rendezvous, one process per rank). The script checks its own result against one
float64 process and exits 1 on a mismatch; the oracle itself is checked here to tell a
document-causal mask from a leaky one.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "quickstart_torchrun.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart_torchrun", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ranks", [2, 3])
def test_quickstart_runs_under_torchrun_and_matches_one_process(ranks: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), str(SCRIPT)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=220, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"cp {ranks}, balanced layout, need exchange: matches one process" in proc.stdout, proc.stdout
    assert proc.stdout.count("rank ") == ranks, proc.stdout


def test_the_oracle_is_document_causal() -> None:
    """One process's attention: each token sees its own document up to itself, nothing else (the bound's claim)."""
    script = _script()
    cu_seqlens = torch.tensor([0, 3, 7])
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(7, script.HEADS, script.DIM, dtype=torch.float64, generator=generator)
    kv = torch.randn(7, script.DIM, dtype=torch.float64, generator=generator)
    out = script.one_process(q, kv, cu_seqlens)
    for start, end in ((0, 3), (3, 7)):  # document by document, a plain causal softmax
        scores = torch.einsum("thd,sd->hts", q[start:end], kv[start:end]) / script.DIM**0.5
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        want = torch.einsum("hts,sd->thd", scores.masked_fill(~causal, float("-inf")).softmax(-1), kv[start:end])
        torch.testing.assert_close(out[start:end], want, rtol=0, atol=1e-14)
    leaked = script.one_process(q, kv, torch.tensor([0, 7]))  # the two documents as one: token 3 sees 0-2
    assert (leaked[3:] - out[3:]).abs().max() > 1e-3
