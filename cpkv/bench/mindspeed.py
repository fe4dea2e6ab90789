"""``python -m cpkv.bench mindspeed``: forward bytes a rank receives per layer, MindSpeed-LLM's all-gather scheme vs cpkv's need exchange.

MindSpeed-LLM's DeepSeek-V4 attention under TND context parallelism (``kvallgather_cp_algo``
with ``reset_attention_mask``: contiguous shards; ``mindspeed_llm/tasks/models/transformer/deepseek4/csa.py``)
all-gathers, in every layer, the kv (``gather_from_sp_cp(kv, tnd=True)``); in a compressed
layer also the hidden states for the compressor and the rotary table of the prefix
(``_freqs_gathered``, complex64, ``rope_dim / 2`` values a row); in an INDEXER layer
(ratio 4) the hidden states a second time, detached, for the indexer's compressor. Each rank
then compresses its whole prefix. Those gathers run here as cpkv's :func:`cpkv.comm.gather_from_sp_cp`
of meta tensors of the same sizes in a fake process group, counted by
:func:`cpkv.commstats.count_bytes` (:mod:`cpkv.bench.traffic`); cpkv's need exchange is
:func:`cpkv.bench.traffic.layer_traffic`'s forward count over the real plan (window halo,
compressor-input halo, compressed entries and, at ratio 4, the indexer keys in fp32).

Forward only: MindSpeed detaches the compressed kv and the indexer's input, so its compressor
gathers have no backward, while cpkv's need exchange returns each gradient along its route.
Prints its section of ``docs/mindspeed.md`` (between :data:`BEGIN` and :data:`END`); ``--out
docs/mindspeed.md`` writes it there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor

from cpkv.bench.layouts import replace_section
from cpkv.bench.traffic import Dims, fake_group, layer_traffic, lognormal_cu_seqlens, need_plan
from cpkv.comm import gather_from_sp_cp
from cpkv.commstats import count_bytes

BEGIN = "<!-- mindspeed bytes: begin (python -m cpkv.bench mindspeed) -->"
END = "<!-- mindspeed bytes: end -->"
ROPE_DIM = 64
"""DeepSeek-V4-Flash's rotary dims (transformers' ``DeepseekV4Config().qk_rope_head_dim``)."""
KINDS = {0: "sliding window (NO_COMPRESS)", 4: "CSA (INDEXER, ratio 4)", 128: "HCA (COMPRESSOR_ONLY, ratio 128)"}


def mindspeed_forward_bytes(num_tokens: int, cp: int, rank: int, ratio: int, dims: Dims) -> int:
    """Bytes ``rank`` receives in one layer's forward under MindSpeed-LLM's TND all-gather (``num_tokens % cp == 0``)."""
    local = num_tokens // cp
    dtype = torch.bfloat16 if dims.element_bytes == 2 else torch.float32

    def gather(cols: int, of: torch.dtype = dtype) -> None:
        gather_from_sp_cp(torch.empty(local, cols, device="meta", dtype=of), None, tnd=True)

    with fake_group(rank, cp), count_bytes() as counter:
        gather(dims.kv_dim)  # kv
        if ratio > 1:
            gather(dims.hidden)  # hidden states for the compressor
            gather(ROPE_DIM, torch.float32)  # the rotary table (complex64 [rope_dim / 2]: rope_dim * 4 bytes a row)
        if ratio == 4:
            gather(dims.hidden)  # hidden states again, detached, for the indexer's compressor
    return counter.total


def bytes_table(tokens_per_rank: int, cps: list[int], mean_doc: int, dims: Dims) -> list[dict[str, object]]:
    """One row per (batch, cp, layer kind): the busiest rank's forward bytes under both schemes."""
    rows: list[dict[str, object]] = []
    for batch in ("one document", "log-normal"):
        for cp in cps:
            total = tokens_per_rank * cp
            cu: Tensor = torch.tensor([0, total]) if batch == "one document" else lognormal_cu_seqlens(total, mean_doc, seed=cp)
            plans = [need_plan(cu, cp, rank, [r for r in KINDS if r > 1], dims) for rank in range(cp)]
            for ratio in KINDS:
                mindspeed = max(mindspeed_forward_bytes(total, cp, rank, ratio, dims) for rank in range(cp))
                need = max(layer_traffic(cu, cp, rank, ratio, "need", dims, plan=plans[rank]).forward for rank in range(cp))
                rows.append({"batch": batch, "cp": cp, "kind": KINDS[ratio], "mindspeed": mindspeed, "need": need})
    return rows


def section(rows: list[dict[str, object]], tokens_per_rank: int, mean_doc: int) -> str:
    """The markdown section (with :data:`BEGIN` and :data:`END`)."""
    mib = 1024 * 1024
    lines = [
        BEGIN, "",
        f"`python -m cpkv.bench mindspeed`: {tokens_per_rank:,} tokens per rank; one document, or log-normal packs"
        f" (mean {mean_doc:,}, seed = cp); DeepSeek-V4-Flash's layer shapes (hidden 4096, kv 512, indexer keys 128"
        " in fp32, bf16 on the wire). Busiest rank, one layer, forward, MiB received.", "",
        "| batch | cp | layer | MindSpeed-LLM all-gather | cpkv need | all-gather / need |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ms, need = int(row["mindspeed"]), int(row["need"])  # type: ignore[call-overload]
        ratio = f"{ms / need:,.0f}x" if need else "no bytes under need"
        lines.append(f"| {row['batch']} | {row['cp']} | {row['kind']} | {ms / mib:,.1f} | {need / mib:,.2f} | {ratio} |")
    return "\n".join([*lines, "", END]) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Count both schemes, print the section and write it into ``--out`` when given; 0 on success."""
    parser = argparse.ArgumentParser(prog="python -m cpkv.bench mindspeed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", type=int, default=131072)
    parser.add_argument("--cps", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--mean-doc", type=int, default=8192)
    parser.add_argument("--out", type=Path, help="replace this command's section of this file (e.g. docs/mindspeed.md); default: print only")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for tests")
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens_per_rank, args.cps, args.mean_doc = 512, [2, 3], 64
    text = section(bytes_table(args.tokens_per_rank, args.cps, args.mean_doc, Dims()), args.tokens_per_rank, args.mean_doc)
    print(text)
    if args.out is None:
        pass
    elif args.out.exists():
        args.out.write_text(replace_section(args.out.read_text(encoding="utf-8"), text, begin=BEGIN, end=END), encoding="utf-8")
    else:
        print(f"{args.out} does not exist: nothing written", file=sys.stderr)
    return 0
