"""Peak memory of the causal-LM loss and its backward on CPU: chunked from the hidden states vs whole logits.

One process, one rank (a fake process group of size 1: the normaliser's all-reduce moves
nothing), a head of ``V x H``, ``T`` tokens of this rank, random labels with every 8th one
ignored. Measured with :class:`~cpkv.bench.memory.LiveBytes` (live storages made by aten ops,
op granularity, on top of the hidden states, the head's weight and the labels):

* **chunked**: :func:`cpkv.integrations.causal_lm.causal_lm_loss_from_hidden` (what
  :func:`~cpkv.integrations.transformers_lm.deepseek_v4_causal_lm_loss` runs) and its backward:
  one chunk's logits at a time, ``grad_hidden`` and the ``[V, H]`` gradient of the weight (in
  the compute dtype, then cast).
* **whole logits**: the head on every token (``F.linear``) then
  :func:`~cpkv.integrations.causal_lm.causal_lm_loss` and its backward (what the HF path did):
  the logits, their float32 copy (bf16 heads), the log-softmax and the ``[T, V]`` gradients.
  Run only where it fits the machine (``--full-max-gib`` of float32 logits).

The reference size is the whole float32 logits, ``4 T V`` bytes (arithmetic, not measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cpkv.bench.memory import LiveBytes
from cpkv.bench.traffic import fake_group
from cpkv.integrations.causal_lm import causal_lm_loss, causal_lm_loss_from_hidden
from cpkv.integrations.linear_cross_entropy import DEFAULT_CHUNK_SIZE

__all__ = ["LossMemory", "loss_memory", "loss_memory_lines", "loss_memory_table"]

TARGET = 0.25
"""The chunked loss's peak, as a fraction of the whole float32 logits, that the table checks."""


@dataclass(frozen=True)
class LossMemory:
    """One row: ``T`` tokens, vocabulary ``V``, hidden ``H``, the head's dtype; measured peaks in bytes (``None``: not run)."""

    tokens: int
    vocab: int
    hidden: int
    dtype: str
    chunk_size: int
    chunked_peak: int
    full_peak: int | None

    @property
    def logits_bytes(self) -> int:
        """The whole float32 logits, ``4 T V``."""
        return 4 * self.tokens * self.vocab


def _inputs(tokens: int, vocab: int, hidden: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=gen) * hidden**-0.5).to(dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    labels[::8] = -100
    return h, w, labels


def loss_memory(tokens: int, vocab: int, hidden: int, dtype: torch.dtype = torch.float32, *,
                chunk_size: int = DEFAULT_CHUNK_SIZE, full: bool = True) -> LossMemory:
    """Measure one row (the whole-logits path only with ``full``)."""
    peaks: list[int] = []
    with fake_group(0, 1):
        for chunked in (True, False) if full else (True,):
            h, w, labels = _inputs(tokens, vocab, hidden, dtype)
            live = LiveBytes()
            with live:
                if chunked:
                    loss = causal_lm_loss_from_hidden(h, w, labels, None, chunk_size=chunk_size)
                else:
                    loss = causal_lm_loss(F.linear(h, w), labels, None)
                loss.backward()  # type: ignore[no-untyped-call]
                del loss
            peaks.append(live.peak)
            del h, w, labels
    return LossMemory(tokens, vocab, hidden, str(dtype).removeprefix("torch."), chunk_size, peaks[0],
                      peaks[1] if full else None)


def loss_memory_table(tokens: list[int], vocabs: list[int], hidden: int, *, bf16: list[tuple[int, int]],
                      chunk_size: int = DEFAULT_CHUNK_SIZE, full_max_gib: float = 1.0) -> list[LossMemory]:
    """Every ``(T, V)`` in float32, plus the ``bf16`` pairs; the whole-logits path where its float32 logits fit ``full_max_gib``."""
    cases = [(t, v, torch.float32) for t in tokens for v in vocabs] + [(t, v, torch.bfloat16) for t, v in bf16]
    return [loss_memory(t, v, hidden, dtype, chunk_size=chunk_size, full=4 * t * v <= full_max_gib * 2**30)
            for t, v, dtype in cases]


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f}"


def loss_memory_lines(rows: list[LossMemory]) -> list[str]:
    """The markdown table and its header paragraph."""
    hidden = sorted({r.hidden for r in rows})
    chunk = sorted({r.chunk_size for r in rows})
    lines = [
        "", "## Loss memory: chunked from the hidden states vs whole logits (forward + backward, CPU)", "",
        "`python -m cpkv.bench memory` (`cpkv/bench/loss_memory.py`): one rank's `T` tokens, a head of `V x H` (H ="
        f" {', '.join(map(str, hidden))}), every 8th label ignored, chunk {', '.join(map(str, chunk))} tokens. Peak: most"
        " bytes of storages made by aten ops alive at once during the loss call and its backward (`LiveBytes`, a dispatch"
        " mode tracking each output storage by weak reference), on top of the hidden states, head weight and labels."
        " `chunked` is `causal_lm_loss_from_hidden` (the HF path's loss); `whole logits` is the head on every token then"
        " `causal_lm_loss` (the HF path before), run only where its float32 logits fit 1 GiB on this machine. Both"
        " include the `[T, H]` and `[V, H]` gradients. Reference: the whole float32 logits, `4 T V` bytes;"
        f" target: chunked <= {TARGET:.2f} of it.", "",
        "| T | V | dtype | float32 logits GiB | chunked peak GiB | / logits | target | whole-logits peak GiB | / logits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = r.chunked_peak / r.logits_bytes
        full = "-" if r.full_peak is None else f"{r.full_peak / r.logits_bytes:.2f}"
        lines.append(
            f"| {r.tokens:,} | {r.vocab:,} | {r.dtype} | {_gib(r.logits_bytes)} | {_gib(r.chunked_peak)} | {share:.3f} |"
            f" {'met' if share <= TARGET else 'MISSED'} | {_gib(r.full_peak)} | {full} |"
        )
    return lines
