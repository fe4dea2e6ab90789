"""A user's module typed against cpkv, as CI checks it: ``mypy --strict`` from outside the repository.

CI (``.ci/run``) type-checks this file twice, against the editable install the README makes
and against the built wheel, so that ``py.typed`` reaches users both ways. It also runs:
``python examples/typed_user.py`` plans a packed batch on one gloo rank and runs a
COMPRESSOR_ONLY layer with the mean-pooling compressor below.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import Tensor

import cpkv
from cpkv import AttentionOutput, AttentionPlan, AttentionSpec, CompressedPlan, CompressorFn, attention_forward, plan_attention

LAYOUT: cpkv.Layout = "contiguous"
EXCHANGE: cpkv.Exchange = "need"
BACKEND: cpkv.BackendName = "reference"


class MeanPool:
    """A :class:`cpkv.CompressorFn`: each entry is the mean of its block's ``ratio`` input rows."""

    def __init__(self, ratio: int, dim: int) -> None:
        self.ratio, self.prev_blocks, self.input_dim = ratio, 0, dim

    def __call__(self, x: Tensor, plan: CompressedPlan, /) -> Tensor | None:
        if plan.num_entries == 0:
            return None
        rows = plan.block_starts[:, None] + torch.arange(plan.ratio, device=x.device)
        return x[rows].mean(dim=1)


def make_plan(cu_seqlens: Tensor, cp_size: int, cp_rank: int, *, ratio: int, window: int) -> AttentionPlan:
    return plan_attention(cu_seqlens, cp_size, cp_rank, layout=LAYOUT, exchange=EXCHANGE,
                          compress_ratios=[ratio], windows=[window])


def layer(q: Tensor, kv: Tensor, plan: AttentionPlan, group: cpkv.Group, compressor: CompressorFn) -> Tensor:
    spec = AttentionSpec(d_v=kv.shape[-1], compress_ratio=compressor.ratio, window=4)
    result: AttentionOutput = attention_forward(q, kv, plan, group, spec=spec, hidden=kv,
                                                compressor=compressor, backend=BACKEND)
    return result.out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'rendezvous')}", rank=0, world_size=1)
        try:
            cu_seqlens = torch.tensor([0, 5, 21, 32])
            plan = make_plan(cu_seqlens, 1, 0, ratio=8, window=4)
            q, kv = torch.randn(32, 2, 8, requires_grad=True), torch.randn(32, 8)
            out = layer(q, kv, plan, dist.group.WORLD, MeanPool(8, 8))
            torch.autograd.backward(out.sum())
            print(tuple(out.shape), q.grad is not None)
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
