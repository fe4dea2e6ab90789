"""The executed-work model of the Triton sparse attention kernels: FLOPs and L2->SM bytes per query row.

``python -m cpkv.bench kernels`` prints it for the DeepSeek-V4 shapes. Every number comes from
the launches the ops build (:func:`cpkv.backends.triton.ops.aot_launches`: grids, tiles,
warps), next to the counted work: cuDNN's convention, forward ``2*H*K*(D + d_v)`` and
backward ``2*H*K*(3*D + 2*d_v)`` FLOPs per query row, and the minimum bytes (each operand
read once, each result written once).

Executed FLOPs count the padded tiles each program multiplies, each once. No dot is computed
twice by two warpgroups: Triton 3.6 lays a ``tl.dot`` whose result feeds another dot out with all
warps along M (``warpsPerTileV3`` returns ``[num_warps, 1]``), which at 64 heads and 8 warps would
have both warpgroups compute the same rows; the forward's QK^T and softmax sit in a branch, which
ends the compiler's dependence slice, and the backward's passes chain no dot into another
(``P``/``dS`` go through memory). The compile report checks it (it fails on a replicated bf16
dot), so this model does not have to guess.
The backward's passes are listed one by one and summed (``sparse_bwd`` with atomic dkv,
``sparse_bwd_deterministic`` with the stored terms and the reduce); the targets apply to the sums.
Bytes count what the loads move (masked lanes move nothing): Q/dO once per program, kv rows
once per head block and pass, the ``P``/``dS`` buffers written once and read twice, the dkv
pass's Q/dO column chunks again at each K step, dkv atomics, or the deterministic mode's
stored terms and their reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cpkv.backends.triton.launches import AOTCase, KernelLaunch

__all__ = ["KernelWork", "kernel_work", "work_lines"]

TARGETS = {"sparse_fwd": 1.1, "sparse_fwd_probs": 1.1, "sparse_fwd_gluon": 1.1, "sparse_bwd": 1.25, "sparse_bwd_deterministic": 1.25}
BWD_PASSES = ("sparse_bwd_ds", "sparse_bwd_dq")


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


def kernel_work(case: AOTCase, launches: Sequence[KernelLaunch]) -> list[KernelWork]:
    """The work of each sparse attention launch of ``launches`` (others are skipped) at ``case``'s shapes.

    Args:
        case: the shapes (heads, dim, d_v, topk) and dtype.
        launches: e.g. ``aot_launches(case)``; read for grid, constexprs and warps.

    Returns:
        One :class:`KernelWork` per known launch (``sparse_fwd_gluon``, ``sparse_fwd``, ``sparse_fwd_probs``,
        ``sparse_bwd_ds``,
        ``sparse_bwd_dq``, ``sparse_bwd_dkv_atomic``, ``sparse_bwd_dkv_partials``, ``dkv_reduce``,
        ``selected_probs``; the backward's passes with no counted FLOPs of their own), in the launches'
        order, then the backward's sums ``sparse_bwd`` (ds + dq + atomic dkv) and
        ``sparse_bwd_deterministic`` (ds + dq + stored terms + reduce) with the counted backward.

    Raises:
        ValueError: ``case.dim < case.d_v`` or a non-positive size.
    """
    if min(case.heads, case.dim, case.d_v, case.topk) <= 0 or case.d_v > case.dim:
        raise ValueError(f"case needs positive sizes and d_v <= dim, got {case}")
    h, d, dv, k = case.heads, case.dim, case.d_v, case.topk
    e = torch.empty((), dtype=case.dtype).element_size()
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
        if launch.name not in ("sparse_fwd", "sparse_fwd_probs", "selected_probs", *BWD_PASSES, "sparse_bwd_dkv_atomic",
                               "sparse_bwd_dkv_partials"):
            continue
        bh, bk = int(c["BLOCK_H"]), int(c["BLOCK_K"])
        steps = _cdiv(k, bk)
        kp = steps * bk
        gather = blocks * (k * d * e + 4.0 * k)  # kv rows and their indices, once per head block
        if launch.name.startswith("sparse_bwd_dkv"):
            bc = int(c["BLOCK_C"])
            dkv_cols = _cdiv(d, bc) * bc + _cdiv(dv, bc) * bc
            flops = blocks * 2.0 * kp * bh * dkv_cols
            chunks = steps * (h * d * e + h * dv * e)  # Q/dO column chunks again at each K step
            moved = 2.0 * h * k * e + chunks + blocks * 4.0 * k + blocks * k * d * 4.0  # P, dS; atomics or terms
            out.append(KernelWork(launch.name, flops, 0.0, moved, 0.0, None))
            continue
        bv = int(c["BLOCK_V"])
        width = bv + (int(c["BLOCK_R"]) if c["HAS_REST"] else 0)  # channels of one gathered tile
        if launch.name in ("sparse_fwd", "sparse_fwd_probs"):
            flops = blocks * (2.0 * bh * kp * width + 2.0 * bh * kp * bv)
            moved = h * d * e + gather + h * dv * e + 8.0 * h
            least = h * d * e + k * d * e + 4.0 * k + h * dv * e + 8.0 * h
            if launch.name == "sparse_fwd_probs":  # the target's steps' exp(s - m) and m to scratch and back
                kc = int(launch.args[6].shape[-1])  # the target's columns (the probs buffer)
                kept = steps - (k - kc) // bk  # steps covering a target column
                moved += blocks * bh * kept * (bk * e + 4.0) * 2 + blocks * kc * 4.0
                least += kc * 4.0
            out.append(KernelWork(launch.name, flops, fwd_counted, moved, least, TARGETS[launch.name]))
        elif launch.name == "selected_probs":
            flops = blocks * 2.0 * bh * kp * width
            moved = h * d * e + gather + blocks * 4.0 * k + 4.0 * h
            least = h * d * e + k * d * e + 8.0 * k + 4.0 * h
            out.append(KernelWork(launch.name, flops, 2.0 * h * k * d, moved, least, None))
        elif launch.name == "sparse_bwd_ds":  # S and dP; no dot feeds another, so no replication
            flops = blocks * 2.0 * bh * kp * (width + bv)
            moved = h * d * e + h * dv * e + gather + 8.0 * h + 2.0 * h * k * e
            out.append(KernelWork(launch.name, flops, 0.0, moved, 0.0, None))
        else:  # sparse_bwd_dq: dS K, dS read back
            flops = blocks * 2.0 * bh * kp * width
            moved = gather + h * k * e + h * d * 4.0
            out.append(KernelWork(launch.name, flops, 0.0, moved, 0.0, None))
    least = h * d * e + h * dv * e + k * d * e + 4.0 * k + 8.0 * h + h * d * e + k * d * 4.0
    by_name = {w.name: w for w in out}
    for total, last in (("sparse_bwd", ("sparse_bwd_dkv_atomic",)),
                        ("sparse_bwd_deterministic", ("sparse_bwd_dkv_partials", "dkv_reduce"))):
        parts = [by_name[n] for n in (*BWD_PASSES, *last) if n in by_name]
        if len(parts) == len(BWD_PASSES) + len(last):
            out.append(KernelWork(total, sum(p.flops for p in parts), bwd_counted, sum(p.bytes for p in parts), least,
                                  TARGETS[total]))
    return out


def blocks_of(launches: Sequence[KernelLaunch]) -> int:
    """Head blocks of the deterministic backward (the reduce reads one term per entry and head block)."""
    for launch in launches:
        if launch.name == "sparse_bwd_dkv_partials":
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
