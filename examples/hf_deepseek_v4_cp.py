"""A small Hugging Face DeepSeek-V4 model's attention layers under CP on 4 gloo ranks.

Builds a tiny random ``DeepseekV4Model`` (one sliding, one CSA and one HCA layer), shards a
packed batch of documents over 4 CPU ranks and runs each layer's ``self_attn`` through
:func:`cpkv.integrations.transformers.deepseek_v4_attention_forward` with the need exchange.
Rank 0 checks the gathered outputs against the model's own layers run on each document
alone (batch 1, positions from 0, sliding-window causal mask). Needs
``pip install 'cpkv[transformers]'``; 18-22 s on 2 CPU cores (measured, most of it starting
the ranks and importing transformers)::

    python examples/hf_deepseek_v4_cp.py
"""

from __future__ import annotations

from typing import Any

import torch

from cpkv import plan_attention
from cpkv.integrations.transformers import deepseek_v4_attention_forward, deepseek_v4_plan_options
from cpkv.launch import spawn
from cpkv.plan import seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_contiguous

CP = 4
LENGTHS = [37, 0, 3, 70, 18]  # 128 tokens: a document shorter than a block, one over three ranks


def build_model() -> Any:
    """A tiny float32 DeepSeek-V4 model with random weights (same on every rank: fixed seed)."""
    from transformers import DeepseekV4Config, DeepseekV4Model

    config = DeepseekV4Config(
        vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, sliding_window=8, partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        # index_topk covers every entry of these documents, so torch.topk's tie order (which
        # differs from cpkv's earlier-entry rule, docs/semantics.md) cannot change the check.
        index_n_heads=2, index_head_dim=16, index_topk=32,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, hc_mult=2,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model: Any = DeepseekV4Model(config)
    model.eval()
    with torch.no_grad():  # HF initialises sinks and position biases to 0: make them matter
        for name, param in model.named_parameters():
            if name.endswith("sinks") or name.endswith("position_bias"):
                param.normal_()
    return model


def run_rank(rank: int, world: int, x: torch.Tensor) -> list[torch.Tensor]:
    """This rank's output of every attention layer for its contiguous shard of ``x``."""
    model = build_model()
    cu_seqlens = seqlens_to_cu_seqlens(LENGTHS)
    # One plan per micro-batch serves every layer: the config says which ratios, window and
    # earlier blocks (CSA's overlapping compressor) to plan.
    plan = plan_attention(cu_seqlens, world, rank, exchange="need", **deepseek_v4_plan_options(model.config))
    x_local = shard_contiguous(x, world, rank)
    with torch.no_grad():
        return [
            deepseek_v4_attention_forward(layer.self_attn, x_local, plan, None, rotary_emb=model.rotary_emb)
            for layer in model.layers
        ]


def model_per_document(model: Any, x: torch.Tensor) -> list[torch.Tensor]:
    """Every layer's ``self_attn`` on each document alone, the way the model runs it."""
    outs: list[list[torch.Tensor]] = [[] for _ in model.layers]
    bounds = seqlens_to_cu_seqlens(LENGTHS).tolist()
    window = model.config.sliding_window
    with torch.no_grad():
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            doc, positions = x[start:end][None], torch.arange(end - start)[None]
            embeddings = {kind: model.rotary_emb(doc, positions, layer_type=kind) for kind in ("main", "compress")}
            tok = torch.arange(end - start)
            allowed = (tok[None, :] <= tok[:, None]) & (tok[None, :] > tok[:, None] - window)
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))[None, None]
            for i, layer in enumerate(model.layers):
                outs[i].append(layer.self_attn(doc, embeddings, positions, mask)[0][0])
    return [torch.cat(o) for o in outs]


def main() -> None:
    x = torch.randn(sum(LENGTHS), 64, generator=torch.Generator().manual_seed(1))
    per_rank = spawn(run_rank, CP, x, timeout=180.0)
    model = build_model()
    expected = model_per_document(model, x)
    for i, layer in enumerate(model.layers):
        actual = torch.cat([outs[i] for outs in per_rank])
        error = float((actual - expected[i]).abs().max() / expected[i].abs().max())
        print(f"layer {i} {layer.self_attn.layer_type:<30} cp={CP} need exchange: max relative error {error:.1e}")
        if error > 1e-5:
            raise SystemExit(f"layer {i}: cpkv differs from the model ({error:.1e} > 1e-5)")
    print("all layers match the model")


if __name__ == "__main__":
    main()
