"""``python -m cpkv.demo``: plan the prefix kv of a packed batch and check it on gloo ranks.

Spawns ``--cp`` CPU ranks; each gathers the packed kv with ``gather_from_sp_cp``,
slices its causal prefix with the plan, and the demo checks every prefix and the
gather's gradient against the single-process values. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from cpkv.comm import gather_from_sp_cp, global_num_seqs
from cpkv.launch import spawn
from cpkv.layout import seqlens_to_cu_seqlens
from cpkv.plan import rearrange_prefix_kv, slice_tnd_kv_prefix
from cpkv.sharding import contiguous_shard_range, shard_contiguous


def _rank_main(rank: int, world: int, lengths: list[int], seed: int) -> dict[str, object]:
    cu = seqlens_to_cu_seqlens(lengths)
    kv_full = torch.randn(int(cu[-1]), 2, 8, generator=torch.Generator().manual_seed(seed))
    local = shard_contiguous(kv_full, world, rank).clone().requires_grad_(True)
    gathered = gather_from_sp_cp(local, None, tnd=True)
    prefix, plan = slice_tnd_kv_prefix(gathered, cu, rank, world)
    prefix.sum().backward()  # type: ignore[no-untyped-call]
    return {
        "prefix_ok": torch.equal(prefix.detach(), rearrange_prefix_kv(kv_full, plan)),
        "cu_q": plan.cu_seqlens_q.tolist(),
        "cu_kv": plan.cu_seqlens_kv.tolist(),
        "kv_range": (plan.kv_start, plan.kv_end),
        "grad": local.grad,
        "total": global_num_seqs(plan.local_len, None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lengths", type=int, nargs="+", default=[5, 0, 27, 3, 9, 20])
    args = parser.parse_args(argv)
    lengths = list(args.lengths)
    pad = -sum(lengths) % args.cp
    if pad:
        lengths.append(pad)
    cu = seqlens_to_cu_seqlens(lengths)
    print(f"packed batch: cu_seqlens={cu.tolist()} over cp={args.cp}")
    start = time.perf_counter()
    results = spawn(_rank_main, args.cp, lengths, args.seed)
    ok = True
    num_tokens = int(cu[-1])
    for rank, res in enumerate(results):
        offset, local_len = contiguous_shard_range(num_tokens, args.cp, rank)
        grad = res["grad"]
        # Every rank's loss is prefix.sum(): the owner of token t receives one unit per rank whose prefix holds t.
        expected = torch.zeros(num_tokens, 2, 8)
        for other in results:
            lo, hi = other["kv_range"]
            expected[lo:hi] += 1
        grad_ok = isinstance(grad, torch.Tensor) and torch.equal(grad, expected[offset : offset + local_len])
        ok &= bool(res["prefix_ok"]) and grad_ok and res["total"] == num_tokens
        print(f"rank {rank}: queries [{offset}, {offset + local_len}) cu_seqlens_q={res['cu_q']}"
              f" cu_seqlens_kv={res['cu_kv']} prefix={res['kv_range']} prefix_ok={res['prefix_ok']} grad_ok={grad_ok}")
    print(f"{'OK' if ok else 'MISMATCH'} in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
