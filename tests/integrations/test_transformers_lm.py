"""A whole Hugging Face ``DeepseekV4ForCausalLM`` under CP equals the model run on each document alone.

Oracle: the ``transformers`` model itself in one process (eager attention and experts), once
per document (batch 1, positions from 0, its own sliding-window mask), with the next-token
cross-entropy of each document summed and divided by the batch's count of valid labels;
loss and every parameter gradient (``None`` in Hugging Face counts as zero: its indexer is
never trained). The CP side is :func:`cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss`
on gloo ranks: a group of 3 ranks runs every case at cp 1-3 on the groups of ranks
0..cp-1 (the ranks' imports of transformers dominate the cost); a group of 4 ranks runs
padded zigzag with the indexer loss at cp 1-4 and the cross-rank checks at cp 4. The tiny random model has
one sliding, one CSA (ratio 4, with its indexer) and one HCA (ratio 16) layer, a hash-routed
and two learned MoE layers, hyper-connections (``hc_mult=2``) and random sinks, position
biases and hash table. Cases:

* ``contiguous/allgather``: ``cu_seqlens`` with an empty document; ``contiguous/need``:
  Hugging Face's restart-at-0 ``position_ids`` (``DataCollatorWithFlattening``);
  ``zigzag/allgather`` and ``zigzag/need``: per-document zigzag over documents of multiples of
  24 tokens; ``balanced/allgather`` and ``balanced/need`` (position_ids): the balanced layout
  (shards of unequal length).
  Labels hold ``ignore_index`` tokens. Gradients are all-reduced (SUM) over the CP group.
* ``ddp``: ``grad_reduction="mean"`` under a real ``DistributedDataParallel`` without
  ``find_unused_parameters`` (two iterations: its reducer raises in the second forward when
  a parameter got no gradient in the first), with the indexer loss on.
* ``checkpoint``: activation checkpointing (non-reentrant), two micro-batches' forwards before
  one backward, with the indexer loss on.

The CP loss is the chunked one (``chunk_size=5``, 7 in the padded case: several uneven chunks per
rank, so the whole model's gradients pass through the chunked cross-entropy's backward);
``contiguous/allgather`` also asks for the logits (``return_logits=True``), the others get ``None``.

Every CP forward runs with Hugging Face's ``create_sliding_window_causal_mask`` replaced by
one that raises: no mask is built. The indexer (trained only with ``indexer_loss=True``, which
HF lacks) is compared with cp 1 of the same case.

Tolerances. HF computes its RMSNorms, RoPE, softmaxes and hyper-connection weights in float32
even in a float64 model; both sides run with those casts lifted to float64 (``lifted``, as in
test_transformers.py, whose shipped-cast comparison covers the attention), and the oracle's
indexer top-k breaks ties towards the earlier entry, as cpkv does. What remains is summation
order in float64 (eps 2.2e-16) through three layers of 20 Sinkhorn iterations, softmaxes and
norms: measured <= 2e-15 absolute on the loss (~4.2) and <= 2e-13 relative (to each gradient's
max magnitude) on the gradients, at every cp and in every case. Bounds: 1e-12 on the loss,
1e-11 on gradients (50x the worst measured); an unshifted label, a local normaliser, a
missing rank or another micro-batch's plan gives >= 1e-3.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers>=5.23 (the transformers/test extra) is missing")

from cpkv.integrations.causal_lm import (  # noqa: E402
    causal_lm_loss,
    cu_seqlens_from_position_ids,
    shard_by_plan,
    shift_labels,
)
from cpkv.launch import spawn  # noqa: E402
from cpkv.plan import plan_attention, seqlens_to_cu_seqlens  # noqa: E402
from tests.integrations import hf_oracle  # noqa: E402
from tests.shared_spawn import shared_spawn  # noqa: E402

VOCAB, IGNORE = 64, -100
# 72 tokens (divisible by cp 1-4: the cross-rank checks run at cp 4). At cp 3 (24 tokens a rank) rank 1 holds no ratio-16 block
# of its own (the 19-token document's one block ends on rank 2): its HCA compressor does not run.
LENGTHS = [5, 0, 30, 3, 1, 19, 14]
OTHER_LENGTHS = [20, 16, 36]  # the second micro-batch of the checkpointing case
ZIGZAG_LENGTHS = [48, 24]  # multiples of 2*cp for cp 1-4
LOSS_ABS, GRAD_REL = 1e-12, 1e-11
CHUNK = 5  # tokens per chunk of the loss: several uneven chunks on every rank (not the default 1024, one chunk here)


def _config() -> Any:
    """The tiny config (:func:`cpkv.bench.hf_compile.hf_config`) with HF's eager experts (grouped_mm has no float64)."""
    from cpkv.bench.hf_compile import hf_config

    return hf_config("eager")


def _model() -> Any:
    """The float64 model, the same on every rank (HF leaves sinks, position biases and the hash table at 0)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model: Any = DeepseekV4ForCausalLM(_config()).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                param.normal_(generator=gen)
            elif name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        table = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(VOCAB)])
        model.model.layers[0].mlp.gate.tid2eid.copy_(table)
    return model


def _batch(lengths: list[int], seed: int) -> dict[str, Any]:
    """Packed ids, unshifted labels (every 7th token ignored) and cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    labels = ids.clone()
    labels[3::7] = IGNORE
    return {"ids": ids, "labels": labels, "cu": seqlens_to_cu_seqlens(lengths, dtype=torch.int64), "lengths": lengths}


PAD_LENGTHS = [13, 0, 30, 5, 19]  # padded per cp to multiples of 2*cp (zigzag); 67 real tokens
BATCHES = {"main": (LENGTHS, 1), "other": (OTHER_LENGTHS, 2), "zigzag": (ZIGZAG_LENGTHS, 4), "padded": (PAD_LENGTHS, 5)}


@contextlib.contextmanager
def _no_mask() -> Iterator[None]:
    """HF's mask builder raises: a CP forward that builds a [T/cp, T/cp] mask fails."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("create_sliding_window_causal_mask was called under CP")

    with mock.patch.object(modeling_deepseek_v4, "create_sliding_window_causal_mask", refuse):
        yield


# --- the CP side, on every rank ------------------------------------------------------------


def _reduced_grads(model: Any, group: Any, reduce: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Parameter gradients, summed over the group (``reduce``) in one all-reduce, and the names without one."""
    import torch.distributed as dist

    params = list(model.named_parameters())
    missing = [n for n, p in params if p.grad is None]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in params])
    if reduce:
        dist.all_reduce(flat, group=group)
    grads, offset = {}, 0
    for name, p in params:
        grads[name] = flat[offset: offset + p.numel()].view_as(p).clone()
        offset += p.numel()
    return grads, missing


def _sum_all(value: torch.Tensor, group: Any) -> float:
    import torch.distributed as dist

    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total)


def _holds_state(model: Any) -> list[str]:
    """Modules that keep a plan or a context after the forward (there must be none)."""
    from cpkv.integrations.transformers_lm import DeepseekV4CPContext
    from cpkv.plan.attention import AttentionPlan

    return [name for name, m in model.named_modules() for v in vars(m).values() if isinstance(v, (AttentionPlan, DeepseekV4CPContext))]


def _run(model: Any, batch: dict[str, Any], group: Any, **options: Any) -> Any:
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss

    source = options.pop("source", "cu")
    options.setdefault("chunk_size", CHUNK)
    if source == "position_ids":  # DataCollatorWithFlattening's form: positions restart at 0, [1, T]
        positions = torch.cat([torch.arange(n) for n in batch["lengths"]])[None]
        where = {"position_ids": positions}
    else:
        where = {"cu_seqlens": batch["cu"]}
    return deepseek_v4_causal_lm_loss(model, batch["ids"][None], group, labels=batch["labels"][None], backend="reference",
                                      **where, **options)


def _sum_case(model: Any, group: Any, batch: dict[str, Any], *, wrapper: Any = None, **options: Any) -> dict[str, Any]:
    """One micro-batch through ``wrapper`` (default ``model``), gradients of ``model`` summed over the group."""
    out = _run(model if wrapper is None else wrapper, batch, group, **options)
    out.loss.backward()
    grads, missing = _reduced_grads(model, group, reduce=True)
    from cpkv.plan.cost import CostModel

    planned = (out.plan.layout, out.plan.exchange, out.plan.cost_model == CostModel.from_deepseek_v4(model.config))
    return {"loss": _sum_all(out.loss, group), "lm_loss": float(out.lm_loss), "grads": grads, "missing": missing,
            "num_tokens": int(out.num_tokens), "state": _holds_state(model), "planned": planned,
            "logits": None if out.logits is None else (tuple(out.logits.shape), out.logits.requires_grad)}


def _ddp_case(model: Any, group: Any, batch: dict[str, Any]) -> dict[str, Any]:
    """``grad_reduction="mean"`` under DDP (averaging) without find_unused_parameters, twice."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, process_group=group, find_unused_parameters=False)
    for _ in range(2):  # the reducer raises in the second forward if a parameter had no gradient in the first
        model.zero_grad(set_to_none=True)
        out = _run(ddp, batch, group, layout="contiguous", exchange="need", grad_reduction="mean", indexer_loss=True)
        out.loss.backward()
    grads, missing = _reduced_grads(model, group, reduce=False)  # DDP averaged them already
    routes = out.plan.compressed[16]
    return {"loss": _sum_all(out.loss, group) / out.plan.cp_size, "lm_loss": float(out.lm_loss), "grads": grads,
            "missing": missing, "indexer": {k: float(v) for k, v in out.indexer_losses.items()},
            "hca_blocks": routes.own.num_entries + routes.straddle.num_entries}


def _checkpoint_case(model: Any, group: Any, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Activation checkpointing (non-reentrant): two micro-batches' forwards, then one backward."""
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    outs = [_run(model, first, group, layout="contiguous", exchange="allgather", indexer_loss=True),
            _run(model, second, group, layout="contiguous", exchange="need", indexer_loss=True)]
    (outs[0].loss + outs[1].loss).backward()
    grads, missing = _reduced_grads(model, group, reduce=True)
    return {"loss": _sum_all(outs[0].loss + outs[1].loss, group), "grads": grads, "missing": missing,
            "state": _holds_state(model)}


def _not_enabled(model: Any, group: Any, batch: dict[str, Any]) -> str:
    try:
        _run(model, batch, group, layout="contiguous", exchange="allgather")
    except (ValueError, TypeError) as error:
        return str(error)
    return "no error"


def _all_cp_sizes(rank: int, world: int) -> dict[int, dict[str, Any]]:
    """Every case at cp 1..world: the group of cp ``k`` is ranks ``0..k-1`` (the others wait)."""
    import torch.distributed as dist

    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    batches = {key: _batch(*value) for key, value in BATCHES.items()}
    results: dict[int, dict[str, Any]] = {}
    for cp in range(1, world + 1):
        group = dist.new_group(list(range(cp)))  # collective: every rank creates every group
        if rank >= cp:
            continue
        # Built outside hf_oracle.lifted(): HF's init draws (and its inv_freq) depend on the dtype.
        models = [enable_deepseek_v4_cp(_model()) for _ in range(8)]
        plain = _model() if cp == 1 else None
        compiled = enable_deepseek_v4_cp(_model()) if cp == 2 else None
        for layer in compiled.model.layers if compiled is not None else []:
            layer.self_attn.compile(backend="aot_eager")  # the whole model: test_whole_model_compiles
        with hf_oracle.lifted(), _no_mask():
            cases = {
                "contiguous/allgather": _sum_case(models[0], group, batches["main"], layout="contiguous", exchange="allgather",
                                                  return_logits=True),
                "contiguous/need": _sum_case(models[1], group, batches["main"], layout="contiguous", exchange="need",
                                             source="position_ids"),
                "zigzag/allgather": _sum_case(models[2], group, batches["zigzag"], layout="zigzag", exchange="allgather"),
                "zigzag/need": _sum_case(models[5], group, batches["zigzag"], layout="zigzag", exchange="need"),
                "balanced/allgather": _sum_case(models[6], group, batches["main"], layout="balanced", exchange="allgather"),
                "balanced/need": _sum_case(models[7], group, batches["main"], source="position_ids"),  # the defaults
                "ddp": _ddp_case(models[3], group, batches["main"]),
                "checkpoint": _checkpoint_case(models[4], group, batches["main"], batches["other"]),
            }
            if cp == 1:
                cases["not_enabled"] = _not_enabled(plain, group, batches["main"])
            if compiled is not None:
                cases["compiled"] = _sum_case(compiled, group, batches["main"], layout="contiguous", exchange="need")
            hca = [0] * cp
            dist.all_gather_object(hca, cases["ddp"]["hca_blocks"], group=group)
            cases["ddp"]["hca_blocks"] = hca
            if rank == 0:
                results[cp] = cases
    return results


CP_RUNS = shared_spawn(_all_cp_sizes, 3, timeout=280.0)


@pytest.fixture(scope="module")
def cp_runs(request: pytest.FixtureRequest) -> dict[int, dict[str, Any]]:
    """One group of 3 ranks runs cp 1, 2 and 3 (tests/shared_spawn.py's 3-rank spawn); rank 0 returns the
    group-reduced results.

    (cp 4 of the attention layer is tests/integrations/test_transformers.py's; the whole model
    at cp 4 on two cores cost a third of this fixture.)
    """
    return CP_RUNS.run(request)[0]  # type: ignore[no-any-return]


@pytest.fixture(params=[1, 2, 3], ids=lambda w: f"cp{w}")
def cp_run(request: pytest.FixtureRequest, cp_runs: dict[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    return request.param, cp_runs[request.param]


def _padded_case(model: Any, group: Any, batch: dict[str, Any], cp: int, exchange: str) -> dict[str, Any]:
    """The docstring's zigzag recipe: every document padded to a multiple of ``2 * cp``, ``padding=`` passed.

    The padding's labels are left as ``pad_documents`` fills them (0, a real token id): the
    call itself makes them no targets.
    """
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss
    from cpkv.plan import pad_documents

    padded = pad_documents(batch["ids"][:, None], batch["cu"], 2 * cp)
    labels = pad_documents(batch["labels"][:, None], batch["cu"], 2 * cp).x[:, 0]
    out = deepseek_v4_causal_lm_loss(model, padded.x[:, 0][None], group, cu_seqlens=padded.cu_seqlens, labels=labels[None],
                                     layout="zigzag", exchange=exchange, padding=padded.padding, indexer_loss=True,
                                     backend="reference", chunk_size=CHUNK + 2)  # type: ignore[arg-type]
    out.loss.backward()
    grads, missing = _reduced_grads(model, group, reduce=True)
    return {"loss": _sum_all(out.loss, group), "lm_loss": float(out.lm_loss), "grads": grads, "missing": missing,
            "num_tokens": int(out.num_tokens), "indexer": {k: float(v) for k, v in out.indexer_losses.items()},
            "queries": out.plan.num_global_queries}


def _padding_and_ranks(rank: int, world: int) -> dict[str, Any]:
    """cp 1..world: the padded zigzag batch with the indexer loss; at cp ``world``, batches that differ by rank."""
    import torch.distributed as dist

    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    batch = _batch(*BATCHES["padded"])
    results: dict[str, Any] = {}
    for cp in range(1, world + 1):
        group = dist.new_group(list(range(cp)))
        if rank >= cp:
            continue
        models = [enable_deepseek_v4_cp(_model()) for _ in range(3 if cp == 1 else 1)]  # outside lifted(), as above
        with hf_oracle.lifted(), _no_mask():
            if cp == 1:  # the indexer's reference: the unpadded batch, contiguous, one process
                results["unpadded"] = _sum_case(models[1], group, batch, indexer_loss=True)
                results["unpadded"]["indexer"] = {
                    k: float(v) for k, v in _run(models[2], batch, group, indexer_loss=True).indexer_losses.items()}
            results[f"padded/cp{cp}"] = _padded_case(models[0], group, batch, cp, "need" if cp % 2 == 0 else "allgather")
    model, batch = enable_deepseek_v4_cp(_model()), _batch(*BATCHES["main"])  # 72 tokens: contiguous at cp 4
    ids, labels = batch["ids"].clone(), batch["labels"].clone()
    local = ids.numel() // world
    if rank == world - 1:  # the first token of the last rank's shard: the previous rank's last label
        ids[(world - 1) * local] = (ids[(world - 1) * local] + 1) % VOCAB
    with _no_mask():
        results["changed_token"] = hf_oracle.outcome(lambda: _run(model, {**batch, "ids": ids}, None))
        results["changed_token_unchecked"] = hf_oracle.outcome(lambda: _run(model, {**batch, "ids": ids}, None, check_ranks=False))
        short = labels[:-1] if rank == 2 else labels
        results["short_labels"] = hf_oracle.outcome(lambda: _run(model, {**batch, "labels": short}, None))
    return results


PADDING_RUNS = shared_spawn(_padding_and_ranks, 4, timeout=240.0)


@pytest.fixture(scope="module")
def padding_runs(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """One group of 4 ranks: the padding case at cp 1-4, then the cross-rank checks at cp 4 (every rank's result)."""
    return PADDING_RUNS.run(request)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_padding_keeps_padding_out_of_loss_and_indexer(padding_runs: list[dict[str, Any]], cp: int) -> None:
    """Padded zigzag with ``padding=``: loss, every gradient, the indexer's gradients and losses equal the unpadded batch's."""
    got, want, base = padding_runs[0][f"padded/cp{cp}"], _hf("padded"), padding_runs[0]["unpadded"]
    assert got["missing"] == [] and got["num_tokens"] == want["count"] and got["queries"] == sum(PAD_LENGTHS)
    assert abs(got["loss"] - want["loss"]) <= LOSS_ABS and abs(got["lm_loss"] - want["loss"]) <= LOSS_ABS
    indexer = _indexer(want["grads"])
    errors = _grad_errors(got["grads"], want["grads"], skip=indexer)
    assert max(errors.values()) <= GRAD_REL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert all(float(base["grads"][n].abs().max()) > 0 for n in indexer)
    errors = _grad_errors({n: got["grads"][n] for n in indexer}, {n: base["grads"][n] for n in indexer})
    assert max(errors.values()) <= GRAD_REL, errors
    assert got["indexer"].keys() == base["indexer"].keys() == {1}
    assert abs(got["indexer"][1] - base["indexer"][1]) <= 1e-12 * abs(base["indexer"][1])


def test_a_changed_token_on_one_rank_raises_on_every_rank(padding_runs: list[dict[str, Any]]) -> None:
    """One token of the last rank's ids differs (its label is the previous rank's): every rank raises."""
    outcomes = [r["changed_token"] for r in padding_runs]
    assert all(o.startswith("ValueError") and "token ids or labels differ" in o for o in outcomes), outcomes
    assert all(r["changed_token_unchecked"] == "no error" for r in padding_runs)  # check_ranks=False: the user's call
    assert outcomes[0] in (Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md").read_text(encoding="utf-8")


def test_short_labels_on_one_rank_raise_on_every_rank_naming_labels(padding_runs: list[dict[str, Any]]) -> None:
    n = sum(LENGTHS)
    outcomes = [r["short_labels"] for r in padding_runs]
    assert outcomes[2] == f"ValueError: labels must hold input_ids' {n} tokens, got {n - 1}", outcomes
    assert all(o.startswith("ValueError: rank 2 of the group failed") and "labels must hold" in o
               for i, o in enumerate(outcomes) if i != 2), outcomes


# --- the Hugging Face side, in the test process ------------------------------------------


@functools.cache
def _hf(key: str) -> dict[str, Any]:
    """HF's model on each document alone: the batch's mean next-token CE over valid labels, and its gradients."""
    batch = _batch(*BATCHES[key])
    model = _model()
    cu = batch["cu"].tolist()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with hf_oracle.lifted(), hf_oracle.earlier_ties():
        for start, end in zip(cu[:-1], cu[1:]):
            if end - start < 2:
                continue
            logits = model(input_ids=batch["ids"][start:end][None], use_cache=False).logits[0]
            targets = batch["labels"][start + 1: end]  # predict token t + 1 of the same document
            total = total + torch.nn.functional.cross_entropy(logits[:-1], targets, ignore_index=IGNORE, reduction="sum")
            count += int((targets != IGNORE).sum())
        loss = total / count
        loss.backward()  # type: ignore[no-untyped-call]
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    return {"loss": float(loss.detach()), "grads": grads, "count": count, "untrained": {n for n, p in model.named_parameters() if p.grad is None}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _grad_errors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], skip: set[str] = frozenset()) -> dict[str, float]:  # type: ignore[assignment]
    assert actual.keys() == expected.keys()
    return {n: _rel(actual[n], g) if g.abs().max() > 0 else float(actual[n].abs().max()) for n, g in expected.items() if n not in skip}


def _indexer(names: Any) -> set[str]:
    return {n for n in names if ".indexer." in n}


RUNS = {"contiguous/allgather": "main", "contiguous/need": "main", "zigzag/allgather": "zigzag", "zigzag/need": "zigzag",
        "balanced/allgather": "main", "balanced/need": "main"}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(RUNS))
def test_loss_and_gradients_match_hf_per_document(cp_run: tuple[int, dict[str, Any]], case: str) -> None:
    """Loss, logged loss, valid count and every gradient (summed over the ranks) equal HF's, each document alone."""
    _cp, results = cp_run
    got, want = results[case], _hf(RUNS[case])
    assert set(got["missing"]) == want["untrained"], "a gradient exactly where HF gives one (zeros where a rank runs none)"
    assert abs(got["loss"] - want["loss"]) <= LOSS_ABS and abs(got["lm_loss"] - want["loss"]) <= LOSS_ABS
    assert got["num_tokens"] == want["count"]
    errors = _grad_errors(got["grads"], want["grads"])
    assert max(errors.values()) <= GRAD_REL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    assert _indexer(want["untrained"]) and all(float(got["grads"][n].abs().max()) == 0 for n in _indexer(want["untrained"]))
    assert got["state"] == []
    # The logits only when asked (contiguous/allgather asks): this rank's [T/cp, V], the head's differentiable output.
    assert got["logits"] == (((sum(LENGTHS) // _cp, VOCAB), True) if case == "contiguous/allgather" else None)
    assert got["planned"] == (*case.split("/"), True)  # "balanced/need" is the call's defaults, by the model's own cost


def test_mean_reduction_under_ddp(cp_run: tuple[int, dict[str, Any]], cp_runs: dict[int, dict[str, Any]]) -> None:
    """``grad_reduction="mean"``: DDP's averaged gradients are the single-process ones, with no unused parameter."""
    cp, results = cp_run
    got, want = results["ddp"], _hf("main")
    assert got["missing"] == []
    assert abs(got["loss"] - want["loss"]) <= LOSS_ABS and abs(got["lm_loss"] - want["loss"]) <= LOSS_ABS
    indexer = _indexer(got["grads"])
    errors = _grad_errors(got["grads"], want["grads"], skip=indexer)
    assert max(errors.values()) <= GRAD_REL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    # The indexer learns only from cpkv's KL loss (HF has none): cp 1 of the same case is the reference.
    base = cp_runs[1]["ddp"]
    assert all(float(base["grads"][n].abs().max()) > 0 for n in indexer)
    errors = _grad_errors({n: got["grads"][n] for n in indexer}, {n: base["grads"][n] for n in indexer})
    assert max(errors.values()) <= GRAD_REL, errors
    assert got["indexer"].keys() == {1} and abs(got["indexer"][1] - base["indexer"][1]) <= 1e-12 * abs(base["indexer"][1])
    if cp == 3:  # the case the zero gradients are for: a rank running no HCA compressor
        assert 0 in got["hca_blocks"], got["hca_blocks"]


def test_checkpointing_two_forwards_before_one_backward(cp_run: tuple[int, dict[str, Any]], cp_runs: dict[int, dict[str, Any]]) -> None:
    """Each recomputed layer reads its own micro-batch's plan (it travels in the forward's kwargs)."""
    _cp, results = cp_run
    got = results["checkpoint"]
    first, second = _hf("main"), _hf("other")
    want = {n: first["grads"][n] + second["grads"][n] for n in first["grads"]}
    assert got["missing"] == [] and got["state"] == []
    assert abs(got["loss"] - (first["loss"] + second["loss"])) <= 2 * LOSS_ABS
    indexer = _indexer(want)
    errors = _grad_errors(got["grads"], want, skip=indexer)
    assert max(errors.values()) <= GRAD_REL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    base = cp_runs[1]["checkpoint"]["grads"]
    errors = _grad_errors({n: got["grads"][n] for n in indexer}, {n: base[n] for n in indexer})
    assert max(errors.values()) <= GRAD_REL, errors


def test_compiled_attention_matches_hf(cp_runs: dict[int, dict[str, Any]]) -> None:
    """The attention modules under ``torch.compile`` (aot_eager: Dynamo and AOTAutograd) at cp 2."""
    got, want = cp_runs[2]["compiled"], _hf("main")
    assert set(got["missing"]) == want["untrained"] and abs(got["loss"] - want["loss"]) <= LOSS_ABS
    errors = _grad_errors(got["grads"], want["grads"])
    assert max(errors.values()) <= GRAD_REL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def _compiled_model(rank: int, world: int) -> dict[str, Any]:
    """The whole model compiled, and eager, both as HF ships it (Dynamo does not see lifted's patches)."""
    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    eager, compiled = enable_deepseek_v4_cp(_model()), enable_deepseek_v4_cp(_model())
    batch = _batch(*BATCHES["main"])
    with _no_mask():
        return {"eager": _sum_case(eager, None, batch), "compiled": _sum_case(compiled, None, batch, wrapper=torch.compile(compiled, backend="aot_eager"))}


@pytest.mark.skipif(os.environ.get("CPKV_SLOW_TESTS") != "1", reason=(
    "slow: Hugging Face's DeepseekV4ForCausalLM itself takes ~30 s to compile (forward + backward,"
    " aot_eager; ~4 min with a cold inductor) on 2 CPU cores, the CP model ~37 s at cp 2;"
    " CI compiles the attention modules (test_compiled_attention_matches_hf). Run with CPKV_SLOW_TESTS=1"))
@pytest.mark.timeout(600)
def test_whole_model_compiles() -> None:
    """``torch.compile(model)`` of the whole CP model at cp 2 equals the eager CP model (itself HF's, above)."""
    result = spawn(_compiled_model, 2, timeout=500.0)[0]
    got, want = result["compiled"], result["eager"]
    assert got["missing"] == want["missing"] and abs(got["loss"] - want["loss"]) <= LOSS_ABS
    errors = _grad_errors(got["grads"], want["grads"])
    assert max(errors.values()) <= GRAD_REL, sorted(errors.items(), key=lambda kv: -kv[1])[:3]


def test_a_model_without_enable_raises(cp_runs: dict[int, dict[str, Any]]) -> None:
    assert "call enable_deepseek_v4_cp(model)" in cp_runs[1]["not_enabled"]


# --- single process: the model's structure, labels, boundaries ------------------------------


def test_enable_keeps_names_classes_and_hf_forward() -> None:
    """state_dict keys and module classes are unchanged; without a context the forward is HF's, bit for bit."""
    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    plain, enabled = _model(), _model()
    classes = [type(m) for m in plain.modules()]
    assert enable_deepseek_v4_cp(enabled) is enabled and enable_deepseek_v4_cp(enabled) is enabled
    assert list(enabled.state_dict()) == list(plain.state_dict())
    assert [type(m) for m in enabled.modules()] == classes
    ids = _batch(LENGTHS, 1)["ids"][None, :20]
    with torch.no_grad():
        assert torch.equal(enabled(input_ids=ids, use_cache=False).logits, plain(input_ids=ids, use_cache=False).logits)


def test_cp_forward_rejects_masks_caches_and_batches() -> None:
    """A CP layer takes one packed row, no [T/cp, T/cp] mask and no decoding cache (raised before any collective)."""
    from cpkv.integrations.transformers_lm import CONTEXT_KWARG, DeepseekV4CPContext, enable_deepseek_v4_cp

    attention = enable_deepseek_v4_cp(_model()).model.layers[1].self_attn
    context = DeepseekV4CPContext(plan_attention(torch.tensor([0, 8]), 1, 0, compress_ratios=[4, 16]))
    x = torch.zeros(1, 8, 64, dtype=torch.float64)
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="attention_mask must be None under CP"):
        attention(x, position_embeddings=None, position_ids=None, attention_mask=mask, **{CONTEXT_KWARG: context})
    with pytest.raises(ValueError, match="attention_mask must be None under CP"):
        attention(x, None, None, mask, **{CONTEXT_KWARG: context})
    with pytest.raises(ValueError, match="use_cache=False"):
        attention(x, None, None, None, cache=object(), **{CONTEXT_KWARG: context})
    with pytest.raises(ValueError, match=r"\[1, T/cp, hidden\]"):
        attention(x.expand(2, 8, 64), None, None, None, **{CONTEXT_KWARG: context})
    with pytest.raises(TypeError, match="must be a DeepseekV4CPContext"):
        attention(x, None, None, None, **{CONTEXT_KWARG: context.plan})


def test_enable_rejects_other_modules() -> None:
    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM or DeepseekV4Model"):
        enable_deepseek_v4_cp(torch.nn.Linear(2, 2))


def test_shift_labels_stops_at_document_ends() -> None:
    labels = torch.arange(10, 19)
    cu = torch.tensor([0, 4, 4, 5, 9])  # documents of 4, 0, 1 and 4 tokens
    assert shift_labels(labels, cu).tolist() == [11, 12, 13, IGNORE, IGNORE, 16, 17, 18, IGNORE]
    assert shift_labels(labels[None], cu, ignore_index=-1).tolist()[3:5] == [-1, -1]
    with pytest.raises(ValueError, match="cu_seqlens"):
        shift_labels(labels, torch.tensor([0, 4]))


def test_shift_labels_with_padding_is_the_unpadded_shift() -> None:
    """Padded with ``pad_documents``: the shifted labels of the real tokens are the unpadded batch's, the rest ignored."""
    from cpkv.integrations.causal_lm import padding_mask
    from cpkv.plan import pad_documents

    labels, cu = torch.arange(10, 19), torch.tensor([0, 4, 4, 5, 9])
    padded = pad_documents(labels[:, None], cu, 4)
    mask = padding_mask(padded.cu_seqlens, padded.padding)
    assert mask.tolist() == [t not in padded.token_index.tolist() for t in range(int(padded.cu_seqlens[-1]))]
    garbage = padded.x[:, 0].masked_fill(mask, 7)  # a real id in the padding: still no target
    shifted = shift_labels(garbage, padded.cu_seqlens, padding=padded.padding)
    assert shifted[padded.token_index].tolist() == shift_labels(labels, cu).tolist()
    assert bool((shifted[mask] == IGNORE).all())
    with pytest.raises(ValueError, match=r"padding\[1\] = 1 must be in \[0, 0\]"):
        shift_labels(labels, cu, padding=torch.tensor([0, 1, 0, 0]))
    with pytest.raises(ValueError, match=r"labels must hold the batch's 9 tokens \(cu_seqlens\[-1\]\), got 8"):
        shift_labels(labels[:8], cu)


def test_batch_fingerprint_sees_every_change_of_one_or_two_tokens() -> None:
    """Against the formula in Python integers; every single change and 2000 random pairs give another fingerprint."""
    from cpkv.integrations.causal_lm import batch_fingerprint

    p = 2**31 - 1
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-100, 2**20, (300,), generator=gen)
    want = [sum((v % p) * (t + 1) ** k for t, v in enumerate(x.tolist())) % p for k in (1, 2)]
    assert batch_fingerprint(x).tolist() == want
    assert batch_fingerprint(x, x[None]).tolist() == want * 2
    base = batch_fingerprint(x)
    for t in range(x.numel()):
        y = x.clone()
        y[t] = -100 if int(y[t]) != -100 else 0
        assert not torch.equal(batch_fingerprint(y), base), t
    for _ in range(2000):
        i, j = torch.randperm(x.numel(), generator=gen)[:2].tolist()
        y = x.clone()
        y[i], y[j] = y[j] + 1, y[i]  # a swap and a change: sums of ids and of labels unchanged or near
        assert not torch.equal(batch_fingerprint(y), base), (i, j)
    with pytest.raises(TypeError, match="integer"):
        batch_fingerprint(torch.zeros(3))


def test_cu_seqlens_from_position_ids() -> None:
    assert cu_seqlens_from_position_ids(torch.tensor([[0, 1, 2, 0, 0, 1]])).tolist() == [0, 3, 4, 6]
    for bad, token in [([1, 2, 0], 0), ([0, 1, 3, 0], 2), ([0, 1, 1], 2)]:
        with pytest.raises(ValueError, match=f"token {token} has position"):
            cu_seqlens_from_position_ids(torch.tensor(bad))
    with pytest.raises(ValueError, match=r"\[T\] or \[1, T\]"):
        cu_seqlens_from_position_ids(torch.zeros(2, 3, dtype=torch.long))


def test_shard_by_plan_follows_the_layout() -> None:
    cu = torch.tensor([0, 8, 12])
    x = torch.arange(12)
    assert shard_by_plan(x, cu, plan_attention(cu, 2, 1)).tolist() == list(range(6, 12))
    assert shard_by_plan(x, cu, plan_attention(cu, 2, 0, layout="zigzag")).tolist() == [0, 1, 6, 7, 8, 11]
    with pytest.raises(ValueError, match="plan.num_tokens"):
        shard_by_plan(x[:10], cu, plan_attention(cu, 2, 1))


def test_causal_lm_loss_rejects_bad_arguments() -> None:
    logits, labels = torch.randn(4, 8), torch.tensor([1, 2, IGNORE, 3])
    with pytest.raises(ValueError, match="grad_reduction must be one of"):
        causal_lm_loss(logits, labels, None, grad_reduction="avg", num_items_in_batch=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"labels must be \[T/cp\]"):
        causal_lm_loss(logits, labels[:3], None, num_items_in_batch=3)
    with pytest.raises(ValueError, match="num_items_in_batch must be >= 1"):
        causal_lm_loss(logits, labels, None, num_items_in_batch=0)


# --- the example, at CI size -----------------------------------------------------------------


@pytest.mark.timeout(120)
def test_training_example_runs(tmp_path: Any) -> None:
    """examples/hf_causal_lm_cp.py: 2 AdamW steps on 4 ranks (DDP) beside one process, and its plot."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    plot = tmp_path / "losses.png"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "examples" / "hf_causal_lm_cp.py"), "--steps", "2", "--ddp", "--plot", str(plot)],
                          capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CP matches one process" in proc.stdout and proc.stdout.count("\n   ") == 2
    assert plot.read_bytes()[:4] == b"\x89PNG"
