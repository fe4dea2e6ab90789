"""The perplexity of one long real document under CP equals one process: the standard library's sources, byte by byte.

The document is the ``.py`` files of the standard library this Python ships, sorted by name and
concatenated, its first ``--tokens`` bytes (a byte vocabulary: 256 ids, no tokenizer to
download). A tiny random float64 ``DeepseekV4ForCausalLM`` (examples/hf_causal_lm_cp.py's, one
sliding, one CSA and one HCA layer) scores it:

1. under CP on ``--cp`` spawned gloo ranks:
   :func:`~cpkv.integrations.causal_lm_eval.deepseek_v4_causal_lm_eval` on the whole document
   (every rank passes it; each runs its balanced shard, forward only, chunked scores), which
   returns the document's summed negative log-likelihood and label count, the same on every rank;
2. in one process: the same call on a one-rank group (cp 1);
3. in one process with Hugging Face's own model (no cpkv), when ``--tokens`` is at most
   ``HF_MAX`` (its eager attention builds a ``[T, T]`` mask).

``perplexity = exp(nll / count)``. CP and cp 1 must agree within ``CP_TOL`` = 1e-10 relative
(the same float64 math in another summation order; measured in docs/integrations.md);
Hugging Face's within ``HF_TOL`` = 1e-3: it computes its norms, RoPE, softmaxes and index
scores in float32 even in a float64 model, and where those reorder near-tied index scores its
indexer picks other top-k entries (measured 5.8e-5 at 2,048 tokens; the tests lift the casts
and get 1e-12). The script exits 1 otherwise. Needs ``pip install 'cpkv[transformers]'``::

    python examples/perplexity_cp.py --tokens 65536   # cp 4, 64K tokens (docs/integrations.md shows the numbers)
    python examples/perplexity_cp.py --tokens 2048    # what CI runs: also against Hugging Face's model
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cpkv  # noqa: F401  # before init_process_group (docs/troubleshooting.md)

VOCAB, HF_MAX, CP_TOL, HF_TOL = 256, 8192, 1e-10, 1e-3
sys.path.insert(0, str(Path(__file__).resolve().parent))  # hf_causal_lm_cp's model, in the spawned ranks too


def document(tokens: int) -> torch.Tensor:
    """The first ``tokens`` bytes of the standard library's ``.py`` files, sorted by name and concatenated: ``[tokens]`` int64."""
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    data = bytearray()
    for path in files:
        data += Path(path).read_bytes()
        if len(data) >= tokens:
            break
    if len(data) < tokens:
        raise RuntimeError(f"the standard library's .py files hold {len(data)} bytes, fewer than --tokens {tokens}")
    return torch.frombuffer(data[:tokens], dtype=torch.uint8).long()


def build_model() -> Any:
    """examples/hf_causal_lm_cp.py's tiny model with a byte vocabulary, float64, eager experts, in eval mode."""
    from hf_causal_lm_cp import build_model as tiny_model

    model = tiny_model(VOCAB).double().eval()
    model.config._experts_implementation = "eager"  # grouped_mm has no float64
    return model


def cpkv_nll(tokens: int, group: Any) -> tuple[float, int, float]:
    """``(nll, count, seconds)`` of the document under CP over ``group`` (every rank the same)."""
    from cpkv.integrations.causal_lm_eval import deepseek_v4_causal_lm_eval
    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    ids = document(tokens)
    model = enable_deepseek_v4_cp(build_model())
    start = time.perf_counter()
    out = deepseek_v4_causal_lm_eval(model, ids, group, cu_seqlens=torch.tensor([0, tokens]), backend="reference")
    return float(out.nll.sum()), int(out.num_tokens.sum()), time.perf_counter() - start


def rank_main(rank: int, world: int, tokens: int) -> tuple[float, int, float]:
    """A spawned rank (cpkv.launch.spawn has joined the gloo group): its result of :func:`cpkv_nll` over the world."""
    torch.set_num_threads(1)
    return cpkv_nll(tokens, dist.group.WORLD)


def hf_nll(tokens: int) -> tuple[float, int]:
    """Hugging Face's model alone on the document (batch 1, positions from 0): ``(nll, count)``."""
    ids = document(tokens)[None]
    with torch.no_grad():
        logits = build_model()(input_ids=ids, use_cache=False).logits[0, :-1]
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")), tokens - 1


def main(argv: list[str] | None = None) -> int:
    from cpkv.launch import spawn

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65536, help="bytes of the document (default 65,536)")
    parser.add_argument("--cp", type=int, default=4, help="CP ranks (default 4)")
    args = parser.parse_args(argv)
    results = spawn(rank_main, args.cp, args.tokens, timeout=3000.0)
    same = len({(nll, count) for nll, count, _ in results}) == 1
    nll, count, seconds = results[0]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        one_nll, one_count, one_seconds = cpkv_nll(args.tokens, None)
    finally:
        dist.destroy_process_group()
    rows = [(f"cpkv, cp {args.cp}", nll, count, seconds), ("cpkv, one process (cp 1)", one_nll, one_count, one_seconds)]
    if args.tokens <= HF_MAX:
        start = time.perf_counter()
        rows.append(("Hugging Face, one process", *hf_nll(args.tokens), time.perf_counter() - start))
    print(f"the standard library's first {args.tokens:,} bytes of .py files as one document ({count:,} labels)")
    print(f"{'run':<28}{'nll':>22}{'perplexity':>16}{'seconds':>10}")
    for name, total, labels, taken in rows:
        print(f"{name:<28}{total:>22.12f}{math.exp(total / labels):>16.10f}{taken:>10.1f}")
    cp_diff = abs(nll - one_nll) / abs(one_nll)
    ok = same and count == one_count == args.tokens - 1 and cp_diff <= CP_TOL
    print(f"cp {args.cp} vs one process: relative difference {cp_diff:.1e} (tolerance {CP_TOL:g});"
          f" every rank the same: {same}")
    if args.tokens <= HF_MAX:
        hf_diff = abs(nll - rows[2][1]) / abs(rows[2][1])
        ok = ok and hf_diff <= HF_TOL
        print(f"cp {args.cp} vs Hugging Face: relative difference {hf_diff:.1e} (tolerance {HF_TOL:g}: its float32 casts)")
    print("perplexity under CP matches one process" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
