"""Spawn a small CPU process group (gloo) and run one function on every rank.

Used by the tests, the demo and the notebooks: each call starts ``world_size``
fresh processes, initialises ``torch.distributed`` with a file store, runs
``fn(rank, world_size, *args)`` on every rank and returns the per-rank results.
A rank that raises, dies or exceeds ``timeout`` fails the whole call quickly
instead of hanging. Results travel back through ``torch.save`` bytes, so
returning tensors is safe.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  (before init_process_group: see cpkv.collectives)


class RankError(RuntimeError):
    """A rank raised: carries the rank and the remote traceback text."""


def _worker(
    fn: Callable[..., Any], rank: int, world_size: int, store_path: str, timeout: float,
    args: tuple[Any, ...], results: Any,
) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level (picklable) function; its return value must be ``torch.save``-able.
        world_size: number of processes (1 is allowed and still initialises a group).
        args: extra positional arguments, pickled to every rank.
        timeout: seconds for the whole run, and for every collective inside it.

    Returns:
        ``[result_of_rank_0, ..., result_of_rank_{world_size-1}]``.

    Raises:
        TypeError: ``fn`` lives in an interactive ``__main__`` (a notebook), which spawned
            processes cannot import.
        RankError: a rank raised (the message holds its traceback) or died.
        TimeoutError: the ranks did not all finish within ``timeout`` (all are killed).
    """
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise TypeError(
            f"fn={getattr(fn, '__name__', fn)!r} is defined in an interactive __main__ (a notebook or REPL), which"
            " spawned ranks cannot import: define it in a module (e.g. examples/cp_helpers.py) and import it"
        )
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, world_size, store, timeout, args, results), daemon=True)
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, results, world_size, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> list[Any]:
    import time

    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(values))
            raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
        try:
            rank, ok, payload = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in values]
            if dead:
                raise RankError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
            continue
        if not ok:
            raise RankError(f"rank {rank} raised:\n{payload}")
        values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [values[r] for r in range(world_size)]
