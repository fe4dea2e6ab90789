"""The need exchange copies no own hidden states and the rank's own kv at most once per layer.

A dispatch mode records the output shape of every copying aten op (``cat``, ``index_select``,
``clone``, ``copy_``, ``_to_copy``) during one compressed layer's forward on gloo ranks. The
hidden states are 96 wide and the kv 32 wide, so a copy of the rank's own rows shows up as an
output of at least ``T/cp`` rows of that width.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cpkv.plan import plan_attention, seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_contiguous
from cpkv.v4 import V4Attention, V4Config
from tests.shared_spawn import shared_spawn

COPY_OPS = {"cat", "index_select", "clone", "copy_", "_to_copy"}
LENGTHS = [10, 100, 6, 76]  # 192 tokens; a document straddles every boundary at cp 2 and 3


class RecordCopies(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in COPY_OPS and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        return out


def copies(rank: int, world: int) -> dict[str, Any]:
    cu = seqlens_to_cu_seqlens(LENGTHS)
    results = {}
    for ratio in (4, 8):
        layer = V4Attention(V4Config(hidden=96, compress_ratio=ratio, window=8, topk=3), seed=1)
        plan = plan_attention(cu, world, rank, exchange="need", compress_ratios=[ratio], windows=[8])
        x = shard_contiguous(torch.randn(192, 96), world, rank)
        q, kv = layer.project(x, plan.q_positions)
        from cpkv.attention import attention_forward

        recorder = RecordCopies()
        with recorder, torch.no_grad():
            attention_forward(q, kv, plan, None, spec=layer.config.spec, sinks=layer.sinks, hidden=x,
                              compressor=layer.compressor, indexer=layer.indexer)
        results[str(ratio)] = {"shapes": recorder.shapes, "local": plan.local_len}
    return results


COPIES = {world: shared_spawn(copies, world, timeout=100.0) for world in (2, 3)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_need_exchange_copies_no_own_hidden_and_kv_once(world: int, request: pytest.FixtureRequest) -> None:
    for per_rank in COPIES[world].run(request):
        for ratio, r in per_rank.items():
            local = r["local"]
            hidden_copies = [s for s in r["shapes"] if len(s) == 2 and s[-1] == 96 and s[0] >= local]
            kv_copies = [s for s in r["shapes"] if len(s) == 2 and s[-1] == 32 and s[0] >= local]
            assert not hidden_copies, (ratio, hidden_copies)
            assert len(kv_copies) <= 1, (ratio, kv_copies)
