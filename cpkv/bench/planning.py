"""Planning time: the vectorised planner against a straightforward per-document loop."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
from torch import Tensor

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
