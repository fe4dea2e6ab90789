"""Hugging Face's DeepSeek-V4 decoder layers, each compiled as torchtitan does, over changing packings under CP.

``python -m cpkv.bench.hf_compile [--packings 20] [--backend aot_eager] [--cp 2]`` builds a small
random ``DeepseekV4ForCausalLM`` (one sliding-window, one CSA and one HCA layer, a hash-routed
and two learned MoE layers, hyper-connections), enables CP (:func:`~cpkv.integrations.transformers_lm.enable_deepseek_v4_cp`),
compiles every decoder layer in place with ``layer.compile(fullgraph=True)`` (torchtitan's
per-block compile; ``fullgraph=True`` raises on any graph break) and runs
:func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss` forward and backward over
``--packings`` packings whose documents change every step: first the edge packings of
:func:`cpkv.bench.torch_compile.edge_packings` for both compress ratios (one document, a document
shorter than the ratio, many tiny documents, ...), then log-normal documents. It prints, per
decoder layer type, the graphs compiled after each step, the compile seconds, and the last step's
loss and gradient errors against the same model run eagerly.

How graphs are counted: every layer type gets its own counting backend (a callable that wraps
``backend``), shared by the layers of that type; Dynamo calls a backend once per graph it compiles
(one per frame with ``fullgraph=True``), so its count is that layer type's graphs. The settings are
those a compiled training run needs: ``torch.fx.experimental._config.backed_size_oblivious = True``
(docs/troubleshooting.md: sizes of 0 and 1 stay symbolic) and Hugging Face's default experts
implementation ``"grouped_mm"`` (under ``torch.compile`` with non-bfloat16 weights it calls HF's
``transformers::grouped_mm_fallback`` custom op: no data-dependent shape in the graph; HF's
``"eager"`` experts loop over ``nonzero()`` and break the graph).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from cpkv.bench.torch_compile import compile_settings, edge_packings, failure_reason, lognormal_packing

__all__ = ["LAYER_TYPES", "hf_config", "hf_layers_over_packings", "hf_model", "hf_packings", "main"]

LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
"""The model's decoder layers: window-dense (with the hash-routed MoE), CSA (ratio 4, indexer) and HCA (ratio 16)."""
VOCAB, IGNORE = 64, -100


def hf_config(experts: str = "grouped_mm") -> Any:
    """The small ``DeepseekV4Config`` of tests/integrations/test_transformers_lm.py, with ``experts`` as the experts implementation."""
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, sliding_window=8, layer_types=LAYER_TYPES, mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=2, index_head_dim=16, index_topk=4, partial_rotary_factor=0.25,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=2,
    )
    config._attn_implementation = "eager"
    config._experts_implementation = experts
    return config


def hf_model(experts: str = "grouped_mm", dtype: torch.dtype = torch.float32) -> Any:
    """The CP-enabled random model in ``dtype``, the same on every rank and in every call (seeded)."""
    from transformers import DeepseekV4ForCausalLM

    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    torch.manual_seed(0)
    model: Any = DeepseekV4ForCausalLM(hf_config(experts))
    model = model.to(dtype)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                param.copy_(torch.randn(param.shape, generator=gen))
        table = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(VOCAB)])
        model.model.layers[0].mlp.gate.tid2eid.copy_(table)
    return enable_deepseek_v4_cp(model)


def hf_packings(tokens: int, world: int, packings: int, ratios: tuple[int, ...] = (4, 16)) -> list[list[int]]:
    """``packings`` document-length lists of ``tokens``: the edge packings of every ratio (duplicates once), then log-normal ones."""
    steps: list[list[int]] = []
    for ratio in ratios:
        steps += [p for p in edge_packings(tokens, world, ratio) if p not in steps]
    rng = random.Random(0)
    while len(steps) < packings:
        steps.append(lognormal_packing(rng, tokens))
    return steps[:packings]


def _counting(backend: str, counts: list[float]) -> Callable[..., Any]:
    """A Dynamo backend: ``backend`` itself, appending the seconds of each graph it is handed to ``counts``."""
    from torch._dynamo.backends.registry import lookup_backend

    inner = lookup_backend(backend)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        start = time.perf_counter()
        compiled = inner(gm, example_inputs)
        counts.append(time.perf_counter() - start)
        return compiled

    return compile_graph


def _step(model: Any, lengths: list[int], seed: int, group: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """One micro-batch forward and backward; (the group's loss, this rank's parameter gradients)."""
    import torch.distributed as dist

    from cpkv.integrations.transformers_lm import deepseek_v4_causal_lm_loss
    from cpkv.plan import seqlens_to_cu_seqlens

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (sum(lengths),), generator=gen)
    labels = ids.clone()
    labels[3::7] = IGNORE
    model.zero_grad(set_to_none=True)
    out = deepseek_v4_causal_lm_loss(model, ids[None], group, cu_seqlens=seqlens_to_cu_seqlens(lengths, dtype=torch.int64),
                                     labels=labels[None], backend="reference")
    out.loss.backward()  # type: ignore[no-untyped-call]
    loss = out.loss.detach().clone()
    dist.all_reduce(loss, group=group)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), grads


def hf_layers_over_packings(rank: int, world: int, packings: int = 20, backend: str = "aot_eager", tokens: int = 96,
                            size_oblivious: bool = True, dynamic: bool | None = None, target: str = "layer") -> dict[str, Any]:
    """Graphs per decoder layer type of the per-layer compiled model after each of ``packings`` steps, on one rank.

    ``target``: ``"layer"`` compiles each decoder layer, ``"attention"`` only its ``self_attn``.
    ``dynamic``: ``torch.compile``'s (``None``: its default, torchtitan's: sizes and integers that
    change become symbolic in a second graph; ``True``: symbolic from the first).

    Returns a dict: ``graphs``: layer type -> graphs compiled after each step (Dynamo called that
    type's backend once per graph); ``compile_seconds``: layer type -> seconds its backend spent
    (``aot_eager``: AOTAutograd's tracing; Dynamo's own tracing is not included);
    ``unique_graphs``: Dynamo's ``counters["stats"]["unique_graphs"]`` after each step (all types);
    ``failed``: the step (1-based) that raised, else 0, and ``reason``; ``seconds``: each compiled
    step's wall time; ``loss_error``: the last step's absolute loss difference against the eager
    model (the same weights), ``grad_error``: the largest gradient difference relative to that
    gradient's largest magnitude, ``missing``: parameters with a gradient on one side only;
    ``eager_seconds``: the eager step's wall time; ``worst``: the parameter of ``grad_error``.
    """
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    compile_settings(size_oblivious)
    group = dist.group.WORLD
    compiled, eager = hf_model(), hf_model()
    types = list(compiled.config.layer_types)
    seconds_of: dict[str, list[float]] = {t: [] for t in dict.fromkeys(types)}
    backends = {t: _counting(backend, seconds_of[t]) for t in seconds_of}
    torch._dynamo.reset()
    counters.clear()
    for layer, kind in zip(compiled.model.layers, types):
        module = layer if target == "layer" else layer.self_attn
        module.compile(backend=backends[kind], fullgraph=True, dynamic=dynamic)
    graphs: dict[str, list[int]] = {t: [] for t in seconds_of}
    unique: list[int] = []
    seconds: list[float] = []
    failed, reason = 0, ""
    loss_error, grad_error, eager_seconds, missing, worst = 0.0, 0.0, 0.0, [], ""
    steps = hf_packings(tokens, world, packings)
    for step, lengths in enumerate(steps):
        start = time.perf_counter()
        try:
            loss, grads = _step(compiled, lengths, step, group)
        except Exception as exc:  # noqa: BLE001 - reported as the failing step
            failed, reason = step + 1, failure_reason(exc)
            break
        seconds.append(time.perf_counter() - start)
        for t in graphs:
            graphs[t].append(len(seconds_of[t]))
        unique.append(int(counters["stats"]["unique_graphs"]))
        if step == len(steps) - 1:
            start = time.perf_counter()
            want_loss, want = _step(eager, lengths, step, group)
            eager_seconds = time.perf_counter() - start
            loss_error = abs(loss - want_loss)
            missing = sorted(set(grads) ^ set(want))
            per_param = {n: float((grads[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-30))
                         for n in set(grads) & set(want)}
            worst = max(per_param, key=per_param.__getitem__)
            grad_error = per_param[worst]
    return {"graphs": graphs, "compile_seconds": {t: sum(s) for t, s in seconds_of.items()}, "unique_graphs": unique,
            "failed": failed, "reason": reason, "seconds": seconds, "loss_error": loss_error, "grad_error": grad_error,
            "missing": missing, "eager_seconds": eager_seconds, "packings": steps, "worst": worst}


def main() -> int:
    """Run :func:`hf_layers_over_packings` on ``--cp`` gloo ranks and print the table; 1 if a step failed."""
    from cpkv.launch import spawn

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default="aot_eager", choices=["inductor", "aot_eager"])
    parser.add_argument("--cp", type=int, default=2, choices=[1, 2, 3, 4])
    parser.add_argument("--packings", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--no-size-oblivious", action="store_true", help="leave backed_size_oblivious unset")
    parser.add_argument("--target", default="layer", choices=["layer", "attention"],
                        help="compile each decoder layer (torchtitan's way) or only its attention module")
    args = parser.parse_args()
    per_rank = spawn(hf_layers_over_packings, args.cp, args.packings, args.backend, args.tokens, not args.no_size_oblivious,
                     None, args.target, timeout=1800.0)
    what = "decoder layers" if args.target == "layer" else "attention modules"
    print(f"HF DeepSeek-V4 {what} compiled (fullgraph=True, backend {args.backend}), cp {args.cp}, {args.tokens} tokens,"
          f" {args.packings} packings, backed_size_oblivious {not args.no_size_oblivious}\n")
    print("| layer type | graphs per rank | step of the last new graph (rank 0) | backend compile s (rank 0) |")
    print("|---|---|---|---|")
    for kind in per_rank[0]["graphs"]:
        counts = [r["graphs"][kind][-1] if r["graphs"][kind] else 0 for r in per_rank]
        series = per_rank[0]["graphs"][kind]
        last = next((i + 1 for i, g in enumerate(series) if g == series[-1]), 0)
        print(f"| {kind} | {', '.join(map(str, counts))} | {last} | {per_rank[0]['compile_seconds'][kind]:.1f} |")
    first = per_rank[0]
    secs = first["seconds"]
    steady = sorted(secs)[len(secs) // 2] if secs else 0.0
    print(f"\nfailed at step: {[r['failed'] for r in per_rank]} {first['reason']}")
    print(f"first step s {secs[0] if secs else 0:.1f}, compiled step s (median) {steady:.2f}, eager step s {first['eager_seconds']:.2f}")
    print(f"last step vs eager: loss |diff| {max(r['loss_error'] for r in per_rank):.1e}, grad max rel. diff"
          f" {max(r['grad_error'] for r in per_rank):.1e} ({max(per_rank, key=lambda r: r['grad_error'])['worst']}),"
          f" gradients on one side only {first['missing']}")
    return 1 if any(r["failed"] for r in per_rank) else 0


if __name__ == "__main__":
    raise SystemExit(main())
