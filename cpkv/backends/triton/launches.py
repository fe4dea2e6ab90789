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

__all__ = ["AOTCase", "KernelLaunch"]


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
