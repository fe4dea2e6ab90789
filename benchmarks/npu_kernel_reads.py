"""The first checks of a hardware run: the points docs/backends.md reads in the fused kernels' sources.

``benchmarks/npu_check.py`` runs :func:`kernel_read_checks` before anything else when CANN's
custom ops (``cann_ops_transformer.ops``) import. Each row is one point of the table
"NPU fused path: the kernels read" (issue 46): either a property cpkv's fused path relies on
(a failure fails the run) or a reading of the sources to confirm or refute (reported, not a
failure: a refuted limit may be lifted). bf16 on the NPU against fp64 on the CPU, relative
to the largest fp64 magnitude; the bound is generous (``2**-5``) since a misread of the
kernel moves whole softmax columns, an O(1) change.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from cpkv.backends import ReferenceBackend  # noqa: E402
from cpkv.backends.base import CompressedLayer  # noqa: E402
from cpkv.backends.npu import NPUBackend  # noqa: E402
from cpkv.backends.npu_fused import fused_arguments, relative_indices  # noqa: E402
from cpkv.plan.attention import plan_attention  # noqa: E402

BOUND = 2.0**-5
KL_DOCS = [0, 300, 2500, 2600, 6000]  # documents of 300, 2200, 100 and 3400 tokens: short ones and long fronts


def rel_err(got: Tensor, want: Tensor) -> float:
    """``max|got - want| / max|want|`` in fp64 on the CPU (inf when ``got`` is not finite)."""
    got64, want64 = got.detach().double().cpu(), want.detach().double().cpu()
    if not bool(torch.isfinite(got64).all()):
        return float("inf")
    return float((got64 - want64).abs().max() / want64.abs().max().clamp_min(1e-30))


def _kl_inputs(device: torch.device, topk: int = 512) -> tuple[Tensor, ...]:
    """One rank's indexer KL inputs at the op's A2/A3 shapes (8 heads of 128), each query selecting its first
    ``min(K, visible)`` visible entries (a top-k's count), a random L1-normalised target."""
    visible = plan_attention(torch.tensor(KL_DOCS), 1, 0, compress_ratios=[4]).visible_for(4)
    rows = visible.visible_indices()
    rows = torch.nn.functional.pad(rows, (0, max(topk - rows.shape[1], 0)), value=-1)[:, :topk]
    gen = torch.Generator().manual_seed(1)
    t, n_c = rows.shape[0], visible.num_entries
    q = torch.randn(t, 8, 128, generator=gen).bfloat16()
    k = torch.randn(n_c, 128, generator=gen).bfloat16()
    w = torch.randn(t, 8, generator=gen) * 0.1
    p = torch.rand(rows.shape, generator=gen, dtype=torch.float64).masked_fill(rows < 0, 0.0)
    p = (p / p.sum(-1, keepdim=True).clamp_min(1e-30)).float()
    return tuple(x.to(device) for x in (q, k, w, rows, p))


def _kl(kl: Callable[..., tuple[Tensor, Tensor]], inputs: tuple[Tensor, ...], dtype: torch.dtype) -> list[Tensor]:
    """Loss and gradients (``grad_factor`` 1) of one KL implementation, inputs cast to ``dtype``."""
    q, k, w = (x.to(dtype).clone().requires_grad_(True) for x in inputs[:3])
    loss, anchor = kl(q, k, w, inputs[3], inputs[4].to(dtype), 1.0)
    anchor.backward()  # type: ignore[no-untyped-call]
    assert q.grad is not None and k.grad is not None and w.grad is not None
    return [loss.detach(), q.grad, k.grad, w.grad]


def _former_kl_loss(ops: Any, inputs: tuple[Tensor, ...]) -> Tensor:
    """cpkv's call before issue 46: one batch over all keys, ``mask_mode=0``, absolute rows; the loss from its softmax."""
    q, k, w, rows, p = inputs
    order = (rows < 0).to(torch.int8).argsort(dim=1, stable=True)
    sorted_rows, p_sorted = rows.gather(1, order), p.gather(1, order)
    common: dict[str, Any] = {"cu_seqlens_q": torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device),
                              "cu_seqlens_k": torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device),
                              "layout_q": "TND", "layout_k": "TND", "mask_mode": 0, "cmp_ratio": 1}
    metadata = ops.sparse_lightning_indexer_kl_loss_grad_metadata(
        q.shape[1], 1, q.shape[2], batch_size=1, max_seqlen_q=q.shape[0], max_seqlen_k=k.shape[0], topk=rows.shape[1], **common)
    pred = ops.sparse_lightning_indexer_kl_loss_grad(
        q, k[:, None].contiguous(), w.float().contiguous(), sorted_rows.to(torch.int32)[:, None].contiguous(),
        p_sorted[:, None].contiguous(), metadata=metadata, **common)[3][:, 0]
    return torch.where(p_sorted > 0, p_sorted * (p_sorted.clamp_min(1e-30).log() - pred.clamp_min(1e-30).log()), 0.0).sum()


def _csa_layer(device: torch.device, topk: int, heads: int = 16) -> tuple[CompressedLayer, Tensor, Tensor, Tensor]:
    """The last 132 queries of an 8448-token document (rank 63 of 64): up to 2112 visible entries, ``topk`` selected."""
    plan = plan_attention(torch.tensor([0, 8448]), 64, 63, compress_ratios=[4]).to(device)
    segments, visible = plan.segments, plan.visible_for(4)
    rows = visible.visible_indices()
    selected = torch.nn.functional.pad(rows, (0, max(topk - rows.shape[1], 0)), value=-1)[:, :topk]
    layer = CompressedLayer(segments, segments, visible, 128, segments.num_kv, selected)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(segments.num_queries, heads, 512, generator=gen).to(device, torch.bfloat16)
    kv = torch.randn(segments.num_kv + visible.num_entries, 512, generator=gen).to(device, torch.bfloat16)
    indices = torch.cat([segments.window_indices(128), torch.where(selected >= 0, selected + segments.num_kv, -1)], 1)
    return layer, q, kv, indices


def _attention_err(layer: CompressedLayer, q: Tensor, kv: Tensor, indices: Tensor, sinks: Tensor | None) -> float:
    backend = NPUBackend(fused=True, kernel_limits=False)
    got = backend.compressed_attention(q, kv, indices, layer, d_v=448, scale=512**-0.5, sinks=sinks, probs_from=None)
    want = ReferenceBackend().sparse_attention(q.double().cpu(), kv.double().cpu(), indices.cpu(), d_v=448,
                                               scale=512**-0.5, sinks=None if sinks is None else sinks.double().cpu())
    return rel_err(got.result.out, want.out)


def _deterministic(fn: Callable[[], Any]) -> Any:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return fn()
    finally:
        torch.use_deterministic_algorithms(previous)


def _grad_metadata_err(ops: Any, device: torch.device) -> float:
    """``sparse_flash_mla_grad`` with ``metadata=None`` against its metadata call's output (same inputs)."""
    layer, q, kv, _ = _csa_layer(device, 512)
    args = fused_arguments(layer)
    assert layer.selected is not None and args.cmp_sparse_indices is not None
    assert torch.equal(args.cmp_sparse_indices, relative_indices(layer.selected, layer.visible.visible_start))
    sinks = torch.zeros(q.shape[1], device=device)
    ori_kv, cmp_kv = kv[: layer.num_kv, None], kv[layer.num_kv :, None]
    meta = ops.sparse_flash_mla_metadata(q.shape[1], 1, 512, **args.metadata_kwargs())
    out, lse = ops.sparse_flash_mla(q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=args.cmp_sparse_indices, sinks=sinks,
                                    metadata=meta, softmax_scale=512**-0.5, return_softmax_lse=True, **args.mask_kwargs())
    d_out = torch.randn_like(out)
    grads = []
    for metadata in (ops.sparse_flash_mla_grad_metadata(q.shape[1], 1, 512, **args.metadata_kwargs()), None):
        grads.append(ops.sparse_flash_mla_grad(q, d_out, out, lse, ori_kv=ori_kv, cmp_kv=cmp_kv,
                                               cmp_sparse_indices=args.cmp_sparse_indices, sinks=sinks, metadata=metadata,
                                               softmax_scale=512**-0.5, **args.mask_kwargs())[0])
    return rel_err(grads[1], grads[0])


def kernel_read_checks(ops: Any, device: torch.device) -> tuple[list[str], bool]:
    """Run the checks; markdown rows and whether every property cpkv relies on held."""
    rows, ok = ["| # | check | result | needed by cpkv | ok |", "|---|---|---|---|---|"], True

    def row(point: str, what: str, run: Callable[[], tuple[str, bool]], needed: bool) -> None:
        nonlocal ok
        print(f"kernel reads: {point} {what} ...", flush=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result, passed = run()
        except Exception as err:  # report every point, do not stop at the first error
            traceback.print_exc()
            result, passed = f"raised {type(err).__name__}: {str(err)[:160]}", False
        ok &= passed or not needed
        rows.append(f"| {point} | {what} | {result} | {'yes' if needed else 'no (a reading)'} | "
                    f"{'PASS' if passed else 'FAIL' if needed else 'refuted'} |")

    kl_inputs = _kl_inputs(device)

    def kl_err() -> tuple[str, bool]:
        want = _kl(ReferenceBackend().indexer_kl, tuple(x.cpu() for x in kl_inputs), torch.float64)
        got = _kl(NPUBackend(fused=True).indexer_kl, kl_inputs, torch.bfloat16)
        errs = [rel_err(g, w) for g, w in zip(got, want)]
        return "loss, dq, dk, dw rel err " + ", ".join(f"{e:.1e}" for e in errs), max(errs) <= BOUND

    def former() -> tuple[str, bool]:
        want = _kl(ReferenceBackend().indexer_kl, tuple(x.cpu() for x in kl_inputs), torch.float64)[0]
        err = rel_err(_former_kl_loss(ops, kl_inputs), want)
        return f"loss rel err {err:.1e} (the issue's read: large)", err > BOUND

    def reread(topk: int, wrong: bool) -> Callable[[], tuple[str, bool]]:
        def run() -> tuple[str, bool]:
            err = _attention_err(*_csa_layer(device, topk), torch.zeros(16, device=device))
            return f"K={topk}, H=16: out rel err {err:.1e}", (err > BOUND) == wrong
        return run

    def grad_refuses() -> tuple[str, bool]:
        layer, q, kv, indices = _csa_layer(device, 512)
        q.requires_grad_(True)

        def step() -> None:
            out = NPUBackend(fused=True, kernel_limits=False).compressed_attention(
                q, kv, indices, layer, d_v=448, scale=512**-0.5, sinks=None, probs_from=None).result.out
            out.sum().backward()  # type: ignore[no-untyped-call]
            torch.npu.synchronize()  # type: ignore[attr-defined]

        try:
            _deterministic(step)
        except Exception as err:
            return f"raised {type(err).__name__} (as read)", True
        return "ran (the guard may be lifted)", False

    def kl_deterministic() -> tuple[str, bool]:
        return _deterministic(kl_err)  # type: ignore[no-any-return]

    def grad_metadata() -> tuple[str, bool]:
        err = _grad_metadata_err(ops, device)
        return f"dq rel err metadata=None vs metadata {err:.1e}", err <= BOUND

    def minus_inf_sinks() -> tuple[str, bool]:
        err = _attention_err(*_csa_layer(device, 512), None)
        return f"out rel err vs no sinks {err:.1e}", err <= BOUND

    row("1", "KL op on indexer_kl_plan's batches (mask_mode=3, cmp_ratio=1, no residual) = composed KL", kl_err, True)
    row("1", "the former one-batch mask_mode=0 call differs from the composed KL", former, False)
    row("2", "sparse_flash_mla CSA with K=1024, 16 heads = reference", reread(1024, False), True)
    row("2", "sparse_flash_mla CSA with K=2048, 16 heads differs (re-read past 1024)", reread(2048, True), False)
    row("3", "sparse_flash_mla_grad fails under deterministic algorithms", grad_refuses, False)
    row("3a", "KL op under deterministic algorithms = composed KL", kl_deterministic, True)
    row("5a", "sparse_flash_mla_grad accepts metadata=None with the same result", grad_metadata, False)
    row("5b", "-inf sinks = no sinks, finite", minus_inf_sinks, True)
    return rows, ok
