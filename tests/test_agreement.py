"""Agreed failure: a check that fails on one rank raises on every rank, and none is left hanging.

Two places where a failure can be local to some ranks:

* ``plan_attention(..., group=g)`` when one rank's own arguments are invalid (it claims another
  position in the group, passes float ``cu_seqlens``, an unplanned ratio in ``prev_blocks``,
  ``windows=[0]``, an unknown layout, ``layout="balanced"`` without ``cost_model``): 0.2.0 raised on that rank while the others waited in the
  cross-rank check's all-reduce;
* a layer call whose compressor or indexer returns what the plan does not allow (entries of the
  wrong width, one entry fewer, keys or queries of the wrong width) or raises, on the ranks
  that own entries: 0.2.0 aborted gloo, hung, or (one entry fewer) gave a wrong output.

Declarations that every rank can check (the indexer's ``key_dim`` and ``feature_dim``, its
methods) raise on every rank before any collective. Each case runs on every rank, then a
barrier proves that no rank was left inside a collective; the last call of each run is a
correct one (the group still works). Every rank's outcome is asserted.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpkv import AttentionSpec, StepStatus, attention_forward, plan_attention
from cpkv.launch import spawn
from cpkv.plan.cost import CostModel
from cpkv.plan.segments import CompressedPlan
from cpkv.plan.sharding import shard_contiguous
from cpkv.v4 import V4Attention, V4Config
from tests.shared_spawn import shared_spawn

CU = torch.tensor([0, 5, 12, 16, 24])
ZIGZAG_CU = torch.tensor([0, 12, 24])  # document lengths in multiples of 2*cp (cp 2, 3)
RUNS = [f"{layout}/{exchange}" for layout in ("contiguous", "zigzag", "balanced") for exchange in ("need", "allgather")]
ROOT = Path(__file__).resolve().parents[1]


class Spoiled:
    """A compressor (or an indexer's ``keys``/``queries``) whose output is changed by ``spoil`` on some ranks."""

    def __init__(self, inner: Any, spoil: Callable[[Any], Any], ranks: tuple[int, ...] | None = None) -> None:
        self.inner, self.spoil, self.ranks = inner, spoil, ranks
        self.ratio, self.prev_blocks, self.input_dim = inner.ratio, inner.prev_blocks, inner.input_dim
        if hasattr(inner, "key_dim"):
            self.key_dim, self.feature_dim = inner.key_dim, inner.feature_dim

    def _apply(self, value: Any) -> Any:
        return self.spoil(value) if self.ranks is None or dist.get_rank() in self.ranks else value

    def __call__(self, x: Tensor, plan: CompressedPlan) -> Tensor | None:
        return self._apply(self.inner(x, plan))  # type: ignore[no-any-return]

    def keys(self, x: Tensor, plan: CompressedPlan) -> Tensor | None:
        return self._apply(self.inner.keys(x, plan))  # type: ignore[no-any-return]

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self.inner.queries(x, positions)  # type: ignore[no-any-return]


class BadQueries(Spoiled):
    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        q, w = self.inner.queries(x, positions)
        return self._apply((q[..., :8], w))  # type: ignore[no-any-return]


def _boom(_value: Any) -> Any:
    raise RuntimeError("boom in the user's compressor")


def _plan_cases(rank: int, world: int) -> list[tuple[str, Callable[[], Any]]]:
    """One rank (the last) passes an invalid argument to plan_attention(..., group=WORLD)."""
    bad = rank == world - 1
    ok = dict(group=dist.group.WORLD)
    return [
        ("do not match the group", lambda: plan_attention(CU, world, (rank + 1) % world if bad else rank, **ok)),
        ("do not match the group", lambda: plan_attention(CU, world + 1 if bad else world, rank, **ok)),
        ("cu_seqlens must be an integer", lambda: plan_attention(CU.float() if bad else CU, world, rank, **ok)),
        ("prev_blocks names ratios", lambda: plan_attention(CU, world, rank, prev_blocks={8: 1} if bad else None, **ok)),
        ("windows[0] must be >= 1", lambda: plan_attention(CU, world, rank, windows=[0] if bad else [4], **ok)),
        ("layout must be one of", lambda: plan_attention(CU, world, rank, layout="bsnd" if bad else "contiguous", **ok)),  # type: ignore[arg-type]
        ("layout='balanced' needs the model's cost: pass cost_model=",  # never V4-Flash's cost silently
         lambda: plan_attention(CU, world, rank, layout="balanced" if bad else "contiguous", **ok)),
    ]


def _layer_cases(rank: int, world: int, run: str) -> list[tuple[str, Callable[[], Any]]]:
    """Compressor/indexer failures in a layer call (every rank, or the ranks that own entries)."""
    layout, exchange = run.split("/")
    layer = V4Attention(V4Config(compress_ratio=4, window=4, topk=4), seed=1)
    plan = plan_attention(ZIGZAG_CU if layout == "zigzag" else CU, world, rank, layout=layout, cost_model=CostModel(), exchange=exchange,  # type: ignore[arg-type]
                          compress_ratios=[4], windows=[4])
    x = plan.shard(torch.randn(24, 64, generator=torch.Generator().manual_seed(0)))
    q, kv = layer.project(x, plan.q_positions)
    spec = layer.config.spec
    compressor, indexer = layer.compressor, layer.indexer
    assert compressor is not None and indexer is not None

    def call(**modules: Any) -> Any:
        kwargs = dict(sinks=layer.sinks, hidden=x, compressor=compressor, indexer=indexer)
        kwargs.update(modules)
        out = attention_forward(q, kv, plan, None, spec=spec, **kwargs).out
        out.sum().backward()
        return out

    last = (world - 1,)
    return [
        ("compressor must return a float [N_c, 32]", lambda: call(compressor=Spoiled(compressor, lambda e: e[:, :16]))),
        ("the plan's N_c", lambda: call(compressor=Spoiled(compressor, lambda e: e[:-1]))),
        ("compressor must return a float", lambda: call(compressor=Spoiled(compressor, lambda e: None))),
        ("boom in the user's compressor", lambda: call(compressor=Spoiled(compressor, _boom, last))),
        ("indexer.keys must return a float [N_c, 16]", lambda: call(indexer=Spoiled(indexer, lambda k: k[:, :8]))),
        ("indexer.queries must return", lambda: call(indexer=BadQueries(indexer, lambda qw: qw))),
        ("indexer must declare an int indexer.key_dim", lambda: call(indexer=compressor)),
        ("index_features must be [T/cp, indexer.feature_dim]", lambda: call(index_features=x[:, :32])),
        ("spec.scale must be a finite positive", lambda: attention_forward(
            q, kv, plan, None, spec=AttentionSpec(d_v=24, compress_ratio=4, window=4, scale=float("nan")))),
    ]


def _outcomes(cases: list[tuple[str, Callable[[], Any]]]) -> list[tuple[str, str]]:
    """``(expected part of the message, what this rank got)`` per case."""
    outcomes = []
    for name, call in cases:
        try:
            call()
            outcomes.append((name, "no error"))
        except (ValueError, TypeError, RuntimeError) as err:
            outcomes.append((name, f"{type(err).__name__}: {err}"))
        dist.barrier()  # reached only if no rank was left inside a collective
    return outcomes


def _run(rank: int, world: int) -> dict[str, list[tuple[str, str]]]:
    result = {"plan": _outcomes(_plan_cases(rank, world))}
    for run in RUNS:
        result[run] = _outcomes(_layer_cases(rank, world, run))
    plan = plan_attention(CU, world, rank, exchange="need", compress_ratios=[4], windows=[4], group=dist.group.WORLD)
    layer = V4Attention(V4Config(compress_ratio=4, window=4, topk=4), seed=1)
    x = shard_contiguous(torch.randn(24, 64), world, rank)
    result["ok"] = [("works", str(tuple(layer(x, plan, None).out.shape)))]
    return result


Results = tuple[int, list[dict[str, list[tuple[str, str]]]]]


RUN = {world: shared_spawn(_run, world, timeout=200.0) for world in (2, 3)}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"cp{w}")
def per_rank(request: pytest.FixtureRequest) -> Results:
    world: int = request.param
    return world, RUN[world].run(request)


def _assert_agreed(outcomes: list[list[tuple[str, str]]], failing: int | None, world: int) -> None:
    """Every rank raised, with the expected message; ``failing``: the one rank that failed itself."""
    assert len({len(o) for o in outcomes}) == 1
    for i in range(len(outcomes[0])):
        name = outcomes[0][i][0]
        messages = [o[i][1] for o in outcomes]
        assert all(m != "no error" and name in m for m in messages), (name, messages)
        if failing is not None:  # the failing rank raises its own error; the others name it
            assert "of the group failed" not in messages[failing], messages
            others = messages[:failing] + messages[failing + 1:]
            assert all(f"rank {failing} of the group failed" in m for m in others), messages


@pytest.mark.timeout(240)
def test_plan_fails_on_every_rank_when_one_rank_is_invalid(per_rank: Results) -> None:
    world, results = per_rank
    _assert_agreed([r["plan"] for r in results], world - 1, world)
    windows = [name for name, _ in results[0]["plan"]].index("windows[0] must be >= 1")
    if world == 2:  # docs/troubleshooting.md quotes what rank 0 raises
        assert results[0]["plan"][windows][1] in (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    assert len({r["ok"][0] for r in results}) == 1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", RUNS)
def test_module_failures_raise_on_every_rank(per_rank: Results, run: str) -> None:
    world, results = per_rank
    outcomes = [r[run] for r in results]
    _assert_agreed(outcomes, None, world)
    boom = [name for name, _ in outcomes[0]].index("boom in the user's compressor")
    _assert_agreed([o[boom:boom + 1] for o in outcomes], world - 1, world)


def _one_rank_bad_q(rank: int, world: int) -> tuple[str, str]:
    """Rank 1 passes one ``q`` row too many, rank 0 a correct call: first agreed in the call
    (``StepStatus(each_call=True)``), then without a status (the immediate mode)."""
    plan = plan_attention(CU, world, rank, group=dist.group.WORLD)
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(plan.local_len + (rank == 1), 2, 8, generator=gen)
    kv = torch.randn(plan.local_len, 8, generator=gen)
    outcomes = []
    for status in (StepStatus(each_call=True), None):
        try:
            attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=8, window=None), status=status)
            outcomes.append("no error")
        except Exception as error:  # noqa: BLE001 - the outcome is the result
            outcomes.append(f"{type(error).__name__}: {error}")
    return outcomes[0], outcomes[1]


@pytest.mark.timeout(120)
def test_one_rank_bad_argument_without_a_status_raises_there_and_fails_the_peers_collective() -> None:
    """``StepStatus(each_call=True)`` agrees in the call: every rank raises, naming rank 1. Without a status
    an argument only one rank gets wrong raises on that rank before any collective; its peers are already in
    the layer's first collective, which fails (gloo: the peer closed) once the failing rank leaves the group
    (so this check has a spawn of its own: the group is broken after it).
    NCCL would wait until the group's timeout instead. (With a deferring status it raises on every rank at
    the step's check: tests/test_step_status.py.)"""
    outcomes = spawn(_one_rank_bad_q, 2, timeout=60.0)
    message = "ValueError: q and kv must hold this rank's 12 tokens (plan.local_len), got 13 and 12"
    assert outcomes[1][0] == message and outcomes[0][0] == message.replace(
        "ValueError: ", "ValueError: rank 1 of the group failed, so every rank raises: ValueError: ", 1), outcomes
    assert outcomes[1][1] == message, outcomes
    assert outcomes[0][1].startswith(("RuntimeError", "DistBackendError")) and "rank 1" not in outcomes[0][1], outcomes
