"""CostModel's dense terms against torch's FLOP counter on tiny real models (HF DeepSeek-V4, cpkv's V4 layer, Megatron).

Each term is the forward MACs per token of some modules; the oracle runs the module on ``T``
tokens under ``torch.utils.flop_counter.FlopCounterMode`` (which counts every matmul's
``2 * M * N * K`` FLOPs, per module) and divides by ``2 T``. The counter knows nothing of
cpkv's formulas; the attention cores (quadratic eager attention, the indexer scorer) are left
out of the dense terms and checked key by key in test_balance.py.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cpkv.plan.cost import CostModel, deepseek_v4_dense_terms
from tests.shared_spawn import shared_spawn

T = 24


def _module_flops(counter: FlopCounterMode, prefix: str, suffixes: tuple[str, ...]) -> int:
    """FLOPs of the modules ``prefix...<suffix>`` (any layer), every op, without double-counting parents."""
    total = 0
    for name, ops in counter.get_flop_counts().items():
        if name.startswith(prefix) and name.endswith(suffixes):
            total += sum(ops.values())
    return total


def _hf_config() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.DeepseekV4Config(
        vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16, q_lora_rank=24,
        o_groups=2, o_lora_rank=12, sliding_window=8, partial_rotary_factor=0.25,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_n_heads=2, index_head_dim=8, index_topk=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=20, hc_mult=2, n_shared_experts=1,
    )


def test_every_deepseek_v4_dense_term_matches_the_flop_counter() -> None:
    from transformers import DeepseekV4ForCausalLM

    config = _hf_config()
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # F.linear per expert (the counter does not see grouped_mm)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config).eval()
    with torch.no_grad():  # distinct experts per token (HF's zero hash table would send every token to expert 0 twice)
        model.model.layers[0].mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(4)[:2] for _ in range(96)]))
    ids = torch.randint(0, 96, (1, T))
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=ids, use_cache=False)
    terms = dict(deepseek_v4_dense_terms(config))
    attn, mlp = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj", "self_attn.o_b_proj"), "mlp."
    counted = {
        "attention projections": _module_flops(counter, "DeepseekV4ForCausalLM.model.layers.", attn),
        "compressors": _module_flops(counter, "DeepseekV4ForCausalLM.model.layers.", ("compressor.kv_proj", "compressor.gate_proj")),
        "indexer projections": _module_flops(counter, "DeepseekV4ForCausalLM.model.layers.", (
            "indexer.kv_proj", "indexer.gate_proj", "indexer.q_b_proj", "scorer.weights_proj")),
        "routed experts": _module_flops(counter, "DeepseekV4ForCausalLM.model.layers.", (mlp + "experts",)),
        "shared experts": _module_flops(counter, "DeepseekV4ForCausalLM.model.layers.", ("shared_experts.gate_proj",
                                        "shared_experts.up_proj", "shared_experts.down_proj")),
        "router": _module_flops(counter, "DeepseekV4ForCausalLM.model.layers.", (mlp + "gate",)),
        "head": _module_flops(counter, "DeepseekV4ForCausalLM.lm_head", ("lm_head",)),
    }
    for name, flops in counted.items():
        assert flops > 0, name  # the counter saw the modules (a test that cannot fail is a defect)
        assert terms[name] * T * 2 == flops, name  # exact: integer counts
    # Hyper-connections: everything else the model multiplies, minus the attention cores (eager T x T
    # products and the indexer's scores) whose sizes are fixed by T and the entry counts.
    total = sum(counter.get_flop_counts()["Global"].values())
    heads, dim = config.num_attention_heads, config.head_dim
    entries = {"compressed_sparse_attention": T // 4, "heavily_compressed_attention": T // 8, "sliding_attention": 0}
    cores = sum(2 * heads * T * (T + entries[t]) * dim * 2 for t in config.layer_types)  # scores and values
    scorer = 2 * config.index_n_heads * T * (T // 4) * config.index_head_dim
    assert total - sum(counted.values()) - cores - scorer == terms["hyper-connections"] * T * 2
    model_cost = CostModel.from_deepseek_v4(config)
    assert (model_cost.csa_layers, model_cost.hca_layers, model_cost.swa_layers) == (1, 1, 1)
    assert (model_cost.hca_ratio, model_cost.window, model_cost.index_topk, model_cost.key_cost) == (8, 8, 4, 4 * 32)
    assert model_cost.dense_macs == sum(terms.values())


def test_the_default_cost_model_is_v4_flash_from_its_config() -> None:
    transformers = pytest.importorskip("transformers")
    assert CostModel.from_deepseek_v4(transformers.DeepseekV4Config()) == CostModel()


def test_v4_layer_terms_match_the_flop_counter() -> None:
    from cpkv.compress_mode import LayerCompressMode
    from cpkv.v4.layer import V4Attention, V4Config

    configs = [V4Config(compress_ratio=4), V4Config(compress_ratio=8, compress_mode=LayerCompressMode.COMPRESSOR_ONLY),
               V4Config(), V4Config(window=None)]
    flops = 0
    for config in configs:
        layer = V4Attention(config)
        x = torch.randn(T, config.hidden)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            layer.wq(x), layer.wkv(x), layer.wo(torch.randn(T, config.heads * config.d_v))
            if layer.compressor is not None:
                layer.compressor.wkv(x), layer.compressor.wgate(x)
            if layer.indexer is not None:
                layer.indexer.wq(x), layer.indexer.wweights(x), layer.indexer.compressor.wkv(x), layer.indexer.compressor.wgate(x)
        flops += sum(counter.get_flop_counts()["Global"].values())
    model = CostModel.from_v4(configs)
    assert flops > 0 and model.dense_macs * T * 2 == flops
    assert (model.csa_layers, model.hca_layers, model.swa_layers, model.causal_layers) == (1, 1, 1, 1)
    assert (model.hca_ratio, model.value_dim, model.window) == (8, 24, 16)


def _megatron_case(rank: int, world: int) -> dict[str, int]:
    """A Megatron GPT layer (GQA, gated dense MLP, window; MLA and MoE layers need CUDA to build) under the FLOP counter; ``(counted, modeled)`` per case."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel()
    base: dict[str, Any] = dict(num_layers=1, hidden_size=24, num_attention_heads=4, use_cpu_initialization=True,
                                params_dtype=torch.float32, add_bias_linear=False, bias_dropout_fusion=False,
                                gradient_accumulation_fusion=False)
    cases = {
        "gqa": (TransformerConfig(**base, num_query_groups=2, kv_channels=6, ffn_hidden_size=32, gated_linear_unit=True,
                                  window_size=(5, 0)), get_gpt_layer_local_spec()),
    }
    out: dict[str, int] = {}
    for name, (config, spec) in cases.items():
        layer = build_module(spec, config=config, layer_number=1)
        x = torch.randn(T, 1, 24)
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            layer.self_attention.linear_qkv(x)
            layer.self_attention.linear_proj(torch.randn(T, 1, 4 * config.kv_channels))
            layer.mlp(x)
        out[name] = sum(counter.get_flop_counts()["Global"].values())
        model = CostModel.from_megatron(config, vocab_size=50)
        out[name + "_modeled"] = 2 * T * (model.dense_macs - 24 * 50)
        out[name + "_window"] = model.window * 1000 + model.swa_layers * 10 + model.causal_layers
        out[name + "_key"] = model.key_cost
    return out


HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
MEGATRON_CASE = shared_spawn(_megatron_case, 1, timeout=300.0) if HAVE_MEGATRON else None


def test_megatron_terms_match_the_flop_counter(request: pytest.FixtureRequest) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is missing")
    assert MEGATRON_CASE is not None
    got = MEGATRON_CASE.run(request)[0]
    assert got["gqa"] > 0 and got["gqa"] == got["gqa_modeled"], got
    assert got["gqa_window"] == 6 * 1000 + 10  # window left + 1, on the one layer
    assert got["gqa_key"] == 4 * 12


def test_megatron_mla_and_moe_terms_match_hf_deepseek_v3() -> None:
    """Megatron's MLA and MoE modules need CUDA to build, so the count comes from Hugging Face's DeepSeek-V3
    (MLA with q and kv LoRA, a dense first layer, routed, shared and router MoE), run on CPU under the FLOP
    counter; the Megatron ``MLATransformerConfig`` of the same shapes gives the modeled terms."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is missing")
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from cpkv.plan.cost import megatron_dense_terms

    hf = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6,
    )
    hf._attn_implementation, hf._experts_implementation = "eager", "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=torch.randint(0, 64, (1, T)), use_cache=False)
    prefix = "DeepseekV3ForCausalLM.model.layers."
    counted = {
        "attention projections": _module_flops(counter, prefix, (".q_a_proj", ".q_b_proj", ".kv_a_proj_with_mqa", ".kv_b_proj", ".o_proj")),
        "mlp": _module_flops(counter, prefix + "0.mlp", (".mlp",)),
        "routed experts": _module_flops(counter, prefix, (".mlp.experts",)),
        "shared experts": _module_flops(counter, prefix, (".mlp.shared_experts",)),
        "router": _module_flops(counter, prefix, (".mlp.gate",)),
        "head": _module_flops(counter, "DeepseekV3ForCausalLM.lm_head", ("lm_head",)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        megatron = MLATransformerConfig(
            num_layers=3, hidden_size=32, num_attention_heads=4, multi_latent_attention=True, q_lora_rank=24,
            kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, ffn_hidden_size=48,
            gated_linear_unit=True, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
            moe_shared_expert_intermediate_size=32, moe_layer_freq=[0, 1, 1], use_cpu_initialization=True,
        )
    modeled = dict(megatron_dense_terms(megatron, vocab_size=64))
    assert all(v > 0 for v in counted.values()), counted
    assert {k: 2 * T * v for k, v in modeled.items()} == counted


def _hf_case(name: str) -> Any:
    """A tiny transformers config of each family ``CostModel.from_hf_config`` reads (no download)."""
    transformers = pytest.importorskip("transformers")
    base: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                num_attention_heads=4)
    moe: dict[str, Any] = dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**base, num_key_value_heads=2, head_dim=12),
        "qwen2-sliding": lambda: transformers.Qwen2Config(**base, num_key_value_heads=2, use_sliding_window=True,
                                                          sliding_window=5, max_window_layers=1),
        "qwen3": lambda: transformers.Qwen3Config(**base, num_key_value_heads=1, head_dim=8),
        "qwen2-moe": lambda: transformers.Qwen2MoeConfig(**base, **moe, num_key_value_heads=2, shared_expert_intermediate_size=24,
                                                         decoder_sparse_step=2),
        "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**base, **moe, num_key_value_heads=2, mlp_only_layers=[0]),
        "deepseek-v3": lambda: transformers.DeepseekV3Config(
            **base, moe_intermediate_size=16, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=4,
            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    }
    return configs[name]()


HF_TERMS = {  # module-name suffixes of each dense term, per family (transformers' module names)
    "attention projections": (".q_proj", ".k_proj", ".v_proj", ".o_proj", ".q_a_proj", ".q_b_proj",
                              ".kv_a_proj_with_mqa", ".kv_b_proj"),
    "mlp": (".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj"),
    "routed experts": (".mlp.experts",),
    "shared experts": (".mlp.shared_experts", ".mlp.shared_expert", ".mlp.shared_expert_gate"),
    "router": (".mlp.gate",),
}


@pytest.mark.parametrize("name", ["llama", "qwen2-sliding", "qwen3", "qwen2-moe", "qwen3-moe", "deepseek-v3"])
def test_hf_config_terms_match_the_flop_counter(name: str) -> None:
    """``CostModel.from_hf_config``'s dense terms equal the FLOP counter's count of each term's modules (exact
    integers), its attention shape equals the config's, and the attention cores (eager ``T x T`` products) are
    all the counter saw besides the terms (the head's and every other matmul accounted for)."""
    transformers = pytest.importorskip("transformers")
    config = _hf_case(name)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(input_ids=torch.randint(0, 64, (1, T)), use_cache=False)
    root = type(model).__name__
    counts = counter.get_flop_counts()
    counted = {term: _module_flops(counter, f"{root}.model.layers.", suffixes) for term, suffixes in HF_TERMS.items()}
    counted["head"] = _module_flops(counter, f"{root}.lm_head", ("lm_head",))
    cost = CostModel.from_hf_config(config)
    assert {k: 2 * T * v for k, v in cost.dense} == counted
    assert counted["attention projections"] > 0 and counted["head"] > 0
    moe = name.endswith("moe") or name == "deepseek-v3"
    assert (counted["routed experts"] > 0) == moe and counted["mlp"] > 0  # every family has a dense layer here
    # Every layer's eager attention: scores and values over all T keys (the mask is applied after the product).
    cores = cost.attention_layers * 2 * cost.heads * T * T * (cost.head_dim + cost.value_dim)
    rotary = sum(v for k, ops in counts.items() if k.endswith("rotary_emb") for v in ops.values())
    assert sum(counts["Global"].values()) - rotary == sum(counted.values()) + cores
    windowed = {"qwen2-sliding": (2, 1, 5)}.get(name, (0, 3, 1))
    assert (cost.swa_layers, cost.causal_layers, cost.window) == windowed
    dims = {"llama": (12, 12), "qwen3": (8, 8), "deepseek-v3": (12, 6)}.get(name, (8, 8))
    assert (cost.heads, cost.head_dim, cost.value_dim) == (4, *dims)
    assert cost.csa_layers == cost.hca_layers == 0


def test_hf_config_refuses_a_deepseek_v4_config() -> None:
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="from_deepseek_v4"):
        CostModel.from_hf_config(transformers.DeepseekV4Config())
