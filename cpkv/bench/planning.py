"""Planning time: the vectorised planners against per-document loops (MindSpeed's among them)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

from cpkv.plan.attention import plan_attention
from cpkv.plan.prefix import compute_prefix_kv_cu_seqlens


def _plan_from_pairs(pairs: Iterable[tuple[int, int]], start: int, stop: int) -> tuple[list[int], list[int], int]:
    """The obvious per-document loop: ``(cu_seqlens_q, cu_seqlens_kv, kv_start)`` of ``[start, stop)``."""
    cu_q, cu_kv, kv_start = [0], [0], stop
    for s, e in pairs:
        if e <= s or s >= stop or e <= start:
            continue
        kv_start = min(kv_start, s)
        cu_q.append(cu_q[-1] + min(e, stop) - max(s, start))
        cu_kv.append(cu_kv[-1] + min(e, stop) - s)
    return cu_q, cu_kv, kv_start


def loop_plan(cu: list[int], start: int, stop: int) -> tuple[list[int], list[int], int]:
    """The loop over a host list of ints (the fastest plain Python)."""
    return _plan_from_pairs(zip(cu[:-1], cu[1:]), start, stop)


def tensor_loop_plan(cu: Tensor, start: int, stop: int) -> tuple[list[int], list[int], int]:
    """The same loop reading the ``cu_seqlens`` tensor element by element (typical first code)."""
    return _plan_from_pairs(((int(s), int(e)) for s, e in zip(cu[:-1], cu[1:])), start, stop)


def planning_times(cu: Tensor, cp: int, repeats: int = 5) -> tuple[float, float, float]:
    """Best-of-``repeats`` seconds to plan every rank: ``(vectorised, host-list loop, tensor loop)``.

    Also checks that the three agree on every rank.
    """
    total = int(cu[-1])
    local = total // cp
    host = cu.tolist()
    for rank in range(cp):
        plan = compute_prefix_kv_cu_seqlens(cu, rank * local, local)
        expected = loop_plan(host, rank * local, (rank + 1) * local)
        got = (plan.cu_seqlens_q.tolist(), plan.cu_seqlens_kv.tolist(), plan.kv_start)
        if got != expected or tensor_loop_plan(cu, rank * local, (rank + 1) * local) != expected:
            raise RuntimeError(f"planner and loops disagree on rank {rank}")
    best = [float("inf")] * 3
    for _ in range(repeats):
        start = time.perf_counter()
        for rank in range(cp):
            compute_prefix_kv_cu_seqlens(cu, rank * local, local)
        best[0] = min(best[0], time.perf_counter() - start)
        start = time.perf_counter()
        for rank in range(cp):
            loop_plan(cu.tolist(), rank * local, (rank + 1) * local)
        best[1] = min(best[1], time.perf_counter() - start)
    start = time.perf_counter()
    for rank in range(cp):  # slow: once is enough
        tensor_loop_plan(cu, rank * local, (rank + 1) * local)
    best[2] = time.perf_counter() - start
    return best[0], best[1], best[2]


def random_documents(num_docs: int, cp: int, seed: int) -> Tensor:
    """``num_docs`` documents of 1-256 tokens (the last padded so that ``T % cp == 0``)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 257, (num_docs,), generator=gen)
    lengths[-1] += -int(lengths.sum()) % cp
    return torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])


def mindspeed_prefix_kv_cu_seqlens(actual_seq_len: list[int], cp_size: int, cp_rank: int) -> tuple[list[int], list[int]]:
    """MindSpeed's per-document loop (``_compute_prefix_kv_cu_seqlens``), re-typed from its documented behaviour.

    Walks the documents (Ascend ``actual_seq_len``: cumulative ends, no leading 0) and, for
    each one overlapping the rank's contiguous range, appends the query and kv prefix
    segment ends: ``(actual_seq_qlen, actual_seq_kvlen)`` of the rank.
    """
    local = actual_seq_len[-1] // cp_size
    a, b = cp_rank * local, (cp_rank + 1) * local
    q_ends: list[int] = []
    kv_ends: list[int] = []
    start = 0
    for end in actual_seq_len:
        if end > a and start < b and end > start:
            q_ends.append((q_ends[-1] if q_ends else 0) + min(end, b) - max(start, a))
            kv_ends.append((kv_ends[-1] if kv_ends else 0) + min(end, b) - start)
        start = end
    return q_ends, kv_ends


def per_rank_times(plan: Callable[[int], object], cp: int, repeats: int = 3) -> tuple[float, float]:
    """``(wall, cpu)`` seconds of the slowest rank's plan, best of ``repeats``, on one thread.

    ``cpu`` is this thread's CPU time (``time.thread_time``): on a machine loaded by others
    the wall time also holds the time the thread waited for a core.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        wall, cpu = 0.0, 0.0
        for rank in range(cp):
            best_wall, best_cpu = float("inf"), float("inf")
            for _ in range(repeats):
                start, start_cpu = time.perf_counter(), time.thread_time()
                plan(rank)
                best_cpu = min(best_cpu, time.thread_time() - start_cpu)
                best_wall = min(best_wall, time.perf_counter() - start)
            wall, cpu = max(wall, best_wall), max(cpu, best_cpu)
        return wall, cpu
    finally:
        torch.set_num_threads(threads)


def attention_planning_times(cu: Tensor, cp: int, repeats: int = 3) -> dict[str, tuple[float, float]]:
    """Per planner, ``(wall, cpu)`` seconds of the slowest rank on one thread (see :func:`per_rank_times`).

    Planners: MindSpeed's loop (prefix segments only), :func:`compute_prefix_kv_cu_seqlens`,
    and :func:`plan_attention` for DeepSeek-V4 (ratios 4 and 128, windows 128 and dense) with
    each exchange.
    """
    ends = cu[1:].tolist()
    local = int(cu[-1]) // cp
    v4 = {"compress_ratios": [4, 128], "windows": [128, None]}
    for rank in range(cp):
        mine = mindspeed_prefix_kv_cu_seqlens(ends, cp, rank)
        plan = compute_prefix_kv_cu_seqlens(cu, rank * local, local)
        if mine != (list(plan.actual_seq_qlen), list(plan.actual_seq_kvlen)):
            raise RuntimeError(f"MindSpeed's loop and the planner disagree on rank {rank}")
    return {
        "mindspeed": per_rank_times(lambda r: mindspeed_prefix_kv_cu_seqlens(ends, cp, r), cp, repeats),
        "prefix": per_rank_times(lambda r: compute_prefix_kv_cu_seqlens(cu, r * local, local), cp, repeats),
        "allgather": per_rank_times(lambda r: plan_attention(cu, cp, r, **v4), cp, repeats),  # type: ignore[arg-type]
        "need": per_rank_times(lambda r: plan_attention(cu, cp, r, exchange="need", **v4), cp, repeats),  # type: ignore[arg-type]
    }


def layout_planning_times(
    tokens: int, cps: list[int], mean_doc: int, repeats: int = 3
) -> list[tuple[str, int, str, float]]:
    """``(layout, cp, exchange, median seconds)`` of :func:`plan_attention` for the last rank, one thread.

    A log-normal pack of ``tokens`` (mean ``mean_doc``), DeepSeek-V4's options (ratios 4 and
    128, window 128); zigzag pads the documents to multiples of ``2 * cp``; ``custom`` is the
    balanced layout given as a ``ShardLayout``.
    """
    from cpkv.bench.balance import pad_for_zigzag
    from cpkv.bench.traffic import lognormal_cu_seqlens
    from cpkv.plan.balance import balanced_layout
    from cpkv.plan.cost import CostModel

    cu = lognormal_cu_seqlens(tokens, mean_doc, seed=0)
    options: dict[str, object] = {"compress_ratios": [4, 128], "windows": [128], "cost_model": CostModel()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for cp in cps:
            padded = pad_for_zigzag(cu, cp)[0]
            cases = {"contiguous": (cu, "contiguous"), "zigzag": (padded, "zigzag"), "balanced": (cu, "balanced"),
                     "custom": (cu, balanced_layout(cu, cp, CostModel()))}
            for name, (batch, layout) in cases.items():
                for exchange in ("allgather", "need"):
                    def run() -> None:
                        plan_attention(batch, cp, cp - 1, layout=layout, exchange=exchange, **options)  # type: ignore[arg-type]
                    run()  # warm-up
                    times = []
                    for _ in range(repeats):
                        start = time.perf_counter()
                        run()
                        times.append(time.perf_counter() - start)
                    out.append((name, cp, exchange, sorted(times)[len(times) // 2]))
    finally:
        torch.set_num_threads(threads)
    return out


def planning_lines(rows: list[tuple[str, int, str, float]], cps: list[int], tokens: int, mean_doc: int,
                   repeats: int) -> list[str]:
    """The markdown table of :func:`layout_planning_times`'s rows (ms), one row per layout and exchange."""
    lines = [f"`plan_attention`, last rank, one thread, median of {repeats}: {tokens:,} tokens, log-normal (mean {mean_doc:,}),"
             " ratios 4 and 128, window 128 (ms; `custom`: the balanced layout given as a `ShardLayout`)", "",
             "| layout | exchange | " + " | ".join(f"cp {c}" for c in cps) + " |", "|---|---|" + "---|" * len(cps)]
    for name in ("contiguous", "zigzag", "balanced", "custom"):
        for exchange in ("allgather", "need"):
            cells = [f"{t * 1e3:.1f}" for n, _, e, t in rows if n == name and e == exchange]
            lines.append(f"| {name} | {exchange} | " + " | ".join(cells) + " |")
    return lines


def planning_main(argv: list[str] | None = None) -> int:
    """``python -m cpkv.bench planning [--tokens N] [--cps ...]``: every layout's planning time, printed as a table."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cpkv.bench planning")
    parser.add_argument("--tokens", type=int, default=1 << 20)
    parser.add_argument("--cps", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--mean-doc", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = layout_planning_times(args.tokens, args.cps, args.mean_doc, args.repeats)
    print("\n".join(planning_lines(rows, args.cps, args.tokens, args.mean_doc, args.repeats)))
    return 0
