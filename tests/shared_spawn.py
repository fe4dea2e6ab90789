"""One spawned gloo group per world size for the multi-rank checks of every test module.

Spawning ``w`` ranks costs each rank a fresh interpreter, its imports of torch, cpkv (and, for
the Hugging Face tests, transformers) and its first calls: a bare spawn took 2-9 s at 1-4
ranks, 6-12 s with transformers, on two busy cores, and a Hugging Face test's spawn far more
than its checks. So a test module registers each
rank-side function at import time with :func:`shared_spawn` (the arguments of
:func:`cpkv.launch.spawn`), and the first test that needs a check's results spawns one group
of that size for every registered check of that size whose module has a selected test;
each rank runs the checks one after another, and the results wait in this process for the
tests that read them (:meth:`SharedCheck.run`).

Each check keeps what its own spawn gave it:

* the same ``fn(rank, world, *args)`` on every rank, its return values per rank;
* the state of a fresh rank where a check could see the difference: torch's default random
  generator reseeded as a new process seeds it, and ``os.environ``, the default dtype, grad
  mode, deterministic algorithms and torch's thread count as they were before it; Dynamo's
  caches cleared after it. A barrier starts it on every rank together;
* its timeout: a rank still inside the check after ``timeout`` seconds dumps its stack and
  exits, and the check fails naming itself (the timeout bounds collectives too, so a hang
  fails as fast as before);
* its own failure: a check that raises or times out fails, naming the check and the rank,
  with the rank's traceback; the checks before it keep their results, the ones after it run
  in a new spawn.

While the shared group runs, the calling test's pytest-timeout alarm is paused (the group
runs other tests' checks, each bounded by its own timeout) and resumed afterwards.

Checks that need processes of their own stay with :func:`cpkv.launch.spawn`: one that leaves
the group broken (a rank leaving during its peer's collective, tests/test_agreement.py), the
compile tests (tests/test_compile.py and the compiled model of
tests/integrations/test_transformers_lm.py: Dynamo's global configuration, inductor's workers),
the Triton interpreter's (tests/backends/test_triton_cp.py, test_triton_backend.py: the
interpreter is patched in the ranks), and the runs of examples and demos (their own launchers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cpkv.launch import RankError, spawn

START_SECONDS = 120.0  # the group's start (imports, process group) before its first check


@dataclasses.dataclass(frozen=True)
class SharedCheck:
    """``fn(rank, world, *args)`` on a ``world``-rank group shared with the other modules' checks of that size."""

    name: str
    owner: str  # the registering test module
    fn: Callable[..., Any]
    world: int
    args: tuple[Any, ...]
    timeout: float

    def run(self, request: pytest.FixtureRequest) -> list[Any]:
        """The check's per-rank results (``[rank 0's, ...]``); raises :class:`CheckFailed` naming it."""
        if self.name not in _OUTCOMES:
            _run_group(self, request)
        ok, value = _OUTCOMES[self.name]
        if not ok:
            raise CheckFailed(value)
        return value  # type: ignore[no-any-return]


class CheckFailed(RuntimeError):
    """A shared check raised or timed out on a rank (the message names the check and the rank)."""


@dataclasses.dataclass(frozen=True)
class TmpPath:
    """An argument of :func:`shared_spawn` that becomes a new directory's path (``tmp_path_factory.mktemp(name)``)."""

    name: str


_CHECKS: dict[str, SharedCheck] = {}
_OUTCOMES: dict[str, tuple[bool, Any]] = {}


def shared_spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float, name: str = "") -> SharedCheck:
    """Register ``fn`` to run on the shared ``world``-rank group (call at a test module's import).

    ``name`` tells two registrations of one ``fn`` at one world size apart; a :class:`TmpPath` among
    ``args`` reaches ``fn`` as the path (``str``) of a new directory.
    """
    owner = sys._getframe(1).f_globals["__name__"]
    key = f"{owner}:{fn.__qualname__}{f'[{name}]' if name else ''}@world{world}"
    check = SharedCheck(key, owner, fn, world, args, timeout)
    _CHECKS.setdefault(key, check)
    return _CHECKS[key]


def _selected_owners(request: pytest.FixtureRequest) -> set[str]:
    return {module.__name__ for item in request.session.items if (module := getattr(item, "module", None)) is not None}


def _run_group(wanted: SharedCheck, request: pytest.FixtureRequest) -> None:
    """Spawn the group of ``wanted``'s size for every pending check of that size whose module has a selected test."""
    owners = _selected_owners(request) | {wanted.owner}
    factory = request.getfixturevalue("tmp_path_factory")
    pending = [dataclasses.replace(c, args=tuple(str(factory.mktemp(a.name)) if isinstance(a, TmpPath) else a for a in c.args))
               for c in _CHECKS.values() if c.world == wanted.world and c.owner in owners and c.name not in _OUTCOMES]
    with _paused_test_alarm():
        while pending:
            done = _spawn_once(pending)
            pending = pending[done:]


def _spawn_once(checks: list[SharedCheck]) -> int:
    """One spawn running ``checks`` in turn; records the outcome of each check it got to; returns how many."""
    world = checks[0].world
    with tempfile.TemporaryDirectory() as tmp:
        error: BaseException | None = None
        try:
            spawn(_ranks, world, checks, tmp, timeout=START_SECONDS + sum(c.timeout for c in checks))
        except (RankError, TimeoutError) as caught:
            error = caught
        out = Path(tmp)
        for index, check in enumerate(checks):
            files = [out / f"{index}.{rank}.pt" for rank in range(world)]
            if all(f.exists() for f in files):
                _OUTCOMES[check.name] = (True, [torch.load(f, weights_only=False) for f in files])
                continue
            reports = [p.read_text() for rank in range(world) for p in (out / f"{index}.{rank}.failed",) if p.exists()]
            detail = "\n".join(reports) if reports else f"{type(error).__name__}: {error}"
            _OUTCOMES[check.name] = (False, f"shared check {check.name} failed:\n{detail}")
            return index + 1
    return len(checks)


@contextlib.contextmanager
def _paused_test_alarm() -> Iterator[None]:
    """pytest-timeout's SIGALRM timer (its ``signal`` method) stopped meanwhile, restarted with the time it had left."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    left, _ = signal.getitimer(signal.ITIMER_REAL)
    if left:
        signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if left:
            signal.setitimer(signal.ITIMER_REAL, left)


# --- on every rank ---------------------------------------------------------------------------


class _Watchdog:
    """Ends the rank when the running check passes its timeout, after writing which check and the rank's stack."""

    def __init__(self, rank: int) -> None:
        self.rank, self.deadline, self.report = rank, float("inf"), Path()
        self.check: SharedCheck | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    @contextlib.contextmanager
    def limit(self, check: SharedCheck, report: Path) -> Iterator[None]:
        self.check, self.report, self.deadline = check, report, time.monotonic() + check.timeout
        try:
            yield
        finally:
            self.deadline = float("inf")

    def _watch(self) -> None:
        while time.monotonic() <= self.deadline:
            time.sleep(0.2)
        assert self.check is not None
        with open(self.report, "w") as f:
            f.write(f"rank {self.rank}: did not finish within {self.check.timeout:.0f} s (killed); its stack:\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        os._exit(3)


@contextlib.contextmanager
def _fresh_state(seed: int) -> Iterator[None]:
    """What a new rank process would give the check (see the module docstring)."""
    environ, dtype, grad = dict(os.environ), torch.get_default_dtype(), torch.is_grad_enabled()
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()


def _ranks(rank: int, world: int, checks: list[SharedCheck], out: str) -> None:
    """Every check in turn on this rank; each one's result to ``out/<index>.<rank>.pt`` (the spawn returns nothing)."""
    import torch.distributed as dist

    seed = torch.initial_seed()  # a fresh process's: reseeding with it restores the generator a new rank starts with
    watchdog = _Watchdog(rank)
    for index, check in enumerate(checks):
        report = Path(out) / f"{index}.{rank}.failed"
        with watchdog.limit(check, report), _fresh_state(seed):
            dist.barrier()
            try:
                value = check.fn(rank, world, *check.args)
            except BaseException:
                report.write_text(f"rank {rank} raised:\n{traceback.format_exc()}")
                raise
        partial = Path(out) / f"{index}.{rank}.partial"
        torch.save(value, partial)
        partial.rename(Path(out) / f"{index}.{rank}.pt")
