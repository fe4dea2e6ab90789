"""Compile every Triton launch the ops issue on CUDA ahead of time for sm_90a (no GPU) and report what it became.

Usage: ``python benchmarks/compile_report.py`` (from the repository root; ``--case NAME`` to
compile a subset, e.g. ``--case "V4-Flash bf16"``).

The launches come from the ops' own launch builders: ``aot_launches(case)`` of
:mod:`cpkv.backends.triton.ops` (and of ``cpkv.backends.triton.indexer_ops`` where that
module exists) builds them on ``meta`` tensors of each case's shapes, so the tiles, grids,
warps and stages are the ones the ops choose on a GPU, never a copy. Each is compiled with
the installed Triton for ``GPUTarget("cuda", 90, 32)`` (sm_90a) and assembled by its
bundled ``ptxas``, which reports registers and spills; the shared memory is Triton's.

Per kernel and case it prints registers a thread, spill bytes (stores + loads), shared
memory, blocks per SM (the least of the register, shared-memory, thread and block limits
of an H100/H200 SM: 65536 registers, 228 KiB shared memory, 2048 threads, 32 blocks), and
for each ``tl.dot`` (by source line) the instruction it lowered to: ``wgmma`` (Hopper warp-group
MMA, with its result shape, instruction shape and warps per CTA; ``(x2 replicated)`` when
the warps along M cover more rows than the dot has, so each warpgroup computes the same
rows), ``mma.sync`` (Ampere-style) or ``FMA`` (no tensor cores: the fp32 IEEE path), and
the kernel's PTX counts of ``wgmma.mma_async``, ``mma.sync`` and ``fma.rn.f32``. The last line is
``compile report: N kernel configs, S with spills, M dots not on wgmma (bf16)``; the exit
status is 1 on a compile error, a spill in a bf16 case, a bf16 ``tl.dot`` not on wgmma, or a
replicated bf16 dot (two warpgroups computing the same rows: FLOPs done twice) (CI's condition).

Cases (the DeepSeek-V4 attention shapes; transformers' ``DeepseekV4Config`` defaults are
V4-Flash: 64 heads, head dim 512, sliding window 128, indexer 64 heads x 128, top-k 512;
its modeling docstring gives V4-Pro's 128 heads of dim 512; V4-Pro's indexer top-k 1024 is
from DeepSeek's V4-Pro config): V4-Flash K = 512 + 128 = 640, V4-Pro K = 1024 + 128 = 1152,
both in bf16 and fp32.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret

import torch  # noqa: E402

from cpkv.backends.triton.launches import AOTCase, KernelLaunch, v4_cases  # noqa: E402

SM_REGS, SM_SMEM, SM_THREADS, SM_BLOCKS = 65536, 228 * 1024, 2048, 32
BLOCK_SMEM_RESERVED = 1024  # the driver's per-block reservation on sm_90
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32", torch.int64: "i64",
          torch.float8_e4m3fn: "fp8e4nv"}


@dataclass(frozen=True)
class Dot:
    """One ``tl.dot`` after lowering: its source line and instruction."""

    line: int
    kind: str  # "wgmma", "mma.sync" or "FMA"
    detail: str


@dataclass(frozen=True)
class Compiled:
    """What one launch compiled to."""

    name: str
    case: str
    regs: int
    spill_bytes: int
    smem: int
    threads: int
    dots: tuple[Dot, ...]
    ptx_counts: tuple[int, int, int]  # wgmma.mma_async, mma.sync, fma.rn.f32 instructions in the PTX

    @property
    def blocks_per_sm(self) -> int:
        """Resident blocks per SM by registers (allocated per warp in 256s), shared memory, threads, and the cap."""
        warps = self.threads // 32
        regs_per_warp = -(-max(self.regs, 1) * 32 // 256) * 256
        by_regs = SM_REGS // (regs_per_warp * warps)
        by_smem = SM_SMEM // (self.smem + BLOCK_SMEM_RESERVED)
        return min(by_regs, by_smem, SM_THREADS // self.threads, SM_BLOCKS)


def _signature(launch: KernelLaunch) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], Any]]:
    """Triton's signature, constexprs and attributes of the launch, specialised as the runtime would."""
    names = launch.kernel.arg_names
    extra = {"num_warps": launch.num_warps} if "num_warps" in names else {}  # Gluon takes it as a constexpr
    launch = KernelLaunch(launch.name, launch.kernel, launch.grid, launch.args, {**launch.constexprs, **extra},
                          launch.num_warps, launch.num_stages)
    runtime = [n for n in names if n not in launch.constexprs]
    if len(runtime) != len(launch.args):
        raise ValueError(f"{launch.name}: {len(launch.args)} arguments for {len(runtime)} runtime parameters")
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = dict(launch.constexprs)
    attrs: dict[tuple[int, ...], Any] = {}
    values = dict(zip(runtime, launch.args))
    for i, name in enumerate(names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
            continue
        value = values[name]
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]  # allocator pointers are 16-byte aligned
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:  # the runtime specialises 1 as a constant
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{launch.name}: argument {name} of type {type(value).__name__}")
    return signature, constexprs, attrs


_MMA = re.compile(r"(#mma\d*) = #ttg\.nvidia_mma<\{([^}]*)\}>")
_LOC = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$", re.M)


def _lines(ttgir: str) -> dict[str, int]:
    """Source line of each ``#loc``: file locations directly, named and call-site locations through what they wrap."""
    raw = {m.group(1): m.group(2) for m in _LOC.finditer(ttgir)}
    resolved: dict[str, int] = {}

    def line(name: str, depth: int = 0) -> int:
        if name in resolved or depth > 50 or name not in raw:
            return resolved.get(name, 0)
        body = raw[name]
        direct = re.match(r'"[^"]*":(\d+):\d+', body)
        inner = re.search(r"(#loc\d*)", body)
        resolved[name] = int(direct.group(1)) if direct else line(inner.group(1), depth + 1) if inner else 0
        return resolved[name]

    return {name: line(name) for name in raw}


def _dots(ttgir: str) -> tuple[Dot, ...]:
    """Each dot op of the TTGIR: ``ttng.warp_group_dot`` is wgmma; ``tt.dot`` on an nvidia_mma v2 layout is mma.sync; else FMA."""
    encodings = {m.group(1): m.group(2) for m in _MMA.finditer(ttgir)}
    locs = _lines(ttgir)
    found = []
    for line in ttgir.splitlines():
        op = re.search(r"= (ttng\.warp_group_dot|tt\.dot) ", line)
        if op is None:
            continue
        loc = re.search(r"loc\((#loc\d*)\)\s*$", line)
        src = locs.get(loc.group(1), 0) if loc else 0
        result = re.search(r"-> tensor<(\d+)x(\d+)x\w+, (#\w+)>", line)
        enc = encodings.get(result.group(3), "") if result else ""
        detail = ""
        if enc and result:
            shape = re.search(r"instrShape = \[([^\]]*)\]", enc)
            warps = re.search(r"warpsPerCTA = \[([^\]]*)\]", enc)
            detail = f"{result.group(1)}x{result.group(2)} instr [{shape.group(1) if shape else '?'}] " \
                     f"warps [{warps.group(1) if warps else '?'}]"
            if warps and op.group(1) == "ttng.warp_group_dot":
                rows = 16 * int(warps.group(1).split(",")[0])  # wgmma: 16 rows a warp along M
                if rows > int(result.group(1)):
                    detail += f" (x{rows // int(result.group(1))} replicated)"
        if op.group(1) == "ttng.warp_group_dot":
            kind = "wgmma"
        elif "versionMajor = 2" in enc:
            kind = "mma.sync"
        else:
            kind = "FMA"
        found.append(Dot(src, kind, detail))
    return tuple(found)


def _ptxas(ptx: str, arch: str) -> tuple[int, int]:
    """(registers, spill store + load bytes) from the bundled ptxas ``-v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([get_ptxas(90).path, f"-arch={arch}", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr)]
    return int(regs.group(1)) if regs else -1, sum(spills)


def compile_launch(launch: KernelLaunch, case: str) -> Compiled:
    """Compile one launch for sm_90a (Triton's own path; ptxas for registers and spills)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = _signature(launch)
    if getattr(launch.kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource

        src: ASTSource = GluonASTSource(launch.kernel, signature, constexprs, attrs)
    else:
        src = ASTSource(launch.kernel, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": launch.num_warps, "num_stages": launch.num_stages})
    ptx = compiled.asm["ptx"]
    regs, spills = _ptxas(ptx, "sm_90a")
    counts = (len(re.findall(r"\bwgmma\.mma_async", ptx)), len(re.findall(r"\bmma\.sync", ptx)),
              len(re.findall(r"\bfma\.rn\.f32", ptx)))
    return Compiled(launch.name, case, regs, spills, int(compiled.metadata.shared), 32 * launch.num_warps,
                    _dots(compiled.asm["ttgir"]), counts)


def all_launches(case: AOTCase) -> list[KernelLaunch]:
    """The launches of every ops module with ``aot_launches`` (the sparse ops; the indexer's when present)."""
    launches = []
    for module in ("cpkv.backends.triton.ops", "cpkv.backends.triton.indexer_ops"):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        if hasattr(mod, "aot_launches"):
            launches.extend(mod.aot_launches(case))
    return launches


def _dot_summary(dots: tuple[Dot, ...]) -> str:
    return "; ".join(f"L{d.line} {d.kind}{' ' + d.detail if d.detail else ''}" for d in dots) or "-"


def main(argv: list[str] | None = None) -> int:
    """Compile, print the table and the summary line; 1 on a compile error, a bf16 spill or a bf16 dot off wgmma."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help="only these case names (repeatable)")
    args = parser.parse_args(argv)
    cases = [c for c in v4_cases() if not args.case or c.name in args.case]
    started = time.monotonic()
    rows: list[Compiled] = []
    errors = 0
    header = (f"{'kernel':<30}{'case':<16}{'warps':>6}{'regs':>6}{'spill B':>9}{'smem KiB':>10}{'blk/SM':>8}"
              f"{'PTX wgmma/mma/fma':>20}  dots (source line: instruction)")
    print(header)
    print("-" * len(header))
    for case in cases:
        for launch in all_launches(case):
            try:
                row = compile_launch(launch, case.name)
            except Exception as err:  # noqa: BLE001 - a compile error is a report line and a failing exit
                errors += 1
                print(f"{launch.name:<30}{case.name:<16} COMPILE ERROR: {type(err).__name__}: {str(err)[:300]}")
                continue
            rows.append(row)
            print(f"{row.name:<30}{row.case:<16}{row.threads // 32:>6}{row.regs:>6}{row.spill_bytes:>9}"
                  f"{row.smem / 1024:>10.1f}{row.blocks_per_sm:>8}{'/'.join(map(str, row.ptx_counts)):>20}  "
                  f"{_dot_summary(row.dots)}", flush=True)
    spilled = [r for r in rows if r.spill_bytes > 0]
    bf16_spills = [r for r in spilled if "bf16" in r.case]
    not_wgmma = sum(1 for r in rows if "bf16" in r.case for d in r.dots if d.kind != "wgmma")
    replicated = [f"{r.name} {r.case} L{d.line}" for r in rows if "bf16" in r.case for d in r.dots
                  if "replicated" in d.detail]
    print(f"({time.monotonic() - started:.0f} s; {errors} compile errors; bf16 spills: "
          f"{', '.join(f'{r.name} {r.case}' for r in bf16_spills) or 'none'}; bf16 replicated dots: "
          f"{', '.join(replicated) or 'none'})")
    print(f"compile report: {len(rows) + errors} kernel configs, {len(spilled)} with spills, "
          f"{not_wgmma} dots not on wgmma (bf16)")
    return 1 if errors or bf16_spills or not_wgmma or replicated else 0


if __name__ == "__main__":
    sys.exit(main())
