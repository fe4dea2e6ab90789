"""One Triton kernel launch as a value: what the ops run, and what the sm_90a compile report compiles.

Each op builds its launches with a function of the tensors it is given (tile sizes, grid,
runtime arguments, constexprs, warps, stages) and then calls them; the compile report
(``benchmarks/compile_report.py``) calls the same functions on ``meta`` tensors of the
DeepSeek-V4 shapes (:class:`AOTCase`) and compiles each launch ahead of time for sm_90a, so
the configurations it reports are the ones the ops use, never a copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AOTCase", "KernelLaunch", "v4_cases"]


@dataclass(frozen=True, eq=False)
class KernelLaunch:
    """A kernel, its grid and its arguments, ready to run (``launch()``) or to compile ahead of time.

    Attributes:
        name: a short label for reports (e.g. ``"sparse_fwd"``).
        kernel: the ``@triton.jit`` function.
        grid: programs per axis.
        args: the runtime arguments in the kernel's order (tensors, ints, floats; no constexprs).
        constexprs: the ``tl.constexpr`` arguments by name.
        num_warps, num_stages: Triton's launch options.
    """

    name: str
    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    constexprs: Mapping[str, Any]
    num_warps: int
    num_stages: int = 2

    def __call__(self) -> None:
        """Run the launch (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


@dataclass(frozen=True)
class AOTCase:
    """The shapes of one ahead-of-time compile case (a model's attention and indexer at one dtype).

    Attributes:
        name: e.g. ``"V4-Flash bf16"``.
        dtype: the activations' dtype (``torch.bfloat16`` or ``torch.float32``).
        tokens: query rows ``T``; kv_rows: shared kv rows ``N``.
        heads, dim, d_v, topk: sparse attention: query heads ``H``, query/key dim ``D``, value
            channels, entries per query row ``K`` (index top-k plus window).
        index_heads, index_dim, index_topk, index_rows: the lightning indexer's ``H_I``, ``D_I``,
            top-k and key rows ``N_c``.
    """

    name: str
    dtype: torch.dtype
    tokens: int
    kv_rows: int
    heads: int
    dim: int
    d_v: int
    topk: int
    index_heads: int
    index_dim: int
    index_topk: int
    index_rows: int


def v4_cases(tokens: int = 8192, kv_rows: int = 2048) -> list[AOTCase]:
    """DeepSeek-V4-Flash and V4-Pro attention shapes, each in bf16 and fp32 (``tokens``, ``kv_rows``: any positive sizes).

    V4-Flash: 64 heads of dim 512 (values = the first 512 channels), K = index top-k 512 +
    sliding window 128 = 640; indexer 64 heads x 128 (transformers' ``DeepseekV4Config``
    defaults). V4-Pro: 128 heads of dim 512 (transformers' modeling docstring), K = index top-k
    1024 (DeepSeek's V4-Pro config) + window 128 = 1152.
    """
    cases = []
    for model, heads, topk in (("V4-Flash", 64, 512), ("V4-Pro", 128, 1024)):
        for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            cases.append(AOTCase(f"{model} {label}", dtype, tokens=tokens, kv_rows=kv_rows, heads=heads, dim=512,
                                 d_v=512, topk=topk + 128, index_heads=64, index_dim=128, index_topk=topk,
                                 index_rows=kv_rows))
    return cases
