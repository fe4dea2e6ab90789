"""``python -m cpkv.bench layouts``: contiguous, zigzag and balanced layouts under both exchanges.

For every layout (zigzag: documents padded to multiples of ``2*cp``) and a DeepSeek-V4 layer
stack (:class:`~cpkv.plan.balance.CostModel`: its layer counts, window and compress ratios):

* the modeled cost per rank (max/mean, :func:`~cpkv.plan.balance.rank_costs`; the same under
  both exchanges: the exchange moves rows, it does not change the attention work);
* the bytes every rank receives in the forward of the stack, against that layout's physical
  limit. ``need``: the row counts of the real plans' routes (``plan.kv[W].halo``,
  ``plan.compressed[m].hidden`` and ``.entries``), times the row bytes. ``allgather``:
  MindSpeed's scheme (every remote kv row, plus every remote hidden row for a compressed
  layer, as :mod:`cpkv.bench.traffic` counts it). The limit, :func:`limit_rows`, is computed
  from the layout's token sets alone (independent of the planner): the distinct remote kv
  rows the rank's queries' windows read, the remote hidden rows its owned blocks' compressor
  reads, and the remote compressed entries (and at the CSA ratio their indexer keys) visible
  to its queries; an entry is owned by the rank holding its block's last token.

It writes a section of ``docs/benchmarks.md`` (between :data:`BEGIN` and :data:`END`; the main
bench keeps it) and ``docs/layouts.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from cpkv.bench.balance import pad_for_zigzag
from cpkv.bench.traffic import Dims, lognormal_cu_seqlens
from cpkv.plan.attention import AttentionPlan, plan_attention
from cpkv.plan.balance import CostModel, balanced_layout, rank_costs
from cpkv.plan.layouts import ShardLayout, contiguous_layout, expand_ranges, zigzag_layout

BEGIN = "<!-- layouts: begin (python -m cpkv.bench layouts) -->"
END = "<!-- layouts: end -->"
LAYOUTS = ("contiguous", "zigzag", "balanced")


@dataclass(frozen=True)
class StackRows:
    """Rows one rank receives in the forward of one layer of each kind.

    Attributes:
        window: kv rows of the sliding window (every layer).
        hidden: per compress ratio, compressor-input (hidden) rows.
        entries: per compress ratio, compressed entries (with their indexer keys at the CSA ratio).
    """

    window: int
    hidden: dict[int, int]
    entries: dict[int, int]


def stack_bytes(rows: StackRows, cost: CostModel, dims: Dims) -> int:
    """Bytes of ``rows`` over the whole layer stack of ``cost`` (every layer attends its window)."""
    kv, hidden = dims.kv_dim * dims.element_bytes, dims.hidden * dims.element_bytes
    total = (cost.swa_layers + cost.csa_layers + cost.hca_layers) * rows.window * kv
    for ratio, layers, entry in ((cost.csa_ratio, cost.csa_layers, kv + dims.key_row_bytes()),
                                 (cost.hca_ratio, cost.hca_layers, kv)):
        total += layers * (rows.hidden.get(ratio, 0) * hidden + rows.entries.get(ratio, 0) * entry)
    return total


def allgather_bytes(layout: ShardLayout, rank: int, cost: CostModel, dims: Dims) -> int:
    """Forward bytes of MindSpeed's all-gather over the stack: every remote kv row, and hidden row when compressed."""
    remote = layout.num_tokens - layout.local_lens[rank]
    compressed = cost.csa_layers + cost.hca_layers
    layers = cost.swa_layers + compressed
    return remote * dims.element_bytes * (layers * dims.kv_dim + compressed * dims.hidden)


def _remote_count(candidates: Tensor, starts: Tensor, ends: Tensor) -> int:
    """Distinct ``candidates`` (global tokens) outside the ranges ``[starts, ends)`` (sorted, disjoint)."""
    tokens = torch.unique(candidates)
    slot = torch.searchsorted(starts, tokens, right=True) - 1
    held = (slot >= 0) & (tokens < ends.index_select(0, slot.clamp(min=0)))
    return int((~held).sum())


def _spans(lo: Tensor, hi: Tensor) -> Tensor:
    """The integers of every interval ``[lo[i], hi[i])`` (empty ones skipped), concatenated."""
    keep = hi > lo
    return expand_ranges(lo[keep], hi[keep])


def limit_rows(layout: ShardLayout, rank: int, window: int, prev_blocks: dict[int, int]) -> StackRows:
    """The fewest rows ``rank`` must receive per layer kind, by set arithmetic on the layout's token ranges.

    Independent of the planner. With the rank's ranges ``[a, b)`` in documents ``[s, e)``:

    * window: the distinct tokens of ``[max(s, a - W + 1), a)`` over its ranges that it does not hold
      (no query of a range reaches further back);
    * entries (ratio ``m``): entry ``k`` of a document (block ``[s + k*m, s + (k+1)*m)``) is visible to
      the rank's queries if its last token is at most the rank's last query in that document, and
      owned by the rank holding that last token: ``(q_max - s + 1) // m`` visible minus the owned;
    * hidden: the distinct tokens the compressor of its owned entries reads (entry ``k`` reads
      ``[max(s, s + (k - prev)*m), s + (k+1)*m)``) that it does not hold.

    Args:
        layout: any layout. rank: the rank. window: ``W`` (own token plus ``W - 1`` before).
        prev_blocks: per compress ratio ``m``, the earlier blocks its compressor reads (V4: 1 at 4).
    """
    starts, ends = layout.ranges_of(rank)
    first = layout.cu_seqlens.index_select(0, layout.documents[int(layout.offsets[rank]):int(layout.offsets[rank + 1])])
    window_rows = _remote_count(_spans(torch.maximum(starts - (window - 1), first), starts), starts, ends)
    # The rank's last query in each document it touches: the end of its last range there.
    doc_first, slot = torch.unique(first, return_inverse=True)
    last_query = torch.full_like(doc_first, -1).scatter_reduce_(0, slot, ends - 1, "amax")
    hidden, entries = {}, {}
    for ratio, prev in prev_blocks.items():
        owned = torch.div(ends - first, ratio, rounding_mode="floor") - torch.div(starts - first, ratio, rounding_mode="floor")
        visible = torch.div(last_query - doc_first + 1, ratio, rounding_mode="floor")
        entries[ratio] = int(visible.sum() - owned.sum())
        # The first owned entry of a range ends at the first block end >= a; it reads (prev + 1) blocks back.
        first_last = first + (torch.div(starts - first, ratio, rounding_mode="floor") + 1) * ratio - 1
        lo = torch.maximum(first_last + 1 - (prev + 1) * ratio, first)
        hidden[ratio] = _remote_count(_spans(lo, torch.where(owned > 0, starts, lo)), starts, ends)
    return StackRows(window_rows, hidden, entries)


def need_rows(plan: AttentionPlan, window: int, ratios: tuple[int, ...]) -> StackRows:
    """Rows the need exchange's routes bring to the rank (one round: ``ring_degree`` 1)."""
    halo = plan.kv[window].halo
    assert halo is not None  # ring_degree 1
    return StackRows(halo.num_recv, {r: plan.compressed[r].hidden.num_recv for r in ratios},
                     {r: plan.compressed[r].entries.num_recv for r in ratios})


def make_layout(name: str, cu: Tensor, cp: int, cost: CostModel) -> tuple[ShardLayout, Tensor, int]:
    """``(layout, its cu_seqlens, padding tokens)``: zigzag pads to multiples of ``2*cp``, contiguous to ``T % cp``."""
    if name == "zigzag":
        padded, pad = pad_for_zigzag(cu, cp)
        return zigzag_layout(padded, cp), padded, pad
    if name == "contiguous":
        pad = -int(cu[-1]) % cp
        padded = cu.clone()
        padded[-1] += pad  # the last document absorbs T % cp (0 in this bench's batches)
        return contiguous_layout(padded, cp), padded, pad
    return balanced_layout(cu, cp, cost), cu, 0


@dataclass(frozen=True)
class LayoutRun:
    """One layout of one batch at one cp: cost balance, and every rank's forward bytes of the stack.

    Attributes:
        layout, cp, padding: the layout, ranks, padding tokens it needed.
        cost_ratio, token_ratio: max/mean over ranks of the modeled cost and of the tokens held.
        ranges: most ranges on one rank. limit, allgather: ``[cp]`` bytes (physical limit,
            MindSpeed all-gather). need: ``[cp]`` bytes of the need plans, ``None`` where the
            planner refused (``note``: its message).
    """

    layout: str
    cp: int
    padding: int
    cost_ratio: float
    token_ratio: float
    ranges: int
    limit: list[int]
    allgather: list[int]
    need: list[int] | None
    note: str


def layout_run(name: str, cu: Tensor, cp: int, cost: CostModel, dims: Dims) -> LayoutRun:
    """Cost balance and forward bytes of every rank of one layout (the need plans from :func:`plan_attention`)."""
    layout, padded, pad = make_layout(name, cu, cp, cost)
    costs = rank_costs(layout, cost)
    lens = torch.tensor(layout.local_lens, dtype=torch.float64)
    ratios = (cost.csa_ratio, cost.hca_ratio)
    prev = {cost.csa_ratio: 1, cost.hca_ratio: 0}  # DeepSeek-V4's compressors (plan_attention's default)
    limits = [stack_bytes(limit_rows(layout, r, cost.window, prev), cost, dims) for r in range(cp)]
    gathered = [allgather_bytes(layout, r, cost, dims) for r in range(cp)]
    need: list[int] = []
    note = ""
    for rank in range(cp):
        try:
            plan = plan_attention(padded, cp, rank, layout=name, exchange="need",  # type: ignore[arg-type]
                                  windows=[cost.window, None], compress_ratios=list(ratios))
        except (ValueError, NotImplementedError) as error:
            note = str(error).split("\n")[0]
            break
        if plan.local_len != layout.local_lens[rank]:
            raise RuntimeError(f"{name}: the plan of rank {rank} holds {plan.local_len} tokens, the layout {layout.local_lens[rank]}")
        need.append(stack_bytes(need_rows(plan, cost.window, ratios), cost, dims))
    return LayoutRun(name, cp, pad, float(costs.max() / costs.mean()), float(lens.max() / lens.mean()),
                     int(layout.offsets.diff().max()), limits, gathered, None if note else need, note)


def _worst_ratio(values: list[int], limits: list[int]) -> float:
    ratios = [v / lim if lim else (1.0 if v == 0 else float("inf")) for v, lim in zip(values, limits)]
    return max(ratios)


def layouts_table(tokens: int, cps: list[int], mean_doc: int, seeds: int, cost: CostModel, dims: Dims) -> list[dict[str, object]]:
    """One row per (batch, cp, layout), the log-normal seeds folded (worst seed)."""
    batches = [("one document", [torch.tensor([0, tokens])])]
    batches.append((f"log-normal, {seeds} seeds", [lognormal_cu_seqlens(tokens, mean_doc, seed=s) for s in range(seeds)]))
    rows: list[dict[str, object]] = []
    jobs = [(b, cp, name) for b in batches for cp in cps for name in LAYOUTS]
    for i, ((batch, cus), cp, name) in enumerate(jobs):
        print(f"\r[{i}/{len(jobs)}] layouts: {batch}, cp {cp}, {name:<12}", end="", file=sys.stderr, flush=True)
        runs = [layout_run(name, cu, cp, cost, dims) for cu in cus]
        needs = [r.need for r in runs if r.need is not None]
        complete = len(needs) == len(runs)
        rows.append({
            "batch": batch, "layout": name, "cp": cp, "padding": max(r.padding for r in runs),
            "cost_ratio": max(r.cost_ratio for r in runs), "token_ratio": max(r.token_ratio for r in runs),
            "ranges": max(r.ranges for r in runs), "limit_max": max(max(r.limit) for r in runs),
            "allgather_max": max(max(r.allgather) for r in runs),
            "need_max": max(max(n) for n in needs) if complete else None,
            "need_ratio": max(_worst_ratio(r.need, r.limit) for r in runs if r.need is not None) if complete else None,
            "note": next((r.note for r in runs if r.note), ""),
        })
    print(f"\r[{len(jobs)}/{len(jobs)}] layouts: done{' ' * 40}", file=sys.stderr)
    return rows


def planning_times(tokens_per_rank: int, cps: list[int], mean_doc: int, repeats: int, cost: CostModel) -> list[tuple[str, int, float]]:
    """``(batch, cp, median seconds)`` of :func:`balanced_layout` on one thread, ``tokens_per_rank * cp`` tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for cp in cps:
            total = tokens_per_rank * cp
            for batch, cu in (("one document", torch.tensor([0, total])),
                              (f"log-normal (mean {mean_doc:,})", lognormal_cu_seqlens(total, mean_doc, seed=0))):
                balanced_layout(cu, cp, cost)  # warm-up
                times = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    balanced_layout(cu, cp, cost)
                    times.append(time.perf_counter() - start)
                out.append((batch, cp, statistics.median(times)))
    finally:
        torch.set_num_threads(threads)
    return out


def _mib(value: object) -> str:
    return f"{float(str(value)) / 2**20:,.1f}"


def render(rows: list[dict[str, object]], times: list[tuple[str, int, float]], args: argparse.Namespace,
           cost: CostModel) -> str:
    """The markdown section from :data:`BEGIN` (the caller closes it with :data:`END`)."""
    lines = [
        BEGIN, "## Layouts: modeled cost and bytes per rank (contiguous, zigzag, balanced)", "",
        f"`python -m cpkv.bench layouts`: {args.tokens:,} tokens at every cp: one document, and log-normal packs (mean"
        f" {args.mean_doc:,}, {args.seeds} seeds: the worst seed of each column). Cost: `CostModel()` (DeepSeek-V4-Flash:"
        f" {cost.csa_layers} CSA + {cost.hca_layers} HCA layers, window {cost.window}, top-k {cost.index_topk}, indexer"
        f" {cost.index_heads}x{cost.index_head_dim}), per rank, the same under both exchanges. Bytes: forward of the whole"
        " stack, busiest rank, V4-Flash dims (hidden 4096, kv 512, fp32 indexer keys, bf16). `limit`: the layout's own"
        " physical limit from set arithmetic on its token sets (`cpkv/bench/layouts.py`, independent of the planner);"
        " `need / limit`: worst rank. zigzag pads every document to a multiple of `2*cp` (padding tokens are computed"
        " and counted); balanced needs no padding.", "",
        "| batch | cp | layout | padding | cost max/mean | tokens max/mean | ranges/rank | allgather MiB | allgather / limit |"
        " need MiB | limit MiB | need / limit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        limit = float(str(row["limit_max"]))
        gathered = float(str(row["allgather_max"]))
        if row["need_max"] is None:
            need, ratio = "n/a", "n/a"
        else:
            need, ratio = _mib(row["need_max"]), f"{float(str(row['need_ratio'])):.3f}"
        lines.append(
            f"| {row['batch']} | {row['cp']} | {row['layout']} | {row['padding']} | {float(str(row['cost_ratio'])):.3f} |"
            f" {float(str(row['token_ratio'])):.3f} | {row['ranges']} | {_mib(gathered)} |"
            f" {gathered / limit if limit else float('inf'):,.0f} | {need} | {_mib(limit)} | {ratio} |"
        )
    notes = sorted({str(r["note"]) for r in rows if r["need_max"] is None and r["note"]})
    if notes:
        lines += ["", "`n/a`: the planner refused the need exchange for this layout: " + "; ".join(f"\"{n}\"" for n in notes)]
    lines += [
        "", f"`balanced_layout` planning time, {args.plan_tokens:,} tokens per rank, one thread, median of"
        f" {args.plan_repeats}:", "", "| batch | cp | tokens | ms |", "|---|---|---|---|",
    ]
    lines += [f"| {batch} | {cp} | {args.plan_tokens * cp:,} | {seconds * 1e3:.1f} |" for batch, cp, seconds in times]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, object]], path: Path) -> bool:
    """Cost max/mean and forward bytes of the busiest rank vs cp, per batch, layout and exchange."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    batches = list(dict.fromkeys(str(r["batch"]) for r in rows))
    fig, axes = plt.subplots(2, len(batches), figsize=(6 * len(batches), 8), squeeze=False)
    colors = {"contiguous": "tab:blue", "zigzag": "tab:orange", "balanced": "tab:green"}
    for col, batch in enumerate(batches):
        for name in LAYOUTS:
            sel = [r for r in rows if r["batch"] == batch and r["layout"] == name]
            cps = [int(str(r["cp"])) for r in sel]
            axes[0][col].plot(cps, [float(str(r["cost_ratio"])) for r in sel], marker="o", color=colors[name], label=name)
            ax = axes[1][col]
            ax.plot(cps, [float(str(r["allgather_max"])) / 2**20 for r in sel], "--", marker="o", color=colors[name],
                    label=f"{name}, allgather")
            need = [(c, float(str(r["need_max"])) / 2**20) for c, r in zip(cps, sel) if r["need_max"] is not None]
            if need:
                ax.plot([c for c, _ in need], [v for _, v in need], "-", marker="o", color=colors[name], label=f"{name}, need")
            ax.plot(cps, [float(str(r["limit_max"])) / 2**20 for r in sel], ":", color=colors[name], label=f"{name}, limit")
        for row_axes, ylabel in ((axes[0][col], "modeled cost max/mean"), (axes[1][col], "forward MiB, busiest rank")):
            row_axes.set_xscale("log", base=2)
            cps_all = sorted({int(str(r["cp"])) for r in rows})
            row_axes.set_xticks(cps_all, [str(c) for c in cps_all])
            row_axes.set(xlabel="cp", ylabel=ylabel, title=batch)
            row_axes.grid(True, which="both", alpha=0.3)
        axes[1][col].set_yscale("log")
    axes[0][-1].legend(fontsize=8)
    axes[1][-1].legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def replace_section(text: str, section: str) -> str:
    """``text`` with its :data:`BEGIN`..:data:`END` section replaced by ``section`` (appended if absent)."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + section.rstrip("\n") + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + section


def existing_section(text: str) -> str:
    """The :data:`BEGIN`..:data:`END` section of ``text`` (with its markers), or ``""``."""
    if BEGIN not in text or END not in text:
        return ""
    return BEGIN + text.split(BEGIN, 1)[1].split(END, 1)[0] + END + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options of ``python -m cpkv.bench layouts`` (``--smoke``: tiny sizes, for tests)."""
    parser = argparse.ArgumentParser(prog="python -m cpkv.bench layouts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens of every batch, at every cp")
    parser.add_argument("--cps", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--mean-doc", type=int, default=8192)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--plan-tokens", type=int, default=131072, help="tokens per rank of the planning-time table")
    parser.add_argument("--plan-repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--plot", type=Path, default=Path("docs/layouts.png"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.cps, args.mean_doc, args.seeds, args.plan_tokens, args.plan_repeats = 4096, [2, 4], 256, 2, 512, 1
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure, print the section, write it into ``--out`` and the figure to ``--plot``; 0 on success."""
    args = parse_args(argv)
    start = time.perf_counter()
    cost, dims = CostModel(), Dims()
    rows = layouts_table(args.tokens, args.cps, args.mean_doc, args.seeds, cost, dims)
    print("balanced planning time ...", file=sys.stderr)
    times = planning_times(args.plan_tokens, args.cps, args.mean_doc, args.plan_repeats, cost)
    section = render(rows, times, args, cost)
    if plot(rows, args.plot):
        section += f"\n![modeled cost and forward bytes per layout]({args.plot.name})\n"
    section += END + "\n"
    old = args.out.read_text() if args.out.exists() else "# Benchmarks\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(replace_section(old, section))
    print(section)
    print(f"wrote the layouts section of {args.out} in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0
