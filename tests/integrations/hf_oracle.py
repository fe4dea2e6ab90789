"""How the tests make Hugging Face's DeepSeek-V4 an exact float64 oracle.

HF casts its RMSNorm, RoPE, softmaxes and scorer to float32 even in a float64 model, and its
indexer's ``topk`` breaks ties in an unspecified order. The tests run HF (and, where HF's own
modules run inside cpkv, both sides) with :func:`lifted` (those casts become float64) and
:func:`earlier_ties` (ties go to the earlier entry, cpkv's order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch


_FLOAT = torch.Tensor.float  # as installed, whatever is patched later


class LiftedTorch:
    """``torch`` as HF's DeepSeek-V4 module sees it with its float32 casts lifted to float64."""

    float32 = torch.float64
    float = torch.float64

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def lifted() -> Iterator[None]:
    """HF's RMSNorm/RoPE/softmax/scorer ``torch.float32`` and ``.float()`` casts become float64."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    with mock.patch.object(modeling_deepseek_v4, "torch", LiftedTorch()), mock.patch.object(torch.Tensor, "float", torch.Tensor.double):
        yield


@contextlib.contextmanager
def shipped() -> Iterator[None]:
    """Inside :func:`lifted`: HF's module as installed again (its float32 casts; ``from_pretrained``'s float32 tensors)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    with mock.patch.object(modeling_deepseek_v4, "torch", torch), mock.patch.object(torch.Tensor, "float", _FLOAT):
        yield


@contextlib.contextmanager
def earlier_ties() -> Iterator[None]:
    """HF's indexer ``topk`` with ties to the earlier entry (cpkv's order; torch.topk's is unspecified)."""
    def topk(self: torch.Tensor, k: int, dim: int = -1, **_: Any) -> Any:
        values, order = self.sort(dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), order.narrow(dim, 0, k)))

    with mock.patch.object(torch.Tensor, "topk", topk):
        yield


def outcome(call: Any) -> str:
    """``"<Error>: <message>"`` of the ``ValueError`` / ``TypeError`` that ``call()`` raises, else ``"no error"``."""
    try:
        call()
    except (ValueError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
