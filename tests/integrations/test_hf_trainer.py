"""Hugging Face's ``Trainer`` under CP (:mod:`cpkv.integrations.hf_trainer`) equals one process's ``Trainer``.

Oracle: a plain ``transformers.Trainer`` in the test process (not distributed) on the same
documents, ``TrainingArguments``, optimizer, linear schedule, gradient clipping and gradient
accumulation (2), whose ``compute_loss`` runs Hugging Face's model on each document alone
(batch 1, positions from 0) and divides the summed cross-entropy by Trainer's own
``num_items_in_batch``; with ``dp`` CP groups its per-device batch is ``dp`` times theirs.
With the indexer loss (HF has none) the oracle's ``compute_loss`` is cpkv at cp 1 on a 1-rank
group in the test process. The CP side is ``CPTrainerMixin`` + ``Trainer`` on gloo ranks with
the environment ``torchrun`` gives (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``...;
``use_cpu=True``), accelerate's DDP over every rank with Trainer's ``find_unused_parameters``
(``True``: HF's indexer gets no gradient). One group of 4 ranks runs, with 4 SGD-momentum
steps (lr 0.1), dp 2 x cp 2 (balanced layout, need exchange; then a resume from its step-2
checkpoint, read with HF's module as installed: ``ShippedLoad``) and dp 1 x cp 4 (zigzag,
padded); with 3 AdamW steps (lr 1e-2, ``weight_decay=0.1``) dp 2 x cp 2 (need) and dp 1 x cp 4
(balanced), indexer loss off and on; and a batch that differs on one rank. One group of 2 runs
dp 1 x cp 2 (contiguous, padded). (The groups: tests/shared_spawn.py's spawns of 4 and 2 ranks.)
Compared: every step's logged loss and every final parameter.

Tolerances. Both sides run float64 with HF's float32 casts lifted (``hf_oracle.lifted``) and
the oracle's indexer ties to the earlier entry, as in test_transformers_lm.py, whose
single-micro-batch bounds are 1e-12 on the loss and 1e-11 relative on gradients. After SGD
steps the parameters are a linear function of the gradients; AdamW divides by sqrt(v), so
where a gradient is about 0 its rounding flips the update. Measured, at every dp x cp:
<= 8.9e-16 on every micro-batch's loss (float64, recorded by ``Recording``), <= 1.2e-7 relative
on the logged loss (Trainer sums it in a float32 tensor), <= 4.9e-14 (SGD) and <= 5.1e-11
(AdamW) on the parameters (max |diff| over the tensor's max |value|). Bounds: 1e-12, 1e-6,
1e-12 and 1e-8. CP groups fed the same batches and a missing ``dp`` factor give 2.1 on the loss
and the parameters; zero gradients where HF has none (cpkv 0.3.0) 2.0e-2 on the AdamW runs'
parameters; a resume that rounds HF's float32 tensors 5.2e-8 on the resumed parameters.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers>=5.23 (the transformers/test extra) is missing")
pytest.importorskip("accelerate", reason="accelerate (the test extra) is missing")

from cpkv.launch import spawn  # noqa: E402
from tests.integrations import hf_oracle  # noqa: E402
from tests.integrations.test_transformers_lm import IGNORE, VOCAB, _model, _no_mask  # noqa: E402
from tests.shared_spawn import TmpPath, shared_spawn  # noqa: E402

STEPS, ACCUMULATION, PER_DEVICE = 4, 2, 4  # per-device batch of dp 1 (and of the oracle); dp 2: half
LOSS_ABS, PARAM_REL, LOGGED_REL, RESUME_REL = 1e-12, 1e-12, 1e-6, 1e-13
ADAMW = {"optim": "adamw_torch", "optim_args": None, "weight_decay": 0.1, "learning_rate": 1e-2, "max_steps": 3}
ADAMW_PARAM_REL = 1e-8
EVAL_BATCH, EVAL_STEPS = 3, 2  # per-device eval batch; evaluation inside training every 2 steps
EVAL_ABS, LOG_PROB_ABS = 1e-12, 1e-12


def _documents(count: int = 32, seed: int = 7) -> list[dict[str, list[int]]]:
    """``count`` documents of 1-20 tokens; unshifted labels with every 5th token ignored."""
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (int(torch.randint(1, 21, (1,), generator=gen)),), generator=gen)
        labels = ids.clone()
        labels[2::5] = IGNORE
        docs.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return docs


def _eval_documents(remainder: bool = False) -> list[dict[str, list[int]]]:
    """12 evaluation documents (whole steps of 3 at dp 1, 2 and 4), or 10 (the last step of one document at dp 1)."""
    return _documents(10, seed=13) if remainder else _documents(12, seed=11)


def _arguments(output_dir: str, per_device: int, **more: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = dict(
        output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS, optim="sgd", optim_args="momentum=0.9", learning_rate=0.1, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0, per_device_eval_batch_size=EVAL_BATCH,  # Trainer's ddp_find_unused_parameters: the indexer gets no gradient, as in HF
    )
    return TrainingArguments(**{**options, **more})


class ShippedLoad:
    """Put before a Trainer class: a resume reads its checkpoint with HF's module as installed (from_pretrained's float32 tensors)."""

    def _load_from_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with hf_oracle.shipped():
            super()._load_from_checkpoint(*args, **kwargs)  # type: ignore[misc]


class Recording:
    """Put before a Trainer class: records every micro-batch's loss averaged over the ranks, in float64.

    That mean, summed over a step's micro-batches, is the loss ``Trainer`` logs (which it
    accumulates in a float32 tensor).
    """

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        import torch.distributed as dist

        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        total = loss.detach().clone()
        if self.args.world_size > 1:  # type: ignore[attr-defined]
            dist.all_reduce(total)
        self.micro_losses = [*getattr(self, "micro_losses", []), float(total) / self.args.world_size]  # type: ignore[attr-defined]
        return loss

    def cp_loss(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """CPTrainerMixin's call, recording each plan's layout, exchange and whether its cost is the model's."""
        from cpkv.plan.cost import CostModel

        out = super().cp_loss(model, inputs, num_items_in_batch)  # type: ignore[misc]
        own = out.plan.cost_model == CostModel.from_deepseek_v4(self.model.config)  # type: ignore[attr-defined]
        self.planned = {*getattr(self, "planned", set()), (out.plan.layout, out.plan.exchange, own)}
        return out


def _result(trainer: Any) -> dict[str, Any]:
    micro = trainer.micro_losses
    return {"losses": [a + b for a, b in zip(micro[::2], micro[1::2])], "micro": micro,
            "logged": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "grad_norms": [float(entry["grad_norm"]) for entry in trainer.state.log_history if "grad_norm" in entry],
            "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "planned": getattr(trainer, "planned", set()),
            "evals": [(entry["step"], entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]}


# --- the CP side, on every rank --------------------------------------------------------------


def _cp_trainer(output_dir: str, cp: Any, docs: Any, dp: int = 1, trainer_options: Any = None, **more: Any) -> Any:
    from transformers import DataCollatorWithFlattening, Trainer

    from cpkv.integrations.hf_trainer import CPTrainerMixin

    class CPTrainer(Recording, ShippedLoad, CPTrainerMixin, Trainer):
        pass

    model = _model()  # built outside hf_oracle.lifted(): HF's init draws depend on the dtype
    return CPTrainer(model=model, args=_arguments(output_dir, PER_DEVICE // dp, **more), train_dataset=docs,
                     eval_dataset=_eval_documents(), data_collator=DataCollatorWithFlattening(), cp=cp, backend="reference",
                     **(trainer_options or {}))


def _train(trainer: Any, lift: bool = True, **options: Any) -> dict[str, Any]:
    with hf_oracle.lifted() if lift else contextlib.nullcontext(), _no_mask():
        trainer.train(**options)
    return _result(trainer)


IN_TRAINING = {"eval_strategy": "steps", "eval_steps": EVAL_STEPS}


def _state(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any], list[bool]]:
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
            [m.training for m in model.modules()])


def _same_state(a: Any, b: Any) -> bool:
    """Parameters and gradients bit for bit, and every module's training flag."""
    grads_equal = all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                      for x, y in zip(a[1].values(), b[1].values()))
    return all(torch.equal(x, y) for x, y in zip(a[0].values(), b[0].values())) and grads_equal and a[2] == b[2]


def _evaluate_after(trainer: Any) -> dict[str, Any]:
    """After training: ``evaluate`` and ``predict`` (per-token scores) on 10 documents; the model's state untouched."""
    trainer.model.train()
    with torch.enable_grad():  # a gradient left in place (Trainer zeroes them to None after each step)
        next(trainer.model.parameters()).grad = torch.full_like(next(trainer.model.parameters()), 0.5)
    before = _state(trainer.model)
    with hf_oracle.lifted(), _no_mask():
        metrics = trainer.evaluate(eval_dataset=_eval_documents(remainder=True))
        predicted = trainer.predict(_eval_documents(remainder=True))
    untouched = _same_state(before, _state(trainer.model))
    next(trainer.model.parameters()).grad = None
    return {"eval_loss": metrics["eval_loss"], "test_loss": predicted.metrics["test_loss"], "untouched": untouched,
            "log_probs": predicted.predictions[0], "argmax": predicted.predictions[1], "labels": predicted.label_ids,
            "metric": predicted.metrics["test_mean_log_prob"]}


def _mean_log_prob(prediction: Any) -> dict[str, float]:
    """``compute_metrics``: the mean label log-probability over every valid token of the set."""
    log_probs, labels = prediction.predictions[0], prediction.label_ids
    mask = labels != IGNORE
    return {"mean_log_prob": float(log_probs[mask].sum() / mask.sum())}


def _fresh_evaluations(tmp: str, docs: Any) -> dict[str, Any]:
    """``evaluate`` on untrained models: dp 4 x cp 1, dp 2 x cp 2 (contiguous, allgather), dp 1 x cp 4 (balanced, allgather)."""
    results = {}
    for key, cp, dp, options in (("cp1", 1, 4, {}), ("dp2cp2", 2, 2, {"layout": "contiguous", "exchange": "allgather"}),
                                 ("cp4", 4, 1, {"exchange": "allgather"})):
        trainer = _cp_trainer(os.path.join(tmp, f"fresh-{key}"), cp, docs, dp, trainer_options=options)
        with hf_oracle.lifted(), _no_mask():
            results[f"fresh/{key}"] = trainer.evaluate()["eval_loss"]
    return results


def _set_env(rank: int, world: int) -> None:
    """What torchrun sets: Trainer's TrainingArguments (accelerate) read it, and find the group already initialised."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1"})


def _meshes(cp: int, config: Any) -> dict[str, Any]:
    """This rank's coordinates from a size, the size's group, and an accelerate ParallelismConfig."""
    from cpkv.integrations.hf_trainer import data_cp_mesh

    by_size = data_cp_mesh(cp)
    meshes = {"size": by_size, "group": data_cp_mesh(by_size.cp_group), "parallelism_config": data_cp_mesh(config)}
    return {k: (m.dp_size, m.cp_size, m.dp_rank, m.cp_rank) for k, m in meshes.items()}


def _four_ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from accelerate import ParallelismConfig

    _set_env(rank, world)
    docs = _documents()
    import torch.distributed as dist

    from cpkv.integrations.hf_trainer import data_cp_mesh

    results: dict[str, Any] = {"mesh": _meshes(2, ParallelismConfig(dp_shard_size=2, cp_size=2))}
    overlapping = [dist.new_group([0, 1, 2]), dist.new_group([2, 3])]  # every rank makes every group
    results["overlapping"] = hf_oracle.outcome(lambda: data_cp_mesh(overlapping[rank == world - 1]))
    saving = dict(save_strategy="steps", save_steps=2)
    run = os.path.join(tmp, "dp2cp2")
    results["dp2cp2"] = _train(_cp_trainer(run, 2, docs, 2, **saving))  # the defaults: balanced, need
    results["checkpoint"] = os.path.join(run, "checkpoint-4")
    resumed = _cp_trainer(os.path.join(tmp, "resumed"), 2, docs, 2, trainer_options={"exchange": "need"}, **saving)
    results["resumed"] = _train(resumed, resume_from_checkpoint=os.path.join(run, "checkpoint-2"))
    cp4 = {"layout": "zigzag", "loss_chunk_size": 3, "compute_metrics": _mean_log_prob}  # the loss over several chunks per micro-batch
    cp4_trainer = _cp_trainer(os.path.join(tmp, "cp4"), 4, docs, trainer_options=cp4, **IN_TRAINING)
    results["cp4"] = _train(cp4_trainer)  # evaluated at steps 2 and 4 inside training
    results["cp4/after"] = _evaluate_after(cp4_trainer)
    results |= _fresh_evaluations(tmp, docs)
    for mesh, cp, dp, options in (("dp2cp2", 2, 2, {"exchange": "need"}), ("cp4", 4, 1, {})):  # balanced: no padding
        for indexer in ("off", "on"):
            key = f"adamw/{mesh}/{indexer}"
            trainer = _cp_trainer(os.path.join(tmp, key), cp, docs, dp, trainer_options={**options, "indexer_loss": indexer == "on"}, **ADAMW)
            results[key] = _train(trainer)
    if rank == world - 1:  # one rank's documents differ in their first token
        docs = [{**d, "input_ids": [(d["input_ids"][0] + 1) % VOCAB, *d["input_ids"][1:]]} for d in docs]
    results["differs"] = hf_oracle.outcome(lambda: _train(_cp_trainer(os.path.join(tmp, "differs"), 4, docs)))
    if rank:
        keep = ("mesh", "overlapping", "differs", "cp4/after", "fresh/cp1", "fresh/dp2cp2", "fresh/cp4")
        results = {k: v for k, v in results.items() if k in keep}  # the others: rank 0's
    return results


def _two_ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from accelerate import ParallelismConfig

    _set_env(rank, world)
    results: dict[str, Any] = {"mesh": _meshes(2, ParallelismConfig(cp_size=2))}
    trainer = _cp_trainer(os.path.join(tmp, "cp2"), 2, _documents(), trainer_options={"layout": "contiguous"})
    results["cp2"] = _train(trainer)
    with hf_oracle.lifted(), _no_mask():
        results["cp2/eval"] = trainer.evaluate(eval_dataset=_eval_documents(remainder=True))["eval_loss"]
    return results


FOUR_RANKS = shared_spawn(_four_ranks, 4, TmpPath("four"), timeout=320.0)
TWO_RANKS = shared_spawn(_two_ranks, 2, TmpPath("two"), timeout=200.0)


@pytest.fixture(scope="module")
def four_ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return FOUR_RANKS.run(request)


@pytest.fixture(scope="module")
def two_ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return TWO_RANKS.run(request)


# --- one process: the oracle ------------------------------------------------------------------


def _one_process(output_dir: Path, lift: bool = True, **more: Any) -> dict[str, Any]:
    """A plain Trainer with the same arguments (and ``more``) and data: HF's model on each document alone."""
    from transformers import DataCollatorWithFlattening, Trainer

    trainer = _plain_trainer(Recording, model=_model(), output_dir=str(output_dir), **more)
    with hf_oracle.lifted() if lift else contextlib.nullcontext(), hf_oracle.earlier_ties():
        trainer.train()
        result = _result(trainer)  # before the evaluation after training (logged at the last step too)
        after = trainer.evaluate(eval_dataset=_eval_documents(remainder=True))["eval_loss"] if more.get("eval_strategy") else None
    return {**result, "eval_after": after}


def _plain_trainer(*bases: type, model: Any, output_dir: str, **more: Any) -> Any:
    """A plain Trainer whose ``compute_loss`` runs HF's model on each document alone (training: over the step's count)."""
    from transformers import DataCollatorWithFlattening, Trainer

    class OneProcess(*bases, Trainer):  # type: ignore[misc]
        loss_is_scaled_for_ga = True  # divided by the step's count below

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
            ids, labels, positions = inputs["input_ids"][0], inputs["labels"][0], inputs["position_ids"][0]
            starts = torch.nonzero(positions == 0).flatten().tolist() + [ids.numel()]
            total, count = torch.zeros((), dtype=torch.float64), 0
            for start, end in zip(starts[:-1], starts[1:]):
                logits = model(input_ids=ids[start:end][None], use_cache=False).logits[0]
                total = total + torch.nn.functional.cross_entropy(logits[:-1], labels[start + 1: end], ignore_index=IGNORE,
                                                                  reduction="sum")
                count += int((labels[start + 1: end] != IGNORE).sum())
            if return_outputs:  # evaluation: this batch's own mean
                return total / max(count, 1), (total,)
            return total / num_items_in_batch

    return OneProcess(model=model, args=_arguments(output_dir, PER_DEVICE, **more), train_dataset=_documents(),
                      eval_dataset=_eval_documents(), data_collator=DataCollatorWithFlattening())


def _one_process_cp1(output_dir: Path, **more: Any) -> dict[str, Any]:
    """The indexer loss's one process (HF has none): cpkv at cp 1 on a 1-rank group, the same Trainer arguments and data.

    The KL summed over the step's queries over ``num_items_in_batch``, as ``CPTrainerMixin`` documents it.
    """
    import torch.distributed as dist
    from transformers import DataCollatorWithFlattening, Trainer

    from cpkv.integrations.collate import packed_batch
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss, enable_deepseek_v4_cp

    class OneProcess(Recording, Trainer):
        loss_is_scaled_for_ga = True

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
            batch = packed_batch(inputs)
            return deepseek_v4_causal_lm_loss(
                model, batch.input_ids, None, cu_seqlens=batch.cu_seqlens, labels=batch.labels, num_items_in_batch=num_items_in_batch,
                indexer_loss=True, grad_scale=batch.input_ids.numel() / int(num_items_in_batch), backend="reference").loss

    trainer = OneProcess(model=enable_deepseek_v4_cp(_model()), args=_arguments(str(output_dir), PER_DEVICE, **more),
                         train_dataset=_documents(), data_collator=DataCollatorWithFlattening())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with hf_oracle.lifted(), _no_mask():
            trainer.train()
    finally:
        dist.destroy_process_group()
    return _result(trainer)


def _single_thread(run: Any, *args: Any, **more: Any) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks; several threads on two busy cores cost up to 10x
    try:
        return run(*args, **more)  # type: ignore[no-any-return]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The SGD oracle, evaluated inside training (steps 2 and 4) and after it."""
    return _single_thread(_one_process, tmp_path_factory.mktemp("one"), **IN_TRAINING)


@pytest.fixture(scope="module")
def one_process_adamw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _single_thread(_one_process, tmp_path_factory.mktemp("one_adamw"), **ADAMW)


@pytest.fixture(scope="module")
def one_process_indexer(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _single_thread(_one_process_cp1, tmp_path_factory.mktemp("one_indexer"), **ADAMW)


def _param_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, float]:
    assert got.keys() == want.keys()
    return {n: float((got[n] - w).abs().max() / w.abs().max().clamp(min=1e-300)) for n, w in want.items()}


def _check(got: dict[str, Any], want: dict[str, Any], steps: int = STEPS, param_rel: float = PARAM_REL) -> None:
    """Recorded (float64) and logged (float32: Trainer sums in a float32 tensor) losses, logged gradient norms, parameters.

    The gradient norm (before clipping, float64) sees a constant factor on a tensor's
    gradient, which AdamW's update does not (it divides by ``sqrt(v)``).
    """
    assert len(got["losses"]) == len(want["losses"]) == steps and len(got["micro"]) == steps * ACCUMULATION
    assert max(abs(a - b) for a, b in zip(got["micro"], want["micro"])) <= LOSS_ABS, (got["micro"], want["micro"])
    assert max(abs(a - b) / b for a, b in zip(got["logged"], want["logged"])) <= LOGGED_REL, (got["logged"], want["logged"])
    assert len(got["grad_norms"]) == steps and max(abs(a - b) / b for a, b in zip(got["grad_norms"], want["grad_norms"])) <= 1e-8
    errors = _param_errors(got["params"], want["params"])
    assert max(errors.values()) <= param_rel, sorted(errors.items(), key=lambda kv: -kv[1])[:3]
    moved = _param_errors(want["params"], {n: p.detach() for n, p in _model().named_parameters()})
    assert max(moved.values()) > 1e-3  # the steps changed the parameters: the comparison can fail


@pytest.mark.timeout(400)
@pytest.mark.parametrize("run", ["dp2cp2", "cp4"])
def test_cp_trainer_equals_one_process(four_ranks: list[dict[str, Any]], one_process: dict[str, Any], run: str) -> None:
    """dp 2 x cp 2 (balanced, need) and dp 1 x cp 4 (zigzag, 3-token loss chunks): every step's loss and every final parameter."""
    _check(four_ranks[0][run], one_process)
    if run == "dp2cp2":  # the trainer's defaults: balanced by the model's own cost, need exchange
        assert four_ranks[0][run]["planned"] == {("balanced", "need", True)}


@pytest.mark.timeout(300)
def test_cp_trainer_at_cp2_equals_one_process(two_ranks: list[dict[str, Any]], one_process: dict[str, Any]) -> None:
    """dp 1 x cp 2 (contiguous, padded)."""
    _check(two_ranks[0]["cp2"], one_process)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("indexer", ["off", "on"])
@pytest.mark.parametrize("mesh", ["dp2cp2", "cp4"])
def test_cp_trainer_with_adamw_weight_decay_equals_one_process(four_ranks: list[dict[str, Any]], request: pytest.FixtureRequest,
                                                               mesh: str, indexer: str) -> None:
    """AdamW, weight_decay 0.1, 3 steps, every step's loss and every parameter.

    Indexer loss off: against HF, whose indexer gets no gradient (neither decayed nor moved
    here either). On: against cpkv at cp 1 in one process (HF has no indexer loss); the
    indexer is trained.
    """
    want = request.getfixturevalue("one_process_adamw" if indexer == "off" else "one_process_indexer")
    got = four_ranks[0][f"adamw/{mesh}/{indexer}"]
    _check(got, want, 3, param_rel=ADAMW_PARAM_REL)
    moved = [not torch.equal(got["params"][n], p) for n, p in _model().named_parameters() if ".indexer." in n]
    assert moved and all(moved) if indexer == "on" else moved and not any(moved)


@pytest.fixture(scope="module")
def plain_evaluation(tmp_path_factory: pytest.TempPathFactory) -> float:
    """A plain Trainer's ``evaluate`` of the untrained model on the 12 evaluation documents (batches of 3)."""
    trainer = _plain_trainer(model=_model(), output_dir=str(tmp_path_factory.mktemp("plain_eval")))
    with hf_oracle.lifted(), hf_oracle.earlier_ties():
        return float(_single_thread(lambda: {"loss": trainer.evaluate()["eval_loss"]})["loss"])


def test_evaluation_inside_training_equals_one_process(four_ranks: list[dict[str, Any]], two_ranks: list[dict[str, Any]],
                                                        one_process: dict[str, Any]) -> None:
    """``eval_strategy="steps"`` (every 2 steps) at dp 1 x cp 4 (zigzag, padded) and after training at cp 2 and 4.

    The oracle is a plain Trainer evaluating the same documents in batches of 3 at the same
    steps (each batch's loss its documents' summed cross-entropy over its valid labels; HF's
    mean over the batches, the 10-document set's last batch of one document weighted 1/10).
    Both sides float64 with HF's casts lifted; the parameters agree to 4.9e-14 (the training
    test), the losses of a batch to 8.9e-16 (bound 1e-12); the looped-back samples accelerate adds
    to a last partial batch (fixed: ``even_batches`` off at dp 1) gave 2.6e-3. The training itself still equals
    the oracle's (``test_cp_trainer_equals_one_process``): evaluating changed nothing in it.
    """
    got, want = four_ranks[0]["cp4"]["evals"], one_process["evals"]
    assert [step for step, _ in got] == [step for step, _ in want] == [2, 4]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want)) <= EVAL_ABS, (got, want)
    after = [r["cp4/after"]["eval_loss"] for r in four_ranks] + [r["cp2/eval"] for r in two_ranks]
    assert len(set(after[:4])) == 1 and len(set(after[4:])) == 1  # the same value on every rank
    assert max(abs(a - one_process["eval_after"]) for a in after) <= EVAL_ABS, (after, one_process["eval_after"])
    assert abs(want[0][1] - want[1][1]) > 1e-4  # training moved the eval loss (9.6e-4): the comparison can fail


def test_evaluation_leaves_the_model_untouched(four_ranks: list[dict[str, Any]]) -> None:
    """``evaluate`` and ``predict`` after training: parameters, a gradient left in place and every training flag, bit for bit."""
    assert all(r["cp4/after"]["untouched"] for r in four_ranks)


def test_eval_loss_at_every_mesh_equals_a_plain_trainer(four_ranks: list[dict[str, Any]], plain_evaluation: float) -> None:
    """dp 4 x cp 1, dp 2 x cp 2 (contiguous, allgather) and dp 1 x cp 4 (balanced, allgather): 12 documents, batches of 3.

    The evaluation set is whole steps at every dp, so ``dp`` processes of a plain Trainer
    report what one process does; every rank the same value. Bound 1e-12 (the training losses'
    measured 8.9e-16, the same forward).
    """
    for key in ("fresh/cp1", "fresh/dp2cp2", "fresh/cp4"):
        values = [r[key] for r in four_ranks]
        assert len(set(values)) == 1, (key, values)
        assert abs(values[0] - plain_evaluation) <= EVAL_ABS, (key, values[0], plain_evaluation)


def test_predictions_are_each_tokens_label_log_probability(four_ranks: list[dict[str, Any]], one_process: dict[str, Any]) -> None:
    """``predict`` at cp 4 (zigzag): per batch, each token's log-probability of its next label and its argmax, in order.

    Oracle: HF's model with the oracle's trained parameters on each document alone (float64,
    lifted casts), ``log_softmax`` of its logits at the next token. The parameters agree to
    4.9e-14 relative (the training test); bound 1e-12 on the log-probabilities (~5); the argmax
    equal. ``compute_metrics`` sees them (its mean log-probability).
    """
    from transformers import DataCollatorWithFlattening

    model = _model()
    model.load_state_dict(one_process["params"], strict=False)
    docs = _eval_documents(remainder=True)
    got = four_ranks[0]["cp4/after"]
    assert all(r["cp4/after"]["metric"] == got["metric"] for r in four_ranks)
    total, count = 0.0, 0
    with torch.no_grad(), hf_oracle.lifted(), hf_oracle.earlier_ties():
        for b in range(0, len(docs), EVAL_BATCH):
            batch = DataCollatorWithFlattening()(docs[b: b + EVAL_BATCH])
            labels, row = batch["labels"][0], b // EVAL_BATCH
            want_lp, want_arg, want_lab = [], [], []
            for doc in docs[b: b + EVAL_BATCH]:
                logits = model(input_ids=torch.tensor([doc["input_ids"]]), use_cache=False).logits[0]
                lp = torch.log_softmax(logits, dim=-1)
                shifted = torch.tensor(doc["labels"][1:] + [IGNORE])
                want_lab.append(shifted)
                want_lp.append(torch.where(shifted != IGNORE, lp.gather(1, shifted.clamp(min=0)[:, None])[:, 0], 0))
                want_arg.append(logits.argmax(-1))
            n = labels.numel()
            lab = torch.cat(want_lab)
            assert torch.equal(torch.as_tensor(got["labels"][row, :n]), lab) and (got["labels"][row, n:] == IGNORE).all()
            err = (torch.as_tensor(got["log_probs"][row, :n]) - torch.cat(want_lp)).abs().max()
            assert err <= LOG_PROB_ABS, err
            assert torch.equal(torch.as_tensor(got["argmax"][row, :n]), torch.cat(want_arg))
            total, count = total + float(torch.cat(want_lp).sum()), count + int((lab != IGNORE).sum())
    assert abs(got["metric"] - total / count) <= LOG_PROB_ABS


def test_a_resumed_run_continues_identically(four_ranks: list[dict[str, Any]], one_process: dict[str, Any]) -> None:
    """Steps 3 and 4 from the step-2 checkpoint (weights, momentum, schedule, RNG, data position) as the uninterrupted run.

    The checkpoint is read with HF's module as installed (``ShippedLoad``), whose
    ``from_pretrained`` builds norms, hyper-connection weights, sinks and position biases in
    float32; the mixin restores them as saved (float64). Not bit for bit by construction: DDP
    lays its gradient buckets out anew after each run's first step, and gloo's ring sums an
    element over the ranks in an order that depends on its place in the bucket, so a parameter
    may differ by an ulp (measured: identical; earlier 2.4e-15 relative). Bound: 1e-13
    (relative); those tensors left rounded to float32 give 5.2e-8 (1.4e-9 on the step-4
    loss), a checkpoint that did not load (transformers' own resume) 8e-3.
    """
    full, resumed = four_ranks[0]["dp2cp2"], four_ranks[0]["resumed"]
    assert len(resumed["micro"]) == 2 * ACCUMULATION
    assert max(abs(a - b) for a, b in zip(resumed["micro"], full["micro"][2 * ACCUMULATION:])) <= RESUME_REL
    assert resumed["logged"][:2] == full["logged"][:2]  # the log history travels in the checkpoint
    assert max(abs(a - b) / b for a, b in zip(resumed["logged"], full["logged"])) <= LOGGED_REL
    assert max(_param_errors(resumed["params"], full["params"]).values()) <= RESUME_REL


def test_checkpoint_loads_into_an_unwrapped_model(four_ranks: list[dict[str, Any]], tmp_path: Path) -> None:
    """The checkpoint holds what save_pretrained of a plain model holds (HF's names) and loads into one.

    HF creates DeepSeek-V4's hyper-connection, norm and position-bias parameters in float32
    whatever ``dtype`` says: those load rounded to float32 (compared at the loaded dtype).
    """
    from safetensors import safe_open
    from transformers import DeepseekV4ForCausalLM

    checkpoint = Path(four_ranks[0]["checkpoint"])
    _model().save_pretrained(tmp_path)
    with safe_open(checkpoint / "model.safetensors", "pt") as saved, safe_open(tmp_path / "model.safetensors", "pt") as plain:
        assert sorted(saved.keys()) == sorted(plain.keys())
    model, info = DeepseekV4ForCausalLM.from_pretrained(checkpoint, output_loading_info=True, dtype=torch.float64)
    assert not any(info.values()), info
    trained = four_ranks[0]["dp2cp2"]["params"]
    assert list(dict(model.named_parameters())) == list(trained)
    assert all(torch.equal(p, trained[n].to(p.dtype)) for n, p in model.named_parameters())


def _pins_float32() -> bool:
    """Whether this transformers builds DeepSeek-V4's norms, sinks and biases in float32 whatever the model dtype."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("5.24")


def test_a_resume_reads_every_tensor_in_its_saved_dtype(tmp_path: Path) -> None:
    """``CPTrainerMixin._load_from_checkpoint`` into a float64 model: every tensor as saved, bit for bit (one file, shards).

    ``from_pretrained`` alone builds HF's norms, hyper-connection weights, sinks and position
    biases in float32 (45 of the 89 tensors here): those come back rounded (a resume then
    drifts from the uninterrupted run by ~1e-8).
    """
    from types import SimpleNamespace

    from transformers import DeepseekV4ForCausalLM

    from cpkv.integrations.hf_trainer import CPTrainerMixin

    saved = _model()
    want = saved.state_dict()
    for directory, shard in ((tmp_path / "one", "5GB"), (tmp_path / "shards", "20KB")):
        saved.save_pretrained(directory, max_shard_size=shard)
        rounded = DeepseekV4ForCausalLM.from_pretrained(directory, dtype=torch.float64).state_dict()
        if _pins_float32():  # the case this is for (transformers >= 5.24 builds those tensors in float32)
            assert sum(t.dtype == torch.float32 for t in rounded.values()) > 10
        target = _model()
        with torch.no_grad():
            for param in target.parameters():
                param.zero_()
        trainer = SimpleNamespace(model=target, is_fsdp_enabled=False, is_deepspeed_enabled=False)
        CPTrainerMixin._load_from_checkpoint(trainer, str(directory))  # type: ignore[arg-type]
        assert all(t.dtype == want[n].dtype and torch.equal(t, want[n]) for n, t in target.state_dict().items())


def test_a_batch_that_differs_within_the_cp_group_raises_on_every_rank(four_ranks: list[dict[str, Any]]) -> None:
    outcomes = [r["differs"] for r in four_ranks]
    assert all(o.startswith("ValueError") and "token ids or labels differ" in o for o in outcomes), outcomes


def test_meshes_from_a_size_a_group_and_a_parallelism_config(four_ranks: list[dict[str, Any]],
                                                            two_ranks: list[dict[str, Any]]) -> None:
    """Contiguous CP groups (CP innermost, as accelerate's meshes): rank r is (r // cp, r % cp)."""
    for results, dp in ((four_ranks, 2), (two_ranks, 1)):
        for rank, r in enumerate(results):
            assert set(r["mesh"].values()) == {(dp, 2, rank // 2, rank % 2)}, r["mesh"]
    outcomes = [r["overlapping"] for r in four_ranks]  # ranks 0-2 pass {0, 1, 2}, rank 3 passes {2, 3}: every rank raises
    assert all(o.startswith("ValueError: the CP groups must split the 4 ranks") for o in outcomes), outcomes


def _shipped_ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """dp 2 x cp 2 and dp 1 x cp 4 (SGD) as in ``_four_ranks``, with HF's module as installed (nothing lifted)."""
    _set_env(rank, world)
    docs, runs = _documents(), {}
    for key, cp, dp, options in (("dp2cp2", 2, 2, {"exchange": "need"}), ("cp4", 4, 1, {"layout": "zigzag"})):
        runs[key] = _train(_cp_trainer(os.path.join(tmp, key), cp, docs, dp, trainer_options=options), lift=False)
    return runs if rank == 0 else {}


@pytest.mark.skipif(os.environ.get("CPKV_SLOW_TESTS") != "1", reason=(
    "slow (a spawn of 4 ranks of its own and another one-process run, ~2 min on 2 busy cores): it measures the docs'"
    " 'shipped' figures. Run with CPKV_SLOW_TESTS=1"))
@pytest.mark.timeout(900)
def test_cp_trainer_against_hugging_face_as_shipped(tmp_path: Path) -> None:
    """Both sides with HF's float32 casts inside the float64 models (the oracle's top-k ties still to the earlier entry).

    HF rounds its RMSNorms, RoPE, softmaxes and hyper-connection weights to float32; cpkv's
    attention computes in float64, so the runs differ by float32 rounding carried through 4
    steps: measured <= 1.8e-9 on every micro-batch's loss, <= 2.1e-5 relative on the parameters
    (``hc_head.hc_base``, whose gradient is close to 0; 4.9e-14 lifted), the same with
    ``torch.topk``'s own ties. Bounds: 2e-8 and 2e-4 (10x).
    """
    got = spawn(_shipped_ranks, 4, str(tmp_path), timeout=800.0)[0]
    want = _single_thread(_one_process, tmp_path / "one", lift=False)
    for key in ("dp2cp2", "cp4"):
        assert max(abs(a - b) for a, b in zip(got[key]["micro"], want["micro"])) <= 2e-8
        assert max(_param_errors(got[key]["params"], want["params"]).values()) <= 2e-4


# --- single process: the pieces ----------------------------------------------------------------


def test_shards_are_re_pointed_to_the_data_ranks() -> None:
    """Accelerate's world shards become dp shards: CP group g reads batches g, g + dp, ... (map-style and iterable)."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

    from cpkv.integrations.hf_trainer import DataCPMesh, shard_over_data_ranks

    batches = BatchSampler(SequentialSampler(range(12)), batch_size=2, drop_last=False)
    for dp_rank in (0, 1):
        mesh = DataCPMesh(2, 2, dp_rank, 1, None)  # type: ignore[arg-type]
        loader = DataLoader(range(12), batch_sampler=BatchSamplerShard(batches, num_processes=4, process_index=3))
        assert shard_over_data_ranks(loader, mesh) is loader
        assert list(loader.batch_sampler) == ([[0, 1], [4, 5], [8, 9]] if dp_rank == 0 else [[2, 3], [6, 7], [10, 11]])
        stream = IterableDatasetShard(range(12), batch_size=2, num_processes=4, process_index=3)
        shard_over_data_ranks(DataLoader(stream, batch_size=2), mesh)
        assert list(stream) == ([0, 1, 4, 5, 8, 9] if dp_rank == 0 else [2, 3, 6, 7, 10, 11])
    with pytest.raises(TypeError, match="dispatch_batches"):
        shard_over_data_ranks(DataLoader(range(4)), DataCPMesh(2, 2, 0, 0, None))  # type: ignore[arg-type]
    assert shard_over_data_ranks("unchanged", DataCPMesh(1, 1, 0, 0, None)) == "unchanged"  # type: ignore[arg-type]


def test_packed_batch_reads_the_collators_row_and_names_what_is_wrong() -> None:
    from transformers import DataCollatorWithFlattening

    from cpkv.integrations.collate import packed_batch

    inputs = DataCollatorWithFlattening()([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    batch = packed_batch(inputs)
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9] and batch.cu_seqlens.tolist() == [0, 3, 5]
    assert batch.labels.tolist() == [IGNORE, 6, 7, IGNORE, 9]
    flash = DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True)([{"input_ids": [5, 6, 7]}])
    assert packed_batch(flash).cu_seqlens.tolist() == [0, 3]
    with pytest.raises(ValueError, match="DataCollatorWithFlattening"):
        packed_batch({**inputs, "attention_mask": torch.ones(1, 5)})
    with pytest.raises(ValueError, match="position_ids"):
        packed_batch({"input_ids": inputs["input_ids"]})
    with pytest.raises(ValueError, match=r"one packed row \[1, T\]"):
        packed_batch({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ValueError, match="labels must hold input_ids' 5 tokens, got 4"):
        packed_batch({**inputs, "labels": inputs["labels"][:, :4]})


def test_the_trainer_refuses_accelerates_own_cp_and_unknown_options() -> None:
    """Checked before Trainer builds anything (no process group needed)."""
    from types import SimpleNamespace

    from transformers import Trainer

    from cpkv.integrations.hf_trainer import CPTrainerMixin

    class CPTrainer(CPTrainerMixin, Trainer):
        pass

    with pytest.raises(ValueError, match="parallelism_config.cp_size = 2: accelerate would run its own"):
        CPTrainer(model=None, args=SimpleNamespace(parallelism_config=SimpleNamespace(cp_size=2)), cp=2)
    with pytest.raises(ValueError, match="layout must be one of"):
        CPTrainer(model=None, args=None, layout="ring")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM or DeepseekV4Model"):
        CPTrainer(model=torch.nn.Linear(2, 2), args=None)
    with pytest.raises(ValueError, match="loss_chunk_size must be >= 1, got 0"):
        CPTrainer(model=None, args=None, loss_chunk_size=0)
    with pytest.raises(TypeError, match="loss_chunk_size must be an int, got float"):
        CPTrainer(model=None, args=None, loss_chunk_size=512.0)  # type: ignore[arg-type]


def test_cp_loss_hands_the_trainers_options_to_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``cp_loss`` passes to ``deepseek_v4_causal_lm_loss`` (the call itself is checked against one process above)."""
    from types import SimpleNamespace

    from cpkv.integrations import hf_trainer

    class Mixin(hf_trainer.CPTrainerMixin):
        pass

    trainer = object.__new__(Mixin)  # the options as __init__ stores them, without Trainer or a process group
    trainer.cp_layout, trainer.cp_exchange, trainer.cp_backend = "balanced", "allgather", "reference"
    trainer.cp_indexer_loss, trainer.cp_loss_chunk_size = False, 7
    trainer.cp_mesh = SimpleNamespace(dp_size=1, cp_size=1, cp_group=None)  # type: ignore[assignment]
    monkeypatch.setattr(hf_trainer, "deepseek_v4_causal_lm_loss", lambda *args, **kwargs: kwargs)
    ids = torch.tensor([[3, 4, 5, 6]])
    inputs = {"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 0, 1]])}
    passed: Any = trainer.cp_loss(None, inputs, num_items_in_batch=2)
    assert passed["chunk_size"] == 7 and passed["exchange"] == "allgather" and passed["layout"] == "balanced"
    assert passed["indexer_loss"] is False and passed["num_items_in_batch"] == 2


# --- the example, at CI size ---------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_trainer_example_runs(tmp_path: Path) -> None:
    """examples/hf_trainer_cp.py: 2 Trainer steps at dp 2 x cp 2 and cp 4 on 4 ranks, beside one process."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(root / "examples" / "hf_trainer_cp.py"), "--steps", "2"],
                          capture_output=True, text=True, timeout=140, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Trainer under CP matches one process" in proc.stdout
    assert [line.split()[0] for line in proc.stdout.splitlines() if line[:4].strip().isdigit()] == ["0", "1"]
