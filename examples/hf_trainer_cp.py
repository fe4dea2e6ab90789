"""Hugging Face's ``Trainer`` trains a tiny DeepSeek-V4 under CP on 4 gloo ranks, beside a one-process ``Trainer``.

The same random ``DeepseekV4ForCausalLM`` (``examples/hf_causal_lm_cp.py``'s ``build_model``)
takes ``--steps`` AdamW steps of ``Trainer`` (gradient accumulation 2, clipping, linear
schedule) on the same packed documents (``DataCollatorWithFlattening``), three times:

* dp 2 x cp 2 and dp 1 x cp 4 on 4 CPU ranks (``CPTrainerMixin``; the ranks get the
  environment ``torchrun`` gives, accelerate's DDP averages over all of them);
* one process: a plain ``Trainer`` whose ``compute_loss`` runs Hugging Face's model on each
  document alone, divided by ``Trainer``'s own ``num_items_in_batch``.

The logged loss of every step is printed for the three. Needs
``pip install 'cpkv[trainer]'``::

    python examples/hf_trainer_cp.py              # 6 steps: 25-39 s on 2 CPU cores (measured)
    python examples/hf_trainer_cp.py --steps 20
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

import torch

from cpkv.launch import spawn
from hf_causal_lm_cp import VOCAB, build_model

ACCUMULATION, DOCUMENTS_PER_MICRO_BATCH = 2, 4  # dp 2: 2 documents a rank's micro-batch


def documents(count: int) -> list[dict[str, list[int]]]:
    """``count`` documents of 2-40 tokens, each counting up by 3 from a random token (something a tiny model learns)."""
    gen = torch.Generator().manual_seed(5)
    docs = []
    for _ in range(count):
        n, start = int(torch.randint(2, 41, (1,), generator=gen)), int(torch.randint(0, VOCAB, (1,), generator=gen))
        docs.append({"input_ids": ((start + 3 * torch.arange(n)) % VOCAB).tolist()})
    return docs


def arguments(output_dir: str, steps: int, per_device: int) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=ACCUMULATION,
        max_steps=steps, learning_rate=3e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, seed=0,  # Trainer's ddp_find_unused_parameters (True): HF's indexer gets no gradient
    )


def train_cp(rank: int, world: int, steps: int, output_dir: str) -> dict[str, list[float]]:
    """On every rank: ``Trainer`` at dp 2 x cp 2, then dp 1 x cp 4; the logged losses of each."""
    from transformers import DataCollatorWithFlattening, Trainer

    from cpkv.integrations.hf_trainer import CPTrainerMixin

    class CPTrainer(CPTrainerMixin, Trainer):
        pass

    # What torchrun sets (the group is already initialised: accelerate takes it as it is).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    losses = {}
    for dp, cp in ((2, 2), (1, 4)):
        args = arguments(os.path.join(output_dir, f"dp{dp}cp{cp}"), steps, DOCUMENTS_PER_MICRO_BATCH // dp)
        trainer = CPTrainer(model=build_model(), args=args, train_dataset=documents(64),
                            data_collator=DataCollatorWithFlattening(), cp=cp, exchange="need")
        trainer.train()
        losses[f"dp {dp} x cp {cp}"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses


def train_single(steps: int, output_dir: str) -> list[float]:
    """The same steps in one process: Hugging Face's model on each document alone."""
    from transformers import DataCollatorWithFlattening, Trainer

    class OneProcess(Trainer):
        loss_is_scaled_for_ga = True  # normalised by the step's count below

        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
            ids, labels, positions = inputs["input_ids"][0], inputs["labels"][0], inputs["position_ids"][0]
            starts = torch.nonzero(positions == 0).flatten().tolist() + [ids.numel()]
            total = torch.zeros(())
            for start, end in zip(starts[:-1], starts[1:]):
                logits = model(input_ids=ids[start:end][None], use_cache=False).logits[0, :-1]  # t predicts t + 1
                total = total + torch.nn.functional.cross_entropy(logits.float(), labels[start + 1: end], reduction="sum")
            return total / num_items_in_batch

    trainer = OneProcess(model=build_model(), args=arguments(output_dir, steps, DOCUMENTS_PER_MICRO_BATCH),
                         train_dataset=documents(64), data_collator=DataCollatorWithFlattening())
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (default 6)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"argument --steps: must be >= 1, got {args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        cp_losses = spawn(train_cp, 4, args.steps, tmp, timeout=600.0)[0]
        torch.set_num_threads(1)  # as each rank
        single = train_single(args.steps, os.path.join(tmp, "single"))
    names = list(cp_losses)
    print("step  1 process  " + "  ".join(f"{n:>12}" for n in names) + "  |difference|")
    for step, want in enumerate(single):
        got = [cp_losses[n][step] for n in names]
        print(f"{step:4d}  {want:9.6f}  " + "  ".join(f"{g:12.6f}" for g in got) + f"  {max(abs(g - want) for g in got):12.1e}")
    # float32 and another summation order: step 0 (the same weights) differs by float32
    # rounding (~1e-7 relative); AdamW then amplifies it slowly. CP groups fed the same
    # batches, a rank-local normaliser or a missing dp factor are off by more than 1e-2.
    first = max(abs(cp_losses[n][0] - single[0]) / single[0] for n in names)
    worst = max(abs(cp_losses[n][s] - single[s]) / single[s] for n in names for s in range(len(single)))
    if first > 1e-5 or worst > 1e-3:
        print(f"CP and one process differ: relative {first:.1e} at step 0 (> 1e-5?), {worst:.1e} worst (> 1e-3?)", file=sys.stderr)
        return 1
    print(f"Trainer under CP matches one process: relative difference {first:.1e} at step 0, {worst:.1e} at worst")
    return 0


if __name__ == "__main__":
    sys.exit(main())
