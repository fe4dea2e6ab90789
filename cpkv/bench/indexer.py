"""The lightning indexer's work, launches and host syncs per layer call, measured on the CPU (no GPU, no kernel run).

``python -m cpkv.bench indexer`` (or ``python -m cpkv.bench.indexer``) prints one markdown table:

* **counted work**: visible (query, entry) pairs x ``H_I`` x ``D_I`` x 2 FLOPs, from the plan's
  :class:`~cpkv.plan.segments.EntryVisibility` of the busiest (last) rank;
* **executed work**: what ``cpkv_triton::indexer_topk`` multiplies with the tile sizes it
  uses on a GPU (:func:`~cpkv.backends.triton.indexer_ops.indexer_tiles`): each tile of
  ``block_t`` queries scores whole ``block_n``-entry chunks of the union of its queries'
  ranges;
* **launches and host syncs**: the op's launch builder run on ``meta`` tensors of those
  shapes inside a dispatch mode that counts the torch kernels it would run (anything but
  allocations and views) and the host syncs (``aten._local_scalar_dense``: ``.item()``,
  ``int()``, ``bool()`` of a tensor), plus the Triton launches it returns;
* **the KL loss** (``cpkv_triton::indexer_kl`` and its backward, atomic and deterministic):
  the same counts for the ops' own bodies run on ``meta`` tensors, their launches collected
  instead of run.

GPU times: ``benchmarks/indexer_check.py`` (docs/gpu_check.md).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from cpkv.backends.triton.indexer_ops import indexer_kl_backward, indexer_kl_forward, indexer_tiles, indexer_topk_launches
from cpkv.backends.triton.launches import KernelLaunch
from cpkv.plan.attention import plan_attention

__all__ = ["IndexerWork", "KLCalls", "indexer_work", "kl_calls", "kl_table", "main", "work_table"]

FREE_OPS = {"empty", "empty_strided", "detach", "view", "alias", "as_strided", "t", "transpose", "expand", "slice", "select"}
SYNC_OPS = {"_local_scalar_dense", "item", "equal", "is_nonzero"}


@dataclass(frozen=True)
class IndexerWork:
    """One indexer layer call's work and host interactions.

    Attributes:
        queries, entries: ``T`` and ``N_c`` of the call. heads, dim: ``H_I``, ``D_I``.
        counted_pairs: visible (query, entry) pairs. executed_pairs: pairs the kernel scores.
        triton_launches, torch_kernels, host_syncs: per call, from the launch builder.
    """

    queries: int
    entries: int
    heads: int
    dim: int
    counted_pairs: int
    executed_pairs: int
    triton_launches: int
    torch_kernels: int
    host_syncs: int

    @property
    def counted_flops(self) -> int:
        """``counted_pairs * H_I * D_I * 2``."""
        return self.counted_pairs * self.heads * self.dim * 2

    @property
    def executed_flops(self) -> int:
        """``executed_pairs * H_I * D_I * 2``."""
        return self.executed_pairs * self.heads * self.dim * 2


class _Counter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.kernels = 0
        self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.syncs += 1
        elif name not in FREE_OPS:
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _executed_pairs(start: Tensor, count: Tensor, block_t: int, block_n: int) -> int:
    """Pairs scored by whole chunks of each tile's union range (int64 host arithmetic on CPU tensors)."""
    pad = -start.numel() % block_t
    lo = torch.nn.functional.pad(start, (0, pad), value=2**62).view(-1, block_t)
    hi = torch.nn.functional.pad(start + count, (0, pad), value=0).view(-1, block_t)
    live = torch.nn.functional.pad(count > 0, (0, pad), value=False).view(-1, block_t)
    lo = torch.where(live, lo, 2**62).amin(1)
    hi = torch.where(live, hi, 0).amax(1)
    chunks = torch.where(hi > lo, (hi - lo + block_n - 1) // block_n, 0)
    return int(chunks.sum()) * block_n * block_t


def indexer_work(cu_seqlens: Tensor, cp: int, rank: int, *, ratio: int = 4, heads: int = 64, dim: int = 128,
                 topk: int = 512, dtype: torch.dtype = torch.bfloat16) -> IndexerWork:
    """The indexer call of ``rank`` of ``cp`` on the packed batch ``cu_seqlens`` (all-gather plan, compress ``ratio``).

    Args:
        cu_seqlens: ``[B + 1]`` int global cu_seqlens. cp, rank: the CP group and the rank.
        ratio: compress ratio of the indexer layer. heads, dim, topk: ``H_I``, ``D_I``, top-k.
        dtype: the indexer's score dtype (``float8_e4m3fn`` adds the per-key scales).

    Returns:
        :class:`IndexerWork`; no kernel runs (the launches are built on ``meta`` tensors).
    """
    plan = plan_attention(cu_seqlens, cp, rank, compress_ratios=[ratio])
    visible = plan.segments.visible_for(ratio)
    start, count = visible.visible_start.cpu(), visible.visible_count.cpu()
    num_q, num_c = int(start.numel()), visible.num_entries
    tiles = indexer_tiles(torch.device("meta"), dim, topk, dtype=dtype)
    meta = torch.device("meta")
    q = torch.empty((num_q, heads, dim), dtype=dtype, device=meta)
    k = torch.empty((num_c, dim), dtype=dtype, device=meta)
    scale = torch.empty(num_c, dtype=torch.float32, device=meta) if dtype == torch.float8_e4m3fn else None
    w = torch.empty((num_q, heads), dtype=torch.float32, device=meta)
    start_m, count_m = start.to(meta), count.to(meta)  # the plan's tensors, already on the device in a layer
    counter = _Counter()
    with counter:
        launches, _, _ = indexer_topk_launches(q, k, w, scale, start_m, count_m, topk)
    return IndexerWork(
        queries=num_q, entries=num_c, heads=heads, dim=dim,
        counted_pairs=int(count.sum()),
        executed_pairs=_executed_pairs(start, count, tiles.block_t, tiles.block_n),
        triton_launches=len(launches), torch_kernels=counter.kernels, host_syncs=counter.syncs,
    )


@dataclass(frozen=True)
class KLCalls:
    """Launches, torch kernels and host syncs of the indexer KL loss per layer call (its forward and backward).

    Attributes:
        forward, backward, backward_deterministic: ``(Triton launches, torch kernels, host syncs)``;
            the backward's with atomic dk, and with the key-major dk.
    """

    forward: tuple[int, int, int]
    backward: tuple[int, int, int]
    backward_deterministic: tuple[int, int, int]


def kl_calls(queries: int, entries: int, *, heads: int = 64, dim: int = 128, topk: int = 512,
             dtype: torch.dtype = torch.bfloat16) -> KLCalls:
    """Count the KL loss's launches, torch kernels and host syncs for ``queries`` x ``topk`` selected of ``entries`` keys.

    Runs the bodies of ``cpkv_triton::indexer_kl`` and ``cpkv_triton::indexer_kl_backward``
    (:func:`~cpkv.backends.triton.indexer_ops.indexer_kl_forward`, ``indexer_kl_backward``)
    on ``meta`` tensors with a launch collector; nothing executes.
    """
    meta = torch.device("meta")
    q = torch.empty((queries, heads, dim), dtype=dtype, device=meta)
    k = torch.empty((entries, dim), dtype=dtype, device=meta)
    w = torch.empty((queries, heads), dtype=torch.float32, device=meta)
    sel = torch.empty((queries, topk), dtype=torch.int64, device=meta)
    target = torch.empty((queries, topk), dtype=torch.float32, device=meta)

    def count(call: Any) -> tuple[int, int, int]:
        launched: list[KernelLaunch] = []
        counter = _Counter()
        with counter:
            call(launched.extend)
        return len(launched), counter.kernels, counter.syncs

    return KLCalls(
        forward=count(lambda run: indexer_kl_forward(q, k, w, sel, target, run)),
        backward=count(lambda run: indexer_kl_backward(q, k, w, sel, target, 0.5, False, run)),
        backward_deterministic=count(lambda run: indexer_kl_backward(q, k, w, sel, target, 0.5, True, run)),
    )


def kl_table(calls: KLCalls) -> list[str]:
    """Markdown rows: the KL loss's launches, torch kernels and host syncs per layer call."""
    rows = ["| KL loss call | Triton launches | torch kernels | host syncs |", "|---|---|---|---|"]
    for name, (launches, kernels, syncs) in (
        ("forward", calls.forward), ("backward (atomic dk)", calls.backward),
        ("backward (deterministic dk)", calls.backward_deterministic),
    ):
        rows.append(f"| {name} | {launches} | {kernels} | {syncs} |")
    return rows


def work_table(cases: dict[str, IndexerWork]) -> list[str]:
    """Markdown rows: counted vs executed work, launches and host syncs per layer call."""
    rows = [
        "| batch | T | N_c | counted pairs | counted TFLOP | executed TFLOP | executed/counted | Triton launches | torch kernels | host syncs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in cases.items():
        ratio = w.executed_pairs / max(w.counted_pairs, 1)
        rows.append(
            f"| {name} | {w.queries:,} | {w.entries:,} | {w.counted_pairs:,} | {w.counted_flops / 1e12:.1f} | "
            f"{w.executed_flops / 1e12:.1f} | {ratio:.3f} | {w.triton_launches} | {w.torch_kernels} | {w.host_syncs} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the indexer table (``--tokens`` per document batch at ``--cp``, busiest rank); 0 on success."""
    parser = argparse.ArgumentParser(prog="python -m cpkv.bench indexer", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens of the batch (default 1M)")
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--topk", type=int, default=512)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.cp = 4096, 2
    total = args.tokens
    docs = torch.arange(0, total + 1, max(total // 16, 1))
    batches = {"one document": torch.tensor([0, total]), "16 documents": torch.cat([docs[docs < total], torch.tensor([total])])}
    cases = {}
    for name, cu in batches.items():
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            label = f"{name}, {str(dtype).removeprefix('torch.')}"
            cases[label] = indexer_work(cu, args.cp, args.cp - 1, topk=args.topk, dtype=dtype)
    print(f"Indexer layer call (ratio 4, H_I 64, D_I 128, top-{args.topk}), {total:,} tokens at cp {args.cp}, last rank:\n")
    print("\n".join(work_table(cases)))
    last = cases["one document, bfloat16"]
    print(f"\nIndexer KL loss of that call (bf16, top-{args.topk} of {last.entries:,} entries, {last.queries:,} queries):\n")
    print("\n".join(kl_table(kl_calls(last.queries, last.entries, topk=args.topk))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
