"""Quick start under torchrun: the plain attention path on the recommended layout, checked against one process.

One rank of a torchrun job (gloo, CPU)::

    torchrun --nproc-per-node 2 examples/quickstart_torchrun.py    # any number of ranks: 1, 2, 3, 4, ...

Every rank builds the same packed micro-batch (six documents; in training, a data loader), then:

1. ``CostModel(...)`` for *your* model: here a 16-layer dense causal transformer (hidden 512,
   8 heads of 64, MLP 2048, vocabulary 32,000); the balanced layout cuts the tokens so that every
   rank's modeled training-step cost (dense work plus causal attention) is equal.
2. ``plan_attention(..., layout="balanced", exchange="need", cost_model=...)``: each rank's
   token ranges and the rows of the causal prefix it needs from the others, planned on every rank
   from ``cu_seqlens`` alone (``group=`` checks that every rank passed the same batch).
3. ``plan.shard(x)``: this rank's rows of a per-token tensor (queries, shared kv, and any other:
   ids, labels, positions).
4. ``attention_forward(q, kv, plan, group, spec=..., status=...)`` then ``backward()``: one
   layer call, no host sync; ``status.check()`` once per step, before ``optimizer.step()``.
5. The check: each rank's output and gradients equal, in float64, one process attending each
   document with an explicit document-causal mask (bound 1e-12: the same float64 math in another
   summation order, measured <= 4e-14 at cp 2 and 3; a key of another document or one future key
   moves the output by > 1). The script exits 1 otherwise.

It imports cpkv (and with it ``torch.distributed.nn``) before ``init_process_group``:
docs/troubleshooting.md ("A torchrun job aborts at exit") says why.
"""

from __future__ import annotations

import sys

import cpkv  # noqa: F401  # first: before init_process_group (docs/troubleshooting.md)
import torch
import torch.distributed as dist
from cpkv import AttentionSpec, CostModel, StepStatus, attention_forward, plan_attention

LENGTHS = [300, 17, 1, 650, 2, 134]  # the packed micro-batch: six documents, 1,104 tokens
HEADS, DIM = 4, 64  # [T, H, D] queries, one shared [T, D] kv head (its first d_v channels are the values)
TOLERANCE = 1e-12


def my_model_cost() -> CostModel:
    """The modeled cost of a token of a 16-layer dense causal transformer (forward MACs per token, all layers)."""
    layers, hidden, mlp, vocab = 16, 512, 2048, 32000
    dense = (("attention projections", layers * 4 * hidden * hidden), ("MLP", layers * 3 * hidden * mlp),
             ("head", hidden * vocab))
    return CostModel(heads=8, head_dim=64, value_dim=64, swa_layers=0, csa_layers=0, hca_layers=0,
                     causal_layers=layers, dense=dense)


def one_process(q: torch.Tensor, kv: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` attention of every token to its own document's keys up to itself: an explicit mask."""
    total = int(cu_seqlens[-1])
    document = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())
    position = torch.arange(total)
    allowed = (document[:, None] == document[None, :]) & (position[None, :] <= position[:, None])
    scores = torch.einsum("thd,sd->hts", q, kv) / DIM**0.5
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,sd->thd", weights, kv)


def main() -> int:
    dist.init_process_group("gloo")  # torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...)
    group = dist.group.WORLD  # your CP group
    cp, rank = group.size(), group.rank()
    cu_seqlens = torch.cumsum(torch.tensor([0, *LENGTHS]), 0)
    generator = torch.Generator().manual_seed(0)  # the same batch on every rank
    total = int(cu_seqlens[-1])
    q_all = torch.randn(total, HEADS, DIM, dtype=torch.float64, generator=generator, requires_grad=True)
    kv_all = torch.randn(total, DIM, dtype=torch.float64, generator=generator, requires_grad=True)
    grad_out = torch.randn(total, HEADS, DIM, dtype=torch.float64, generator=generator)

    plan = plan_attention(cu_seqlens, cp, rank, layout="balanced", exchange="need", cost_model=my_model_cost(),
                          group=group)
    q = plan.shard(q_all).detach().requires_grad_(True)  # [T_r, H, D]: this rank's queries
    kv = plan.shard(kv_all).detach().requires_grad_(True)  # [T_r, D]: this rank's shared kv
    status = StepStatus(group)
    out = attention_forward(q, kv, plan, group, spec=AttentionSpec(d_v=DIM), status=status).out  # [T_r, H, d_v]
    out.backward(plan.shard(grad_out))
    status.check()  # once per step, before optimizer.step(): raises on every rank if any layer call failed

    want = one_process(q_all, kv_all, cu_seqlens)
    want.backward(grad_out)
    assert q_all.grad is not None and kv_all.grad is not None and q.grad is not None and kv.grad is not None
    with torch.no_grad():
        errors = {
            "output": (out - plan.shard(want)).abs().max(),
            "q grad": (q.grad - plan.shard(q_all.grad)).abs().max(),
            "kv grad": (kv.grad - plan.shard(kv_all.grad)).abs().max(),
        }
    worst = torch.stack(list(errors.values())).max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the worst error of every rank
    print(f"rank {rank}/{cp}: tokens {plan.local_len} of {total}; "
          + ", ".join(f"{name} {float(error):.1e}" for name, error in errors.items()), flush=True)
    dist.barrier()
    ok = float(worst) <= TOLERANCE
    if rank == 0:
        verdict = "matches one process" if ok else "DIFFERS from one process"
        print(f"cp {cp}, balanced layout, need exchange: {verdict} (worst {float(worst):.1e}, bound {TOLERANCE:g})")
    dist.destroy_process_group()
    del group  # a group referenced at exit keeps gloo's threads alive (docs/troubleshooting.md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
