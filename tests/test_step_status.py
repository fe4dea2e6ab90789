"""No host sync in a layer call; one rank's failed check raises on every rank at ``StepStatus.check()``.

* Host syncs per layer call, forward and backward, counted (tests/host_syncs.py) on every
  rank: 0 with a :class:`~cpkv.StepStatus` in every compress mode, layout, exchange and ring
  degree (the cases of ``cpkv.bench.torch_compile``), through ``V4Attention`` and
  ``attention_forward`` itself, and with kv heads and separate values. Without a status a
  compressed call keeps its one agreement (a host read), counted too.
* One rank's bad layer argument (q or kv one row too many, q's head dim, sinks' length; in a
  window and an indexer layer, under both exchanges) and one rank's compressor or indexer
  returning a wrong shape (or raising) raise on every rank of a 2- and a 3-rank group at the
  step's check, within seconds, naming the failing rank, the layer call and the argument; a
  barrier after each case proves that no rank was left in a collective.
* A poisoned step never updates the weights: the check raises before ``optimizer.step()``, the
  failing rank's gradients are NaN, and the HF loss raises on every rank before any backward.
"""

from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpkv import AttentionSpec, StepStatus, attention_forward, plan_attention
from cpkv.bench.torch_compile import ALL_CASES, CASES, LENGTHS, MODES, case_id
from cpkv.plan import seqlens_to_cu_seqlens
from cpkv.plan.cost import CostModel
from cpkv.v4 import V4Attention, V4Config
from tests.host_syncs import count_host_syncs
from tests.shared_spawn import shared_spawn
from tests.test_agreement import Spoiled

# The reference backend's primitives: kernels here (they loop over blocks on the host, the CPU oracle's way); the CUDA
# backend's Triton kernels in their place make no host sync (docs/gpu_check.md, set_sync_debug_mode("error")).
KERNELS = {f"cpkv::{op}" for op in ("sparse_attention", "sparse_attention_backward", "selected_probs", "range_attention",
                                     "range_attention_backward", "indexer_topk")}
ROOT = Path(__file__).resolve().parents[1]
CU = torch.tensor([0, 5, 12, 16, 24])  # the last rank of 2 or 3 owns compressed blocks at ratio 4
LAYERS = {"window": V4Config(compress_ratio=0, window=4), "indexer": V4Config(compress_ratio=4, window=4, topk=4)}


# ----------------------------------------------------------------------------- the counter itself


def test_counter_counts_each_host_read_once() -> None:
    t, u = torch.tensor([3.0]), torch.tensor([1, 2, 3])
    reads: list[Callable[[], object]] = [
        lambda: t.item(), lambda: int(t), lambda: float(t), lambda: bool(t), lambda: u.tolist(), lambda: u.numpy(), lambda: [1, 2, 3, 4][u[0]],
        lambda: torch.equal(u, u), lambda: torch.nonzero(u), lambda: u[u > 1], lambda: torch.unique(u),
        lambda: torch.repeat_interleave(u),
    ]
    for read in reads:
        with count_host_syncs() as syncs:
            read()
        assert syncs.total == 1, dict(syncs.counts)
    with count_host_syncs() as syncs:  # values stay on the device
        torch.where(u > 1, u, 0), torch.repeat_interleave(u, output_size=6), u.shape[0]  # noqa: B018
    assert syncs.total == 0, dict(syncs.counts)

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:
            float(grad.sum())
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    with count_host_syncs() as syncs:
        ReadsInBackward.apply(x).sum().backward()
    assert syncs.total == 1, dict(syncs.counts)


# ----------------------------------------------------------------------------- syncs per layer call


def _direct(layer: V4Attention, x: Tensor, plan: Any, status: StepStatus | None) -> Tensor:
    """``attention_forward`` itself (the layer's projections outside)."""
    q, kv = layer.project(x, plan.q_positions)
    out: Tensor = attention_forward(q, kv, plan, None, spec=layer.config.spec, sinks=layer.sinks, hidden=x,
                                    compressor=layer.compressor, indexer=layer.indexer, backend="reference",
                                    status=status).out
    return out


def _syncs(call: Callable[[], Tensor]) -> int:
    with count_host_syncs(KERNELS) as syncs:
        call().sum().backward()
    return syncs.total


def _sync_counts(rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """Per case: host syncs of one layer call (forward + backward) through the layer with a status, and on the
    compile cover's cases also through ``attention_forward`` itself with one and through the layer without one."""
    counts = {}
    for mode, layout, exchange, ring in ALL_CASES:
        config = MODES[mode]
        plan = plan_attention(seqlens_to_cu_seqlens(LENGTHS[layout]), world, rank, layout=layout,  # type: ignore[arg-type]
                              exchange=exchange, ring_degree=ring,  # type: ignore[arg-type]
                              compress_ratios=[config.compress_ratio] if config.mode.compresses else [], windows=[config.window],
                              cost_model=CostModel.from_v4(config))
        layer = V4Attention(config, seed=5)
        x = plan.shard(torch.randn(48, 64, generator=torch.Generator().manual_seed(3))).requires_grad_(True)
        status = StepStatus()
        with_status = _syncs(lambda: layer(x, plan, None, backend="reference", status=status).out)
        covered = (mode, layout, exchange, ring) in CASES  # the compile cover's subset: directly, and without a status
        direct = _syncs(lambda: _direct(layer, x, plan, status)) if covered else 0
        status.check()
        without = _syncs(lambda: layer(x, plan, None, backend="reference").out) if covered else -1
        counts[case_id(mode, layout, exchange, ring)] = (with_status, direct, without)
    for exchange, ring in (("allgather", 1), ("need", 2)):  # kv heads with separate values and sinks
        plan = plan_attention(seqlens_to_cu_seqlens(LENGTHS["balanced"]), world, rank, layout="balanced",
                              exchange=exchange, ring_degree=ring, windows=[8], cost_model=CostModel())  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(4)
        q, k, v = (plan.shard(torch.randn(48, *shape, generator=gen)).requires_grad_(True) for shape in ((4, 16), (2, 16), (2, 8)))
        sinks, status = torch.randn(4, requires_grad=True), StepStatus()
        spec = AttentionSpec(d_v=8, window=8)
        gqa = _syncs(lambda: attention_forward(q, k, plan, None, spec=spec, v=v, sinks=sinks, status=status).out)
        status.check()
        counts[f"gqa/balanced/{exchange}/ring{ring}"] = (gqa, gqa, _syncs(lambda: attention_forward(q, k, plan, None, spec=spec, v=v).out))
    return counts


def _run(rank: int, world: int) -> dict[str, Any]:
    """Everything in one group per size (tests/shared_spawn.py): the failures; at cp 2 also the sync counts and steps."""
    result: dict[str, Any] = {"failures": _one_rank_failures(rank, world)}
    if world == 2:
        result.update(syncs=_sync_counts(rank, world), direct=_step(rank, world), hf=_hf_step(rank, world))
    return result


RUN = {world: shared_spawn(_run, world, timeout=300.0) for world in (2, 3)}


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[int, list[dict[str, Any]]]:
    pytest.importorskip("transformers")
    return {world: RUN[world].run(request) for world in (2, 3)}


@pytest.mark.timeout(600)
def test_a_layer_call_makes_no_host_sync_with_a_status(runs: dict[int, list[dict[str, Any]]]) -> None:
    for result in runs[2]:
        counts = result["syncs"]
        assert len(counts) == len(ALL_CASES) + 2
        synced = {case: c for case, c in counts.items() if c[:2] != (0, 0)}
        assert not synced, synced
        # without a status, a compressed call agrees on its modules' outputs: one host read (the debugging mode's cost)
        legacy = {case: c[2] for case, c in counts.items()
                  if c[2] not in (-1, 1 if case.split("/")[0] in ("compressor", "indexer") else 0)}
        assert not legacy, legacy


# ----------------------------------------------------------------------------- one rank's failure


def _layer_case(rank: int, world: int, kind: str, exchange: str, *, leaves: bool = True) -> tuple[V4Attention, Any, Tensor, Tensor, Tensor]:
    """A layer, its plan, the rank's hidden states and its q and kv (leaves: every case backpropagates on its own)."""
    config = LAYERS[kind]
    plan = plan_attention(CU, world, rank, exchange=exchange, compress_ratios=[4] if kind == "indexer" else [],  # type: ignore[arg-type]
                          windows=[4])
    layer = V4Attention(config, seed=1)
    x = plan.shard(torch.randn(24, 64, generator=torch.Generator().manual_seed(0)))
    q, kv = layer.project(x, plan.q_positions)
    if leaves:
        q, kv = q.detach().requires_grad_(True), kv.detach().requires_grad_(True)
    return layer, plan, x, q, kv


def _caller(rank: int, world: int, kind: str, exchange: str) -> tuple[Callable[..., Tensor], V4Attention, Tensor, Tensor, Tensor]:
    """``call(status, **changes)``: the layer's ``attention_forward`` call on this rank, with some arguments changed."""
    layer, plan, x, q, kv = _layer_case(rank, world, kind, exchange)
    sinks = layer.sinks
    assert sinks is not None

    def call(status: StepStatus, **changes: Any) -> Tensor:
        kwargs: dict[str, Any] = dict(q=q, kv=kv, sinks=sinks, hidden=x, compressor=layer.compressor, indexer=layer.indexer)
        kwargs.update(changes)
        return attention_forward(plan=plan, group=None, spec=layer.config.spec, status=status, **kwargs).out

    return call, layer, q, kv, sinks


def _one_rank_cases(rank: int, world: int) -> list[tuple[str, str, Callable[[StepStatus], Tensor]]]:
    """``(case, what the message names, call)``: the last rank alone passes a bad argument or has a failing module.

    The argument cases in a window layer (need exchange) and an indexer layer (all-gather); the module
    cases spread over both exchanges."""
    bad, last = rank == world - 1, (world - 1,)
    cases: list[tuple[str, str, Callable[[StepStatus], Tensor]]] = []
    for kind, exchange in (("window", "need"), ("indexer", "allgather")):
        call, _, q, kv, sinks = _caller(rank, world, kind, exchange)
        changed = {
            "q one row too many": ("q and kv must hold this rank's", {"q": torch.cat([q, q[:1]])}),
            "kv one row too many": ("q and kv must hold this rank's", {"kv": torch.cat([kv, kv[:1]])}),
            "q's head dim": ("q's head dim D must be kv's", {"q": torch.cat([q, q[..., :1]], dim=-1)}),
            "sinks' length": ("sinks must be a float [H]", {"sinks": torch.cat([sinks, sinks[:1]])}),
        }
        for name, (words, change) in changed.items():
            cases.append((f"{kind}/{exchange}: {name}", words, lambda s, c=call, k=change: c(s, **(k if bad else {}))))
    for exchange, names in (("allgather", ("compressor width", "indexer queries")),
                            ("need", ("one entry fewer", "indexer keys", "compressor raises"))):
        call, layer, *_ = _caller(rank, world, "indexer", exchange)
        compressor, indexer = layer.compressor, layer.indexer
        modules = {
            "compressor width": ("compressor must return a float [N_c, 32]", {"compressor": Spoiled(compressor, lambda e: e[:, :16], last)}),
            "one entry fewer": ("the plan's N_c", {"compressor": Spoiled(compressor, lambda e: e[:-1], last)}),
            "indexer keys": ("indexer.keys must return a float [N_c, 16]", {"indexer": Spoiled(indexer, lambda k: k[:, :8], last)}),
            "indexer queries": ("indexer.queries must return", {"indexer": SpoiledQueries(indexer, _narrow_queries, last)}),
            "compressor raises": ("boom in the user's compressor", {"compressor": Spoiled(compressor, _boom, last)}),
        }
        for name in names:
            words, change = modules[name]
            cases.append((f"indexer/{exchange}: {name}", words, lambda s, c=call, k=change: c(s, **k)))
    return cases


class SpoiledQueries(Spoiled):
    """An indexer whose ``queries`` are changed by ``spoil`` on some ranks."""

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        return self._apply(self.inner.queries(x, positions))  # type: ignore[no-any-return]


def _narrow_queries(value: Any) -> Any:
    """Queries ``(q_index, weights)`` with half their width (keys pass unchanged)."""
    return (value[0][..., :8], value[1]) if isinstance(value, tuple) else value


def _boom(_value: Any) -> Any:
    raise RuntimeError("boom in the user's compressor")


def _one_rank_failures(rank: int, world: int) -> list[tuple[str, str, str, float, bool]]:
    """Per case: ``(case, expected words, this rank's outcome, seconds until it raised, NaN output)``."""
    outcomes = []
    for name, words, call in _one_rank_cases(rank, world):
        status = StepStatus()
        start = time.perf_counter()
        out = call(status)
        out.sum().backward()
        try:
            status.check()
            outcome = "no error"
        except (ValueError, TypeError, RuntimeError) as error:
            outcome = f"{type(error).__name__}: {error}"
        outcomes.append((name, words, outcome, time.perf_counter() - start, bool(out.isnan().any())))
        dist.barrier()  # reached only if no rank was left inside a collective
    return outcomes


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", [2, 3], ids=lambda w: f"cp{w}")
def test_one_ranks_failure_raises_on_every_rank_at_the_check(runs: dict[int, list[dict[str, Any]]], world: int) -> None:
    per_rank = [result["failures"] for result in runs[world]]
    failing = world - 1
    assert len(per_rank[0]) == 4 * 2 + 5
    for i, (name, words, own, seconds, poisoned) in enumerate(per_rank[failing]):
        assert poisoned and words in own and own.startswith(("ValueError", "TypeError", "RuntimeError")), (name, own)
        assert "layer call 1 of the step" in own and "of the group failed" not in own, (name, own)
        kind = own.split(":")[0]
        for rank in range(world):
            if rank == failing:
                continue
            theirs = per_rank[rank][i][2]
            assert theirs.startswith(f"{kind}: rank {failing} of the group failed, so every rank raises:"), (name, theirs)
            assert words in theirs and "layer call 1 of the step" in theirs, (name, theirs)
        assert max(p[i][3] for p in per_rank) < 30, (name, [p[i][3] for p in per_rank])  # seconds, under a loaded CI
    if world == 2:  # the docs quote what the ranks raise
        quoted = {name: (own, per_rank[0][i][2]) for i, (name, _, own, _, _) in enumerate(per_rank[failing])}
        troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
        semantics = (ROOT / "docs" / "semantics.md").read_text(encoding="utf-8")
        for name in ("window/need: q one row too many", "indexer/allgather: q's head dim", "indexer/allgather: sinks' length"):
            assert quoted[name][1] in troubleshooting, quoted[name][1]
        assert all(text in semantics for text in quoted["window/need: q one row too many"]), quoted


# ----------------------------------------------------------------------------- the step


def _step(rank: int, world: int) -> dict[str, Any]:
    """An SGD step whose layer call failed on the last rank: the check raises before the optimizer steps."""
    layer, plan, x, q, kv = _layer_case(rank, world, "indexer", "need", leaves=False)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    status = StepStatus()
    if rank == world - 1:
        q = torch.cat([q, q[:1]])
    out = attention_forward(q, kv, plan, None, spec=layer.config.spec, sinks=layer.sinks, hidden=x,
                            compressor=layer.compressor, indexer=layer.indexer, status=status).out
    out.sum().backward()  # a linear loss: its gradient is finite, the NaN comes from the failed call
    try:
        status.check()
        optimizer.step()
        raised = "no error"
    except ValueError as error:
        raised = str(error)
    grads = layer.wq.weight.grad
    return {"raised": raised, "unchanged": all(torch.equal(p, before[n]) for n, p in layer.named_parameters()),
            "nan_grads": grads is not None and bool(grads.isnan().all())}


def _hf_step(rank: int, world: int) -> dict[str, Any]:
    """The HF loss with one rank's CSA compressor returning one channel fewer: every rank raises before any backward."""
    from cpkv.integrations.transformers import DeepseekV4Compressor
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss, enable_deepseek_v4_cp
    from tests.integrations.test_transformers_lm import _batch, _model

    model = enable_deepseek_v4_cp(_model())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = _batch([5, 0, 30, 3, 1, 19, 14], 1)
    original = DeepseekV4Compressor.__call__

    def narrow(self: Any, x: Tensor, plan: Any) -> Tensor | None:
        entries = original(self, x, plan)
        return entries[:, :-1] if entries is not None and rank == world - 1 else entries

    with mock.patch.object(DeepseekV4Compressor, "__call__", narrow):
        try:
            deepseek_v4_causal_lm_loss(model, batch["ids"][None], None, cu_seqlens=batch["cu"], labels=batch["labels"][None],
                                       backend="reference").loss.backward()
            raised = "no error"
        except ValueError as error:
            raised = str(error)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return {"raised": raised, "unchanged": all(torch.equal(p, before[n]) for n, p in model.named_parameters()),
            "no_backward": not grads}


@pytest.mark.timeout(600)
def test_a_poisoned_step_never_updates_the_weights(runs: dict[int, list[dict[str, Any]]]) -> None:
    per_rank = runs[2]
    assert per_rank[1]["direct"]["raised"].startswith("layer call 1 of the step (INDEXER, compress_ratio=4, window=4): q and kv")
    assert per_rank[0]["direct"]["raised"].startswith("rank 1 of the group failed, so every rank raises: ValueError: layer call 1")
    assert per_rank[1]["direct"]["nan_grads"], per_rank  # the failing rank's gradients are poisoned
    assert per_rank[1]["hf"]["raised"].startswith("layer call 2 of the step (INDEXER, compress_ratio=4, window=8): compressor must")
    assert per_rank[0]["hf"]["raised"].startswith("rank 1 of the group failed, so every rank raises: ValueError: layer call 2")
    for result in per_rank:
        assert result["direct"]["unchanged"] and result["hf"]["unchanged"] and result["hf"]["no_backward"], result
