"""The CUDA backend: ``torch.nn.attention.varlen.varlen_attn`` (flash-attention varlen) and cpkv's Triton kernels.

Routing (docs/backends.md):

* :meth:`CUDABackend.varlen_attention` and :meth:`CUDABackend.range_attention` (ring rounds)
  run ``varlen_attn`` where it serves the call (fp16/bf16, ``D_v <= D <= 256``) and is the
  faster choice: dense (causal) layers, with or without sinks, and windowed layers without
  sinks. A windowed layer with sinks, and any call with ``D > 256`` or fp32, goes to the
  Triton sparse kernel (:mod:`cpkv.backends.triton`) through an index list (the window's
  rows, or the causal/ring range's rows); several kv heads (GQA/MHA) fold into the kernel's
  one shared head (query rows ``(t, g)`` over kv rows ``j * H_kv + g``), still one launch.
* :meth:`CUDABackend.sparse_attention`, :meth:`CUDABackend.selected_probs` (from the
  kernel's LSE), :meth:`CUDABackend.indexer_topk` and :meth:`CUDABackend.indexer_kl` (the
  indexer loss and its backward) run the Triton kernels.
* ``deterministic=True`` makes the Triton backwards compute dkv and the indexer's dk
  without atomics (bitwise reproducible; slower).

Kernel conventions: docs/semantics.md, "Fused ops: CUDA"; marshalling in docs/backends.md.

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

Fallbacks to the reference (a ``UserWarning`` once per backend instance and reason), where
neither kernel serves a call: for ``varlen_attn`` dtypes other than fp16/bf16, head dims
above 256 or ``D_v > D``, a window (finite ``left``) on the torch 2.10 form, and tensors not
on a CUDA device (torch's own kernel only; an injected ``varlen_attn``, as the tests use, is
trusted with any device); for the Triton kernels no ``triton`` package, fp64, or tensors not on a CUDA device (unless ``triton_kernels=True``
forces them, as the CPU tests do under ``TRITON_INTERPRET=1``).
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
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
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
        block_size: block size of the reference ops used for fallbacks.
        deterministic: the Triton backwards (sparse attention's dkv, the indexer loss's dk)
            sum by a key-major pass over an inverted index instead of fp32 atomics: bitwise
            reproducible run to run, slower.
        triton_kernels: None (default) runs cpkv's Triton kernels on CUDA tensors where
            ``triton`` is importable; False never runs them (reference ops instead); True runs
            them on any device (CPU needs ``TRITON_INTERPRET=1`` before triton is imported: tests).

    Raises:
        TypeError: ``varlen_attn`` is neither callable nor None; ``deterministic`` is not a
            bool or ``triton_kernels`` neither a bool nor None.
        RuntimeError: torch has no ``varlen_attn``, or its signature is neither the
            ``window_size`` form nor the torch 2.10 ``is_causal`` form.

    Example:
        >>> backend = CUDABackend(deterministic=True)  # doctest: +SKIP
        >>> layer(x_local, plan, group, backend=backend)  # doctest: +SKIP
    """

    name = "cuda"

    def __init__(
        self, varlen_attn: Callable[..., Any] | None = None, *, block_size: int = 1024,
        deterministic: bool = False, triton_kernels: bool | None = None,
    ) -> None:
        if varlen_attn is not None and not callable(varlen_attn):
            raise TypeError(
                "varlen_attn must be a callable like torch.nn.attention.varlen.varlen_attn, or None "
                f"(torch's own), got {varlen_attn!r}"
            )
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
        if not isinstance(deterministic, bool) or not (triton_kernels is None or isinstance(triton_kernels, bool)):
            raise TypeError(f"deterministic must be a bool and triton_kernels a bool or None, got {deterministic!r}, {triton_kernels!r}")
        self.deterministic = deterministic
        self._triton_kernels = triton_kernels

    def _warn(self, reason: str, what: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"CUDABackend: falling back to the reference {what} for {reason}", UserWarning, stacklevel=4)

    def _triton_reason(self, q: Tensor) -> str | None:
        """Why the Triton kernels cannot serve tensors like ``q``, or None."""
        from cpkv.backends import triton as triton_ops

        if self._triton_kernels is False:
            return "triton_kernels=False"
        if not triton_ops.is_available():
            return "no triton package (pip install triton)"
        if q.dtype not in TRITON_DTYPES:
            return f"dtype {q.dtype} (the Triton kernels take float16/bfloat16/float32)"
        if self._triton_kernels is None and q.device.type != "cuda":
            return f"device {q.device} (Triton kernels run on CUDA devices)"
        return None

    def _triton(self, q: Tensor, what: str) -> bool:
        """True when the Triton kernels serve this sparse primitive; else warn once and use the reference."""
        reason = self._triton_reason(q)
        if reason is not None:
            self._warn(reason, what)
        return reason is None

    def _flash_reason(self, q: Tensor, v: Tensor, window_size: tuple[int, int]) -> str | None:
        """Why ``varlen_attn`` cannot serve this call, or None."""
        reason = None
        if q.dtype not in KERNEL_DTYPES:
            reason = f"dtype {q.dtype} (flash kernels take float16/bfloat16)"
        elif q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > q.shape[-1]:
            reason = f"head dims D={q.shape[-1]}, D_v={v.shape[-1]} (flash kernels take D_v <= D <= {MAX_HEAD_DIM})"
        elif window_size not in (CAUSAL, FULL) and not self._window_form:
            reason = "a sliding window (this torch's varlen_attn has no window_size)"
        elif self._check_device and q.device.type != "cuda":
            reason = f"device {q.device} (varlen_attn has no kernel there)"
        return reason

    def _route(self, q: Tensor, k: Tensor, v: Tensor, window_size: tuple[int, int], prefer_triton: bool) -> str:
        """``"flash"``, ``"triton"`` (index-list sparse kernel) or ``"reference"`` (warned once) for a dense primitive."""
        flash_reason = self._flash_reason(q, v, window_size)
        triton_reason = self._triton_reason(q)
        if v.shape[-1] > q.shape[-1]:
            triton_reason = f"D_v={v.shape[-1]} > D={q.shape[-1]}"
        if flash_reason is None and (triton_reason is not None or not prefer_triton):
            return "flash"
        if triton_reason is None:
            return "triton"
        self._warn(flash_reason or triton_reason, "attention")
        return "reference"

    def _list_attention(
        self, q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, width: int, scale: float, sinks: Tensor | None
    ) -> AttentionResult:
        """Row ``t`` over kv rows ``[lo[t], hi[t])`` (at most ``width``) through the Triton sparse kernel.

        k ``[n, H_kv, D]``, v ``[n, H_kv, D_v]``: when v is a view of k's leading channels (shared KV, as
        in V4) the kv rows are k's; otherwise ``[v, k]`` with q zero-padded in front (exact,
        more work). Several kv heads (GQA/MHA) fold into the kernel's one shared head: query row
        ``(t, g)`` (kv head ``g``'s ``H / H_kv`` query heads) lists rows ``j * H_kv + g`` of the
        ``[n * H_kv, ...]`` kv, one launch for all heads; the sinks, which then differ per row,
        join from the kernel's differentiable LSE (``lse_s = logaddexp(lse, sink)``, ``out *
        exp(lse - lse_s)``), as for ``varlen_attn``.
        """
        from cpkv.backends.triton import sparse_attention_op

        (num_q, heads, _), heads_kv, d_v = q.shape, k.shape[1], v.shape[-1]
        kv = k
        leading = not torch.compiler.is_compiling() and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
        if not leading:  # values are not k's leading channels (or unknown while compiling): append them
            kv = torch.cat([v, k], -1)
            q = torch.cat([q.new_zeros((*q.shape[:2], d_v)), q], -1)  # zero weights on the value copy
        rows = lo.unsqueeze(1) + torch.arange(width, device=q.device)
        indices = torch.where(rows < hi.unsqueeze(1), rows, -1)
        if heads_kv == 1:
            out, lse = sparse_attention_op(q, kv[:, 0], indices, sinks, float(scale), d_v, self.deterministic)
            return AttentionResult(out, lse)
        group = heads // heads_kv
        folded_q = q.reshape(num_q * heads_kv, group, q.shape[-1])  # row t * H_kv + g: head g * G + i is (g, i)
        folded_kv = kv.reshape(kv.shape[0] * heads_kv, kv.shape[-1])
        offsets = torch.arange(heads_kv, device=q.device)
        folded = torch.where(indices[:, None, :] >= 0, indices[:, None, :] * heads_kv + offsets[None, :, None], -1)
        out, lse = sparse_attention_op(folded_q, folded_kv, folded.reshape(num_q * heads_kv, width), None, float(scale),
                                       d_v, self.deterministic)
        result = AttentionResult(out.reshape(num_q, heads, d_v), lse.reshape(num_q, heads))
        if sinks is None:
            return result
        lse_sink = torch.logaddexp(result.lse, sinks.to(result.lse.dtype))
        scaled = (result.out.to(lse_sink.dtype) * torch.exp(result.lse - lse_sink).unsqueeze(-1)).to(out.dtype)
        return AttentionResult(scaled, lse_sink)

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
        route = self._route(q, k, v, window_size, prefer_triton=window is not None and sinks is not None)
        if route == "reference" or q.shape[0] == 0:
            return self._reference.varlen_attention(q, k, v, segments, scale=scale, window=window, sinks=sinks)
        if route == "triton":
            hi = segments.q_kv_rows.to(q.device, torch.int64) + 1
            lo = segments.q_first_rows.to(q.device, torch.int64)
            width = segments.max_seqlen_kv if window is None else min(window, segments.max_seqlen_kv)
            lo = lo if window is None else torch.maximum(lo, hi - window)
            return self._list_attention(q, k, v, lo, hi, width, scale, sinks)
        call = self._call(segments.max_seqlen_q, segments.max_seqlen_kv, scale, window_size)
        cu_q = segments.cu_seqlens_q.to(device=q.device, dtype=torch.int32)
        cu_k = segments.cu_seqlens_kv.to(device=q.device, dtype=torch.int32)
        return _varlen_with_sinks(call, q, k, v, cu_q, cu_k, sinks)

    def range_attention(self, q: Tensor, k: Tensor, v: Tensor, ranges: KeyRanges, *, scale: float) -> AttentionResult:
        """One ring round through the kernel, in the :class:`~cpkv.backends.base.KeyRanges` kernel form.

        Query rows ``[0, num_rows)`` attend bottom-right aligned over all ``num_keys`` keys
        with ``window_size=(left, -1)``; the other rows see no key. Ranges without that form
        (``ranges.bottom_right`` False: a layout whose rounds span several documents) run the
        index-list Triton kernel over ``lo``/``hi``, else the reference.

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
        route = self._route(q, k, v, window_size, prefer_triton=False)
        if route == "flash" and not ranges.bottom_right:  # ranges of several documents: only lo/hi say them
            route = "triton" if self._triton_reason(q) is None else "reference"
        if route == "reference":
            return self._reference.range_attention(q, k, v, ranges, scale=scale)
        if route == "triton":
            lo, hi = ranges.lo.to(q.device, torch.int64), ranges.hi.to(q.device, torch.int64)
            return self._list_attention(q, k, v, lo, hi, num_keys, scale, None)
        cu = torch.tensor([[0, num_rows], [0, num_keys]], dtype=torch.int32, device=q.device)
        result = _varlen_with_sinks(self._call(num_rows, num_keys, scale, window_size), q[:num_rows], k, v, cu[0], cu[1], None)
        return _pad_rows(result, q.shape[0])

    def sparse_attention(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None,
    ) -> AttentionResult:
        """Shared-KV sparse attention with sinks through the Triton kernel (reference where it cannot serve).

        Args:
            q: ``[T, H, D]``. kv: ``[N, D]`` one shared head, values = its first ``d_v`` channels.
            indices: ``[T, K]`` int, -1 padded. Not validated (no host sync): on the Triton
                path any index outside ``[0, N)`` is padding, never read or written (the
                reference's validated ``sparse_attention`` raises for it). scale: softmax scale.
                sinks: ``[H]`` or None.

        Returns:
            ``AttentionResult(out [T, H, d_v] dtype of q, lse [T, H] fp32)``, differentiable
            (q, kv, sinks, also through the LSE); dkv deterministic with ``deterministic=True``.
        """
        if not self._triton(q, "sparse attention"):
            return self._reference.sparse_attention(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks)
        from cpkv.backends.triton import sparse_attention_op

        out, lse = sparse_attention_op(q, kv, indices, sinks, float(scale), d_v, self.deterministic)
        return AttentionResult(out, lse)

    def sparse_attention_probs(
        self, q: Tensor, kv: Tensor, indices: Tensor, *, d_v: int, scale: float, sinks: Tensor | None, probs_from: int,
    ) -> tuple[AttentionResult, Tensor]:
        """Sparse attention and the KL target of the columns ``>= probs_from`` from one Triton launch.

        ``cpkv_triton::sparse_attention_probs``: the forward keeps each step's ``exp(s - m)`` in
        L2 scratch and rescales it by the final LSE, so the target costs no second QK^T
        (the plain-Triton forward: the opt-in Gluon forward has no such output). Arguments as
        :meth:`sparse_attention`; ``probs`` ``[T, K - probs_from]`` fp32, no gradient.
        """
        if not self._triton(q, "sparse attention"):
            return self._reference.sparse_attention_probs(q, kv, indices, d_v=d_v, scale=scale, sinks=sinks,
                                                          probs_from=probs_from)
        from cpkv.backends.triton.ops import sparse_attention_probs_op

        out, lse, probs = sparse_attention_probs_op(q, kv, indices, sinks, float(scale), d_v, self.deterministic,
                                                    probs_from)
        return AttentionResult(out, lse), probs

    def selected_probs(self, q: Tensor, kv: Tensor, indices: Tensor, lse: Tensor, *, scale: float) -> Tensor:
        """``[T, K]`` fp32 head-summed probabilities of the listed rows from the sparse kernel's LSE (no gradient)."""
        if not self._triton(q, "selected probabilities"):
            return self._reference.selected_probs(q, kv, indices, lse, scale=scale)
        from cpkv.backends.triton import selected_probs_op

        result: Tensor = selected_probs_op(q.detach(), kv.detach(), indices, lse.detach(), float(scale))
        return result

    def indexer_topk(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, segments: SegmentPlan,
        visible: EntryVisibility, *, topk: int, fp8: bool = False,
    ) -> Tensor:
        """``[T, topk]`` int64 visible rows of ``k_index`` with the highest indexer scores (one Triton launch, no host sync).

        Scores on tensor cores and the exact running top-k per query tile
        (``cpkv_triton::indexer_topk``); ties go to the earlier row; -1 padded; no gradient.
        ``fp8`` (both inputs fp8-rounded, ``AttentionSpec.scores_in_fp8``): the rows are split
        back into their e4m3 payloads and fp32 scales (:func:`~cpkv.backends.triton.indexer_ops.fp8_rows`:
        the payloads exactly, the scales up to the compute dtype's rounding of the rounded
        rows), the queries' scales fold into ``weights`` and the kernel scores on fp8 tensor
        cores; else k_index is cast to q_index's dtype.
        """
        if not self._triton(q_index, "indexer top-k"):
            return self._reference.indexer_topk(q_index, k_index, weights, segments, visible, topk=topk, fp8=fp8)
        from cpkv.backends.triton.indexer_ops import fp8_rows, indexer_topk_op

        q, k, w, k_scale = q_index.detach(), k_index.detach().to(q_index.dtype), weights.detach(), None
        if fp8:
            q, q_scale = fp8_rows(q)
            k, k_scale = fp8_rows(k_index.detach())
            w = w.float() * q_scale
        indices, _ = indexer_topk_op(
            q, k, w, k_scale, visible.visible_start.to(q_index.device), visible.visible_count.to(q_index.device), topk,
        )
        result: Tensor = indices
        return result

    def indexer_kl(
        self, q_index: Tensor, k_index: Tensor, weights: Tensor, selected: Tensor, target: Tensor, grad_factor: float,
    ) -> tuple[Tensor, Tensor]:
        """``(loss, anchor)`` of the indexer KL on the Triton kernels (``cpkv_triton::indexer_kl``).

        The selected scores, and in the backward their recomputation, ``dq``, ``dw`` and
        ``dk``, run over the ``[T, K]`` selection only (never ``[T, N_c]``); ``dk`` is summed by
        fp32 atomics, or in a fixed key-major order with ``deterministic=True``. k_index is
        cast to q_index's dtype (differentiably). Contract: :func:`cpkv.indexer_loss.indexer_kl_op`.
        """
        if not self._triton(q_index, "indexer KL"):
            return self._reference.indexer_kl(q_index, k_index, weights, selected, target, grad_factor)
        from cpkv.backends.triton.indexer_ops import indexer_kl_op

        loss, anchor = indexer_kl_op(
            q_index, k_index.to(q_index.dtype), weights, selected, target, float(grad_factor), self.deterministic,
        )
        return loss, anchor


def _torch_varlen_attn() -> Callable[..., Any] | None:
    """torch's own ``varlen_attn``, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn
