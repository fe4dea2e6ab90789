"""cpkv's indexer KL call before issue 46, kept as a test double: the contract tests must fail on it.

One batch over all ``N_c`` indexer keys, absolute rows valid first, ``mask_mode=0``: the
arch22 kernel then reads ``min(K, N_c)`` index slots for every row, so a row with fewer than
``K`` selections gets stale columns (docs/backends.md, "NPU fused path: the kernels read").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpkv.backends.npu import NPUBackend
from cpkv.backends.npu_fused import KLCall, KLPlan, fused_indexer_kl


def former_kl_plan(selected: Tensor, num_keys: int, **_: Any) -> KLPlan:
    """Every row of ``selected`` ``[T, K]`` in one ``mask_mode=0`` batch over all ``num_keys`` keys."""
    device = selected.device
    order = (selected < 0).to(torch.int8).argsort(dim=1, stable=True)
    rows = torch.arange(selected.shape[0], device=device)
    indices = selected.long().gather(1, order).to(torch.int32).unsqueeze(1)
    cu_q = torch.tensor([0, selected.shape[0]], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, num_keys], dtype=torch.int32, device=device)
    call = KLCall(rows, torch.arange(num_keys, device=device), indices, cu_q, cu_k, selected.shape[0], num_keys)
    return KLPlan([call], order, rows[:0], mask_mode=0)


class FormerKLBackend(NPUBackend):
    """The fused path with the former KL call (everything else as :class:`NPUBackend`)."""

    def __init__(self, torch_npu_module: Any, cann: Any, **kw: Any) -> None:
        super().__init__(torch_npu_module, fused_ops_module=cann, **kw)
        self.cann = cann

    def indexer_kl(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
    ) -> tuple[Tensor, Tensor]:
        plan = former_kl_plan(selected, k_index.shape[0])
        return fused_indexer_kl(self.cann, q_index, k_index, weights, target, plan, grad_factor)
