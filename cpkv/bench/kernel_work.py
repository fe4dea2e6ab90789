"""The executed-work model of the Triton sparse attention kernels: FLOPs and L2->SM bytes per query row.

``python -m cpkv.bench kernels`` prints it for the DeepSeek-V4 shapes. Every number comes from
the launches the ops build (:func:`cpkv.backends.triton.ops.aot_launches`: grids, tiles,
warps), next to the counted work: cuDNN's convention, forward ``2*H*K*(D + d_v)`` and
backward ``2*H*K*(3*D + 2*d_v)`` FLOPs per query row, and the minimum bytes (each operand
read once, each result written once).

Executed FLOPs count the padded tiles each program multiplies, times the replication of a
chained dot: Triton 3.6 lays a ``tl.dot`` whose result feeds another dot (S -> P -> PV, S and
dP -> dS -> dq) out with all warps along M (``warpsPerTileV3`` returns ``[num_warps, 1]``), so
with wgmma (16 rows a warp) a ``BLOCK_H``-row dot covers ``16 * num_warps`` rows: at 64 heads
and 8 warps both warpgroups compute the same 64 rows (replication 2; the compile report
shows it as ``warps [8, 1]``). The backward's dkv dots (built transposed, M = a channel
chunk, split ``[4, 2]``), mma.sync and FMA dots are counted once.
Bytes count what the loads move (masked lanes move nothing): Q/dO once per program, kv rows
once per head block, the backward's Q/dO column chunks again at each K step, dkv atomics,
or the deterministic mode's stored terms and their reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpkv.backends.triton.launches import AOTCase, KernelLaunch

__all__ = ["KernelWork", "kernel_work", "work_lines"]

TARGETS = {"sparse_fwd": 1.1, "sparse_fwd_gluon": 1.1, "sparse_bwd_atomic": 1.25, "sparse_bwd_partials": 1.25}


@dataclass(frozen=True)
class KernelWork:
    """One kernel's work per query row (all heads).

    Attributes:
        name: the launch's name. flops, counted_flops: executed and counted FLOPs.
        bytes, min_bytes: executed L2->SM (and SM->L2) bytes, and the minimum.
        target: the bound on ``flops / counted_flops`` (None: no target).
    """

    name: str
    flops: float
    counted_flops: float
    bytes: float
    min_bytes: float
    target: float | None

    @property
    def ratio(self) -> float:
        """Executed over counted FLOPs (``inf`` when nothing is counted)."""
        return self.flops / self.counted_flops if self.counted_flops else float("inf")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def chained_replication(block_m: int, num_warps: int, tensor_cores: bool) -> int:
    """How many times a chained wgmma dot of ``block_m`` rows is computed (``16 * num_warps`` rows covered)."""
    return max(1, 16 * num_warps // block_m) if tensor_cores else 1


def kernel_work(case: AOTCase, launches: Sequence[KernelLaunch]) -> list[KernelWork]:
    """The work of each sparse attention launch of ``launches`` (others are skipped) at ``case``'s shapes.

    Args:
        case: the shapes (heads, dim, d_v, topk) and dtype.
        launches: e.g. ``aot_launches(case)``; read for grid, constexprs and warps.

    Returns:
        One :class:`KernelWork` per known launch (``sparse_fwd_gluon``, ``sparse_fwd``, ``sparse_bwd_atomic``,
        ``sparse_bwd_partials``, ``dkv_reduce``, ``selected_probs``), in the launches' order.

    Raises:
        ValueError: ``case.dim < case.d_v`` or a non-positive size.
    """
    if min(case.heads, case.dim, case.d_v, case.topk) <= 0 or case.d_v > case.dim:
        raise ValueError(f"case needs positive sizes and d_v <= dim, got {case}")
    h, d, dv, k = case.heads, case.dim, case.d_v, case.topk
    e = torch.empty((), dtype=case.dtype).element_size()
    tc = case.dtype in (torch.bfloat16, torch.float16)
    fwd_counted, bwd_counted = 2.0 * h * k * (d + dv), 2.0 * h * k * (3 * d + 2 * dv)
    out: list[KernelWork] = []
    for launch in launches:
        c: Mapping[str, Any] = launch.constexprs
        blocks = launch.grid[1] if len(launch.grid) > 1 else 1
        if launch.name == "dkv_reduce":
            terms = blocks_of(launches) * k * d * 4.0
            out.append(KernelWork(launch.name, 0.0, 0.0, terms + 4.0 * k, 0.0, None))
            continue
        if launch.name == "sparse_fwd_gluon":  # explicit layouts: S split over the warpgroups, no replication
            kp = _cdiv(k, int(c["BLOCK_K"])) * int(c["BLOCK_K"])
            flops = blocks * 2.0 * 2.0 * int(c["BLOCK_H"]) * kp * int(c["D"])
            moved = h * d * e + blocks * (k * d * e + 4.0 * (k + int(c["BLOCK_K"]))) + h * dv * e + 8.0 * h
            least = h * d * e + k * d * e + 4.0 * k + h * dv * e + 8.0 * h
            out.append(KernelWork(launch.name, flops, fwd_counted, moved, least, TARGETS[launch.name]))
            continue
        if launch.name not in ("sparse_fwd", "sparse_bwd_atomic", "sparse_bwd_partials", "selected_probs"):
            continue
        bh, bk, bv = int(c["BLOCK_H"]), int(c["BLOCK_K"]), int(c["BLOCK_V"])
        width = bv + (int(c["BLOCK_R"]) if c["HAS_REST"] else 0)  # channels of one gathered tile
        steps = _cdiv(k, bk)
        kp = steps * bk
        rep = chained_replication(bh, launch.num_warps, tc)
        gather = blocks * (k * d * e + 4.0 * k)  # kv rows and their indices, once per head block
        if launch.name == "sparse_fwd":
            flops = blocks * (2.0 * bh * kp * width * rep + 2.0 * bh * kp * bv)
            moved = h * d * e + gather + h * dv * e + 8.0 * h
            least = h * d * e + k * d * e + 4.0 * k + h * dv * e + 8.0 * h
            out.append(KernelWork(launch.name, flops, fwd_counted, moved, least, TARGETS[launch.name]))
        elif launch.name == "selected_probs":
            flops = blocks * 2.0 * bh * kp * width
            moved = h * d * e + gather + blocks * 4.0 * k + 4.0 * h
            least = h * d * e + k * d * e + 8.0 * k + 4.0 * h
            out.append(KernelWork(launch.name, flops, 2.0 * h * k * d, moved, least, None))
        else:
            bc = int(c["BLOCK_C"])
            dkv_cols = _cdiv(d, bc) * bc + _cdiv(dv, bc) * bc
            flops = blocks * (2.0 * bh * kp * (width * rep + bv * rep + width) + 2.0 * kp * bh * dkv_cols)
            resident = h * d * e + h * dv * e
            chunks = steps * (h * d * e + h * dv * e)  # Q/dO column chunks again at each K step
            dkv = blocks * k * d * 4.0  # atomics, or the stored terms
            moved = resident + chunks + gather + 8.0 * h + h * d * 4.0 + dkv
            least = resident + k * d * e + 4.0 * k + 8.0 * h + h * d * e + k * d * 4.0
            out.append(KernelWork(launch.name, flops, bwd_counted, moved, least, TARGETS[launch.name]))
    return out


def blocks_of(launches: Sequence[KernelLaunch]) -> int:
    """Head blocks of the deterministic backward (the reduce reads one term per entry and head block)."""
    for launch in launches:
        if launch.name == "sparse_bwd_partials":
            return launch.grid[1]
    return 1


def work_lines(case: AOTCase, launches: Sequence[KernelLaunch]) -> list[str]:
    """A markdown table of :func:`kernel_work` (MFLOP and KiB per query row), with the target check."""
    lines = [
        f"{case.name}: H {case.heads}, D {case.dim}, d_v {case.d_v}, K {case.topk} (per query row)",
        "",
        "| kernel | executed MFLOP | counted MFLOP | executed/counted | target | executed KiB | min KiB | bytes/min |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for w in kernel_work(case, launches):
        ratio = f"{w.ratio:.2f}" if w.counted_flops else "-"
        target = "-" if w.target is None else f"<= {w.target}: {'ok' if w.ratio <= w.target else 'MISSED'}"
        per_min = f"{w.bytes / w.min_bytes:.2f}" if w.min_bytes else "-"
        lines.append(f"| {w.name} | {w.flops / 1e6:.1f} | {w.counted_flops / 1e6:.1f} | {ratio} | {target} | "
                     f"{w.bytes / 1024:.0f} | {w.min_bytes / 1024:.0f} | {per_min} |")
    return lines
