"""The CUDA backend: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention varlen).

:meth:`CUDABackend.varlen_attention` and :meth:`CUDABackend.range_attention` (ring rounds)
run the fused kernel; the sparse ops and the indexer run the reference ops on the GPU
tensors (no public sparse kernel fits them yet). Kernel conventions: docs/semantics.md,
"Fused ops: CUDA"; marshalling in docs/backends.md.

Kernel adapter (one for both primitives):

* ``cu_seq_q`` / ``cu_seq_k``: int32, leading 0, on q's device; ``max_q`` / ``max_k``
  host ints from the plan (no host sync). ``varlen_attention`` passes the plan's
  ``cu_seqlens_q/kv``. ``range_attention`` passes the :class:`~cpkv.backends.base.KeyRanges`
  kernel form: q rows ``[0, num_rows)`` as one sequence over all ``num_keys`` keys
  (``cu_seq_q = [0, num_rows]``, ``cu_seq_k = [0, num_keys]``); the remaining rows see no
  key and get ``out = 0``, ``lse = -inf`` (padded differentiably; an empty round calls no
  kernel).
* mask, bottom-right aligned: ``window_size=(-1, 0)`` (causal) or ``(W - 1, 0)`` for
  ``varlen_attention``; ``(left, -1)`` for a ring round (``left = -1``: every key). The
  torch 2.10 form (``is_causal``, no ``scale``/``window_size``/``enable_gqa``) gets
  ``is_causal=True`` for ``(-1, 0)`` and ``False`` for ``(-1, -1)``, q pre-multiplied by
  ``scale * sqrt(D)`` when ``scale`` is not the kernel default; other windows fall back.
  The form is read once, from the public function's ``inspect.signature``.
* MQA/GQA: ``enable_gqa=True`` where the parameter exists, else the kv heads are expanded.
* ``D_v < D``: flash kernels need one head dim for q, k and v, so v is zero-padded to
  ``D`` and the output sliced back (exact).
* LSE: the kernel returns it as ``[H, T_q]`` fp32 (flash's varlen layout); it becomes
  ``[T_q, H]``. The kernel's backward **ignores the LSE's gradient**, so the LSE is
  detached from it and :class:`_LseGradient` supplies ``d lse / d(q, k)`` exactly: with
  ``P`` the attention probabilities, ``d lse_i / d q_i = scale * sum_j P_ij k_j`` (one
  more kernel call with ``value = k``) and ``d lse_i / d k_j = scale * P_ij q_i`` (that
  call's value gradient). It only runs when the LSE receives a gradient (sinks, and the
  merge of ring rounds, differentiate through it).
* sinks (the kernel has none): ``lse_s = logaddexp(lse, sink)``,
  ``out_s = out * exp(lse - lse_s)``, in fp32 autograd on top of the above, so the
  gradients w.r.t. q, k, v and the sinks are exact.

Fallbacks to the reference (a ``UserWarning`` once per backend instance and reason):
dtypes other than fp16/bf16, head dims above 256 or ``D_v > D``, a window (finite
``left``) on the torch 2.10 form, and tensors not on a CUDA device (torch's own kernel
only; an injected ``varlen_attn``, as the tests use, is trusted with any device).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from cpkv.backends.base import AttentionResult, KeyRanges
from cpkv.backends.reference import ReferenceBackend
from cpkv.plan.segments import EntryVisibility, SegmentPlan

__all__ = ["CUDABackend"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
CAUSAL = (-1, 0)  # window_size of bottom-right causal attention
FULL = (-1, -1)  # window_size of attention over every key
_Apply = Callable[..., Tensor]  # autograd.Function.apply is untyped


@dataclass(frozen=True)
class _KernelCall:
    """How to call ``varlen_attn`` for one attention (per call; kept on autograd ctx).

    Attributes:
        fn: the ``varlen_attn`` function.
        window_form: True for the ``window_size``/``scale`` form (torch >= 2.11), False for
            torch 2.10's ``is_causal`` form.
        gqa: the function takes ``enable_gqa``.
        max_q, max_k: longest query / key sequence (host ints).
        scale: softmax scale.
        window_size: ``(left, right)``, bottom-right aligned, ``-1`` = unbounded.
    """

    fn: Callable[..., Any]
    window_form: bool
    gqa: bool
    max_q: int
    max_k: int
    scale: float
    window_size: tuple[int, int]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _lse_to_tnd(lse: Tensor, num_tokens: int, heads: int) -> Tensor:
    """The kernel's LSE (``[H, T_q]``, flash's varlen layout; ``[T_q, H]`` accepted) as ``[T_q, H]``, at least fp32."""
    if tuple(lse.shape) == (heads, num_tokens):
        return lse.transpose(0, 1).to(_acc(lse.dtype))
    if tuple(lse.shape) == (num_tokens, heads):
        return lse.to(_acc(lse.dtype))
    raise RuntimeError(f"varlen_attn returned an LSE of shape {tuple(lse.shape)}; expected [H, T_q] = [{heads}, {num_tokens}]")


def _run_kernel(call: _KernelCall, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> tuple[Tensor, Tensor]:
    """``varlen_attn`` on q ``[T_q, H, D]``, k ``[T_kv, H_kv, D]``, v ``[T_kv, H_kv, D_v <= D]``.

    Returns out ``[T_q, H, D_v]`` (differentiable through the kernel's backward) and the
    LSE ``[T_q, H]`` fp32 (the kernel drops its gradient).
    """
    (num_q, heads, dim), heads_kv, d_v = q.shape, k.shape[1], v.shape[2]
    if d_v < dim:
        v = torch.nn.functional.pad(v, (0, dim - d_v))
    kwargs: dict[str, Any] = {}
    if heads_kv != heads:
        if call.gqa:
            kwargs["enable_gqa"] = True
        elif heads_kv == 1:  # MQA: a stride-0 view, no copy (flash takes it)
            k, v = k.expand(-1, heads, -1), v.expand(-1, heads, -1)
        else:
            k, v = k.repeat_interleave(heads // heads_kv, 1), v.repeat_interleave(heads // heads_kv, 1)
    from torch.nn.attention.varlen import AuxRequest

    kwargs["return_aux"] = AuxRequest(lse=True)
    if call.window_form:
        kwargs["scale"] = call.scale
        kwargs["window_size"] = call.window_size
    else:  # CAUSAL or FULL only (other windows fall back)
        kwargs["is_causal"] = call.window_size == CAUSAL
        ratio = call.scale * math.sqrt(dim)  # the 2.10 form always uses 1/sqrt(D)
        if ratio != 1.0:
            q = q * ratio
    out, lse = call.fn(q, k, v, cu_q, cu_k, call.max_q, call.max_k, **kwargs)
    return out[..., :d_v], _lse_to_tnd(lse, num_q, heads)


class _LseGradient(torch.autograd.Function):
    """Identity on the (detached) kernel LSE whose backward adds ``d lse / d(q, k)``."""

    @staticmethod
    def forward(  # lse [T_q, H] fp32 detached; cu_q, cu_k int32 [B + 1]
        ctx: Any, lse: Tensor, q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, call: _KernelCall
    ) -> Tensor:
        ctx.save_for_backward(q, k, cu_q, cu_k)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return lse.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        if d_lse is None:
            return (None,) * 6
        q, k, cu_q, cu_k = ctx.saved_tensors
        call: _KernelCall = ctx.call
        with torch.enable_grad():
            k_as_value = k.detach().requires_grad_(True)
            pk, _ = _run_kernel(call, q.detach(), k.detach(), k_as_value, cu_q, cu_k)  # sum_j P_ij k_j
            weight = call.scale * d_lse.unsqueeze(-1)
            (dk,) = torch.autograd.grad(pk, k_as_value, (weight * q.to(weight.dtype)).to(q.dtype))
        dq = (weight * pk.to(weight.dtype)).to(q.dtype)
        return None, dq, dk, None, None, None


def _varlen_with_sinks(
    call: _KernelCall, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, sinks: Tensor | None
) -> AttentionResult:
    """Kernel attention with an exactly differentiable LSE and the sinks (``[H]`` or None) applied from it."""
    out, lse_kernel = _run_kernel(call, q, k, v, cu_q, cu_k)
    lse = cast(_Apply, _LseGradient.apply)(lse_kernel.detach(), q, k, cu_q, cu_k, call)
    if sinks is None:
        return AttentionResult(out, lse)
    lse_sink = torch.logaddexp(lse, sinks.to(lse.dtype))
    out = (out.to(lse.dtype) * torch.exp(lse - lse_sink).unsqueeze(-1)).to(q.dtype)
    return AttentionResult(out, lse_sink)


def _pad_rows(result: AttentionResult, num_tokens: int) -> AttentionResult:
    """``result`` of the leading rows, padded (differentiably) to ``num_tokens`` rows: out 0, lse -inf."""
    missing = num_tokens - result.out.shape[0]
    if missing == 0:
        return result
    out = torch.nn.functional.pad(result.out, (0, 0, 0, 0, 0, missing))
    return AttentionResult(out, torch.nn.functional.pad(result.lse, (0, 0, 0, missing), value=float("-inf")))


class CUDABackend:
    """Flash varlen attention through ``torch.nn.attention.varlen.varlen_attn``; reference ops elsewhere.

    Implements :class:`~cpkv.backends.base.AttentionBackend`; conventions in the module doc.

    Args:
        varlen_attn: the kernel function; default ``torch.nn.attention.varlen.varlen_attn``.
            Tests inject a stand-in with the same signature (trusted with any device).
        block_size: block size of the reference ops used for the sparse parts and fallbacks.

    Raises:
        RuntimeError: torch has no ``varlen_attn``, or its signature is neither the
            ``window_size`` form nor the torch 2.10 ``is_causal`` form.

    Example:
        >>> backend = CUDABackend()  # doctest: +SKIP
        >>> layer(x_local, plan, group, backend=backend)  # doctest: +SKIP
    """

    name = "cuda"

    def __init__(self, varlen_attn: Callable[..., Any] | None = None, *, block_size: int = 1024) -> None:
        default = _torch_varlen_attn()
        if varlen_attn is None:
            if default is None:
                raise RuntimeError(f"CUDABackend needs torch.nn.attention.varlen (torch >= 2.10), torch is {torch.__version__}")
            varlen_attn = default
        params = inspect.signature(varlen_attn).parameters
        self._window_form = "window_size" in params and "scale" in params
        if not self._window_form and "is_causal" not in params:
            raise RuntimeError(f"unsupported varlen_attn signature {inspect.signature(varlen_attn)}: need window_size or is_causal")
        self._gqa = "enable_gqa" in params
        self._varlen_attn = varlen_attn
        self._check_device = varlen_attn is default
        self._reference = ReferenceBackend(block_size)
        self._warned: set[str] = set()

    def _fallback(self, q: Tensor, v: Tensor, window_size: tuple[int, int]) -> bool:
        """Warn once per reason; True when the kernel cannot serve this call and the reference must."""
        reason = None
        if q.dtype not in KERNEL_DTYPES:
            reason = f"dtype {q.dtype} (flash kernels take float16/bfloat16)"
        elif q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > q.shape[-1]:
            reason = f"head dims D={q.shape[-1]}, D_v={v.shape[-1]} (flash kernels take D_v <= D <= {MAX_HEAD_DIM})"
        elif window_size not in (CAUSAL, FULL) and not self._window_form:
            reason = "a sliding window (this torch's varlen_attn has no window_size)"
        elif self._check_device and q.device.type != "cuda":
            reason = f"device {q.device} (varlen_attn has no kernel there)"
        if reason is not None and reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"CUDABackend: falling back to the reference attention for {reason}", UserWarning, stacklevel=3)
        return reason is not None

    def _call(self, max_q: int, max_k: int, scale: float, window_size: tuple[int, int]) -> _KernelCall:
        return _KernelCall(self._varlen_attn, self._window_form, self._gqa, max_q, max_k, float(scale), window_size)

    def varlen_attention(
        self, q: Tensor, k: Tensor, v: Tensor, segments: SegmentPlan, *,
        scale: float, window: int | None, sinks: Tensor | None,
    ) -> AttentionResult:
        """Bottom-right causal (optionally windowed) varlen attention with sinks; see the module doc.

        Args:
            q: ``[T_q, H, D]`` fp16/bf16. k: ``[T_kv, H_kv, D]``, v: ``[T_kv, H_kv, D_v]``.
            segments: pairs ``cu_seqlens_q`` with ``cu_seqlens_kv`` (leading 0, int32).
            scale: softmax scale. window: ``W`` keys (the query's own and ``W - 1`` before) or
                None (causal). sinks: ``[H]`` logits or None.

        Returns:
            ``AttentionResult(out [T_q, H, D_v] dtype of q, lse [T_q, H] fp32)``, both
            differentiable (q, k, v, sinks); the LSE includes the sink.
        """
        window_size = CAUSAL if window is None else (window - 1, 0)
        if self._fallback(q, v, window_size) or q.shape[0] == 0:
            return self._reference.varlen_attention(q, k, v, segments, scale=scale, window=window, sinks=sinks)
        call = self._call(segments.max_seqlen_q, segments.max_seqlen_kv, scale, window_size)
        cu_q = segments.cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        cu_k = segments.cu_seqlens_kv.to(device=q.device, dtype=torch.int32)
        return _varlen_with_sinks(call, q, k, v, cu_q, cu_k, sinks)

    def range_attention(self, q: Tensor, k: Tensor, v: Tensor, ranges: KeyRanges, *, scale: float) -> AttentionResult:
        """One ring round through the kernel, in the :class:`~cpkv.backends.base.KeyRanges` kernel form.

        Query rows ``[0, num_rows)`` attend bottom-right aligned over all ``num_keys`` keys
        with ``window_size=(left, -1)``; the other rows see no key.

        Args:
            q: ``[T_q, H, D]`` fp16/bf16. k: ``[n, H_kv, D]``, v: ``[n, H_kv, D_v]``, ``n = ranges.num_keys``.
            ranges: the round's key ranges (only the host ints ``num_rows``, ``num_keys``,
                ``left`` are read, no host sync). scale: softmax scale.

        Returns:
            ``AttentionResult(out [T_q, H, D_v] dtype of q, lse [T_q, H] fp32)``, both
            differentiable (q, k, v); ``out = 0``, ``lse = -inf`` on rows that see no key.

        Raises:
            ValueError: ``ranges.num_keys`` is not k's row count or ``ranges.num_rows`` is not in ``[0, T_q]``.
        """
        num_rows, num_keys = ranges.num_rows, ranges.num_keys
        if num_keys != k.shape[0] or not 0 <= num_rows <= q.shape[0]:
            raise ValueError(
                f"ranges must fit q [T_q={q.shape[0]}] and k [n={k.shape[0]}], got num_rows={num_rows}, num_keys={num_keys}"
            )
        if num_rows == 0 or num_keys == 0:
            out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
            return AttentionResult(out, torch.full(q.shape[:2], float("-inf"), dtype=_acc(q.dtype), device=q.device))
        window_size = (ranges.left, -1)
        if self._fallback(q, v, window_size):
            return self._reference.range_attention(q, k, v, ranges, scale=scale)
        cu = torch.tensor([[0, num_rows], [0, num_keys]], dtype=torch.int32, device=q.device)
        result = _varlen_with_sinks(self._call(num_rows, num_keys, scale, window_size), q[:num_rows], k, v, cu[0], cu[1], None)
        return _pad_rows(result, q.shape[0])

    def sparse_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None,
    ) -> AttentionResult:
        """The reference sparse attention on the GPU tensors (no fused kernel yet)."""
        return self._reference.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks)

    def selected_probs(self, q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, scale: float) -> Tensor:
        """The reference head-summed probabilities of the listed rows on the GPU tensors (no gradient)."""
        return self._reference.selected_probs(q, kv, indices, lse, scale=scale)

    def indexer_topk(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, segments: SegmentPlan,
        visible: EntryVisibility, *, topk: int,
    ) -> Tensor:
        """The reference lightning-indexer top-k on the GPU tensors."""
        return self._reference.indexer_topk(q_index, k_index, weights, segments, visible, topk=topk)


def _torch_varlen_attn() -> Callable[..., Any] | None:
    """torch's own ``varlen_attn``, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn
