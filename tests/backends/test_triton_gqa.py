"""Several kv heads through CUDABackend's Triton index-list path (forced on CPU under Triton's interpreter).

GQA/MHA kv ``[n, H_kv, D]`` fold into the sparse kernel's one shared head (query rows ``(t, g)``
over kv rows ``j * H_kv + g``) in one launch, the sinks joining from the kernel's LSE. Compared
with :class:`~cpkv.backends.ReferenceBackend` in fp32, as ``test_triton_backend.py`` does
(``1e-5`` of the largest value for outputs and LSEs, ``1e-4`` for gradients: summation order
only); another head map or a dropped sink moves results by O(1).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.backends.test_triton_backend import SEGMENTS, _compare, _grads
from tests.backends.triton_interpreter import interpreted_kernels

from cpkv.backends import ReferenceBackend  # noqa: E402
from cpkv.backends.cuda import CUDABackend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    interpreted_kernels()


@pytest.mark.parametrize(("heads_kv", "shared", "window", "with_sinks"), [(2, False, 3, True), (4, True, None, True), (2, True, 3, False)])
def test_kv_heads_fold_into_one_launch(heads_kv: int, shared: bool, window: int | None, with_sinks: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    q, k = torch.randn(7, 4, 16, generator=gen), torch.randn(12, heads_kv, 16, generator=gen)
    v, sinks = torch.randn(12, heads_kv, 8, generator=gen), torch.randn(4, generator=gen)
    inputs = [q, k] + ([sinks] if with_sinks else []) + ([] if shared else [v])
    launches = {"n": 0}
    import cpkv.backends.triton as triton_ops

    original = triton_ops.sparse_attention_op

    def counted(*args: object) -> object:
        launches["n"] += 1
        return original(*args)

    def run(backend: object) -> object:
        def call(q: torch.Tensor, k: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            values = k[..., :8] if shared else rest[-1]  # shared: a view of k's leading channels
            result = backend.varlen_attention(q, k, values, SEGMENTS, scale=0.3, window=window,  # type: ignore[attr-defined]
                                              sinks=rest[0] if with_sinks else None)
            return result.out, result.lse
        return call

    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as patch:
        warnings.simplefilter("error")  # no fallback
        patch.setattr(triton_ops, "sparse_attention_op", counted)
        backend = CUDABackend(triton_kernels=True)
        backend._varlen_attn = None  # type: ignore[assignment]  # never the flash kernel
        got = _grads(run(backend), inputs)
    assert launches["n"] == 1
    want = _grads(run(ReferenceBackend()), inputs)
    _compare(got, want)
