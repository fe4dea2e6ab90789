"""The executed-work model (cpkv.bench.kernel_work) against hand counts of the kernels' tiles."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cpkv.backends.triton.launches import AOTCase, v4_cases  # noqa: E402
from cpkv.backends.triton.ops import aot_launches  # noqa: E402
from cpkv.bench.__main__ import main as bench_main  # noqa: E402
from cpkv.bench.kernel_work import kernel_work  # noqa: E402


def _flash(dtype: torch.dtype) -> AOTCase:
    return next(c for c in v4_cases() if c.name == f"V4-Flash {'bf16' if dtype == torch.bfloat16 else 'fp32'}")


def test_forward_work_by_hand() -> None:
    case = _flash(torch.bfloat16)
    work = {w.name: w for w in kernel_work(case, aot_launches(case))}
    h, d, k = 64, 512, 640
    assert work["sparse_fwd"].counted_flops == 2 * h * k * (d + d)
    # 64 heads, 8 warps: QK^T split over the two warpgroups, PV too: each FLOP once.
    assert work["sparse_fwd"].flops == 2 * h * k * d + 2 * h * k * d
    assert work["sparse_fwd"].ratio == 1.0 and work["sparse_fwd"].target == 1.1
    # bytes: q once, each kv row and index once (one head block), out and lse/sinks once
    assert work["sparse_fwd"].bytes == h * d * 2 + k * d * 2 + 4 * k + h * d * 2 + 8 * h
    assert work["sparse_bwd"].counted_flops == 2 * h * k * (3 * d + 2 * d)


def test_the_forward_with_the_kl_target_does_no_second_qk() -> None:
    """``sparse_fwd_probs``: the forward's FLOPs (no ``selected_probs`` pass), plus its scratch round trip and the target."""
    case = _flash(torch.bfloat16)
    work = {w.name: w for w in kernel_work(case, aot_launches(case))}
    h, d, k, kc = 64, 512, 640, 512  # the target covers the 512 entries after the 128 window rows
    assert work["sparse_fwd_probs"].flops == work["sparse_fwd"].flops
    steps = kc // 64  # 64 entries a step; the window's two steps are not kept
    scratch = h * (kc * 2 * 2 + steps * 4 * 2)  # exp(s - m) in bf16 and the running max, stored and read back
    assert work["sparse_fwd_probs"].bytes == work["sparse_fwd"].bytes + scratch + kc * 4


def test_backward_passes_do_each_flop_once() -> None:
    """S and dP (first pass), dq (second), dS^T Q + P^T dO (third): the counted backward exactly, atomic or not."""
    case = _flash(torch.bfloat16)
    work = {w.name: w for w in kernel_work(case, aot_launches(case))}
    h, d, k = 64, 512, 640
    assert work["sparse_bwd_ds"].flops == 2 * h * k * (d + d)
    assert work["sparse_bwd_dq"].flops == 2 * h * k * d
    assert work["sparse_bwd_dkv_atomic"].flops == work["sparse_bwd_dkv_partials"].flops == 2 * h * k * (d + d)
    for total in ("sparse_bwd", "sparse_bwd_deterministic"):
        assert work[total].ratio == 1.0 and work[total].target == 1.25
    # first pass: Q and dO once, each kv row and index once, lse and delta, then P and dS stored (bf16)
    assert work["sparse_bwd_ds"].bytes == 2 * h * d * 2 + k * d * 2 + 4 * k + 8 * h + 2 * h * k * 2
    # second pass: the kv rows again, dS read back, dq written in fp32
    assert work["sparse_bwd_dq"].bytes == k * d * 2 + 4 * k + h * k * 2 + h * d * 4


def test_fp32_forward_does_each_flop_once_and_pro_has_two_head_blocks() -> None:
    case = _flash(torch.float32)
    fwd = kernel_work(case, aot_launches(case))[0]
    assert fwd.name == "sparse_fwd" and fwd.ratio == 1.0
    pro = next(c for c in v4_cases() if c.name == "V4-Pro bf16")
    fwd_pro = kernel_work(pro, aot_launches(pro))[0]
    assert fwd_pro.bytes > pro.heads * pro.dim * 2 + 2 * pro.topk * pro.dim * 2  # kv gathered per head block


def test_bench_kernels_subcommand_prints_every_case(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["kernels"]) == 0
    text = capsys.readouterr().out
    for case in v4_cases():
        assert case.name in text
    assert text.count("| sparse_fwd |") == 4


def test_kernel_work_rejects_bad_cases() -> None:
    bad = AOTCase("bad", torch.bfloat16, 4, 6, 2, 16, 32, 8, 2, 16, 4, 6)
    with pytest.raises(ValueError, match="d_v <= dim"):
        kernel_work(bad, [])
