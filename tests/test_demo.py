"""The demo (the README's main job) runs, checks and fails loudly."""

import os
import subprocess
import sys

import pytest

from cpkv import demo


@pytest.mark.timeout(180)
def test_demo_spawned_ranks_pass(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--cp", "3", "--tokens", "192"]) == 0
    out = capsys.readouterr().out
    assert "| indexer | 3 | fp32 |" in out and "OK: 4 mode(s)" in out


@pytest.mark.timeout(180)
def test_demo_under_torchrun() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "cpkv.demo", "--tokens", "128", "--mode", "compressor"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| compressor | 2 | fp32 |" in proc.stdout and proc.stdout.count("OK: 1 mode(s)") == 1


def test_verdict_rejects_a_mismatch() -> None:
    row = {"cp_out": 1e-3, "cp_grads": 1e-7, "sp_out": 0.0, "sp_grads": 0.0}
    assert not demo._verdict(row, "fp32")
    assert demo._verdict({**row, "cp_out": 1e-6}, "fp32")
    assert not demo._verdict({**row, "cp_out": 0.1, "sp_out": 0.01}, "bf16")


def test_the_defaults_are_the_recommended_options() -> None:
    """``python -m cpkv.demo`` takes the README's default: balanced (by the layer's own cost) and need."""
    args = demo._parser().parse_args([])
    assert (args.layout, args.exchange) == ("balanced", "need")
    assert "contiguous shard" not in " ".join((demo.__doc__ or "").split()) + demo._parser().format_help()


def test_bad_flags_exit_with_usage_error() -> None:
    with pytest.raises(SystemExit):
        demo.main(["--cp", "3", "--tokens", "100", "--layout", "contiguous"])
    with pytest.raises(SystemExit):
        demo.main(["--ring-degree", "2", "--exchange", "allgather"])


@pytest.mark.timeout(180)
def test_demo_with_ring_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--cp", "2", "--tokens", "192", "--ring-degree", "3"]) == 0
    assert "OK: 4 mode(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--tokens", "0"], "--tokens"), (["--cp", "0"], "--cp"), (["--cp", "-2"], "--cp"), (["--tokens", "-8"], "--tokens"),
     (["--ring-degree", "0"], "--ring-degree"), (["--seed", "-1"], "--seed"), (["--tokens", "1.5"], "--tokens"),
     (["--timeout", "0"], "--timeout")],
)
def test_bad_flag_values_are_named(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse errors (exit 2) naming the flag, not a crash deep inside the demo."""
    with pytest.raises(SystemExit) as info:
        demo.main(argv)
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


FAULTY = """
import sys
import torch.distributed as dist
from cpkv import demo

original = demo._errors


def failing(config, args, rank, world, device):
    if dist.get_rank() == 1:
        raise RuntimeError("injected fault on rank 1")
    return original(config, args, rank, world, device)


demo._errors = failing
sys.exit(demo.main(sys.argv[1:]))
"""


@pytest.mark.timeout(180)
def test_demo_under_torchrun_fails_fast_with_the_first_error(tmp_path: "os.PathLike[str]") -> None:
    """One rank fails inside a layer while its peer waits in a collective: the run ends at once, not at the timeout."""
    script = os.path.join(tmp_path, "faulty_demo.py")
    with open(script, "w", encoding="utf-8") as handle:
        handle.write(FAULTY)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
           "--tokens", "128", "--mode", "window", "--timeout", "600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode != 0
    assert "injected fault on rank 1" in proc.stderr
