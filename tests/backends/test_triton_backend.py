"""CUDABackend's routing to the Triton kernels, forced on CPU (``triton_kernels=True``) under Triton's interpreter.

Each primitive is compared with :class:`~cpkv.backends.ReferenceBackend` in fp32 (tolerance
``1e-5`` of the largest value for outputs, ``1e-4`` for gradients: summation order only).
torch's own ``varlen_attn`` has no CPU kernel, so every dense call here takes the Triton
index-list path, which is what a GPU runs at D > 256 or for windowed layers with sinks.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import Tensor

from tests.backends.op_names import OpNames
from tests.backends.triton_interpreter import interpreted_kernels

from cpkv.backends import ReferenceBackend  # noqa: E402
from cpkv.backends.base import KeyRanges  # noqa: E402
from cpkv.backends.cuda import CUDABackend  # noqa: E402
from cpkv.plan.segments import plan_segments  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture(autouse=True, scope="module")
def _kernels() -> None:
    interpreted_kernels()


def _backend(**kwargs: bool) -> CUDABackend:
    return CUDABackend(triton_kernels=True, **kwargs)


def _grads(fn, inputs: list[Tensor]) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out, lse = fn(*leaves)
    gen = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=gen)).sum()
    loss = loss + torch.where(torch.isfinite(lse), lse * torch.randn(lse.shape, generator=gen), 0.0).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)


def _close(got: Tensor, want: Tensor, rel: float) -> None:
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= rel * max(want[finite].abs().max().item() if finite.any() else 1.0, 1.0), err


def _compare(got: tuple, want: tuple) -> None:
    _close(got[0], want[0], 1e-5)
    _close(got[1], want[1], 1e-5)
    for g, w in zip(got[2], want[2]):
        _close(g, w, 1e-4)


SEGMENTS = plan_segments(torch.tensor([0, 3, 3, 7]), torch.tensor([0, 5, 6, 12]))  # prefix kv, an empty query segment


@pytest.mark.parametrize("window", [None, 3])
def test_varlen_attention_shared_kv_through_the_sparse_kernel(window: int | None) -> None:
    gen = torch.Generator().manual_seed(2)
    q, kv, sinks = torch.randn(7, 4, 320, generator=gen), torch.randn(12, 1, 320, generator=gen), torch.randn(4, generator=gen)

    def run(backend):
        return lambda q, kv, s: backend.varlen_attention(q, kv, kv[..., :256], SEGMENTS, scale=0.1, window=window, sinks=s)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        got = _grads(run(_backend(deterministic=True)), [q, kv, sinks])
    _compare(got, _grads(run(ReferenceBackend()), [q, kv, sinks]))


def test_windowed_sinks_with_separate_values_and_ring_round() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(7, 2, 32, generator=gen), torch.randn(12, 1, 32, generator=gen), torch.randn(12, 1, 16, generator=gen)
    sinks = torch.randn(2, generator=gen)
    for backend_fn in (lambda b: (lambda q, k, v, s: b.varlen_attention(q, k, v, SEGMENTS, scale=0.2, window=4, sinks=s)),):
        got = _grads(backend_fn(_backend()), [q, k, v, sinks])
        _compare(got, _grads(backend_fn(ReferenceBackend()), [q, k, v, sinks]))
    ranges = KeyRanges(torch.tensor([0, 0, 2, 12, 3, 3, 5]), torch.tensor([0, 4, 6, 12, 9, 12, 12]), 12, 7, -1)
    fn = lambda b: (lambda q, k, v: b.range_attention(q, k, v, ranges, scale=0.2))  # noqa: E731
    _compare(_grads(fn(_backend()), [q, k, v]), _grads(fn(ReferenceBackend()), [q, k, v]))


def test_sparse_probs_and_indexer_through_the_backend() -> None:
    gen = torch.Generator().manual_seed(6)
    q, kv, sinks = torch.randn(5, 4, 64, generator=gen), torch.randn(9, 64, generator=gen), torch.randn(4, generator=gen)
    idx = torch.randint(-1, 9, (5, 6), generator=gen)
    for deterministic in (False, True):
        got = _grads(lambda q, kv, s: _backend(deterministic=deterministic).sparse_attention(q, kv, idx, d_v=32, scale=0.125, sinks=s),
                     [q, kv, sinks])
        want = _grads(lambda q, kv, s: ReferenceBackend().sparse_attention(q, kv, idx, d_v=32, scale=0.125, sinks=s), [q, kv, sinks])
        _compare(got, want)
    _close(_backend().selected_probs(q, kv, idx, got[1], scale=0.125),
           ReferenceBackend().selected_probs(q, kv, idx, got[1], scale=0.125), 1e-5)
    fused, probs = _backend().sparse_attention_probs(q, kv, idx, d_v=32, scale=0.125, sinks=sinks, probs_from=2)
    want_fused, want_probs = ReferenceBackend().sparse_attention_probs(q, kv, idx, d_v=32, scale=0.125, sinks=sinks,
                                                                        probs_from=2)
    _close(fused.out, want_fused.out, 1e-5)
    _close(probs, want_probs, 1e-5)
    qi, ki, w = torch.randn(5, 2, 16, generator=gen), torch.randn(11, 16, generator=gen), torch.rand(5, 2, generator=gen)
    visible = SimpleNamespace(visible_start=torch.tensor([0, 0, 2, 4, 4]), visible_count=torch.tensor([0, 3, 5, 7, 2]))
    got_i = _backend().indexer_topk(qi, ki, w, SEGMENTS, visible, topk=4)  # type: ignore[arg-type]
    assert torch.equal(got_i, ReferenceBackend().indexer_topk(qi, ki, w, SEGMENTS, visible, topk=4))  # type: ignore[arg-type]


def test_unforced_backend_warns_once_and_uses_the_reference_on_cpu() -> None:
    backend = CUDABackend()
    q, kv, idx = torch.randn(2, 2, 8), torch.randn(3, 8), torch.tensor([[0, 1], [2, -1]])
    with pytest.warns(UserWarning, match="Triton kernels run on CUDA devices"):
        backend.sparse_attention(q, kv, idx, d_v=8, scale=0.3, sinks=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backend.sparse_attention(q, kv, idx, d_v=8, scale=0.3, sinks=None)
    with pytest.raises(TypeError, match="deterministic"):
        CUDABackend(deterministic=1)  # type: ignore[arg-type]


def indexer_layer_calls(rank: int, world: int) -> list[tuple[Any, ...]]:
    """One INDEXER layer call per backend (CUDA forced, reference) on a 1-rank group: loss, out, indexer grads, op names."""
    from cpkv.plan import plan_attention
    from cpkv.v4 import V4Attention, V4Config

    interpreted_kernels()

    plan = plan_attention(torch.tensor([0, 13, 40]), world, rank, compress_ratios=[4], windows=[6])
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(4))
    results = []
    for backend in (_backend(), ReferenceBackend()):
        layer = V4Attention(V4Config(compress_ratio=4, window=6, topk=3, heads=2), seed=3)
        with OpNames() as ops:
            out = layer(x, plan, None, backend=backend)
            out.out.sum().backward()
        grads = {n: p.grad for n, p in layer.named_parameters() if n.startswith("indexer.") and p.grad is not None}
        results.append((out.indexer_loss, out.out.detach(), grads, ops.names))
    return results


@pytest.mark.timeout(200)
def test_indexer_layer_takes_its_kl_target_from_the_forward() -> None:
    """An INDEXER layer call on the CUDA backend (no ring round): the KL target comes out of the sparse forward
    (``cpkv_triton::sparse_attention_probs``), no separate ``selected_probs`` pass runs, and the loss, output and
    indexer gradients equal the reference backend's (1e-4: fp32 summation order)."""
    from cpkv.launch import spawn

    (loss, out, grads, names), (want_loss, want_out, want_grads, want_names) = spawn(indexer_layer_calls, 1, timeout=180.0)[0]
    assert "cpkv_triton.sparse_attention_probs" in names and "cpkv_triton.selected_probs" not in names
    assert "cpkv.selected_probs" in want_names  # the reference backend's target: the reference op
    assert loss is not None and want_loss is not None
    _close(loss.reshape(1), want_loss.reshape(1), 1e-4)
    _close(out, want_out, 1e-4)
    assert grads.keys() == want_grads.keys() and grads
    for name, grad in grads.items():
        _close(grad, want_grads[name], 1e-4)
