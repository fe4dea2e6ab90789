"""The memory counter checked against the CPU allocator at small sizes.

:func:`counter_checks` runs each case the whole-step table counts (the chunked and the
whole-logits loss, cpkv's V4-style attention layer, Hugging Face's attention through cpkv and
the rest of a Hugging Face decoder layer) three times: the counter
(:class:`~cpkv.bench.step_memory.MemoryCounter`) on meta tensors, the counter on real CPU
tensors, and the CPU allocator's peak of the real run (``torch.profiler`` memory events), also
with each ``cpkv::`` custom op's events netted to its outputs (what its fake allocates).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from cpkv.bench.memory import no_all_to_all
from cpkv.bench.step_memory import MemoryCounter, decoder_rest, hf_attention_module, tiny_v4_config
from cpkv.bench.traffic import fake_group
from cpkv.integrations.causal_lm import causal_lm_loss, causal_lm_loss_from_hidden
from cpkv.plan.attention import AttentionPlan, plan_attention
from cpkv.v4 import V4Attention, V4Config

__all__ = ["CounterCheck", "counter_check_lines", "counter_checks"]


@dataclass(frozen=True)
class CounterCheck:
    """The counter on meta tensors and on real CPU tensors, and the CPU allocator's measured peak, bytes."""

    case: str
    counted: int
    counted_cpu: int
    measured: int
    measured_outputs: int


def _profiled_peaks(run: Callable[[], None]) -> tuple[int, int]:
    """Peaks of the CPU allocator's live bytes during ``run()``: as measured, and with cpkv's custom ops as their outputs.

    ``torch.profiler`` memory events (every allocation and free, in time order). The second
    peak replaces the events inside each outermost ``cpkv::`` custom op by one event of their
    net bytes at the op's end: what remains of the op (its outputs, less what it freed), its
    internal temporaries (the reference implementation's) left out.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    results: Any = prof.profiler.kineto_results if prof.profiler is not None else None
    events = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    windows: list[tuple[int, int]] = []
    for start, end in sorted((e.start_ns(), e.end_ns()) for e in results.events() if e.name().startswith("cpkv::")):
        if windows and start <= windows[-1][1]:
            windows[-1] = (windows[-1][0], max(windows[-1][1], end))
        else:
            windows.append((start, end))
    merged: dict[int, int] = {}
    for time_ns, nbytes in events:
        inside = next((end for start, end in windows if start <= time_ns <= end), None)
        key = time_ns if inside is None else inside
        merged[key] = merged.get(key, 0) + nbytes
    return _running_peak(events), _running_peak(sorted(merged.items()))


def _running_peak(events: list[tuple[int, int]]) -> int:
    now = peak = 0
    for _, nbytes in events:
        now += nbytes
        peak = max(peak, now)
    return peak


def _counted_peak(run: Callable[[], None]) -> int:
    counter = MemoryCounter()
    with counter:
        run()
    return counter.peak


def _check(case: str, make: Callable[[str], Callable[[], None]]) -> CounterCheck:
    """``make(device)`` builds the inputs on ``device`` and returns the run (forward + backward) to measure."""
    measured, outputs_only = _profiled_peaks(make("cpu"))
    return CounterCheck(case, _counted_peak(make("meta")), _counted_peak(make("cpu")), measured, outputs_only)


def _loss_run(tokens: int, hidden: int, vocab: int, chunked: bool) -> Callable[[str], Callable[[], None]]:
    def make(device: str) -> Callable[[], None]:
        h = torch.empty(tokens, hidden, device=device).normal_().requires_grad_()
        w = torch.empty(vocab, hidden, device=device).normal_().requires_grad_()
        labels = torch.zeros(tokens, device=device, dtype=torch.int64)

        def run() -> None:
            with fake_group(0, 1):
                if chunked:
                    loss = causal_lm_loss_from_hidden(h, w, labels, None, num_items_in_batch=tokens, chunk_size=256)
                else:
                    loss = causal_lm_loss(torch.nn.functional.linear(h, w), labels, None, num_items_in_batch=tokens)
                loss.backward()  # type: ignore[no-untyped-call]

        return run

    return make


def _planned_run(plan: AttentionPlan, cp: int, rank: int,
                 build: Callable[[str, AttentionPlan], Callable[[Tensor], Tensor]], hidden: int) -> Callable[[str], Callable[[], None]]:
    """``make(device)`` for :func:`_check`: ``build(device, plan)`` gives the layer call, run forward + backward on the last rank."""

    def make(device: str) -> Callable[[], None]:
        on_device = plan.to(torch.device(device))
        call = build(device, on_device)
        x = torch.empty(on_device.local_len, hidden, device=device).normal_().requires_grad_()

        def run() -> None:
            with fake_group(rank, cp), no_all_to_all():
                out = call(x)
                out.backward(torch.ones_like(out))  # type: ignore[no-untyped-call]

        return run

    return make


def _layer_run(ratio: int, tokens: int, cp: int) -> Callable[[str], Callable[[], None]]:
    config = V4Config(hidden=256, heads=4, head_dim=64, rope_dim=16, window=16, compress_ratio=ratio, topk=16,
                      index_heads=2, index_head_dim=32)
    rank = cp - 1
    with fake_group(rank, cp):
        plan = plan_attention(torch.tensor([0, tokens]), cp, rank, exchange="need", compress_ratios=[ratio],
                              windows=[16], check_ranks=False)

    def build(device: str, on_device: AttentionPlan) -> Callable[[Tensor], Tensor]:
        with torch.device(device):
            layer = V4Attention(config)
        return lambda x: layer(x, on_device, None, backend="reference").out

    return _planned_run(plan, cp, rank, build, config.hidden)


def _hf_attention_run(layer_index: int, tokens: int, cp: int) -> Callable[[str], Callable[[], None]]:
    from cpkv.integrations.transformers import deepseek_v4_attention, deepseek_v4_plan_options

    config, rank = tiny_v4_config(), cp - 1
    with fake_group(rank, cp):
        plan = plan_attention(torch.tensor([0, tokens]), cp, rank, exchange="need", check_ranks=False,
                              **deepseek_v4_plan_options(config))

    def build(device: str, on_device: AttentionPlan) -> Callable[[Tensor], Tensor]:
        attn, rotary = hf_attention_module(config, layer_index, device, torch.float32)
        return lambda x: deepseek_v4_attention(attn, x, on_device, None, backend="reference", indexer_loss=True,
                                               rotary_emb=rotary).out

    return _planned_run(plan, cp, rank, build, int(config.hidden_size))


def _rest_run(tokens: int) -> Callable[[str], Callable[[], None]]:
    def make(device: str) -> Callable[[], None]:
        layer, x = decoder_rest(tiny_v4_config(), tokens, device, torch.bfloat16)  # grouped_mm takes bf16 only

        def run() -> None:
            out = layer(x)
            out.backward(torch.ones_like(out))

        return run

    return make


def counter_checks(*, smoke: bool = False) -> list[CounterCheck]:
    """The counter (meta and CPU tensors) vs the CPU allocator, float32, at small sizes."""
    tokens, vocab = (256, 1024) if smoke else (2048, 8192)
    checks = [_check(f"chunked loss, T {tokens}, V {vocab}, H 64", _loss_run(tokens, 64, vocab, True)),
              _check(f"whole-logits loss, T {tokens}, V {vocab}, H 64", _loss_run(tokens, 64, vocab, False))]
    for ratio in (4, 128):
        checks.append(_check(f"cpkv.v4 attention layer, ratio {ratio}, T/cp {tokens // 4} (cp 4)", _layer_run(ratio, tokens, 4)))
    for index, kind in enumerate(tiny_v4_config().layer_types):
        checks.append(_check(f"Hugging Face attention ({kind}), T/cp {tokens // 4} (cp 4)", _hf_attention_run(index, tokens, 4)))
    checks.append(_check(f"decoder rest, bf16 (hidden 256, 4 experts of 64, 2 per token), T {tokens}", _rest_run(tokens)))
    return checks


def counter_check_lines(checks: list[CounterCheck]) -> list[str]:
    """The check table."""
    lines = [
        "", "Counter check (`cpkv/bench/memory_check.py`), CPU, float32 (the decoder rest bf16): the counter's peak of a forward + backward on meta tensors and on real CPU"
        " tensors, against the CPU allocator's measured peak of the real run (`torch.profiler` memory events: every"
        " allocation and free, temporaries inside kernels and inside the reference backend's custom ops included), and"
        " the same events with each `cpkv::` custom op's events replaced by their net at the op's end (the op as its"
        " outputs: what its fake, and a kernel keeping its tiles on chip, allocates). cpkv.v4 attention layers: hidden 256,"
        " 4 heads of 64, window 16, top-k 16; Hugging Face attention and decoder rest: `tiny_v4_config()` (hidden 256,"
        " 4 heads of 64, its CSA and HCA layer); last rank of cp 4, need exchange, reference backend.", "",
        "| case | counted on meta MiB | counted on CPU MiB | measured MiB | measured, custom ops as outputs MiB |"
        " meta / measured | meta / measured (outputs) |", "|---|---|---|---|---|---|---|",
    ]
    for c in checks:
        lines.append(f"| {c.case} | {c.counted / 2**20:.2f} | {c.counted_cpu / 2**20:.2f} | {c.measured / 2**20:.2f} |"
                     f" {c.measured_outputs / 2**20:.2f} | {c.counted / max(c.measured, 1):.3f} |"
                     f" {c.counted / max(c.measured_outputs, 1):.3f} |")
    return lines
