"""The sm_90a compile report compiles the launches the ops issue: ``aot_launches`` against what the ops run.

The ops (on CPU under the interpreter) are run with ``KernelLaunch.__call__`` recorded; the
report's ``aot_launches`` of the same shapes must name the same kernels with the same
constexpr names and channel split (the tile values differ: CPU tiles vs GPU tiles, by device).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.backends.triton_interpreter import interpreted_kernels

from cpkv.backends.triton import ops  # noqa: E402
from cpkv.backends.triton.launches import AOTCase, KernelLaunch  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    interpreted_kernels()


def _case(dtype: torch.dtype = torch.float32) -> AOTCase:
    return AOTCase("small", dtype, tokens=4, kv_rows=6, heads=3, dim=40, d_v=24, topk=5,
                   index_heads=2, index_dim=16, index_topk=4, index_rows=6)


def test_aot_launches_are_the_launches_the_ops_make(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[KernelLaunch] = []
    original = KernelLaunch.__call__

    def record(self: KernelLaunch) -> None:
        ran.append(self)
        original(self)

    monkeypatch.setattr(KernelLaunch, "__call__", record)
    case = _case()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(case.tokens, case.heads, case.dim, generator=gen, requires_grad=True)
    kv = torch.randn(case.kv_rows, case.dim, generator=gen, requires_grad=True)
    idx = torch.randint(-1, case.kv_rows, (case.tokens, case.topk), generator=gen)
    for deterministic in (False, True):
        out, lse = ops.sparse_attention_op(q, kv, idx, torch.zeros(case.heads), 0.2, case.d_v, deterministic)
        out.sum().backward()
    ops.selected_probs_op(q.detach(), kv.detach(), idx, lse.detach(), 0.2)
    ops.sparse_attention_probs_op(q.detach(), kv.detach(), idx, torch.zeros(case.heads), 0.2, case.d_v, False, 2)
    planned = [launch for launch in ops.aot_launches(case) if not launch.name.endswith("_gluon")]  # CUDA only

    def key(launch: KernelLaunch) -> tuple[str, object, tuple[str, ...]]:
        return launch.name, launch.kernel, tuple(sorted(launch.constexprs))

    assert sorted(map(key, planned), key=str) == sorted(set(map(key, ran)), key=str)
    for a in planned:
        for b in ran:
            if a.name == b.name and "D" in a.constexprs:
                assert (a.constexprs["D"], a.constexprs.get("DV")) == (b.constexprs["D"], b.constexprs.get("DV"))
                assert len(a.args) == len(b.args)


def test_aot_launches_take_gpu_tiles_on_meta_tensors() -> None:
    case = AOTCase("V4-Flash bf16", torch.bfloat16, tokens=8, kv_rows=16, heads=64, dim=512, d_v=512, topk=640,
                   index_heads=64, index_dim=128, index_topk=512, index_rows=16)
    launches = {launch.name: launch for launch in ops.aot_launches(case)}
    fwd = launches["sparse_fwd"]
    assert fwd.grid == (8, 1) and fwd.constexprs["BLOCK_H"] == 64 and fwd.constexprs["BLOCK_V"] == 512
    assert not fwd.constexprs["HAS_REST"] and fwd.num_warps == 8
    assert all(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in fwd.args if isinstance(a, torch.Tensor))
    pro = ops.aot_launches(AOTCase("V4-Pro bf16", torch.bfloat16, 8, 16, 128, 512, 512, 1152, 64, 128, 1024, 16))
    assert pro[0].grid == (8, 2)  # 128 heads: two programs of 64 per query row
    dkv = {launch.name: launch for launch in pro}["sparse_bwd_dkv_partials"]
    assert dkv.grid[1] == 1 and dkv.constexprs["BLOCK_H"] == 128  # the dkv terms summed over all 128 heads


def test_aot_launches_reject_bad_cases() -> None:
    with pytest.raises(ValueError, match="d_v <= dim"):
        ops.aot_launches(AOTCase("bad", torch.float32, 4, 6, 3, 16, 24, 5, 2, 16, 4, 6))


def test_the_gluon_forward_is_planned_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    flash = AOTCase("V4-Flash bf16", torch.bfloat16, 8, 16, 64, 512, 512, 640, 64, 128, 512, 16)
    names = [launch.name for launch in ops.aot_launches(flash)]
    assert names[:2] == ["sparse_fwd_gluon", "sparse_fwd"]
    gluon = ops.aot_launches(flash)[0]
    assert gluon.constexprs["S_N"] == 32 and gluon.constexprs["O_N"] == 256 and gluon.num_warps == 8
    monkeypatch.setenv("CPKV_TRITON_GLUON", "1")  # opted in: still both, each once
    assert [launch.name for launch in ops.aot_launches(flash)][:2] == ["sparse_fwd_gluon", "sparse_fwd"]
    for case in (_case(), _case(torch.bfloat16), AOTCase("rope", torch.bfloat16, 8, 16, 64, 576, 512, 640, 64, 128, 512, 16)):
        assert all(not launch.name.endswith("_gluon") for launch in ops.aot_launches(case))  # fp32, D != d_v


_COMPILE = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import compile_report  # drops TRITON_INTERPRET: this process compiles for sm_90a
from cpkv.backends.triton import ops
from cpkv.backends.triton.launches import v4_cases
case = next(c for c in v4_cases(64, 64) if c.name == sys.argv[1])
rows = [compile_report.compile_launch(launch, case.name) for launch in ops.aot_launches(case)
        if launch.name in sys.argv[2:]]
print(json.dumps([[r.name, r.spill_bytes, [[d.line, d.kind, d.detail] for d in r.dots]] for r in rows]))
"""


def _compiled(case: str, *names: str) -> list[tuple[str, int, list[tuple[int, str, str]]]]:
    """The sm_90a compile of the named launches (``benchmarks/compile_report.py``'s path, in a subprocess)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", _COMPILE, case, *names], cwd=root, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(r[0] for r in rows) == sorted(names)
    return rows


def test_bf16_attention_dots_are_all_wgmma_without_spills_or_replication() -> None:
    """The forward (with and without the KL target) and the backward's passes: every dot on wgmma,
    no spill, and no dot computed twice by two warpgroups. The forward's QK^T ends Triton's
    chained-dot slice inside a branch, so S splits over the warpgroups (``warps [4, 2]``); the
    backward's ``P``/``dS`` go through memory, so no dot feeds another; the dkv terms are built
    transposed."""
    names = ("sparse_fwd", "sparse_fwd_probs", "sparse_bwd_ds", "sparse_bwd_dq", "sparse_bwd_dkv_atomic",
             "sparse_bwd_dkv_partials")
    for name, spills, dots in _compiled("V4-Flash bf16", *names):
        assert spills == 0, name
        assert dots and all(kind == "wgmma" and "replicated" not in detail for _, kind, detail in dots), (name, dots)
