"""``python -m cpkv.demo``: the V4-style layer under CP, checked against one process.

Spawns ``--cp`` CPU ranks (gloo) by default, or runs as one rank of a ``torchrun`` job
(``RANK`` / ``WORLD_SIZE`` in the environment; ``--backend`` gloo, nccl or hccl). Every
rank runs the layer in each mode on its shard of a packed batch of mixed-length
documents (by default ``--layout balanced --exchange need``: ranges cut by the layer's own
modeled cost, :meth:`cpkv.CostModel.from_v4`, and only the needed rows received), forward
and backward, builds the whole-batch single-process
result itself, and the errors are reduced over the group: output and input-gradient
errors from the shards, parameter-gradient errors after summing the gradients over
ranks (what CP gradient reduction does). Prints a table; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from cpkv.commstats import count_bytes
from cpkv.launch import spawn
from cpkv.plan.attention import plan_attention
from cpkv.plan.cost import CostModel
from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.v4 import V4Attention, V4Config, reference_forward

MODES: dict[str, V4Config] = {
    "window": V4Config(compress_ratio=0, window=32),
    "dense": V4Config(compress_ratio=0, window=None),
    "compressor": V4Config(compress_ratio=16, window=32),
    "indexer": V4Config(compress_ratio=4, window=32, topk=8),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}
TOLERANCE = {"fp64": 1e-10, "fp32": 1e-4}  # bf16: 2x the single-process bf16 error vs fp64, + 2**-8


def mixed_lengths(tokens: int, seed: int) -> list[int]:
    """Log-normal document lengths (mean ~tokens/6) with zero-length ones, summing to ``tokens``."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        draw = torch.empty(1).log_normal_(0.0, 1.0, generator=gen).item()
        lengths.append(min(int(draw * tokens / 10), tokens - sum(lengths)))
    return lengths


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


Result = dict[str, torch.Tensor]


def _grads(layer: V4Attention) -> Result:
    return {f"param:{n}": p.grad if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}


def _single_process(config: V4Config, x: torch.Tensor, g: torch.Tensor, cu: torch.Tensor, seed: int) -> Result:
    """Output, input gradient and parameter gradients of the whole batch in one process."""
    layer = V4Attention(config, seed=seed).to(x.device, x.dtype)
    x = x.clone().requires_grad_(True)
    out = reference_forward(layer, x, cu).out
    torch.autograd.backward(out, g)
    return {"out": out.detach(), "grad_x": x.grad if x.grad is not None else torch.zeros_like(x), **_grads(layer)}


def _cp(config: V4Config, x: torch.Tensor, g: torch.Tensor, cu: torch.Tensor, args: argparse.Namespace,
        rank: int, world: int) -> tuple[Result, float, int]:
    """This rank's shard of the same under CP; parameter gradients summed over ranks."""
    layer = V4Attention(config, seed=args.seed).to(x.device, x.dtype)
    ratios = [config.compress_ratio] if config.mode.compresses else []
    plan = plan_attention(cu, world, rank, layout=args.layout, exchange=args.exchange, ring_degree=args.ring_degree,
                          compress_ratios=ratios, windows=[config.window], cost_model=CostModel.from_v4(config))
    x_local = plan.shard(x).clone().requires_grad_(True)
    with count_bytes() as counter:
        start = time.perf_counter()
        out = layer(x_local, plan, None).out
        torch.autograd.backward(out, plan.shard(g))
        elapsed = time.perf_counter() - start
    grads = _grads(layer)
    for grad in grads.values():
        dist.all_reduce(grad)  # CP gradient reduction
    grad_x = x_local.grad if x_local.grad is not None else torch.zeros_like(x_local)
    return {"out": out.detach(), "grad_x": grad_x, **grads}, elapsed, counter.total


def _errors(config: V4Config, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict[str, float]:
    """Max relative errors of one mode on this rank (``cp`` and, for bf16, ``sp`` errors vs fp64)."""
    cu = seqlens_to_cu_seqlens(mixed_lengths(args.tokens, args.seed), device=device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x64, g64 = (torch.randn(args.tokens, config.hidden, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    dtype = DTYPES[args.dtype]
    exact = _single_process(config, x64.to(torch.float64 if args.dtype == "bf16" else dtype), g64.to(x64.dtype if args.dtype == "bf16" else dtype), cu, args.seed)
    local, elapsed, nbytes = _cp(config, x64.to(dtype), g64.to(dtype), cu, args, rank, world)
    rows = plan_attention(cu, world, rank, layout=args.layout, cost_model=CostModel.from_v4(config)).shard(torch.arange(args.tokens, device=device))
    sharded = {k: (v[rows] if k in ("out", "grad_x") else v) for k, v in exact.items()}
    summary = {"cp_out": _rel(local["out"], sharded["out"]),
               "cp_grads": max(_rel(local[k], sharded[k]) for k in sharded if k != "out")}
    if args.dtype == "bf16":  # the single-process bf16 run's own error, for the 2x rule
        single = _single_process(config, x64.to(dtype), g64.to(dtype), cu, args.seed)
        summary["sp_out"] = _rel(single["out"][rows], sharded["out"])
        summary["sp_grads"] = max(_rel(single[k] if k.startswith("param") else single[k][rows], sharded[k]) for k in sharded if k != "out")
    summary["time"], summary["bytes"] = elapsed, float(nbytes)
    return summary


def _rank_main(rank: int, world: int, args: argparse.Namespace, device_name: str = "cpu") -> list[dict[str, Any]]:
    device = torch.device(device_name)
    rows = []
    names = list(MODES) if args.mode == "all" else [args.mode]
    for i, name in enumerate(names):
        if rank == 0:
            print(f"[{i + 1}/{len(names)}] {name}: cp={world} tokens={args.tokens} dtype={args.dtype}"
                  f" layout={args.layout} exchange={args.exchange} ring_degree={args.ring_degree} ...", flush=True)
        summary = _errors(MODES[name], args, rank, world, device)
        values = torch.tensor(list(summary.values()), dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        rows.append({"mode": name, **dict(zip(summary, values.tolist()))})
    return rows


def _verdict(row: dict[str, Any], dtype: str) -> bool:
    if dtype == "bf16":
        return bool(row["cp_out"] <= 2 * row["sp_out"] + 2**-8 and row["cp_grads"] <= 2 * row["sp_grads"] + 2**-8)
    return bool(row["cp_out"] <= TOLERANCE[dtype] and row["cp_grads"] <= TOLERANCE[dtype])


def print_table(rows: list[dict[str, Any]], cp: int, dtype: str) -> bool:
    """Print the result table; return whether every mode matched."""
    print("\n| mode | cp | dtype | max rel err out | max rel err grads | fwd+bwd s | bytes recv/rank | ok |")
    print("|---|---|---|---|---|---|---|---|")
    all_ok = True
    for row in rows:
        ok = _verdict(row, dtype)
        all_ok &= ok
        print(f"| {row['mode']} | {cp} | {dtype} | {row['cp_out']:.2e} | {row['cp_grads']:.2e} | {row['time']:.3f} |"
              f" {int(row['bytes']):,} | {'yes' if ok else 'NO'} |")
    return all_ok


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = _non_negative(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    """argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    """The demo's flags (defaults: the README's recommended ``--layout balanced --exchange need``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp", type=_positive, default=4, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--tokens", type=_positive, default=1536, help="packed tokens of the micro-batch (divisible by cp for --layout contiguous)")
    parser.add_argument("--mode", choices=["all", *MODES], default="all")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--seed", type=_non_negative, default=0)
    parser.add_argument("--timeout", type=_positive, default=300,
                        help="seconds a collective may wait for a peer before the process group fails (torchrun)")
    parser.add_argument("--ring-degree", type=_positive, default=1,
                        help="rounds of the need-based kv exchange, merged exactly by LSE (plan_attention(ring_degree=...))")
    parser.add_argument("--exchange", choices=["allgather", "need"], default="need",
                        help="move every rank's tokens (allgather) or only what each rank needs (need)")
    parser.add_argument("--layout", choices=["contiguous", "balanced"], default="balanced",
                        help="packed tokens cut by the layer's own modeled cost (balanced, the default) or evenly (contiguous)")
    parser.add_argument("--backend", default=None, help="torch.distributed backend under torchrun (default gloo)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.cp
    if args.tokens % world != 0 and args.layout == "contiguous":
        parser.error(f"--tokens ({args.tokens}) must be divisible by the number of ranks ({world})")
    if args.ring_degree > 1 and args.exchange != "need":
        parser.error(f"--ring-degree {args.ring_degree}: values > 1 need --exchange need")
    start = time.perf_counter()
    if torchrun:
        backend = args.backend or "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        device = {"nccl": f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}", "hccl": f"npu:{int(os.environ.get('LOCAL_RANK', 0))}"}
        try:
            rows = _rank_main(dist.get_rank(), world, args, device.get(backend, "cpu"))
        except Exception:  # fail fast: torchrun stops the peers as soon as this rank exits
            traceback.print_exc()
            print(f"rank {dist.get_rank()}: failed; exiting so that torchrun stops the other ranks", file=sys.stderr, flush=True)
            os._exit(1)
        is_first = dist.get_rank() == 0
        ok = print_table(rows, world, args.dtype) if is_first else True
        dist.destroy_process_group()
        if not is_first:
            return 0 if ok else 1
    else:
        rows = spawn(_rank_main, world, args, timeout=600.0)[0]
        ok = print_table(rows, world, args.dtype)
    print(f"\n{'OK' if ok else 'MISMATCH'}: {len(rows)} mode(s) in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
