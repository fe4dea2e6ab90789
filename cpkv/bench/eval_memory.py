"""One rank's memory of a DeepSeek-V4 evaluation (forward-only) step at 1M tokens, counted on meta tensors.

The evaluation rows of the whole-step table (:mod:`cpkv.bench.step_memory`), counted on the
real code path as the training rows are, with the same counter, model dims, plan and CUDA-path
kernels, but forward only under ``torch.no_grad()`` (what
:func:`~cpkv.integrations.causal_lm_eval.deepseek_v4_causal_lm_eval` runs):

* **attention layers**: Hugging Face's ``DeepseekV4Attention`` through cpkv (the CSA and HCA
  layer, the indexer's KL skipped as under ``no_grad``): the forward's peak of live storages
  and the tensors saved for backward (``saved_tensors_hooks``: 0 expected, reported);
* **the rest of a decoder layer** (mHC, norms, router, experts): the forward's peak;
* **scores**: :func:`~cpkv.integrations.linear_cross_entropy.linear_token_scores` (1,024-token
  chunks) on ``[T/cp, hidden]`` with the ``[V, hidden]`` head;
* **states**: the parameters only (no gradients, no optimizer): FSDP2's float32 parameter
  shards and two decoder layers' bf16 all-gather outputs (:func:`~cpkv.bench.fsdp2_states.fsdp2_states`);
* **stream** (arithmetic): a layer's input and output residual streams,
  ``2 * [T/cp, hc_mult, hidden]`` bf16, alive across a layer.

``total = states + stream + max(attention, rest, scores)``: one layer runs at a time and keeps
nothing for a backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpkv.bench.fsdp2_states import fsdp2_states
from cpkv.bench.memory import no_all_to_all, storage_key
from cpkv.bench.step_memory import (
    ASCEND,
    H200,
    MemoryCounter,
    cuda_path_backend,
    decoder_rest,
    hf_attention_module,
    saved_bytes,
    tiny_v4_config,
)
from cpkv.bench.traffic import fake_group
from cpkv.integrations.linear_cross_entropy import linear_token_scores
from cpkv.plan.attention import plan_attention

__all__ = ["EvalRow", "eval_memory_lines", "eval_memory_table"]


@dataclass(frozen=True)
class EvalRow:
    """One (model, cp) evaluation row, bytes (see the module docstring)."""

    model: str
    cp: int
    tokens: int
    states: int
    stream: int
    attention: int
    rest: int
    scores: int
    saved: int

    @property
    def total(self) -> int:
        """States, the streams and the largest forward peak."""
        return self.states + self.stream + max(self.attention, self.rest, self.scores)


def _forward_peak(module: torch.nn.Module, call: Callable[[], Any], inputs: list[Tensor]) -> tuple[int, int]:
    """``(peak of live storages, bytes saved for backward)`` of ``call()`` under ``torch.no_grad()``."""
    exclude = {storage_key(t) for t in [*module.parameters(), *module.buffers(), *inputs]}
    counter = MemoryCounter()
    with torch.no_grad(), counter, saved_bytes(exclude) as saved:
        out = call()
        del out
    return counter.peak, sum(saved.values())


def eval_memory_table(tokens: int, cps: list[int], world: int, *, smoke: bool = False) -> list[EvalRow]:
    """Every model x cp, forward only: balanced layout, need exchange, one document of ``tokens`` tokens, the last rank."""
    from transformers import DeepseekV4Config

    from cpkv.bench.layouts import v4_pro_config
    from cpkv.integrations.transformers import deepseek_v4_attention, deepseek_v4_plan_options

    models = {"tiny": tiny_v4_config()} if smoke else {"V4-Flash": DeepseekV4Config(), "V4-Pro": v4_pro_config()}
    backend = cuda_path_backend()
    rows = []
    for name, config in models.items():
        fsdp2 = fsdp2_states(config, world)
        hidden, vocab = int(config.hidden_size), int(config.vocab_size)
        first = {int(r): list(config.layer_types).index(t) for t, r in dict(config.compress_rates).items()}
        for cp in cps:
            rank = cp - 1
            with fake_group(rank, cp):
                plan = plan_attention(torch.tensor([0, tokens]), cp, rank, layout="balanced", exchange="need",
                                      check_ranks=False, **deepseek_v4_plan_options(config))
            plan = plan.to(torch.device("meta"))
            local = plan.local_len
            attention, saved = 0, 0
            for layer in first.values():
                attn, rotary = hf_attention_module(config, layer, "meta", torch.bfloat16)
                x = torch.empty(local, hidden, device="meta", dtype=torch.bfloat16)
                with fake_group(rank, cp), no_all_to_all():
                    peak, kept = _forward_peak(attn, lambda: deepseek_v4_attention(
                        attn, x, plan, None, backend=backend, indexer_loss=True, rotary_emb=rotary).out, [x])
                attention, saved = max(attention, peak), saved + kept
            layer_rest, stream_in = decoder_rest(config, local, "meta", torch.bfloat16)
            stream_in = stream_in.detach()
            rest, kept = _forward_peak(layer_rest, lambda: layer_rest(stream_in), [stream_in])
            h = torch.empty(local, hidden, device="meta", dtype=torch.bfloat16)
            w = torch.empty(vocab, hidden, device="meta", dtype=torch.bfloat16)
            labels = torch.zeros(local, device="meta", dtype=torch.int64)
            head = torch.nn.Module()
            scores, _ = _forward_peak(head, lambda: linear_token_scores(h, w, labels), [h, w, labels])
            rows.append(EvalRow(name, cp, local, fsdp2.parameters + fsdp2.gathered, 2 * stream_in.numel() * 2, attention,
                                rest, scores, saved + kept))
    return rows


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f}"


def eval_memory_lines(rows: list[EvalRow], tokens: int, world: int) -> list[str]:
    """The evaluation table, its header and a reading: the smallest cp each device needs."""
    lines = [
        "", f"## Memory of an evaluation (forward-only) step per rank at {tokens:,} tokens (counted on meta tensors)", "",
        "`python -m cpkv.bench memory` (`cpkv/bench/eval_memory.py`): what `deepseek_v4_causal_lm_eval` (and"
        " `CPTrainerMixin`'s evaluation) runs, under `torch.no_grad()`, on the code path and with the counter of the"
        f" training table above; one document, balanced layout, need exchange, bf16, the last rank. `states`: FSDP2's fp32"
        f" parameter shards over {world} ranks and two layers' bf16 all-gathers (no gradients, no optimizer). `stream`:"
        " a layer's input and output `[T/cp, hc_mult, hidden]` bf16. `attention`, `rest`, `scores`: counted forward"
        " peaks of the CSA/HCA attention (the larger), the decoder rest, and the chunked label scores"
        " (`linear_token_scores`, 1,024-token chunks). `saved`: bytes saved for backward by all of them (counted)."
        " `total` = states + stream + max(attention, rest, scores).", "",
        "| model | cp | T/cp | states | stream | attention | rest | scores | saved | total | H200 | 64 GB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fits = ["yes" if r.total <= cap else "no" for cap in (H200, ASCEND)]
        lines.append(f"| {r.model} | {r.cp} | {r.tokens:,} | {_gb(r.states)} | {_gb(r.stream)} | {_gb(r.attention)} |"
                     f" {_gb(r.rest)} | {_gb(r.scores)} | {r.saved} | {_gb(r.total)} | {fits[0]} | {fits[1]} |")
    sentences = []
    for model in dict.fromkeys(r.model for r in rows):
        mine = [r for r in rows if r.model == model]
        need = []
        for device, cap in (("an H200", H200), ("a 64 GB device", ASCEND)):
            ok = [r.cp for r in mine if r.total <= cap]
            need.append(f"{device} from cp {min(ok)}" if ok else f"no {device.split(' ', 1)[1]} at any cp shown")
        sentences.append(f"{model} evaluates on {' and '.join(need)}.")
    return [*lines, "", "Reading: " + " ".join(sentences)]
