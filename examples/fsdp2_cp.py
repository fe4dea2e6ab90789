"""Train a tiny DeepSeek-V4 on the Python standard library's own source: FSDP2 x context parallelism, a plain loop.

No Trainer: the loop's blocks are the ones a torchtitan-style script has.

1. A ``dp x cp`` :class:`~torch.distributed.device_mesh.DeviceMesh` (``init_device_mesh``).
2. The model: ``enable_deepseek_v4_cp`` (before any wrapper), activation checkpointing of the
   decoder layers (Hugging Face's, non-reentrant), then FSDP2 ``fully_shard`` of every decoder
   layer and of the root over the flattened ``dp x cp`` mesh, with
   ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (``--runs`` with
   ``-bf16``) or in float32. FSDP2 averages the gradients over the ``dp x cp`` ranks:
   the loss call is told ``grad_reduction="mean"``.
3. Data: byte-level documents (vocabulary 256) cut from the ``.py`` files of the standard
   library this Python ships, packed ``TOKENS`` to a micro-batch; each rank's
   ``DataLoader`` (a worker process) packs its data replica's micro-batches and plans its
   CP shard with :class:`~cpkv.integrations.collate.PackedCPCollator` (balanced layout, need
   exchange, the model's cost model).
4. The step: :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss` with the
   collator's plan, ``loss.backward()`` (``MICRO // dp`` micro-batches accumulated), AdamW.
5. A distributed checkpoint (``torch.distributed.checkpoint``: model and optimizer) after
   step ``--save-at``; then a fresh model and optimizer load it and run the remaining steps
   again, which must repeat the first pass's losses exactly.

Every run (``dp1xcp4``, ``dp2xcp2``: float32; ``dp2xcp2-bf16``) is compared with one process
training Hugging Face's model without CP (float32, each document alone, the same ``MICRO``
micro-batches a step). Float32 runs must agree within ``FP32_TOL`` = 1e-5 (relative loss
difference at every step; measured <= 1.9e-7 over 24 steps: the same math in another
summation order, whose float32 rounding AdamW carries on; a label shifted across documents or
a rank-local normaliser is off by > 1e-2 at step 0), the bf16 run within ``BF16_TOL`` = 1e-2
(about one bf16 rounding, 7.8e-3; measured <= 2.9e-4). Learned MoE routing amplifies any
difference once the router's top-2 choices flip: at ``LR`` = 3e-3 the float32 runs drifted
to 2e-2 by step 28, so the learning rate is 1e-3. ``--plot`` draws the curves
(docs/fsdp2_loss.png is ``--plot docs/fsdp2_loss.png``; by default it draws nothing). Needs ``pip install 'cpkv[transformers]'``::

    python examples/fsdp2_cp.py                       # 4 spawned gloo ranks, 24 steps (--plot PATH draws the curves)
    python examples/fsdp2_cp.py --steps 2 --runs dp2xcp2-bf16 --plot ""   # what CI runs
    torchrun --nproc-per-node 4 examples/fsdp2_cp.py --runs dp2xcp2-bf16 --plot ""   # under torchrun

The checkpoint goes into a temporary directory, removed at the end (``--checkpoint-dir DIR``
keeps it in ``DIR``); nothing is written into the current directory. The script imports
cpkv (and with it ``torch._dynamo``) before ``init_process_group``: see
docs/troubleshooting.md ("A torchrun job aborts at exit").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cpkv  # noqa: F401  # before init_process_group (docs/troubleshooting.md)

VOCAB, TOKENS, MICRO, LR = 256, 128, 2, 1e-3  # MICRO micro-batches of TOKENS bytes per optimizer step
RUNS = {"dp1xcp4": (1, 4, "float32"), "dp2xcp2": (2, 2, "float32"), "dp2xcp2-bf16": (2, 2, "bfloat16")}
FP32_TOL, BF16_TOL = 1e-5, 1e-2  # measured (24 steps): <= 1.9e-7 (float32), <= 2.9e-4 (bf16)


# ------------------------------------------------------------------ data: the standard library's bytes


@functools.cache
def documents() -> list[torch.Tensor]:
    """Byte documents of 16-96 bytes cut from the standard library's ``.py`` files (sorted, fixed seed)."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    if not files:
        raise RuntimeError("no .py file in the standard library directory: this example reads its text")
    gen = torch.Generator().manual_seed(0)
    docs = []
    for path in files[:: max(1, len(files) // 40)]:
        data = torch.frombuffer(bytearray(Path(path).read_bytes()[:4096]), dtype=torch.uint8).long()
        start = 0
        while start + 16 <= data.numel():
            length = int(torch.randint(16, 97, (1,), generator=gen))
            docs.append(data[start: start + length])
            start += length
    return docs


def micro_batch(index: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batch ``index``: consecutive documents packed to exactly ``TOKENS`` bytes (the last one cut)."""
    docs, out, used = documents(), [], 0
    k = index * 3  # about 2-3 documents a micro-batch: start each micro-batch 3 documents on
    while used < TOKENS:
        doc = docs[k % len(docs)][: TOKENS - used]
        out.append({"input_ids": doc})
        used += doc.numel()
        k += 1
    return out


class ReplicaBatches(torch.utils.data.Dataset[list[dict[str, torch.Tensor]]]):
    """The micro-batches data replica ``dp_rank`` of ``dp`` reads in steps ``first ..``: ``MICRO // dp`` a step."""

    def __init__(self, dp_rank: int, dp: int, first: int, steps: int) -> None:
        per = MICRO // dp
        self.indices = [s * MICRO + dp_rank * per + k for s in range(first, steps) for k in range(per)]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> list[dict[str, torch.Tensor]]:
        return micro_batch(self.indices[i])


def collate(collator: Any, examples: list[dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], Any]:
    """In the loader's worker: the packed micro-batch (the loss call takes it whole) and this rank's planned shard."""
    from cpkv.integrations.collate import flatten_examples

    return flatten_examples(examples), collator(examples)


# ------------------------------------------------------------------ the model


def build_model() -> Any:
    """The tiny float32 DeepSeek-V4 of examples/hf_causal_lm_cp.py with a byte vocabulary; eager experts (any dtype)."""
    from hf_causal_lm_cp import build_model as tiny_model

    model = tiny_model(VOCAB)
    model.config._experts_implementation = "eager"  # read at each forward
    return model


def sharded_model(mesh: Any, dtype: str) -> tuple[Any, Any]:
    """The model with cpkv's forward, activation checkpointing and FSDP2 over the flattened ``dp x cp`` mesh; AdamW."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    model = enable_deepseek_v4_cp(build_model())  # first: the attention modules get cpkv's forward
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")  # torchtitan's way; DeviceMesh has no public flatten yet
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if dtype == "bfloat16" else None
    options = {} if policy is None else {"mp_policy": policy}
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh, **options)
    fully_shard(model, mesh=shard_mesh, **options)
    # The optimizer gets the parameters that train: without the indexer loss the CSA indexers get no
    # gradient (as in Hugging Face), and DCP's get_state_dict would give a fresh optimizer state for
    # them that the saved checkpoint lacks ("Missing key in checkpoint state_dict" at the load).
    trained = [p for name, p in model.named_parameters() if ".indexer." not in name]
    return model, torch.optim.AdamW(trained, lr=LR)


# ------------------------------------------------------------------ one rank's loop


def train(run: str, steps: int, first: int, mesh: Any, model: Any, optimizer: Any, save: str | None, save_at: int) -> list[float]:
    """Steps ``first .. steps - 1`` of ``run`` on this rank; the losses (mean over the global batch), the same on every rank."""
    from torch.utils.data import DataLoader

    from cpkv.integrations.collate import PackedCPCollator
    from cpkv.integrations.transformers import deepseek_v4_plan_options
    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss

    dp = RUNS[run][0]
    collator = PackedCPCollator.for_group(mesh["cp"], layout="balanced", exchange="need",
                                          plan_options=deepseek_v4_plan_options(model.config))
    data = ReplicaBatches(mesh.get_local_rank("dp"), dp, first, steps)
    # One worker process packs and plans off the critical path. "fork": the worker needs no import of its own (the
    # collator runs on the CPU only, so forking is safe next to CUDA); spawned workers re-import this script.
    loader = iter(DataLoader(data, batch_size=None, collate_fn=functools.partial(collate, collator), num_workers=1,
                             multiprocessing_context="fork"))
    losses = []
    for step in range(first, steps):
        logged = torch.zeros(())
        for _ in range(MICRO // dp):  # gradient accumulation: dp 1 reads both micro-batches of a step
            packed, shard = next(loader)
            out = deepseek_v4_causal_lm_loss(model, packed["input_ids"], mesh["cp"], cu_seqlens=shard.cu_seqlens,
                                             plan=shard.plan, grad_reduction="mean")  # FSDP2 averages over dp x cp
            (out.loss / (MICRO // dp)).backward()
            logged += out.lm_loss.float() / (MICRO // dp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(logged)  # each CP group's loss, once per rank: the mean over the dp replicas
        losses.append(float(logged) / dist.get_world_size())
        if save is not None and step + 1 == save_at:
            save_checkpoint(save, model, optimizer)
    return losses


def save_checkpoint(path: str, model: Any, optimizer: Any) -> None:
    """Model and optimizer, each rank writing its shards (``torch.distributed.checkpoint``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def load_checkpoint(path: str, model: Any, optimizer: Any) -> None:
    """The checkpoint into a freshly sharded model and its optimizer (resharded to their meshes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def run_all(runs: Sequence[str], steps: int, save_at: int, directory: str) -> dict[str, Any]:
    """Every run on this rank (the process group is up): losses, then the resumed steps' losses."""
    from torch.distributed.device_mesh import init_device_mesh

    results = {}
    for run in runs:
        dp, cp, dtype = RUNS[run]
        mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
        path = os.path.join(directory, run)
        model, optimizer = sharded_model(mesh, dtype)
        losses = train(run, steps, 0, mesh, model, optimizer, path, save_at)
        model, optimizer = sharded_model(mesh, dtype)  # a fresh start, as after a crash
        load_checkpoint(path, model, optimizer)
        resumed = train(run, steps, save_at, mesh, model, optimizer, None, save_at)
        results[run] = {"losses": losses, "resumed": resumed}
    return results


@contextlib.contextmanager
def checkpoint_dir(path: str | None) -> Iterator[str]:
    """``path``, or a temporary directory rank 0 makes and every rank uses (one node), removed at the end."""
    if path is not None:
        yield path
        return
    made = [tempfile.mkdtemp(prefix="fsdp2_cp_checkpoint_") if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(made, src=0)
    try:
        yield made[0]
    finally:
        dist.barrier()  # every rank has loaded before rank 0 removes it
        if dist.get_rank() == 0:
            shutil.rmtree(made[0], ignore_errors=True)


def rank_main(rank: int, world: int, runs: Sequence[str], steps: int, save_at: int, directory: str,
              checkpoints: str | None) -> None:
    """A spawned rank: join the gloo group (its store in ``directory``), run, rank 0 writes the results there."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=world)
    try:
        results = run_all(runs, steps, save_at, checkpoints or directory)
        if rank == 0:
            Path(directory, "results.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ one process, no CP


def train_single(steps: int) -> list[float]:
    """The same steps in one process: Hugging Face's model on each document alone, float32."""
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for index in range(step * MICRO, (step + 1) * MICRO):
            ce, count = torch.zeros(()), 0
            for example in micro_batch(index):
                doc = example["input_ids"][None]
                logits = model(input_ids=doc, use_cache=False).logits[0, :-1]  # token t predicts token t + 1
                ce = ce + torch.nn.functional.cross_entropy(logits.float(), doc[0, 1:], reduction="sum")
                count += doc.shape[1] - 1
            total = total + ce / count / MICRO
        total.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total.detach()))
    return losses


# ------------------------------------------------------------------ the comparison


def plot(path: str, results: dict[str, Any], single: list[float]) -> None:
    """The CP runs' loss curves over one process's, and their relative differences, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(len(single))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    top.plot(steps, single, "k-", lw=3, alpha=0.3, label="1 process, no CP (HF, float32)")
    for (run, result), style in zip(results.items(), ["o", "x", "+"]):
        top.plot(steps, result["losses"], style, ms=4, label=f"FSDP2 {run} (cpkv)")
        bottom.semilogy(steps, [abs(a - b) / b or float("nan") for a, b in zip(result["losses"], single)], style, ms=4,
                        label=run)
    bottom.axhline(FP32_TOL, color="k", ls="--", lw=1, label=f"float32 tolerance {FP32_TOL:g}")
    bottom.axhline(BF16_TOL, color="g", ls=":", lw=1, label=f"bf16 tolerance {BF16_TOL:g}")
    top.set_ylabel("loss (bytes of the stdlib's .py files)")
    top.legend()
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=7, ncol=2)
    fig.suptitle("Tiny DeepseekV4ForCausalLM under FSDP2 x CP vs one process")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def check(results: dict[str, Any], single: list[float], save_at: int) -> list[str]:
    """What differs beyond the tolerances (empty: all agree); prints the table."""
    problems = []
    print("step  1-process  " + "  ".join(f"{run:>13}" for run in results))
    for step, want in enumerate(single):
        print(f"{step:4d}  {want:9.5f}  " + "  ".join(f"{r['losses'][step]:13.5f}" for r in results.values()))
    for run, result in results.items():
        tol = BF16_TOL if RUNS[run][2] == "bfloat16" else FP32_TOL
        worst = max(abs(a - b) / b for a, b in zip(result["losses"], single))
        print(f"{run}: worst relative difference {worst:.1e} (tolerance {tol:g}); resumed steps {save_at}..: "
              f"{'identical' if result['resumed'] == result['losses'][save_at:] else 'DIFFERENT'}")
        if worst > tol:
            problems.append(f"{run} differs from one process by {worst:.1e} > {tol:g}")
        if result["resumed"] != result["losses"][save_at:]:
            problems.append(f"{run}: the steps resumed from the checkpoint differ: {result['resumed']} vs {result['losses'][save_at:]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps (default 24)")
    parser.add_argument("--save-at", type=int, help="checkpoint after this many steps (default: max(1, steps - 2))")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="the CP runs (default all)")
    parser.add_argument("--plot", default="", metavar="PATH", help="draw the loss curves into this PNG (default: none)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="where the distributed checkpoint goes and stays (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    save_at = max(1, args.steps - 2) if args.save_at is None else args.save_at
    if args.steps < 2 or not 1 <= save_at < args.steps:
        parser.error(f"need --steps >= 2 and 1 <= --save-at < --steps, got {args.steps} and {save_at}")
    if "RANK" in os.environ:  # under torchrun: this process is one rank
        dist.init_process_group("gloo")
        with checkpoint_dir(args.checkpoint_dir) as directory:
            results = run_all(args.runs, args.steps, save_at, directory)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank:
            return 0
    else:
        # Imported once, here: the forked ranks share them.
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.fsdp  # noqa: F401
        import transformers.models.deepseek_v4.modeling_deepseek_v4  # noqa: F401

        import cpkv.integrations.collate  # noqa: F401
        import cpkv.integrations.transformers_lm  # noqa: F401

        with tempfile.TemporaryDirectory() as directory:
            # Forked ranks share this process's imports; it has run no torch op yet, so no thread pool is forked.
            ranks = torch.multiprocessing.start_processes(
                rank_main, args=(4, args.runs, args.steps, save_at, directory, args.checkpoint_dir), nprocs=4, join=False, start_method="fork")
            single = train_single(args.steps)  # meanwhile, the same steps in this process
            while not ranks.join():
                pass
            results = json.loads(Path(directory, "results.json").read_text())
    if "RANK" in os.environ:
        single = train_single(args.steps)
    problems = check(results, single, save_at)
    if args.plot:
        plot(args.plot, results, single)
        print(f"wrote {args.plot}")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
