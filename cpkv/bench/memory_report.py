"""``python -m cpkv.bench memory``: the loss-memory table and the whole-step memory table per rank.

Prints its section of ``docs/benchmarks.md`` (between :data:`BEGIN` and :data:`END`; the main
bench keeps it); ``--out docs/benchmarks.md`` writes it there. ``--smoke`` runs tiny sizes (used by the tests).

* :mod:`cpkv.bench.loss_memory`: the chunked causal-LM loss vs whole logits, measured on CPU.
* :mod:`cpkv.bench.step_memory`: one rank's memory of a whole DeepSeek-V4 training step at 1M
  tokens, counted on meta tensors, and the counter checked against a CPU measurement.
* :mod:`cpkv.bench.eval_memory`: the same for an evaluation (forward-only) step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from cpkv.bench.eval_memory import eval_memory_lines, eval_memory_table
from cpkv.bench.layouts import existing_section, replace_section
from cpkv.bench.loss_memory import loss_memory_lines, loss_memory_table
from cpkv.bench.memory_check import counter_check_lines, counter_checks
from cpkv.bench.step_memory import reading_lines, step_memory_lines, step_memory_table

__all__ = ["BEGIN", "END", "kept_section", "main", "parse_args"]

BEGIN = "<!-- memory: begin (python -m cpkv.bench memory) -->"
END = "<!-- memory: end -->"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options of ``python -m cpkv.bench memory`` (``--smoke``: tiny sizes)."""
    parser = argparse.ArgumentParser(prog="python -m cpkv.bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loss-tokens", type=int, nargs="+", default=[8192, 16384, 32768], help="T/cp of the loss table")
    parser.add_argument("--loss-vocabs", type=int, nargs="+", default=[32768, 129280], help="V of the loss table")
    parser.add_argument("--loss-hidden", type=int, default=64, help="H of the loss table (the head's width)")
    parser.add_argument("--full-max-gib", type=float, default=1.0,
                        help="run the whole-logits path where its float32 logits are at most this many GiB")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="tokens of the whole-step table's batch")
    parser.add_argument("--cps", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--world", type=int, default=256, help="ranks FSDP2 shards the parameters and optimizer state over")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, help="replace this command's section of this file (e.g. docs/benchmarks.md); default: print only")
    args = parser.parse_args(argv)
    if args.smoke:
        args.loss_tokens, args.loss_vocabs, args.full_max_gib = [512], [2048], 1.0
        args.tokens, args.cps = 1 << 14, [8]
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and count, print the section and write it into ``--out`` when given; 0 on success."""
    args = parse_args(argv)
    start = time.perf_counter()
    print("loss memory ...", file=sys.stderr)
    smallest = min(args.loss_tokens), min(args.loss_vocabs)
    loss_rows = loss_memory_table(args.loss_tokens, args.loss_vocabs, args.loss_hidden, bf16=[smallest],
                                  full_max_gib=args.full_max_gib)
    print("whole step ...", file=sys.stderr)
    step_rows = step_memory_table(args.tokens, args.cps, args.world, smoke=args.smoke)
    print("evaluation step ...", file=sys.stderr)
    eval_rows = eval_memory_table(args.tokens, args.cps, args.world, smoke=args.smoke)
    checks = counter_checks(smoke=args.smoke)
    lines = [BEGIN, *loss_memory_lines(loss_rows), *step_memory_lines(step_rows, args.tokens, args.world),
             *reading_lines(step_rows), *eval_memory_lines(eval_rows, args.tokens, args.world),
             *counter_check_lines(checks), END]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out is not None:
        old = args.out.read_text() if args.out.exists() else "# Benchmarks\n"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(replace_section(old, section, begin=BEGIN, end=END))
        print(f"wrote the memory section of {args.out}", file=sys.stderr)
    print(f"done in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


def kept_section(text: str) -> str:
    """This command's section of ``text`` (with its markers), or ``""``: what the main bench keeps."""
    return existing_section(text, begin=BEGIN, end=END)
