"""Collectives, bytes and kernel calls per layer with several kv heads: one call per kv group vs one call per layer.

Megatron hands its core attention ``ng`` key and value heads (GQA ``1 < ng < np``, MLA's
training path ``ng == np``). Before cpkv took kv heads, :class:`~cpkv.integrations.megatron_attention.CPKVCoreAttention`
ran one :func:`cpkv.attention_forward` per kv group, over the shared kv ``[v_g, k_g]`` with the
queries ``[0, q_h]`` (:func:`per_group_attention`, kept here as the baseline); now it makes one
call with keys ``[t, ng, hk]`` and values ``[t, ng, hv]`` (:func:`one_call_attention`).

Both run for real, on **meta** tensors of the true sizes in a *fake* process group (as
:mod:`cpkv.bench.traffic`): :func:`cpkv.commstats.count_bytes` counts the collective calls and
the bytes this rank receives (forward + backward), and a counting
:class:`~cpkv.backends.ReferenceBackend` counts the attention kernel calls of the forward
(each has one backward). The layout is Megatron's (per-document zigzag over one document).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from cpkv.attention import AttentionSpec, attention_forward
from cpkv.backends.base import AttentionResult, KeyRanges
from cpkv.backends.reference import ReferenceBackend
from cpkv.bench.traffic import fake_group
from cpkv.commstats import count_bytes
from cpkv.plan.attention import AttentionPlan, Exchange, plan_attention
from cpkv.plan.segments import SegmentPlan


@dataclass(frozen=True)
class HeadsCase:
    """A layer's heads: ``heads`` query heads over ``kv_heads`` kv heads, key and value head dims."""

    name: str
    heads: int
    kv_heads: int
    key_dim: int
    value_dim: int


CASES = (
    HeadsCase("GQA (H 64, H_kv 8, head dim 128)", 64, 8, 128, 128),
    HeadsCase("MLA (128 heads, keys 192, values 128)", 128, 128, 192, 128),
)
"""The rows of the table: a 64-head GQA layer and DeepSeek-V3-style MLA's per-head keys and values."""


class CountingBackend(ReferenceBackend):
    """The reference backend, counting its dense attention calls (``varlen_attention``, ``range_attention``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def varlen_attention(
        self, q: Tensor, k: Tensor, v: Tensor, segments: SegmentPlan, *,
        scale: float, window: int | None, sinks: Tensor | None,
    ) -> AttentionResult:
        """:meth:`ReferenceBackend.varlen_attention`, counted."""
        self.calls += 1
        return super().varlen_attention(q, k, v, segments, scale=scale, window=window, sinks=sinks)

    def range_attention(self, q: Tensor, k: Tensor, v: Tensor, ranges: KeyRanges, *, scale: float) -> AttentionResult:
        """:meth:`ReferenceBackend.range_attention`, counted."""
        self.calls += 1
        return super().range_attention(q, k, v, ranges, scale=scale)


def per_group_attention(query: Tensor, key: Tensor, value: Tensor, plan: AttentionPlan, spec: AttentionSpec,
                        sinks: Tensor | None, backend: Any) -> Tensor:
    """The former core attention: one call per kv group ``g`` over ``[v_g, k_g]`` with queries ``[0, q_h]``.

    query ``[t, np, hk]``, key ``[t, ng, hk]``, value ``[t, ng, hv]`` -> ``[t, np, hv]``.
    """
    t, heads, _ = query.shape
    groups, hv = value.shape[1], value.shape[2]
    per_group = heads // groups
    outs = []
    for g in range(groups):
        rows = slice(g * per_group, (g + 1) * per_group)
        q = torch.cat([query.new_zeros(t, per_group, hv), query[:, rows]], dim=-1)
        kv = torch.cat([value[:, g], key[:, g]], dim=-1)
        group_sinks = None if sinks is None else sinks[rows]
        outs.append(attention_forward(q, kv, plan, None, spec=spec, sinks=group_sinks, backend=backend).out)
    return torch.cat(outs, dim=1)


def one_call_attention(query: Tensor, key: Tensor, value: Tensor, plan: AttentionPlan, spec: AttentionSpec,
                       sinks: Tensor | None, backend: Any) -> Tensor:
    """Today's core attention: one call with keys ``[t, ng, hk]`` as ``kv`` and values ``[t, ng, hv]`` as ``v``."""
    return attention_forward(query, key, plan, None, spec=spec, v=value, sinks=sinks, backend=backend).out


class LayerCalls(NamedTuple):
    """One rank's layer call, forward + backward: collective calls, bytes received, forward kernel calls."""

    collectives: int
    bytes: int
    kernels: int


def layer_calls(case: HeadsCase, cu_seqlens: Tensor, cp: int, rank: int, exchange: Exchange, *, per_group: bool,
                window: int = 128, element_bytes: int = 2) -> LayerCalls:
    """Count one layer call of ``case`` on ``rank`` (meta tensors, fake process group; Megatron's zigzag layout)."""
    plan = plan_attention(cu_seqlens, cp, rank, layout="zigzag", exchange=exchange, windows=[window])
    dtype = torch.bfloat16 if element_bytes == 2 else torch.float32
    t = plan.local_len

    def meta(*shape: int) -> Tensor:
        return torch.empty(*shape, device="meta", dtype=dtype, requires_grad=True)

    query, key, value = meta(t, case.heads, case.key_dim), meta(t, case.kv_heads, case.key_dim), meta(t, case.kv_heads, case.value_dim)
    sinks = meta(case.heads)
    spec = AttentionSpec(d_v=case.value_dim, window=window, scale=case.key_dim ** -0.5)
    backend = CountingBackend()
    run = per_group_attention if per_group else one_call_attention
    with fake_group(rank, cp), count_bytes() as counter:
        out = run(query, key, value, plan, spec, sinks, backend)
        torch.autograd.backward(out, torch.empty_like(out))
    return LayerCalls(counter.num_calls, counter.total, backend.calls)


def heads_table(tokens_per_rank: int, cp: int, exchanges: tuple[Exchange, ...] = ("allgather", "need"),
                window: int = 128) -> list[dict[str, object]]:
    """Per case and exchange: the busiest rank's counts before (one call per kv group) and after (one call)."""
    cu = torch.tensor([0, tokens_per_rank * cp])
    rows: list[dict[str, object]] = []
    for case in CASES:
        for exchange in exchanges:
            row: dict[str, object] = {"case": case.name, "exchange": exchange, "cp": cp}
            for label, per_group in (("before", True), ("after", False)):
                counts = [layer_calls(case, cu, cp, rank, exchange, per_group=per_group, window=window) for rank in range(cp)]
                row[label] = LayerCalls(*(max(getattr(c, field) for c in counts) for field in LayerCalls._fields))
            rows.append(row)
    return rows


def heads_lines(rows: list[dict[str, object]], tokens_per_rank: int) -> list[str]:
    """The markdown section of :func:`heads_table`'s rows."""
    lines = [
        "", "## kv heads: collectives and kernel calls per layer (GQA, MLA)", "",
        f"One Megatron core-attention call, forward + backward, busiest rank, one document of {tokens_per_rank:,} tokens"
        " per rank in Megatron's zigzag layout, window 128, sinks, bf16. `before`: one `attention_forward` per kv group"
        " (the former `CPKVCoreAttention`, over `[v_g, k_g]` with queries `[0, q_h]`); `after`: one call with kv heads"
        " `[t, H_kv, hk]` and values `[t, H_kv, hv]`. Counted on the real calls (`cpkv/bench/heads.py`: meta tensors"
        " in a fake process group): collectives (forward + backward), MiB received, forward kernel calls.", "",
        "| layer | cp | exchange | collectives before / after | MiB before / after | kernel calls before / after |"
        " fewer collectives |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        before, after = row["before"], row["after"]
        assert isinstance(before, LayerCalls) and isinstance(after, LayerCalls)
        lines.append(
            f"| {row['case']} | {row['cp']} | {row['exchange']} | {before.collectives} / {after.collectives} |"
            f" {before.bytes / 2**20:,.2f} / {after.bytes / 2**20:,.2f} | {before.kernels} / {after.kernels} |"
            f" {before.collectives / max(after.collectives, 1):.0f}x |"
        )
    return lines


def main(argv: list[str]) -> int:
    """``python -m cpkv.bench heads [--tokens-per-rank N] [--cp N]``: print the table."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cpkv.bench heads", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=8)
    args = parser.parse_args(argv)
    print("\n".join(heads_lines(heads_table(args.tokens_per_rank, args.cp), args.tokens_per_rank)))
    return 0
