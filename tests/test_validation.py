"""No silent wrong results: every rank raises the same clear error before any collective.

One group per world size (tests/shared_spawn.py's spawn of that size) runs every case; after each
call a barrier proves that no rank was left inside a collective (a rank that entered one alone
would hang the barrier, and the check's timeout would fail the test fast).

* every public entry point, for each invalid argument, raises on every rank with a message
  that names the argument (``BAD_CALLS``);
* ranks that disagree on ``cu_seqlens`` (boundaries moved +1, -2, +1: same count, same
  total, same sum) or on the plan options are caught exactly by ``plan_attention(...,
  group=...)``, on every rank;
* bad input that only some ranks would touch (a compressor input of the wrong width under
  the need exchange, where only one rank owns a block) raises on every rank.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpkv import (
    AttentionSpec,
    all_gather_qk_weight_kvallgather,
    attention_forward,
    check_same_on_all_ranks,
    exchange_rows,
    gather_from_sp_cp,
    global_num_seqs,
    plan_attention,
)
from cpkv.plan.sharding import shard_contiguous
from cpkv.v4 import V4Attention, V4Config
from tests.shared_spawn import shared_spawn

CU = torch.tensor([0, 5, 12, 16, 24])
SPEC = AttentionSpec(d_v=24, window=4)


def _bad_calls(rank: int, world: int) -> list[tuple[str, Callable[[], Any]]]:
    local = 24 // world
    q, kv = torch.randn(local, 4, 32), torch.randn(local, 32)
    plan = plan_attention(CU, world, rank)
    need = plan_attention(CU, world, rank, exchange="need", windows=[4], compress_ratios=[4])
    cmp_layer = V4Attention(V4Config(compress_ratio=4, window=4))
    x = torch.randn(local, 64)
    routes = need.compressed[4].hidden
    return [
        # attention_forward
        ("plan must be an AttentionPlan", lambda: attention_forward(q, kv, None, None, spec=SPEC)),  # type: ignore[arg-type]
        ("group must be a torch.distributed ProcessGroup", lambda: attention_forward(q, kv, plan, "world", spec=SPEC)),  # type: ignore[arg-type]
        ("spec must be an AttentionSpec", lambda: attention_forward(q, kv, plan, None, spec={"d_v": 24})),  # type: ignore[arg-type]
        ("q must be a floating-point", lambda: attention_forward(q.long(), kv, plan, None, spec=SPEC)),
        ("kv must have q's dtype", lambda: attention_forward(q.bfloat16(), kv, plan, None, spec=SPEC)),
        ("plan.local_len", lambda: attention_forward(q[1:], kv[1:], plan, None, spec=SPEC)),
        ("grad_scale", lambda: attention_forward(q, kv, plan, None, spec=SPEC, grad_scale="2")),  # type: ignore[arg-type]
        ("sinks", lambda: attention_forward(q, kv, plan, None, spec=SPEC, sinks=torch.zeros(4, dtype=torch.int64))),
        ("spec.window", lambda: attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=24, window=0))),
        ("spec.index_query_dtype must be None or one of", lambda: attention_forward(
            q, kv, plan, None, spec=AttentionSpec(d_v=24, window=4, index_query_dtype=torch.float16))),
        # V4Attention.forward: compressor/indexer inputs checked on every rank
        ("x must be [T/cp, hidden]", lambda: cmp_layer(x[:, :32], need, None)),
        ("x must have the layer's dtype", lambda: cmp_layer(x.bfloat16(), need, None)),
        ("x must hold this rank's", lambda: cmp_layer(x[1:], need, None)),
        ("hidden must be [T/cp, compressor.input_dim]", lambda: attention_forward(
            q, kv, need, None, spec=AttentionSpec(d_v=24, window=4, compress_ratio=4), hidden=x[:, :32],
            compressor=cmp_layer.compressor, indexer=cmp_layer.indexer)),
        ("compressor.prev_blocks=1", lambda: attention_forward(
            q, kv, plan_attention(CU, world, rank, exchange="need", windows=[4], compress_ratios=[4], prev_blocks={4: 0}),
            None, spec=AttentionSpec(d_v=24, window=4, compress_ratio=4), hidden=x,
            compressor=cmp_layer.compressor, indexer=cmp_layer.indexer)),
        ("index_features", lambda: attention_forward(
            q, kv, need, None, spec=AttentionSpec(d_v=24, window=4, compress_ratio=4), hidden=x,
            compressor=cmp_layer.compressor, indexer=cmp_layer.indexer, index_features=x[1:])),
        ("spec.scale must be a finite positive", lambda: attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=24, scale=float("inf")))),
        ("spec.scale must be a finite positive", lambda: attention_forward(q, kv, plan, None, spec=AttentionSpec(d_v=24, scale=float("nan")))),
        ("grad_scale must be a finite", lambda: attention_forward(q, kv, plan, None, spec=SPEC, grad_scale=float("inf"))),
        # plan_attention: containers and bounds named, under either exchange
        ("windows must be a sequence", lambda: plan_attention(CU, world, rank, exchange="need", windows=8)),  # type: ignore[arg-type]
        ("compress_ratios must be a sequence", lambda: plan_attention(CU, world, rank, compress_ratios=4)),  # type: ignore[arg-type]
        ("prev_blocks must be a mapping", lambda: plan_attention(CU, world, rank, compress_ratios=[4], prev_blocks=[1])),  # type: ignore[arg-type]
        ("prev_blocks must be a mapping", lambda: plan_attention(CU, world, rank, compress_ratios=[4], prev_blocks=-1)),  # type: ignore[arg-type]
        ("prev_blocks[4] must be >= 0", lambda: plan_attention(CU, world, rank, compress_ratios=[4], prev_blocks={4: -1})),
        ("windows[0] must be >= 1", lambda: plan_attention(CU, world, rank, windows=[0])),
        ("windows[1] must be >= 1", lambda: plan_attention(CU, world, rank, windows=[4, -1])),
        # plan_attention with a group
        ("do not match the group", lambda: plan_attention(CU, world, (rank + 1) % world if world > 1 else 1, group=dist.group.WORLD)),
        ("prev_blocks names ratios", lambda: plan_attention(CU, world, rank, prev_blocks={8: 1}, group=dist.group.WORLD)),
        # collectives
        ("x must be a torch.Tensor", lambda: gather_from_sp_cp([1, 2], None, tnd=True)),  # type: ignore[arg-type]
        ("group must be a torch.distributed ProcessGroup", lambda: gather_from_sp_cp(kv, 0, tnd=True)),  # type: ignore[arg-type]
        ("local_num_tokens", lambda: global_num_seqs(torch.tensor(True), None)),
        ("local_num_tokens", lambda: global_num_seqs(-1, None)),
        ("cu_seqlens must be an integer tensor", lambda: check_same_on_all_ranks(CU.float(), None)),
        ("dim=5", lambda: all_gather_qk_weight_kvallgather(
            q, kv, q[..., 0], tp_group=None, cp_group=None, tnd=False, dim=5)),
        ("group must be a torch.distributed ProcessGroup", lambda: exchange_rows(x, routes, "cp")),  # type: ignore[arg-type]
    ]


def _disagreeing_ranks(rank: int, world: int) -> list[str]:
    """Cases where ranks pass different (individually valid) inputs to a plan with a group."""
    cases: list[Callable[[], Any]] = [
        # boundaries moved +1, -2, +1 on the last rank: same count, total and sum
        lambda: plan_attention(torch.tensor([0, 6, 10, 17, 24]) if rank == world - 1 else CU, world, rank, group=dist.group.WORLD),
        # different token totals under the need exchange
        lambda: plan_attention(torch.tensor([0, 5, 12, 16, 24 + world]) if rank == 0 else CU, world, rank,
                               exchange="need", group=dist.group.WORLD),
        # same cu_seqlens, other options
        lambda: plan_attention(CU, world, rank, compress_ratios=[4] if rank == 0 else [8], group=dist.group.WORLD),
        lambda: plan_attention(CU, world, rank, exchange="need", windows=[4 + rank], group=dist.group.WORLD),
        # rank 1 given 36 tokens and rank 0 32 (cp 2): without group= this completed with wrong numbers
        lambda: plan_attention(torch.tensor([0, (36 if rank == 1 else 32) * world]), world, rank, exchange="need",
                               group=dist.group.WORLD),
        # a different number of documents
        lambda: plan_attention(torch.tensor([0, 24]) if rank == 0 else CU, world, rank, group=dist.group.WORLD),
    ]
    messages = []
    for call in cases:
        try:
            call()
            messages.append("no error")
        except ValueError as err:
            messages.append(str(err))
        dist.barrier()
    return messages


def _run_all(rank: int, world: int) -> dict[str, list[str]]:
    messages = []
    for _name, call in _bad_calls(rank, world):
        try:
            call()
            messages.append("no error")
        except (ValueError, TypeError) as err:
            messages.append(f"{type(err).__name__}: {err}")
        dist.barrier()  # reached only if no rank entered a collective alone
    # A correct call still works after all of that (nothing left half-done in the group).
    plan = plan_attention(CU, world, rank, exchange="need", windows=[4], group=dist.group.WORLD)
    torch.manual_seed(0)
    q = shard_contiguous(torch.randn(24, 4, 32), world, rank)
    kv = shard_contiguous(torch.randn(24, 32), world, rank)
    runs = []
    for _ in range(2):  # bitwise deterministic run to run, forward and backward
        q_in, kv_in = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
        out = attention_forward(q_in, kv_in, plan, None, spec=SPEC).out
        out.backward(torch.ones_like(out))
        runs.append((out.detach(), q_in.grad, kv_in.grad))
    same = all(torch.equal(a, b) for a, b in zip(*runs))  # type: ignore[arg-type]
    return {"bad": messages, "disagree": _disagreeing_ranks(rank, world) if world > 1 else [], "ok": [str(out.shape), str(same)]}


RUN_ALL = {world: shared_spawn(_run_all, world, timeout=180.0) for world in (1, 2, 3)}


@pytest.fixture(scope="module", params=[1, 2, 3])
def per_rank(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, list[str]]]]:
    world: int = request.param
    return world, RUN_ALL[world].run(request)


@pytest.mark.timeout(200)
def test_every_entry_point_raises_on_every_rank_before_any_collective(per_rank: tuple[int, list[dict[str, list[str]]]]) -> None:
    world, results = per_rank
    names = [name for name, _ in _bad_calls(0, world)]
    for result in results:
        assert len(result["bad"]) == len(names)
        for name, message in zip(names, result["bad"]):
            assert name in message, (name, message)
    for i in range(len(names)):  # the same outcome on every rank (up to the rank's own numbers)
        assert len({re.sub(r"\d+", "N", r["bad"][i]) for r in results}) == 1, results[0]["bad"][i]
    assert all(r["ok"] == results[0]["ok"] for r in results) and results[0]["ok"][1] == "True"


@pytest.mark.timeout(200)
def test_ranks_that_disagree_all_raise_the_same_error(per_rank: tuple[int, list[dict[str, list[str]]]]) -> None:
    world, results = per_rank
    if world == 1:
        pytest.skip("one rank cannot disagree with itself")
    for i in range(len(results[0]["disagree"])):
        messages = [r["disagree"][i] for r in results]
        assert all("differ between the ranks of the group" in m for m in messages), messages
        assert all(m.split(" (this rank")[0] == messages[0].split(" (this rank")[0] for m in messages), messages
