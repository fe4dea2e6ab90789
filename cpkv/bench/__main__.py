"""``python -m cpkv.bench``: bytes per rank, planning time and wall time, in one run.

Prints the tables; writes nothing unless told: ``--out docs/benchmarks.md`` writes the report
(keeping the sections of the ``layouts`` and ``memory`` runs), ``--plot docs/benchmarks.png``
the figure. ``--smoke`` runs tiny sizes (used by the tests).
``python -m cpkv.bench SUBCOMMAND [...]`` runs one of :data:`SUBCOMMANDS` instead (``--help``
lists them; each has its own ``--help``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

from cpkv.bench import layouts, memory_report, mindspeed
from cpkv.bench.balance import pad_for_zigzag, rank_work
from cpkv.bench.heads import heads_lines, heads_table
from cpkv.bench.heads import main as heads_main
from cpkv.bench.indexer import main as indexer_main
from cpkv.bench.memory import LayerDims, layer_memory
from cpkv.bench.planning import attention_planning_times, planning_main, planning_times, random_documents
from cpkv.bench.traffic import Dims, Traffic, layer_traffic, lognormal_cu_seqlens, need_plan, physical_limit
from cpkv.bench.walltime import WALL_WINDOW, ring_times, wall_times

MODE_NAMES = {4: "INDEXER (ratio 4)", 128: "COMPRESSOR_ONLY (ratio 128)"}
TARGETS = {0: 1 / 1000, 4: 1 / 16, 128: 1 / 200}


def mode_name(ratio: int, window: int) -> str:
    """The table label of a layer kind: ``NO_COMPRESS (window W)`` for ratio 0, else its mode and ratio."""
    return f"NO_COMPRESS (window {window})" if ratio == 0 else MODE_NAMES.get(ratio, str(ratio))


def _load() -> str:
    try:
        return ", ".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def _progress(done: int, total: int, label: str) -> None:
    filled = int(30 * done / max(total, 1))
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {label:<40}", end="", file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def _batch(scenario: str, total: int, mean_doc: int, seed: int) -> torch.Tensor:
    return torch.tensor([0, total]) if scenario == "one document" else lognormal_cu_seqlens(total, mean_doc, seed=seed)


def _need_rows(cu: torch.Tensor, cp: int, ratios: list[int], dims: Dims) -> dict[int, list[tuple[Traffic, int]]]:
    """Per ratio, per rank: the need exchange's traffic and the forward physical limit (one plan per rank)."""
    compressed = [r for r in ratios if r > 1]
    out: dict[int, list[tuple[Traffic, int]]] = {r: [] for r in ratios}
    for rank in range(cp):
        plan = need_plan(cu, cp, rank, compressed, dims)
        for ratio in ratios:
            traffic = layer_traffic(cu, cp, rank, ratio, "need", dims, plan=plan)
            out[ratio].append((traffic, physical_limit(cu, cp, rank, ratio, dims)))
    return out


def traffic_table(tokens_per_rank: int, cps: list[int], ratios: list[int], mean_doc: int, dims: Dims) -> list[dict[str, object]]:
    """One row per (scenario, cp, ratio): bytes received per rank for both strategies, and the physical limit."""
    rows: list[dict[str, object]] = []
    jobs = [(s, cp) for s in ("one document", "log-normal docs") for cp in cps]
    for i, (scenario, cp) in enumerate(jobs):
        _progress(i, len(jobs), f"bytes: {scenario}, cp {cp}")
        cu = _batch(scenario, tokens_per_rank * cp, mean_doc, seed=cp)
        need = _need_rows(cu, cp, ratios, dims)
        for ratio in ratios:
            row: dict[str, object] = {"scenario": scenario, "cp": cp, "ratio": ratio}
            gathered = [layer_traffic(cu, cp, rank, ratio, "allgather", dims) for rank in range(cp)]
            for strategy, counts in (("allgather", gathered), ("need", [t for t, _ in need[ratio]])):
                received = [c.received for c in counts]
                row[f"{strategy}_max"], row[f"{strategy}_mean"] = max(received), sum(received) / cp
                row[f"{strategy}_fwd_max"] = max(c.forward for c in counts)
                row[f"{strategy}_total"] = sum(received)
                row[f"{strategy}_copied"] = max(c.copied for c in counts)
            limits = [limit for _, limit in need[ratio]]
            row["limit_fwd_max"], row["limit_total"] = max(limits), 2 * sum(limits)  # each row's gradient returns once
            rows.append(row)
    _progress(len(jobs), len(jobs), "bytes: done")
    return rows


def scaling_table(tokens_per_rank: int, cps: list[int], ratios: list[int], mean_doc: int, seeds: int,
                  dims: Dims) -> list[dict[str, object]]:
    """Forward bytes of the busiest rank at growing cp: need exchange vs physical limit (packed: several seeds)."""
    rows: list[dict[str, object]] = []
    jobs = [(s, cp) for s in ("one document", "log-normal docs") for cp in cps]
    for i, (scenario, cp) in enumerate(jobs):
        _progress(i, len(jobs), f"scaling: {scenario}, cp {cp}")
        runs = [_need_rows(_batch(scenario, tokens_per_rank * cp, mean_doc, seed=1000 * cp + k), cp, ratios, dims)
                for k in range(1 if scenario == "one document" else seeds)]
        for ratio in ratios:
            need = [max(t.forward for t, _ in run[ratio]) for run in runs]
            limit = [max(lim for _, lim in run[ratio]) for run in runs]
            gathered = layer_traffic(_batch(scenario, tokens_per_rank * cp, mean_doc, 0), cp, 0, ratio, "allgather", dims)
            rows.append({"scenario": scenario, "cp": cp, "ratio": ratio, "seeds": len(runs), "need": need,
                         "limit": limit, "allgather": gathered.forward})
    _progress(len(jobs), len(jobs), "scaling: done")
    return rows


def balance_table(tokens_per_rank: int, cps: list[int], mean_doc: int) -> list[dict[str, object]]:
    """Causal work per rank (max/mean) for contiguous vs per-document zigzag TND."""
    rows: list[dict[str, object]] = []
    for scenario in ("one document", "log-normal docs"):
        for cp in cps:
            total = tokens_per_rank * cp
            cu = torch.tensor([0, total]) if scenario == "one document" else lognormal_cu_seqlens(total, mean_doc, seed=cp)
            padded, pad = pad_for_zigzag(cu, cp)
            work = rank_work(padded, cp)
            row: dict[str, object] = {"scenario": scenario, "cp": cp, "padding": pad, "tokens": int(padded[-1])}
            for key, values in work.items():
                row[f"{key}_max"], row[f"{key}_mean"] = max(values), sum(values) / cp
            rows.append(row)
    return rows


def _mib(value: object) -> str:
    return f"{float(str(value)) / 2**20:,.2f}"


def _balance_lines(balance: list[dict[str, object]], args: argparse.Namespace) -> list[str]:
    lines = [
        "", "## Load balance: causal attention work per rank", "",
        f"Score elements per rank (causal, no window) from the real plans, {args.tokens_per_rank:,} tokens per rank;"
        " documents padded to multiples of `2*cp` for zigzag (the same padded batch for both)."
        " `kv rows` is what the kernel reads: the contiguous prefix, or zigzag's duplicated prefixes"
        " (two kernel segments per document, the shorter prefix read twice).", "",
        "| scenario | cp | padding tokens | contiguous max/mean | zigzag max/mean | zigzag max / contiguous max |"
        " kv rows max: contiguous / zigzag |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in balance:
        c_max, c_mean = float(str(row["contiguous_max"])), float(str(row["contiguous_mean"]))
        z_max, z_mean = float(str(row["zigzag_max"])), float(str(row["zigzag_mean"]))
        lines.append(
            f"| {row['scenario']} | {row['cp']} | {row['padding']} | {c_max / c_mean:.3f} | {z_max / z_mean:.3f} |"
            f" {z_max / c_max:.3f} | {int(str(row['contiguous_kv_max'])):,} / {int(str(row['zigzag_kv_max'])):,} |"
        )
    return lines


def _ratio(value: float, limit: float) -> str:
    return f"{value / limit:.3f}" if limit else ("at 0" if value == 0 else "inf")


def _scaling_lines(scaling: list[dict[str, object]], args: argparse.Namespace) -> list[str]:
    lines = [
        "", "## Scaling: forward bytes of the busiest rank vs the physical limit", "",
        f"{args.tokens_per_rank:,} tokens per rank; packed documents log-normal (mean {args.mean_doc:,}), {args.seeds} seeds"
        " (max and mean over seeds: the maximum is set by the longest document that straddles a boundary)."
        " Forward bytes only, `need / allgather` included.", "",
        "| scenario | cp | layer | need MiB max (mean) | limit MiB max (mean) | need / limit (worst seed) | need / allgather (fwd) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in scaling:
        need, limit = [float(v) for v in row["need"]], [float(v) for v in row["limit"]]  # type: ignore[attr-defined]
        worst = max((_n / _l if _l else (1.0 if _n == 0 else float("inf"))) for _n, _l in zip(need, limit))
        lines.append(
            f"| {row['scenario']} | {row['cp']} | {mode_name(int(str(row['ratio'])), Dims().window)} |"
            f" {_mib(max(need))} ({_mib(sum(need) / len(need))}) | {_mib(max(limit))} ({_mib(sum(limit) / len(limit))}) |"
            f" {worst:.3f} | {max(need) / max(float(str(row['allgather'])), 1.0):.2e} |"
        )
    return lines


def key_dtype_table(tokens_per_rank: int, cp: int) -> list[dict[str, object]]:
    """INDEXER layer, one document, busiest rank, forward: need vs its limit and vs the all-gather, per key dtype."""
    cu = torch.tensor([0, tokens_per_rank * cp])
    gathered = max(layer_traffic(cu, cp, r, 4, "allgather", Dims()).forward for r in range(cp))
    rows: list[dict[str, object]] = []
    for key_dtype in ("float32", "bfloat16", "float8"):
        dims = Dims(key_dtype=key_dtype)
        need = [layer_traffic(cu, cp, r, 4, "need", dims).forward for r in range(cp)]
        limits = [physical_limit(cu, cp, r, 4, dims) for r in range(cp)]
        rows.append({"key_dtype": key_dtype, "need": max(need), "limit": max(limits), "allgather": gathered})
    return rows


def _key_dtype_lines(rows: list[dict[str, object]], args: argparse.Namespace) -> list[str]:
    lines = [
        "", "## Indexer keys on the wire (`AttentionSpec.index_key_dtype`)", "",
        f"INDEXER layer (ratio 4), one document, cp {args.key_cp}, {args.tokens_per_rank:,} tokens per rank, busiest rank,"
        " forward bytes received, as a fraction of MindSpeed's all-gather of kv and hidden states. float8 is e4m3 with"
        " one fp32 scale per key (D + 4 bytes a key).", "",
        "| key dtype | need MiB | limit MiB | need / limit | need / allgather (fwd) | limit / allgather (fwd) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        need, limit, gathered = (float(str(row[k])) for k in ("need", "limit", "allgather"))
        lines.append(
            f"| {row['key_dtype']} | {_mib(need)} | {_mib(limit)} | {_ratio(need, limit)} | {need / gathered:.2e} |"
            f" {limit / gathered:.2e} |"
        )
    return lines


def _memory_lines(memory: dict[str, tuple[int, int]]) -> list[str]:
    d = LayerDims()
    lines = [
        "", "## Bytes copied and peak memory of one layer (forward + backward, CPU)", "",
        f"V4-Flash proportions at a smaller scale: hidden {d.hidden}, kv {d.head_dim}, indexer keys {d.index_head_dim},"
        f" window {d.window}, fp32, cp {d.cp}, one document of {d.cp * d.tokens_per_rank:,} tokens, last rank, one process"
        " in a fake process group (`cpkv/bench/memory.py`). Copies: bytes written by copying aten ops (`cat`,"
        " `index_select`, `clone`, `copy_`, `_to_copy`; not `slice_backward`, `add` and other ops that also write"
        " new tensors: RoPE's gradient, now a `clone`, was a `slice_backward` per slice and their sum, so its copies"
        " count more and its peak less than before). Peak: most bytes of storages created by aten ops alive at once"
        " (a dispatch mode tracking each output storage by weak reference), on top of the parameters, input and plan.", "",
        "| layer | copied MiB allgather / need | peak MiB allgather / need |", "|---|---|---|",
    ]
    for ratio in sorted({int(k.split("/")[0]) for k in memory}):
        (ca, pa), (cn, pn) = memory[f"{ratio}/allgather"], memory[f"{ratio}/need"]
        lines.append(f"| {mode_name(ratio, d.window)} | {_mib(ca)} / {_mib(cn)} | {_mib(pa)} / {_mib(pn)} |")
    return lines


def render(traffic: list[dict[str, object]], planning: tuple[float, float, float], walls: dict[str, float],
           args: argparse.Namespace, balance: list[dict[str, object]] | None = None,
           rings: dict[str, float] | None = None, scaling: list[dict[str, object]] | None = None,
           memory: dict[str, tuple[int, int]] | None = None,
           plans: dict[str, dict[str, tuple[float, float]]] | None = None,
           keys: list[dict[str, object]] | None = None, heads: list[dict[str, object]] | None = None) -> str:
    """The markdown report."""
    dims_key = Dims().key_dtype
    lines = [
        "# Benchmarks", "",
        f"Measured {date.today().isoformat()} by `python -m cpkv.bench` on {platform.machine()},"
        f" {torch.get_num_threads()} CPU threads, torch {torch.__version__} (a small shared machine: read ratios, not absolutes;"
        f" load average {_load()} while running). Every `python -m cpkv.bench` command prints its tables and writes only"
        " where `--out` (and `--plot`) say: this page is `--out docs/benchmarks.md --plot docs/benchmarks.png`, and each"
        " section below names the command that rewrites it with `--out docs/benchmarks.md`.", "",
        "## Bytes received per rank per layer", "",
        f"DeepSeek-V4-Flash dimensions (hidden 4096, one shared kv head of 512, indexer keys 128, window 128, bf16),"
        f" {args.tokens_per_rank:,} tokens per rank. Counted on the real collective calls of the exchange code"
        " (`gather_from_sp_cp` / `exchange_rows`) run on meta tensors of the true sizes in a fake process group;"
        " `allgather` is MindSpeed's scheme (kv, plus hidden states for compressed layers, gathered; prefix"
        " re-compressed on every rank). `allgather max`, `need max`, `need mean` and `need/allgather (fwd+bwd)` count the"
        " bytes received in forward + backward (MiB; max and mean over ranks; `need/allgather` = need max / allgather"
        " max, the busiest ranks).", "",
        "`limit` is the physical minimum, computed from the document lengths and the layer's reach alone"
        " (`physical_limit` in `cpkv/bench/traffic.py`, independent of the exchange code): the W-1 kv rows before the"
        f" rank's first token within its document, plus for compressed layers the entries of that document owned by"
        f" earlier ranks, their indexer keys ({dims_key} on the wire: `AttentionSpec.index_key_dtype=None` sends the"
        " indexer's compute dtype, float32 for bf16 inputs; the next table compares key dtypes) and the hidden"
        " rows the block straddling the boundary reads. `fwd busiest` = forward bytes of the busiest rank;"
        " `fwd+bwd all` = forward + backward summed over ranks (the limit counts each forward row's gradient once).", "",
        "| scenario | cp | layer | allgather max | need max | need mean | need/allgather (fwd+bwd) | target |"
        " fwd busiest: need / limit MiB | ratio | fwd+bwd all: need / limit MiB | ratio | prefix copy MiB (allgather / need) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in traffic:
        ratio = int(str(row["ratio"]))
        share = float(str(row["need_max"])) / max(float(str(row["allgather_max"])), 1.0)
        target = TARGETS.get(ratio, 1.0)
        verdict = "met" if share <= target else "MISSED"
        fwd, fwd_limit = float(str(row["need_fwd_max"])), float(str(row["limit_fwd_max"]))
        both, both_limit = float(str(row["need_total"])), float(str(row["limit_total"]))
        lines.append(
            f"| {row['scenario']} | {row['cp']} | {mode_name(ratio, Dims().window)} | {_mib(row['allgather_max'])} |"
            f" {_mib(row['need_max'])} | {_mib(row['need_mean'])} | {share:.2e} |"
            f" <= {target:.2e} ({verdict if row['cp'] == 8 else 'cp 8 only'}) |"
            f" {_mib(fwd)} / {_mib(fwd_limit)} | {_ratio(fwd, fwd_limit)} | {_mib(both)} / {_mib(both_limit)} |"
            f" {_ratio(both, both_limit)} | {_mib(row['allgather_copied'])} / {_mib(row['need_copied'])} |"
        )
    lines += _key_dtype_lines(keys, args) if keys else []
    lines += _scaling_lines(scaling, args) if scaling else []
    lines += _memory_lines(memory) if memory else []
    lines += heads_lines(heads, args.heads_tokens) if heads else []
    lines += _balance_lines(balance or [], args) if balance else []
    vec, host_loop, tensor_loop = planning
    lines += [
        "", "## Planning time", "",
        f"`compute_prefix_kv_cu_seqlens` for all {args.plan_cp} ranks of {args.plan_docs:,} documents (1-256 tokens) vs"
        " the same plan by a per-document Python loop (`cpkv/bench/planning.py`), best of 5.", "",
        "| planner | ms for all ranks | loop / vectorised |", "|---|---|---|",
        f"| vectorised (`compute_prefix_kv_cu_seqlens`) | {vec * 1e3:.2f} | 1 |",
        f"| loop over a host list of ints | {host_loop * 1e3:.2f} | {host_loop / vec:.1f}x |",
        f"| loop over the cu_seqlens tensor | {tensor_loop * 1e3:.2f} | {tensor_loop / vec:.1f}x |",
    ]
    if plans:
        lines += [
            "", f"Per rank, one thread (`torch.set_num_threads(1)`), slowest rank of cp {args.plan_cp}, best of"
            f" {args.plan_repeats}: MindSpeed's per-document loop `_compute_prefix_kv_cu_seqlens` (re-typed in"
            " `cpkv/bench/planning.py` from its documented behaviour: prefix segments only) next to the whole"
            " DeepSeek-V4 plan (`plan_attention(..., compress_ratios=[4, 128], windows=[128, None])`). wall ms / CPU ms"
            " of the planning thread (the machine is shared: wall includes waiting for a core).", "",
            "| batch | MindSpeed loop | `compute_prefix_kv_cu_seqlens` | `plan_attention` allgather | `plan_attention` need |",
            "|---|---|---|---|---|",
        ]
        for batch, times in plans.items():
            cells = " | ".join(f"{times[k][0] * 1e3:.2f} / {times[k][1] * 1e3:.2f}" for k in ("mindspeed", "prefix", "allgather", "need"))
            lines.append(f"| {batch} | {cells} |")
    if walls:
        lines += [
            "", "## Wall time, forward + backward, CPU gloo", "",
            f"The small V4-style layer (hidden 64, 4 heads, window {WALL_WINDOW}) at cp {args.wall_cp}, {args.wall_tokens:,} packed"
            " log-normal tokens, reference backend; slowest rank, best of 3. Two cores shared by all ranks.", "",
            "| layer | allgather s | need s | allgather / need |", "|---|---|---|---|",
        ]
        for ratio in args.ratios:
            a, n = walls[f"{ratio}/allgather"], walls[f"{ratio}/need"]
            lines.append(f"| {mode_name(ratio, WALL_WINDOW)} | {a:.3f} | {n:.3f} | {a / n:.2f}x |")
    if rings:
        lines += [
            "", "## ring_degree: rounds of the kv exchange", "",
            f"Dense causal V4-style layer (hidden 64, head dim 32, fp32) at cp {args.wall_cp}, {args.wall_tokens:,} tokens"
            " in long log-normal documents, `exchange=\"need\"`. Largest round = received kv of the largest single"
            " round (R = 1: the whole halo), busiest rank, from the plan's routes (which the bytes test checks against"
            " counted traffic). Rounds run one after the other (no prefetch of the next round), so this is the most remote"
            " kv one collective receives; without autograd it is also the remote kv held at once (with autograd every"
            " round's rows stay saved for the backward). Wall time: forward + backward, slowest rank, best of 3.", "",
            "| ring_degree | largest round kv rows | largest round kv bytes | vs R=1 | fwd+bwd s |", "|---|---|---|---|---|",
        ]
        base = rings["1/round_rows"] or 1.0
        for ring in (1, 2, 4):
            lines.append(f"| {ring} | {int(rings[f'{ring}/round_rows']):,} | {int(rings[f'{ring}/round_bytes']):,} |"
                         f" {rings[f'{ring}/round_rows'] / base:.2f} |"
                         f" {rings[f'{ring}/seconds']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(traffic: list[dict[str, object]], path: Path) -> bool:
    """Bytes received by the busiest rank vs cp, per layer kind and strategy (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    scenarios = sorted({str(r["scenario"]) for r in traffic})
    fig, axes = plt.subplots(1, len(scenarios), figsize=(6 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios):
        for ratio in sorted({int(str(r["ratio"])) for r in traffic}):
            rows = [r for r in traffic if r["scenario"] == scenario and r["ratio"] == ratio]
            cps = [int(str(r["cp"])) for r in rows]
            for strategy, style in (("allgather", "--"), ("need", "-")):
                ax.plot(cps, [float(str(r[f"{strategy}_max"])) / 2**20 for r in rows], style, marker="o",
                        label=f"{mode_name(ratio, Dims().window)}, {strategy}")
        cps_all = sorted({int(str(r["cp"])) for r in traffic})
        ax.set_xscale("log", base=2)
        ax.set_xticks(cps_all, [str(c) for c in cps_all])
        ax.set(yscale="log", xlabel="cp", ylabel="MiB received by the busiest rank (fwd+bwd)", title=scenario)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (``--smoke`` shrinks the sizes); the defaults are those of docs/benchmarks.md."""
    parser = argparse.ArgumentParser(prog="python -m cpkv.bench", description=__doc__, epilog=subcommands_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", type=int, default=131072)
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ratios", type=int, nargs="+", default=[0, 4, 128])
    parser.add_argument("--mean-doc", type=int, default=8192, help="mean document length of the log-normal batch")
    parser.add_argument("--plan-docs", type=int, default=8192)
    parser.add_argument("--plan-cp", type=int, default=8)
    parser.add_argument("--wall-cp", type=int, default=4)
    parser.add_argument("--wall-tokens", type=int, default=4096)
    parser.add_argument("--scaling-cps", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the packed batch in the scaling table")
    parser.add_argument("--key-cp", type=int, default=8, help="cp of the indexer key-dtype table")
    parser.add_argument("--plan-repeats", type=int, default=5)
    parser.add_argument("--heads-tokens", type=int, default=4096, help="tokens per rank of the kv-heads table")
    parser.add_argument("--heads-cp", type=int, default=8, help="cp of the kv-heads table")
    parser.add_argument("--skip-wall", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--out", type=Path, help="write the report here (e.g. docs/benchmarks.md); default: print only")
    parser.add_argument("--plot", type=Path, help="draw the traffic figure here (e.g. docs/benchmarks.png); default: none")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens_per_rank, args.cps, args.mean_doc, args.plan_docs, args.wall_tokens = 512, [2, 3], 64, 256, 192
        args.scaling_cps, args.seeds, args.plan_repeats, args.key_cp = [4], 2, 1, 2
        args.heads_tokens, args.heads_cp = 128, 2
    return args


def kernels_main(argv: list[str]) -> int:
    """``python -m cpkv.bench kernels``: the Triton kernels' executed-work model at the V4 shapes (needs triton)."""
    from cpkv.backends.triton.launches import v4_cases
    from cpkv.backends.triton.ops import aot_launches
    from cpkv.bench.kernel_work import work_lines

    parser = argparse.ArgumentParser(prog="python -m cpkv.bench kernels", description=kernels_main.__doc__)
    parser.parse_args(argv)
    for case in v4_cases():
        print("\n".join(work_lines(case, aot_launches(case))) + "\n")
    return 0


SUBCOMMANDS: tuple[tuple[str, Callable[[list[str]], int], str], ...] = (
    ("layouts", layouts.main, "every layout's modeled cost and bytes at 1M tokens (its section of docs/benchmarks.md)"),
    ("memory", memory_report.main, "the loss-memory and whole-step memory tables per rank (its section)"),
    ("planning", planning_main, "every layout's planning time at 1M tokens"),
    ("indexer", indexer_main, "the indexer's counted and executed work, launches and host syncs"),
    ("heads", heads_main, "the kv-heads table: collectives, bytes and kernel calls per layer"),
    ("kernels", kernels_main, "the Triton kernels' executed FLOPs and bytes per query row (needs triton)"),
    ("mindspeed", mindspeed.main, "MindSpeed-LLM's all-gather bytes against the need exchange (docs/mindspeed.md)"),
)
"""``python -m cpkv.bench NAME [...]``: name, the function run on the rest of the arguments, what it prints."""


def subcommands_help() -> str:
    """The ``--help`` epilog: every subcommand of :data:`SUBCOMMANDS`, a line each."""
    width = max(len(name) for name, _, _ in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {what}" for name, _, what in SUBCOMMANDS]
    return "\n".join(["subcommands (python -m cpkv.bench NAME --help for each one's options):", *lines])


def main(argv: list[str] | None = None) -> int:
    """Measure every table and print the report (``--out``, ``--plot``: write it and the figure); 0 on success.

    ``argv`` starting with the name of one of :data:`SUBCOMMANDS` runs that one on the rest instead.
    """
    argv = sys.argv[1:] if argv is None else argv
    for name, run, _ in SUBCOMMANDS:
        if argv[:1] == [name]:
            return run(argv[1:])
    args = parse_args(argv)
    start = time.perf_counter()
    traffic = traffic_table(args.tokens_per_rank, args.cps, args.ratios, args.mean_doc, Dims())
    print("planning ...", file=sys.stderr)
    planning = planning_times(random_documents(args.plan_docs, args.plan_cp, seed=0), args.plan_cp)
    total = args.tokens_per_rank * args.plan_cp
    batches = {
        f"one document of {total:,} tokens": torch.tensor([0, total]),
        f"log-normal documents (mean {args.mean_doc:,}), {total:,} tokens": lognormal_cu_seqlens(total, args.mean_doc, seed=8),
        f"{args.plan_docs:,} documents of 1-256 tokens": random_documents(args.plan_docs, args.plan_cp, seed=0),
    }
    plans = {name: attention_planning_times(cu, args.plan_cp, args.plan_repeats) for name, cu in batches.items()}
    print("key dtypes ...", file=sys.stderr)
    keys = key_dtype_table(args.tokens_per_rank, args.key_cp)
    print("scaling ...", file=sys.stderr)
    scaling = scaling_table(args.tokens_per_rank, args.scaling_cps, args.ratios, args.mean_doc, args.seeds, Dims())
    print("copies and peak memory ...", file=sys.stderr)
    memory = {f"{r}/{e}": layer_memory(r, e, LayerDims(tokens_per_rank=64, hidden=128, head_dim=32) if args.smoke else LayerDims())
              for r in args.ratios for e in ("allgather", "need")}
    walls: dict[str, float] = {}
    if not args.skip_wall:
        print(f"wall time at cp {args.wall_cp} ...", file=sys.stderr)
        cu = lognormal_cu_seqlens(args.wall_tokens, max(args.wall_tokens // 8, 1), seed=1)
        cu[-1] += -int(cu[-1]) % args.wall_cp
        walls = wall_times(cu, args.wall_cp, args.ratios)
    rings: dict[str, float] = {}
    if not args.skip_wall:
        print(f"ring rounds at cp {args.wall_cp} ...", file=sys.stderr)
        long_docs = lognormal_cu_seqlens(args.wall_tokens, args.wall_tokens // 2, seed=2)
        long_docs[-1] += -int(long_docs[-1]) % args.wall_cp
        rings = ring_times(long_docs, args.wall_cp, [1, 2, 4])
    print("kv heads ...", file=sys.stderr)
    heads = heads_table(args.heads_tokens, args.heads_cp)
    print("load balance ...", file=sys.stderr)
    balance = balance_table(args.tokens_per_rank, sorted({2, 3, 4, 8} | set(args.cps)), args.mean_doc)
    report = render(traffic, planning, walls, args, balance, rings, scaling, memory, plans, keys, heads)
    if args.plot is not None and plot(traffic, args.plot):
        report += f"\n![bytes received by the busiest rank]({args.plot.name})\n"
    report += "\nGPU (CUDA backend) checks and timings: [gpu_check.md](gpu_check.md).\n"
    print(report)
    if args.out is not None:
        old = args.out.read_text() if args.out.exists() else ""
        for kept in (layouts.existing_section(old), memory_report.kept_section(old)):  # sections from their own runs
            report += "\n" + kept if kept else ""
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        print(f"wrote {args.out}", file=sys.stderr)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
