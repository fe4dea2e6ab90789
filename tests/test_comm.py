"""Collectives on real gloo process groups (world 1-4) against single-process oracles.

One group per world size runs every check (tests/shared_spawn.py's spawn of that size, shared
with the other test modules: spawning costs seconds); the worker
returns raw results and the assertions run here, against tensors rebuilt from
the same seeds in the parent.
"""

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cpkv.comm import all_gather_qk_weight_kvallgather, check_same_on_all_ranks, gather_from_sp_cp, global_num_seqs
from cpkv.launch import spawn
from cpkv.plan.sharding import shard_contiguous, shard_zigzag
from tests.shared_spawn import shared_spawn

TIMEOUT = 90.0


def full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _gather_case(rank: int, world: int, x_full: torch.Tensor, tnd: bool, dim: int) -> dict[str, torch.Tensor]:
    shard = shard_contiguous(x_full, world, rank, dim=dim) if tnd else shard_zigzag(x_full, world, rank, dim=dim)
    local = shard.clone().requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch 2.13's FutureWarning for the old names must not leak
        gathered = gather_from_sp_cp(local, None, tnd=tnd, dim=dim)
    weight = full(100 + rank, *x_full.shape)  # a different loss on every rank
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (gathered * weight).sum().backward()
    assert local.grad is not None
    return {"gathered": gathered.detach(), "grad": local.grad}


def _indexer_gather_case(rank: int, world: int) -> dict[str, Any]:
    # world 4 = TP 2 x CP 2, TP rank fastest: global rank = cp_rank * 2 + tp_rank.
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, cp_rank = rank % 2, rank // 2
    q_full, k_full, w_full = full(1, 16, 3, 4), full(2, 16, 4), full(3, 16, 3)

    def local(x: torch.Tensor) -> torch.Tensor:
        cp_shard = shard_zigzag(x, 2, cp_rank, dim=0)
        return shard_contiguous(cp_shard, 2, tp_rank).clone()

    out = all_gather_qk_weight_kvallgather(
        local(q_full), local(k_full), local(w_full),
        tp_group=tp_groups[cp_rank], cp_group=cp_groups[tp_rank], tnd=False,
    )
    k_untouched = local(k_full)
    out_tnd = all_gather_qk_weight_kvallgather(
        local(q_full), k_untouched, local(w_full),
        tp_group=tp_groups[cp_rank], cp_group=cp_groups[tp_rank], tnd=True,
    )
    return {"q": out.q, "k": out.k, "w": out.weights, "k_tnd_is_input": out_tnd.k is k_untouched}


def _bad_input_case(rank: int, world: int) -> list[str]:
    """Every rank passes the same bad input; every rank must raise (no hang)."""
    raised = []
    for call in (
        lambda: gather_from_sp_cp(torch.zeros(3, 2), None, tnd=False),  # 3*world not divisible by 2*world
        lambda: gather_from_sp_cp(torch.zeros(4, 2), None, tnd=True, tp_size=world + 1),  # group size mismatch
        lambda: gather_from_sp_cp(torch.zeros(4, 2), None, tnd=True, dim=2),
        lambda: global_num_seqs(-1, None),
    ):
        try:
            call()
        except (ValueError, TypeError) as err:
            raised.append(f"{type(err).__name__}: {err}")
    dist.barrier()  # reached only if no rank hung inside a collective
    return raised


def _comm_checks(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for tnd in (True, False):
        for dim in (0, 1):
            shape = (4 * world, 6, 3) if dim == 0 else (2, 4 * world, 3)
            results[f"gather_{tnd}_{dim}"] = _gather_case(rank, world, full(7, *shape), tnd, dim)
    results["num_seqs"] = global_num_seqs(rank + 1, None)
    results["num_seqs_tensor"] = global_num_seqs(torch.tensor(2 * rank), None)
    results["bad"] = _bad_input_case(rank, world)
    check_same_on_all_ranks(torch.tensor([0, 5, 12, 16]), None)  # same everywhere: no error
    try:  # same T, other boundaries on the last rank
        check_same_on_all_ranks(torch.tensor([0, 5, 12, 16]) if rank < world - 1 else torch.tensor([0, 6, 12, 16]), None)
        results["mismatch"] = "no error"
    except ValueError as err:
        results["mismatch"] = str(err)
    if world == 4:
        results["indexer"] = _indexer_gather_case(rank, world)
    return results


COMM_CHECKS = {world: shared_spawn(_comm_checks, world, timeout=TIMEOUT) for world in (1, 2, 3, 4)}


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"world{w}")
def comm_run(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    return world, COMM_CHECKS[world].run(request)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tnd", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_gather_from_sp_cp_forward_and_backward(comm_run: tuple[int, list[dict[str, Any]]], tnd: bool, dim: int) -> None:
    world, results = comm_run
    shape = (4 * world, 6, 3) if dim == 0 else (2, 4 * world, 3)
    x_full = full(7, *shape)
    # Oracle: sum over ranks of each rank's loss weight, then this rank's shard of it.
    weight_sum = sum(full(100 + r, *shape) for r in range(world))
    assert isinstance(weight_sum, torch.Tensor)
    for rank, res in enumerate(results):
        case = res[f"gather_{tnd}_{dim}"]
        assert torch.equal(case["gathered"], x_full)
        shard = shard_contiguous if tnd else shard_zigzag
        torch.testing.assert_close(case["grad"], shard(weight_sum, world, rank, dim=dim), rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(150)
def test_global_num_seqs_with_unequal_counts(comm_run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = comm_run
    assert [r["num_seqs"] for r in results] == [world * (world + 1) // 2] * world
    assert [r["num_seqs_tensor"] for r in results] == [world * (world - 1)] * world


@pytest.mark.timeout(150)
def test_bad_input_raises_on_every_rank(comm_run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = comm_run
    for res in results:
        messages = res["bad"]
        assert len(messages) == 4, messages
        assert "2*cp" in messages[0] and "tp_size" in messages[1] and "dim" in messages[2]
        assert "local_num_tokens" in messages[3]


@pytest.mark.timeout(150)
def test_mismatched_cu_seqlens_raise_on_every_rank(comm_run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = comm_run
    for res in results:
        assert ("differ between the ranks" in res["mismatch"]) == (world > 1), res["mismatch"]


@pytest.mark.timeout(150)
def test_indexer_inputs_gathered_over_tp_and_cp(comm_run: tuple[int, list[dict[str, Any]]]) -> None:
    world, results = comm_run
    if world != 4:
        pytest.skip("TP 2 x CP 2 needs world size 4")
    q_full, k_full, w_full = full(1, 16, 3, 4), full(2, 16, 4), full(3, 16, 3)
    for rank, res in enumerate(results):
        cp_rank = rank // 2
        assert torch.equal(res["indexer"]["q"], shard_zigzag(q_full, 2, cp_rank, dim=0))
        assert torch.equal(res["indexer"]["w"], shard_zigzag(w_full, 2, cp_rank, dim=0))
        assert torch.equal(res["indexer"]["k"], k_full)
        assert res["indexer"]["k_tnd_is_input"]


def test_spawn_rejects_functions_of_an_interactive_main(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    def worker(rank: int, world: int) -> int:
        return rank

    worker.__module__ = "__main__"
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # no __file__, like a notebook
    with pytest.raises(TypeError, match="interactive __main__"):
        spawn(worker, 2)
