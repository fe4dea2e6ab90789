"""AdamW with weight decay over a CP-enabled ``DeepseekV4ForCausalLM`` equals one process: no gradient where it has none.

AdamW's decoupled weight decay (and its moment update) acts on every parameter that has a
gradient, zeros included, and skips those without one (``None``). So a CP run equals one
process only if every parameter gets a gradient exactly when one process gives it one:
Hugging Face's indexer never (it returns integer indices) unless cpkv's indexer loss trains
it, a compressor whenever a document of the micro-batch holds a block of its ratio, also on
ranks that run none (:func:`cpkv.integrations.transformers_lm.enable_deepseek_v4_cp`).

One group of 4 gloo ranks (tests/shared_spawn.py's 4-rank spawn) runs a plain training loop
(3 AdamW steps, ``weight_decay=0.1``, ``lr=1e-2``) under ``DistributedDataParallel`` over all 4 ranks at dp 1 x cp 4 and dp 2 x cp 2
(need exchange, balanced layout), with the indexer loss off (``find_unused_parameters=True``:
docs/integrations.md's choice) and on (``find_unused_parameters=False``: every parameter then
gets a gradient on every rank), once at dp 2 x cp 2 with the indexer frozen
(``requires_grad_(False)``, ``find_unused_parameters=False``), and under FSDP2 (``fully_shard``)
at dp 1 x cp 4 with the indexer loss off. Each CP group gets its own
documents; the loss is normalised by the whole step's valid labels (``num_items_in_batch``)
and multiplied by ``dp``, the indexer's ``grad_scale`` is ``dp * T_g / T`` (its KL is then
averaged over the step's queries, as one process averages it over its batch).

Oracles. Indexer loss off: Hugging Face's model in the test process on each document alone,
the same AdamW. Indexer loss on (Hugging Face has none): cpkv at cp 1 on rank 0 alone with
the whole step's batch. Both run float64 with Hugging Face's float32 casts lifted and top-k
ties to the earlier entry (``hf_oracle``), as test_transformers_lm.py.

Tolerances. Single micro-batches match to <= 2e-13 relative in the gradients
(test_transformers_lm.py); AdamW divides by ``sqrt(v)``, so a gradient that is about 0 turns
its rounding into an update of up to ``lr`` (the hyper-connections' ``base`` here). Measured
after 3 steps: <= 2.4e-10 relative (to the tensor's largest entry) on every parameter. Bound
1e-8. A zero gradient in place of ``None`` (the indexer decayed by ``1 - lr * 0.1`` a step, as
cpkv 0.3.0 did) gives 3.0e-3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers>=5.23 (the transformers/test extra) is missing")

from cpkv.plan import seqlens_to_cu_seqlens  # noqa: E402
from tests.integrations import hf_oracle  # noqa: E402
from tests.integrations.test_transformers_lm import IGNORE, VOCAB, _model, _no_mask  # noqa: E402
from tests.shared_spawn import shared_spawn  # noqa: E402

# Per step: CP group 0's documents, CP group 1's (at dp 1 one group takes both). Each group's
# micro-batch holds a ratio-16 block (find_unused_parameters=False needs every parameter used);
# at cp 4 and cp 2 some ranks hold none.
STEPS = [([18, 3, 9, 1], [20, 5, 2]), ([7, 17, 0, 4], [16, 11]), ([2, 25, 6], [19, 1, 8])]
SHORT = [3, 9, 5, 15, 4]  # no ratio-16 block: one process's HCA compressor gets no gradient
LR, WEIGHT_DECAY, PARAM_REL = 1e-2, 0.1, 1e-8


def _batch(lengths: list[int], seed: int) -> dict[str, Any]:
    """Packed ids, unshifted labels (every 7th token ignored), cu_seqlens, valid shifted labels."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    labels = ids.clone()
    labels[3::7] = IGNORE
    cu = seqlens_to_cu_seqlens(lengths, dtype=torch.int64)
    valid = sum(int((labels[s + 1: e] != IGNORE).sum()) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()))
    return {"ids": ids, "labels": labels, "cu": cu, "valid": valid}


def _step_batches(step: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Group 0's, group 1's and the whole step's batch (their concatenation)."""
    first, second = STEPS[step]
    a, b = _batch(first, 10 + step), _batch(second, 20 + step)
    whole = {"ids": torch.cat([a["ids"], b["ids"]]), "labels": torch.cat([a["labels"], b["labels"]]),
             "cu": seqlens_to_cu_seqlens(first + second, dtype=torch.int64), "valid": a["valid"] + b["valid"]}
    return a, b, whole


def _optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def _presence(model: Any) -> dict[str, bool]:
    return {n: p.grad is not None for n, p in model.named_parameters()}


# --- the CP side, on every rank --------------------------------------------------------------


def _wrap(model: Any, wrapper: str) -> Any:
    """DDP over the world (``find_unused_parameters`` as ``wrapper`` says), or FSDP2 (every layer, then the root)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if wrapper == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    return DistributedDataParallel(model, find_unused_parameters=wrapper == "ddp/find_unused")


def _train(model: Any, dp: int, cp_group: Any, dp_rank: int, *, indexer_loss: bool, wrapper: str) -> dict[str, Any]:
    """3 AdamW steps under ``wrapper`` over the world; the parameters and step 1's gradient presence."""
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss

    wrapped = _wrap(model, wrapper)
    optimizer = _optimizer(model)
    result: dict[str, Any] = {}
    for step in range(len(STEPS)):
        a, b, whole = _step_batches(step)
        mine = whole if dp == 1 else (a, b)[dp_rank]
        scale = dp * int(mine["cu"][-1]) / int(whole["cu"][-1])  # the KL averaged over the step's queries
        out = deepseek_v4_causal_lm_loss(
            wrapped, mine["ids"], cp_group, cu_seqlens=mine["cu"], labels=mine["labels"], layout="balanced", exchange="need",
            grad_reduction="mean", num_items_in_batch=whole["valid"], indexer_loss=indexer_loss, grad_scale=scale,
            backend="reference")
        (out.loss * dp).backward()
        if step == 0:
            routes = out.plan.compressed[16]
            result["presence"] = _presence(model)
            result["hca_blocks"] = routes.own.num_entries + routes.straddle.num_entries
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result["params"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}
    return result


def _one_rank_reference(model: Any, group: Any) -> dict[str, torch.Tensor]:
    """cpkv at cp 1 with each step's whole batch and the indexer loss: the indexer's one-process run."""
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss

    optimizer = _optimizer(model)
    for step in range(len(STEPS)):
        whole = _step_batches(step)[2]
        out = deepseek_v4_causal_lm_loss(model, whole["ids"], group, cu_seqlens=whole["cu"], labels=whole["labels"],
                                         indexer_loss=True, backend="reference")
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _short_batch(model: Any, group: Any) -> dict[str, bool]:
    """One backward of a batch without a ratio-16 block at cp 4: which parameters got a gradient."""
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss

    batch = _batch(SHORT, 30)
    out = deepseek_v4_causal_lm_loss(model, batch["ids"], group, cu_seqlens=batch["cu"], labels=batch["labels"],
                                     layout="balanced", backend="reference")
    out.loss.backward()
    return _presence(model)


def _four_ranks(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    solo = dist.new_group([0])
    meshes = {"dp1cp4": (1, None, 0), "dp2cp2": (2, pairs[rank // 2], rank // 2)}
    models = {key: enable_deepseek_v4_cp(_model()) for key in ("reference", "short", "frozen", "fsdp2", *(
        f"{m}/{i}" for m in meshes for i in ("off", "on")))}  # built outside hf_oracle.lifted(): the init draws depend on it
    for name, param in models["frozen"].named_parameters():
        param.requires_grad_(".indexer." not in name)
    results: dict[str, Any] = {}
    with hf_oracle.lifted(), _no_mask():
        for mesh, (dp, group, dp_rank) in meshes.items():
            results[f"{mesh}/off"] = _train(models[f"{mesh}/off"], dp, group, dp_rank, indexer_loss=False, wrapper="ddp/find_unused")
            results[f"{mesh}/on"] = _train(models[f"{mesh}/on"], dp, group, dp_rank, indexer_loss=True, wrapper="ddp")
        results["frozen"] = _train(models["frozen"], 2, pairs[rank // 2], rank // 2, indexer_loss=False, wrapper="ddp")
        results["fsdp2"] = _train(models["fsdp2"], 1, None, 0, indexer_loss=False, wrapper="fsdp2")
        results["short"] = _short_batch(models["short"], None)
        if rank == 0:
            results["reference"] = _one_rank_reference(models["reference"], solo)
        dist.barrier()
    if rank:  # the parameters are replicated: rank 0's
        results = {k: {"presence": v["presence"], "hca_blocks": v["hca_blocks"]} if isinstance(v, dict) and "params" in v else v
                   for k, v in results.items()}
    return results


FOUR_RANKS = shared_spawn(_four_ranks, 4, timeout=300.0)


@pytest.fixture(scope="module")
def four_ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return FOUR_RANKS.run(request)


# --- one process: Hugging Face's model on each document alone ---------------------------------


def _hugging_face() -> dict[str, Any]:
    """3 AdamW steps of Hugging Face's model on each step's documents, each alone; step 1's gradient presence."""
    model = _model()
    optimizer = _optimizer(model)
    presence: dict[str, bool] = {}
    with hf_oracle.lifted(), hf_oracle.earlier_ties():
        for step in range(len(STEPS)):
            whole = _step_batches(step)[2]
            cu = whole["cu"].tolist()
            total = torch.zeros((), dtype=torch.float64)
            for start, end in zip(cu[:-1], cu[1:]):
                if end - start < 2:
                    continue
                logits = model(input_ids=whole["ids"][start:end][None], use_cache=False).logits[0]
                total = total + torch.nn.functional.cross_entropy(
                    logits[:-1], whole["labels"][start + 1: end], ignore_index=IGNORE, reduction="sum")
            (total / whole["valid"]).backward()  # type: ignore[no-untyped-call]
            presence = presence or _presence(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"presence": presence, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    return _hugging_face()


def _errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert got.keys() == want.keys()
    return {n: float((got[n] - w).abs().max() / w.abs().max().clamp(min=1e-300)) for n, w in want.items()}


def _worst(errors: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(errors.items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh", ["dp1cp4", "dp2cp2"])
def test_adamw_without_the_indexer_loss_equals_hugging_face(four_ranks: list[dict[str, Any]], one_process: dict[str, Any],
                                                            mesh: str) -> None:
    """Every parameter after 3 decayed AdamW steps; the indexer has no gradient on any rank and is untouched."""
    got = four_ranks[0][f"{mesh}/off"]
    errors = _errors(got["params"], one_process["params"])
    assert max(errors.values()) <= PARAM_REL, _worst(errors)
    indexer = {n for n, present in one_process["presence"].items() if not present}
    assert indexer and all(".indexer." in n for n in indexer)  # what Hugging Face gives no gradient
    assert all({n for n, present in r[f"{mesh}/off"]["presence"].items() if not present} == indexer for r in four_ranks)
    initial = dict(_model().named_parameters())
    assert all(torch.equal(got["params"][n], initial[n]) for n in indexer)
    assert 0 in [r[f"{mesh}/off"]["hca_blocks"] for r in four_ranks]  # a rank running no HCA compressor: its tie counts


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh", ["dp1cp4", "dp2cp2"])
def test_adamw_with_the_indexer_loss_equals_cp1(four_ranks: list[dict[str, Any]], mesh: str) -> None:
    """With the indexer loss every parameter gets a gradient on every rank (DDP without find_unused_parameters)."""
    got, want = four_ranks[0][f"{mesh}/on"], four_ranks[0]["reference"]
    errors = _errors(got["params"], want)
    assert max(errors.values()) <= PARAM_REL, _worst(errors)
    assert all(all(r[f"{mesh}/on"]["presence"].values()) for r in four_ranks)
    initial = dict(_model().named_parameters())
    assert all(not torch.equal(want[n], initial[n]) for n in want if ".indexer." in n)  # the indexer was trained


def test_a_frozen_indexer_trains_as_hugging_face_under_plain_ddp(four_ranks: list[dict[str, Any]],
                                                                 one_process: dict[str, Any]) -> None:
    """The other documented option: ``requires_grad_(False)`` on the indexer, ``find_unused_parameters=False``."""
    errors = _errors(four_ranks[0]["frozen"]["params"], one_process["params"])
    assert max(errors.values()) <= PARAM_REL, _worst(errors)


def test_fsdp2_with_the_untrained_indexer_equals_hugging_face(four_ranks: list[dict[str, Any]],
                                                               one_process: dict[str, Any]) -> None:
    """FSDP2 (``fully_shard`` per layer and the root) at dp 1 x cp 4, no option: the indexer has no gradient on any rank.

    FSDP2 reduce-scatters the gradients that exist, the same set on every rank here: the
    indexer keeps ``None`` and AdamW skips it, as in one process.
    """
    got = four_ranks[0]["fsdp2"]
    errors = _errors(got["params"], one_process["params"])
    assert max(errors.values()) <= PARAM_REL, _worst(errors)
    initial = dict(_model().named_parameters())
    assert all(torch.equal(got["params"][n], p) for n, p in initial.items() if ".indexer." in n)


def test_no_block_in_the_batch_gives_no_compressor_gradient(four_ranks: list[dict[str, Any]]) -> None:
    """Documents all shorter than 16: the HCA compressor gets no gradient on any rank (as one process), CSA's does."""
    for r in four_ranks:
        missing = {n for n, present in r["short"].items() if not present}
        assert {n.split(".self_attn.")[0] for n in missing} == {"model.layers.1", "model.layers.2"}, sorted(missing)
        assert all(".indexer." in n or n.startswith("model.layers.2.self_attn.compressor.") for n in missing), sorted(missing)
        assert any(n.startswith("model.layers.2.self_attn.compressor.") for n in missing)
