"""``python -m cpkv.bench``: bytes per rank, planning time and wall time, in one run.

Writes ``docs/benchmarks.md`` and ``docs/benchmarks.png`` (``--out``, ``--plot``) and
prints the same tables. ``--smoke`` runs tiny sizes (used by the tests).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from cpkv.bench.balance import pad_for_zigzag, rank_work
from cpkv.bench.planning import planning_times, random_documents
from cpkv.bench.traffic import Dims, layer_traffic, lognormal_cu_seqlens
from cpkv.bench.walltime import ring_times, wall_times

MODE_NAMES = {0: "NO_COMPRESS (window 128)", 4: "INDEXER (ratio 4)", 128: "COMPRESSOR_ONLY (ratio 128)"}
TARGETS = {0: 1 / 1000, 4: 1 / 16, 128: 1 / 200}


def _progress(done: int, total: int, label: str) -> None:
    filled = int(30 * done / max(total, 1))
    print(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {label:<40}", end="", file=sys.stderr, flush=True)
    if done == total:
        print(file=sys.stderr)


def traffic_table(tokens_per_rank: int, cps: list[int], ratios: list[int], mean_doc: int, dims: Dims) -> list[dict[str, object]]:
    """One row per (scenario, cp, ratio): bytes received per rank (max, mean) for both strategies."""
    rows: list[dict[str, object]] = []
    jobs = [(s, cp, r) for s in ("one document", "log-normal docs") for cp in cps for r in ratios]
    for i, (scenario, cp, ratio) in enumerate(jobs):
        _progress(i, len(jobs), f"bytes: {scenario}, cp {cp}, ratio {ratio}")
        total = tokens_per_rank * cp
        cu = torch.tensor([0, total]) if scenario == "one document" else lognormal_cu_seqlens(total, mean_doc, seed=cp)
        row: dict[str, object] = {"scenario": scenario, "cp": cp, "ratio": ratio}
        for strategy in ("allgather", "need"):
            counts = [layer_traffic(cu, cp, rank, ratio, strategy, dims) for rank in range(cp)]
            received = [c[0] for c in counts]
            row[f"{strategy}_max"], row[f"{strategy}_mean"] = max(received), sum(received) / cp
            row[f"{strategy}_copied"] = max(c[1] for c in counts)
        rows.append(row)
    _progress(len(jobs), len(jobs), "bytes: done")
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


def render(traffic: list[dict[str, object]], planning: tuple[float, float, float], walls: dict[str, float],
           args: argparse.Namespace, balance: list[dict[str, object]] | None = None,
           rings: dict[str, float] | None = None) -> str:
    """The markdown report."""
    lines = [
        "# Benchmarks", "",
        f"Measured {date.today().isoformat()} by `python -m cpkv.bench` on {platform.machine()},"
        f" {torch.get_num_threads()} CPU threads, torch {torch.__version__} (a small shared machine: read ratios, not absolutes).", "",
        "## Bytes received per rank per layer (forward + backward)", "",
        f"DeepSeek-V4-Flash dimensions (hidden 4096, one shared kv head of 512, indexer keys 128, window 128, bf16),"
        f" {args.tokens_per_rank:,} tokens per rank. Counted on the real collective calls of the exchange code"
        " (`gather_from_sp_cp` / `exchange_rows`) run on meta tensors of the true sizes in a fake process group;"
        " `allgather` is MindSpeed's scheme (kv, plus hidden states for compressed layers, gathered; prefix"
        " re-compressed on every rank). MiB; max and mean over ranks; `need/allgather` compares the busiest ranks.", "",
        "| scenario | cp | layer | allgather max | allgather mean | need max | need mean | need/allgather | target | prefix copy MiB (allgather / need) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in traffic:
        ratio = int(str(row["ratio"]))
        share = float(str(row["need_max"])) / max(float(str(row["allgather_max"])), 1.0)
        target = TARGETS.get(ratio, 1.0)
        verdict = "met" if share <= target else "MISSED"
        lines.append(
            f"| {row['scenario']} | {row['cp']} | {MODE_NAMES.get(ratio, ratio)} | {_mib(row['allgather_max'])} |"
            f" {_mib(row['allgather_mean'])} | {_mib(row['need_max'])} | {_mib(row['need_mean'])} | {share:.2e} |"
            f" <= {target:.2e} ({verdict if row['cp'] == 8 else 'cp 8 only'}) |"
            f" {_mib(row['allgather_copied'])} / {_mib(row['need_copied'])} |"
        )
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
    if walls:
        lines += [
            "", "## Wall time, forward + backward, CPU gloo", "",
            f"The small V4-style layer (hidden 64, 4 heads, window 128) at cp {args.wall_cp}, {args.wall_tokens:,} packed"
            " log-normal tokens, reference backend; slowest rank, best of 3. Two cores shared by all ranks.", "",
            "| layer | allgather s | need s | allgather / need |", "|---|---|---|---|",
        ]
        for ratio in args.ratios:
            a, n = walls[f"{ratio}/allgather"], walls[f"{ratio}/need"]
            lines.append(f"| {MODE_NAMES.get(ratio, ratio)} | {a:.3f} | {n:.3f} | {a / n:.2f}x |")
    if rings:
        lines += [
            "", "## ring_degree: rounds of the kv exchange", "",
            f"Dense causal V4-style layer (hidden 64, head dim 32, fp32) at cp {args.wall_cp}, {args.wall_tokens:,} tokens"
            " in long log-normal documents, `exchange=\"need\"`. Largest round = received kv of the largest single"
            " round (R = 1: the whole halo), busiest rank, from the plan's routes (which the bytes test checks against"
            " counted traffic). Rounds run one after the other (no prefetch of the next round), so this is the remote"
            " kv held at once. Wall time: forward + backward, slowest rank, best of 3.", "",
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
                        label=f"{MODE_NAMES.get(ratio, ratio)}, {strategy}")
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", type=int, default=131072)
    parser.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--ratios", type=int, nargs="+", default=[0, 4, 128])
    parser.add_argument("--mean-doc", type=int, default=8192, help="mean document length of the log-normal batch")
    parser.add_argument("--plan-docs", type=int, default=8192)
    parser.add_argument("--plan-cp", type=int, default=8)
    parser.add_argument("--wall-cp", type=int, default=4)
    parser.add_argument("--wall-tokens", type=int, default=4096)
    parser.add_argument("--skip-wall", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--plot", type=Path, default=Path("docs/benchmarks.png"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens_per_rank, args.cps, args.mean_doc, args.plan_docs, args.wall_tokens = 512, [2, 3], 64, 256, 192
    start = time.perf_counter()
    traffic = traffic_table(args.tokens_per_rank, args.cps, args.ratios, args.mean_doc, Dims())
    print("planning ...", file=sys.stderr)
    planning = planning_times(random_documents(args.plan_docs, args.plan_cp, seed=0), args.plan_cp)
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
    print("load balance ...", file=sys.stderr)
    balance = balance_table(args.tokens_per_rank, sorted({2, 3, 4, 8} | set(args.cps)), args.mean_doc)
    report = render(traffic, planning, walls, args, balance, rings)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if plot(traffic, args.plot):
        report += f"\n![bytes received by the busiest rank]({args.plot.name})\n"
    report += "\nGPU (CUDA backend) checks and timings: [gpu_check.md](gpu_check.md).\n"
    args.out.write_text(report)
    print(report)
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
