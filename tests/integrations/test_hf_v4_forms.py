"""What cpkv reads from Hugging Face's DeepSeek-V4 modules is declared, checked once, and fails with one clear error.

Each declared read is removed (or given another form) on a real tiny model in turn:
``enable_deepseek_v4_cp`` must raise the RuntimeError that names the installed transformers
version, the tested range and the piece, not an AttributeError inside a layer. The adapter's
source is parsed to check that every attribute it reads off a Hugging Face module is declared.
"""

from __future__ import annotations

import ast
import copy
import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from cpkv.integrations import hf_v4_forms  # noqa: E402
from cpkv.integrations.hf_v4_forms import (  # noqa: E402
    ATTENTION_READS, COMPRESSOR_READS, INDEXER_READS, TESTED_TRANSFORMERS, check_deepseek_v4_forms, rms_norm_eps,
)

ROOT = Path(__file__).resolve().parents[2]


def _model() -> Any:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    config = DeepseekV4Config(
        vocab_size=64, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, sliding_window=8,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["moe", "moe", "moe"], compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        index_n_heads=2, index_head_dim=16, index_topk=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        hc_mult=2,
    )
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(config)


@pytest.fixture(scope="module")
def model() -> Any:
    return _model()


def _csa(model: Any) -> Any:
    return model.model.layers[1].self_attn


def _owner(model: Any, table: str) -> Any:
    attention = _csa(model)
    return {"attention": attention, "compressor": attention.compressor, "indexer": attention.compressor.indexer}[table]


def _remove(obj: Any, path: str) -> None:
    *parents, name = path.split(".")
    for p in parents:
        obj = getattr(obj, p)
    delattr(obj, name)


CASES = [(t, r.path) for t, reads in (("attention", ATTENTION_READS), ("compressor", COMPRESSOR_READS),
                                      ("indexer", INDEXER_READS)) for r in reads]


def _expect_form_error(model: Any, piece: str) -> None:
    import transformers

    from cpkv.integrations.transformers_lm import enable_deepseek_v4_cp

    with pytest.raises(RuntimeError) as info:
        enable_deepseek_v4_cp(model)
    text = str(info.value)
    low, high = TESTED_TRANSFORMERS
    assert f"installed transformers {transformers.__version__}" in text
    assert f"tested with transformers {low} through {high}" in text
    assert piece in text, text
    assert not any("forward" in vars(m) for m in model.modules()), "no module was patched before the check"


@pytest.mark.parametrize(("table", "path"), CASES, ids=[f"{t}.{p}" for t, p in CASES])
def test_each_declared_read_removed_gives_the_form_error(model: Any, table: str, path: str) -> None:
    """Every piece the adapter reads, taken away, is named in one RuntimeError before any forward."""
    broken = copy.deepcopy(model)
    owner = _owner(broken, table)
    where = {"attention": "model.layers.1.self_attn", "compressor": "model.layers.1.self_attn.compressor",
             "indexer": "model.layers.1.self_attn.compressor.indexer"}[table]
    if path.startswith("config."):  # a config field falls back to its class default: this module gets a config without it
        field = path.split(".", 1)[1]
        owner.config = types.SimpleNamespace(**{k: v for k, v in vars(owner.config).items() if k != field})
    else:
        _remove(owner, path)
    _expect_form_error(broken, f"{where}.{path}: missing")


def test_the_5_25_rename_undone_is_caught_and_both_forms_are_read(model: Any) -> None:
    """``variance_epsilon`` (5.25) and ``eps`` (5.23-5.24) both read; an epsilon under a third name is the form error."""
    norm = _csa(model).q_b_norm
    eps = rms_norm_eps(norm)
    assert eps == model.config.rms_norm_eps
    old = copy.deepcopy(norm)
    value = old.__dict__.pop("variance_epsilon", None)
    if value is not None:
        old.eps = value
    assert rms_norm_eps(old) == eps
    broken = copy.deepcopy(model)
    q_b_norm = _csa(broken).q_b_norm
    q_b_norm.__dict__.pop("variance_epsilon", None)
    q_b_norm.__dict__.pop("eps", None)
    q_b_norm.epsilon = eps
    _expect_form_error(broken, "model.layers.1.self_attn.q_b_norm: DeepseekV4UnweightedRMSNorm")
    with pytest.raises(RuntimeError, match="no epsilon"):
        rms_norm_eps(q_b_norm)


def test_a_changed_forward_signature_and_rotary_are_caught(model: Any) -> None:
    """Hugging Face's forward takes cpkv's positional arguments; the model's rotary embedding has both rope types."""
    broken = copy.deepcopy(model)
    attention = _csa(broken)

    def forward(self: Any, hidden_states: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        raise AssertionError("never called")

    attention.__class__ = type("DeepseekV4Attention", (type(attention),), {"forward": forward})
    _expect_form_error(broken, "model.layers.1.self_attn.forward: its first arguments are")
    broken = copy.deepcopy(model)
    del broken.model.rotary_emb.compress_inv_freq
    _expect_form_error(broken, "model.rotary_emb: not a DeepseekV4RotaryEmbedding")


def test_the_direct_layer_call_checks_the_forms_before_anything_else(model: Any) -> None:
    """``deepseek_v4_attention`` on a module that lost a piece: the same error, before any tensor or plan check."""
    from cpkv.integrations.transformers import deepseek_v4_attention

    broken = copy.deepcopy(_csa(model))
    del broken.compressor.indexer.scorer.weights_scaling
    with pytest.raises(RuntimeError, match=r"DeepseekV4Attention\.compressor\.indexer\.scorer\.weights_scaling: missing"):
        deepseek_v4_attention(broken, torch.zeros(1), None, None)  # type: ignore[arg-type]


def test_an_intact_model_passes_and_lists_every_problem_at_once(model: Any) -> None:
    """The real model has no problem; two pieces removed on every layer: each named once per module."""
    named = [(n, m) for n, m in model.named_modules() if type(m).__name__ == "DeepseekV4Attention"]
    assert len(named) == 3
    check_deepseek_v4_forms(named, model.model.rotary_emb)
    broken = copy.deepcopy(model)
    for layer in broken.model.layers:
        del layer.self_attn.o_b_proj
    with pytest.raises(RuntimeError) as info:
        check_deepseek_v4_forms([(n, m) for n, m in broken.named_modules() if type(m).__name__ == "DeepseekV4Attention"])
    assert str(info.value).count(".o_b_proj: missing") == 3


def _adapter_reads(path: Path) -> set[str]:
    """First attribute names read off ``module`` / ``self.module`` / ``compressor`` / ``indexer`` / ``scorer`` in a file."""
    roots = {"module", "compressor", "indexer"}
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in roots:
            out.add(node.attr)
        elif isinstance(base, ast.Attribute) and base.attr == "module" and isinstance(base.value, ast.Name) and base.value.id == "self":
            out.add(node.attr)
    return out


def test_every_attribute_the_adapter_reads_is_declared() -> None:
    """The adapter's reads off Hugging Face modules (parsed from its source) are all in the declared tables."""
    declared = {r.path.split(".")[0] for r in ATTENTION_READS + COMPRESSOR_READS + INDEXER_READS}
    read = set()
    for name in ("transformers.py", "transformers_lm.py"):
        read |= _adapter_reads(ROOT / "cpkv" / "integrations" / name)
    every_module = {"training"}  # nn.Module's own flag (an instance attribute, so not on the class)
    undeclared = {a for a in read if a not in declared | every_module and not hasattr(torch.nn.Module, a)}
    assert len(read) > 20, read
    assert not undeclared, f"read off Hugging Face modules but not declared in {hf_v4_forms.__name__}: {sorted(undeclared)}"
