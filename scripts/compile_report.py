"""Compile every layer case with ``torch.compile(fullgraph=True)`` and print a table.

Usage: ``python scripts/compile_report.py [--backend inductor|aot_eager] [--cp 2]``.
For each compress mode x layout x exchange (ring rounds included) on gloo ranks: whether
the layer call compiled as one graph (``fullgraph=True`` raises on any graph break, so "yes"
means 0 breaks), the seconds of the first compiled call (compile + run, forward and
backward, rank 0) and the max relative error of outputs and gradients against eager.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cpkv.launch import RankError, spawn  # noqa: E402
from tests.test_compile import ALL_CASES, _case_id, compile_cases  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--cp", type=int, default=2, choices=[1, 2, 3, 4])
    args = parser.parse_args()
    print(f"| case | fullgraph | graph breaks | first call s ({args.backend}) | max rel. error vs eager |")
    print("|---|---|---|---|---|")
    failed = False
    for target in ("layer", "attention"):
        for case in ALL_CASES:
            name = ("V4Attention.forward " if target == "layer" else "attention_forward ") + _case_id(*case)
            try:
                result = spawn(compile_cases, args.cp, [case], args.backend, target, timeout=900.0)[0]
                row = next(iter(result.values()))
                print(f"| {name} | yes | 0 | {row['seconds']:.1f} | {row['error']:.1e} |", flush=True)
            except RankError as err:
                failed = True
                print(f"| {name} | no | - | - | {str(err).splitlines()[-1][:80]} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
