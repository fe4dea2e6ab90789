"""Several kv heads in the executor: GQA, MHA and shared kv heads, every layout and exchange, against a brute-force oracle.

``attention_forward`` with kv ``[T/cp, H_kv, D]`` (shared heads, values their first ``d_v``
channels) or keys ``[T/cp, H_kv, D]`` with values ``v`` ``[T/cp, H_kv, d_v]``, on gloo ranks
at cp 3 (and 2), under the contiguous, zigzag, balanced and a custom layout (several ranges
per rank, out of order, an empty rank), with the all-gather, the need exchange and ring rounds,
windows and sinks. The oracle is written here: dense float64 attention per document of the
whole batch in one process, kv heads repeated over their query groups (head ``h`` uses kv head
``h // (H / H_kv)``), softmax with the sink as one extra logit. Compared: the rank's output
rows, the gradients of its q, kv and v rows, and the sinks' gradient summed over the ranks.

Each multi-head call moves all heads in one collective per exchange: the counted collectives
of an H_kv = 4 call equal an H_kv = 1 call's, the bytes scale with the heads.

V4's MQA (kv ``[T/cp, D]``) is the H_kv = 1 case and stays bitwise what it was: the call
equals, bit for bit, main's route written out with the public primitives (all-gather, the
prefix rows, one ``varlen_attention`` over ``kv[:, None]`` and ``kv[:, None, :d_v]``).

Tolerance (float64): both sides sum a few hundred O(1) products in other orders (online
softmax merged by LSE vs one dense softmax; gradients summed over ranks), so rounding stays
below ~1e3 * eps ~ 2e-13; 1e-10 leaves margin, while another head map, a key too many or
too few, a missing sink or a lost gradient moves results by more than 1e-3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.plan.cost import CostModel
from cpkv.attention import AttentionSpec, attention_forward
from cpkv.backends.reference import ReferenceBackend
from cpkv.comm import gather_from_sp_cp
from cpkv.commstats import count_bytes
from cpkv.plan import AttentionPlan, plan_attention, seqlens_to_cu_seqlens
from tests.shared_spawn import shared_spawn
from tests.test_attention_cp import _custom_layout

TOL = 1e-10
HEADS, DIM, D_V = 4, 8, 6
LENGTHS = [5, 0, 23, 3, 17]  # 48 tokens
ZIGZAG = {2: [12, 0, 4, 24, 8], 3: [12, 0, 6, 24, 6]}  # multiples of 2 * cp
WINDOW = 5
# (kv heads, separate values, window, sinks)
FORMS = {"gqa2": (2, True, WINDOW, True), "mha": (4, False, None, False), "gqa2-shared": (2, False, WINDOW, True)}
EXCHANGES = [("allgather", 1), ("need", 1), ("need", 2)]
LAYOUTS = ["contiguous", "zigzag", "balanced", "custom"]


def oracle(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, window: int | None, sinks: Tensor | None, scale: float) -> Tensor:
    """Dense causal (windowed) attention per document of q ``[T, H, D]``, k ``[T, H_kv, D]``, v ``[T, H_kv, d_v]``."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        scores = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) * scale
        i = torch.arange(e - s)
        allowed = i[None, :] <= i[:, None]
        if window is not None:
            allowed &= i[None, :] > i[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks[:, None, None].expand(-1, e - s, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., : e - s]
        outs.append(torch.einsum("hij,jhd->ihd", probs, v[s:e]))
    return torch.cat(outs)


def _cu(layout: str, world: int) -> Tensor:
    return seqlens_to_cu_seqlens(ZIGZAG[world] if layout == "zigzag" else LENGTHS)


def _plan(layout: str, world: int, rank: int, exchange: str, ring: int, window: int | None) -> AttentionPlan:
    cu = _cu(layout, world)
    arg: Any = _custom_layout(cu, world) if layout == "custom" else layout
    return plan_attention(cu, world, rank, layout=arg, cost_model=CostModel(), exchange=exchange, ring_degree=ring, windows=[window])  # type: ignore[arg-type]


def _inputs(num_tokens: int, kv_heads: int, seed: int = 4) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (num_tokens, HEADS, DIM), "k": (num_tokens, kv_heads, DIM), "v": (num_tokens, kv_heads, D_V),
              "w": (num_tokens, HEADS, D_V), "sinks": (HEADS,)}
    return {name: torch.randn(*shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}


def _case(rank: int, world: int, form: str, layout: str, exchange: str, ring: int) -> dict[str, float]:
    """This rank's largest errors against the oracle (sinks: the gradient summed over the ranks)."""
    kv_heads, separate, window, with_sinks = FORMS[form]
    plan = _plan(layout, world, rank, exchange, ring, window)
    data = _inputs(plan.num_tokens, kv_heads)
    scale = 0.4
    full = {name: data[name].clone().requires_grad_(True) for name in ("q", "k", "v", "sinks")}
    ref_v = full["v"] if separate else full["k"][..., :D_V]
    want = oracle(full["q"], full["k"], ref_v, _cu(layout, world), window, full["sinks"] if with_sinks else None, scale)
    (want * data["w"]).sum().backward()
    local = {name: plan.shard(data[name]).clone().requires_grad_(True) for name in ("q", "k", "v")}
    sinks = data["sinks"].clone().requires_grad_(True)
    spec = AttentionSpec(d_v=D_V, window=window, scale=scale)
    out = attention_forward(local["q"], local["k"], plan, None, spec=spec, v=local["v"] if separate else None,
                            sinks=sinks if with_sinks else None, backend="reference").out
    (out * plan.shard(data["w"])).sum().backward()
    errors = {"out": float((out - plan.shard(want.detach())).abs().max()) if out.numel() else 0.0,
              "scale": float(want.abs().max())}
    for name in ("q", "k", "v") if separate else ("q", "k"):
        grad, ref = local[name].grad, full[name].grad
        assert grad is not None and ref is not None
        errors[f"d{name}"] = float((grad - plan.shard(ref)).abs().max()) if grad.numel() else 0.0
    if with_sinks:
        assert sinks.grad is not None and full["sinks"].grad is not None
        summed = sinks.grad.clone()
        dist.all_reduce(summed)
        errors["dsinks"] = float((summed - full["sinks"].grad).abs().max())
    return errors


def _counted(rank: int, world: int, kv_heads: int, exchange: str) -> dict[str, float]:
    """Collectives (forward + backward) and bytes of one separate-values call with ``kv_heads`` heads."""
    plan = _plan("contiguous", world, rank, exchange, 1, WINDOW)
    data = _inputs(plan.num_tokens, kv_heads)
    q, k, v = (plan.shard(data[n]).clone().requires_grad_(True) for n in ("q", "k", "v"))
    calls = {"n": 0}

    class Counting(ReferenceBackend):
        def varlen_attention(self, *args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            return super().varlen_attention(*args, **kwargs)

    with count_bytes() as counter:
        out = attention_forward(q, k, plan, None, spec=AttentionSpec(d_v=D_V, window=WINDOW), v=v, backend=Counting()).out
        out.sum().backward()
    return {"collectives": float(counter.num_calls), "bytes": float(counter.total), "kernels": float(calls["n"])}


def _bitwise_mqa(rank: int, world: int) -> dict[str, float]:
    """kv ``[T/cp, D]`` against main's route written out (contiguous all-gather), bit for bit; and ``[T/cp, 1, D]``."""
    plan = _plan("contiguous", world, rank, "allgather", 1, WINDOW)
    gen = torch.Generator().manual_seed(5)
    q_all, kv_all = torch.randn(plan.num_tokens, HEADS, DIM, generator=gen), torch.randn(plan.num_tokens, DIM, generator=gen)
    sinks = torch.randn(HEADS, generator=gen)
    spec = AttentionSpec(d_v=D_V, window=WINDOW)
    q, kv = plan.shard(q_all), plan.shard(kv_all)
    got = attention_forward(q, kv, plan, None, spec=spec, sinks=sinks, backend="reference").out
    shared = attention_forward(q, kv[:, None], plan, None, spec=spec, sinks=sinks, backend="reference").out
    assert plan.prefix is not None
    buffer = gather_from_sp_cp(kv, None, tnd=True).narrow(0, plan.prefix.kv_start, plan.prefix.kv_len)
    main = ReferenceBackend().varlen_attention(q, buffer[:, None], buffer[:, None, :D_V], plan.kv_source(WINDOW).segments,
                                               scale=DIM ** -0.5, window=WINDOW, sinks=sinks).out
    return {"equal_main": float(torch.equal(got, main)), "equal_shared": float(torch.equal(got, shared))}


def _worker(rank: int, world: int) -> dict[str, Any]:
    torch.set_default_dtype(torch.float64)
    results: dict[str, Any] = {}
    forms = FORMS if world == 3 else {"gqa2": FORMS["gqa2"]}
    for form in forms:
        for layout in LAYOUTS:
            for exchange, ring in EXCHANGES:
                results[f"{form}/{layout}/{exchange}{ring}"] = _case(rank, world, form, layout, exchange, ring)
    if world == 3:
        for exchange in ("allgather", "need"):
            for kv_heads in (1, 4):
                results[f"count/{exchange}/{kv_heads}"] = _counted(rank, world, kv_heads, exchange)
        results["bitwise"] = _bitwise_mqa(rank, world)
    return results


WORKER = {world: shared_spawn(_worker, world, timeout=240.0) for world in (2, 3)}


@pytest.fixture(scope="module", params=[2, 3])
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    return world, WORKER[world].run(request)


@pytest.mark.timeout(300)
def test_kv_heads_equal_the_dense_oracle_in_every_layout_and_exchange(runs: tuple[int, list[dict[str, Any]]]) -> None:
    world, per_rank = runs
    cases = [k for k in per_rank[0] if not k.startswith(("count/", "bitwise"))]
    assert len(cases) == (len(FORMS) if world == 3 else 1) * len(LAYOUTS) * len(EXCHANGES)
    for rank, results in enumerate(per_rank):
        for case in cases:
            errors = results[case]
            assert errors["scale"] > 0.1, (case, errors)  # the oracle produced real values
            assert all(v <= TOL for k, v in errors.items() if k != "scale"), (world, rank, case, errors)


def test_all_kv_heads_travel_in_one_collective(runs: tuple[int, list[dict[str, Any]]]) -> None:
    """H_kv = 4 makes the collectives and kernel calls of H_kv = 1; its bytes are 4 times as many."""
    world, per_rank = runs
    if world != 3:
        pytest.skip("counted at cp 3")
    for rank, results in enumerate(per_rank):
        for exchange in ("allgather", "need"):
            one, four = results[f"count/{exchange}/1"], results[f"count/{exchange}/4"]
            assert four["collectives"] == one["collectives"] and four["kernels"] == one["kernels"] == 1, (rank, exchange, one, four)
            assert four["bytes"] == 4 * one["bytes"], (rank, exchange, one, four)
            if exchange == "allgather" or rank > 0:  # rank 0's need exchange receives nothing in the contiguous layout
                assert one["collectives"] >= 2 and one["bytes"] > 0, (rank, exchange, one)


def test_mqa_stays_bitwise_as_main(runs: tuple[int, list[dict[str, Any]]]) -> None:
    world, per_rank = runs
    if world != 3:
        pytest.skip("checked at cp 3")
    for results in per_rank:
        assert results["bitwise"] == {"equal_main": 1.0, "equal_shared": 1.0}


def test_kv_heads_are_checked_before_any_collective(request: pytest.FixtureRequest) -> None:
    """Bad head counts and value shapes raise on the arguments (no collective is reached), on a 1-rank group."""
    assert BAD_HEADS.run(request) == ["raised"]


def _bad_heads(rank: int, world: int) -> str:
    plan = plan_attention(seqlens_to_cu_seqlens([8]), 1, 0)
    q, k, v = torch.randn(8, 4, 8), torch.randn(8, 3, 8), torch.randn(8, 2, 6)
    spec = AttentionSpec(d_v=6)
    with pytest.raises(ValueError, match=r"must divide q's 4 heads \(H % H_kv == 0\)"):
        attention_forward(q, k, plan, None, spec=spec)
    with pytest.raises(ValueError, match=r"v must be \[T/cp, H_kv, spec.d_v\] = \[8, 2, 6\]"):
        attention_forward(q, torch.randn(8, 2, 8), plan, None, spec=spec, v=torch.randn(8, 2, 5))
    with pytest.raises(ValueError, match="kv must hold the keys as"):
        attention_forward(q, torch.randn(8, 8), plan, None, spec=spec, v=v)
    with pytest.raises(ValueError, match=r"kv must be \[T/cp, D\] \(one shared kv head\) or \[T/cp, H_kv, D\]"):
        attention_forward(q, torch.randn(8, 2, 2, 8), plan, None, spec=spec)
    with pytest.raises(ValueError, match="spec.d_v .10. must be <= D = 8"):
        attention_forward(q, torch.randn(8, 2, 8), plan, None, spec=AttentionSpec(d_v=10))
    return "raised"


BAD_HEADS = shared_spawn(_bad_heads, 1, timeout=120.0)
