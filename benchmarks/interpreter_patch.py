"""Fixes to Triton 3.6's CPU interpreter (``TRITON_INTERPRET=1``) for the tests and the check scripts' ``--smoke``.

Never imported by the ``cpkv`` package: ``tests/backends/triton_interpreter.py`` and the
``--smoke`` modes of ``benchmarks/*check.py`` call :func:`patch_interpreter` in their own
process. It patches, once (idempotent, marked on Triton's interpreter module):

* ``int()`` of a runtime loop bound: the interpreter calls ``int(size-1 array)``, an error
  since NumPy 2.4.
* bf16. The interpreter stores bf16 as its raw ``uint16`` bit patterns and does not convert
  them: ``tl.dot`` multiplies the integers, arithmetic, comparisons and reductions act on the
  integers, there is no bf16 constant (``'InterpreterBuilder' object has no attribute
  'get_bf16'``), and a cast to bf16 truncates instead of rounding. Patched as a GPU computes:

  - ``tl.dot``: bf16 operands widened exactly to fp32 (bf16 -> fp32 is a 16-bit shift of
    the pattern; the products of two bf16 values are exact in fp32, as on tensor cores),
    accumulated in the dot's accumulator dtype; fp8 operands as the interpreter already
    does (widened to fp16, accumulated in the accumulator dtype); other dtypes untouched.
  - casts to bf16 round to nearest even (NaN stays NaN), from bf16 are exact.
  - float arithmetic, comparisons, math functions, ``tl.fma``, ``tl.clamp`` on bf16: computed
    in fp32 and rounded once to bf16 (what Triton's lowering does on sm_90; for one add or
    multiply of two bf16 values this is the correctly rounded bf16 result).
  - bf16 constants (``get_bf16``, e.g. a bf16 tile times a Python float).
  - a reduction or scan over bf16 raises ``NotImplementedError`` instead of reducing the
    integers (``tl.sum``, ``tl.max``, ``tl.min`` promote bf16 to fp32 first and never get
    there; a raw ``tl.reduce`` of bf16 would round each partial to bf16 in the GPU's own tree
    order, which the interpreter cannot reproduce).

fp8 loads, stores and casts were already right (bit-level conversions with rounding). Not
emulated: casts from fp64 to bf16 round twice (through fp32); bf16 atomics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

_MARK = "_cpkv_interpreter_patch"
_FLOAT_BINARY = (
    "create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem", "create_precise_divf",
    "create_minimumf", "create_minnumf", "create_maximumf", "create_maxnumf",
    "create_fcmpOLT", "create_fcmpOGT", "create_fcmpOLE", "create_fcmpOGE", "create_fcmpOEQ", "create_fcmpONE",
    "create_fcmpULT", "create_fcmpUGT", "create_fcmpULE", "create_fcmpUGE", "create_fcmpUEQ", "create_fcmpUNE",
)
_FLOAT_UNARY = (
    "create_exp", "create_exp2", "create_log", "create_log2", "create_sqrt", "create_precise_sqrt", "create_rsqrt",
    "create_sin", "create_cos", "create_floor", "create_ceil", "create_erf",
)
_FLOAT_OTHER = ("create_fma", "create_clampf")


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """Exact: bf16 patterns (``uint16``) -> fp32 values (the pattern shifted into the high half)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def fp32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """fp32 values -> bf16 patterns (``uint16``), rounded to nearest even; NaN -> a quiet NaN of the same sign."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    u = x.view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((u >> 16) | np.uint32(0x40)).astype(np.uint16), rounded)


def patch_interpreter() -> None:
    """Apply the fixes above to Triton's interpreter in this process (once; later calls do nothing)."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, _MARK, False):
        return
    _patch_index(interpreter)
    _patch_bf16(interpreter, tl)
    setattr(interpreter, _MARK, True)


def _patch_index(interpreter: Any) -> None:
    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _patch_bf16(interpreter: Any, tl: Any) -> None:
    handle_cls, builder = interpreter.TensorHandle, interpreter.InterpreterBuilder
    bf16, fp32 = tl.bfloat16, tl.float32

    def is_bf16(h: Any) -> bool:
        return isinstance(h, handle_cls) and h.dtype == bf16

    def widen(h: Any) -> Any:
        return handle_cls(bf16_bits_to_fp32(h.data), fp32) if is_bf16(h) else h

    def narrow(h: Any) -> Any:
        """An fp32 result back to bf16 (booleans, e.g. comparisons, stay as they are)."""
        if h.data.dtype != np.float32:
            return handle_cls(h.data, bf16) if h.data.dtype == np.bool_ else h
        return handle_cls(fp32_to_bf16_bits(h.data), bf16)

    def in_fp32(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any) -> Any:
            if not any(is_bf16(a) for a in args):
                return method(self, *args)
            return narrow(method(self, *(widen(a) for a in args)))
        return run

    for name in _FLOAT_BINARY + _FLOAT_UNARY + _FLOAT_OTHER:
        setattr(builder, name, in_fp32(getattr(builder, name)))

    cast_impl = builder.cast_impl

    def cast(self: Any, src: Any, dst_type: Any) -> Any:
        dst = dst_type.scalar
        if is_bf16(src):
            return handle_cls(src.data, bf16) if dst == bf16 else cast_impl(self, widen(src), dst_type)
        if dst == bf16:
            data = src.data if src.data.dtype == np.float32 else src.data.astype(np.float32)
            return handle_cls(fp32_to_bf16_bits(data), bf16)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = cast  # create_fp_ext, create_fp_trunc, ... call self.cast_impl
    create_dot = builder.create_dot

    def dot(self: Any, a: Any, b: Any, acc: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        out = create_dot(self, widen(a), widen(b), widen(acc), input_precision, max_num_imprecise_acc)
        return narrow(out) if is_bf16(acc) else out

    builder.create_dot = dot
    builder.get_bf16 = lambda self, value: handle_cls(fp32_to_bf16_bits(np.array([value], np.float32)), bf16)
    _refuse_bf16_reductions(interpreter, tl)


def _refuse_bf16_reductions(interpreter: Any, tl: Any) -> None:
    for ops in (interpreter.ReduceOps, interpreter.ScanOps):
        def apply_impl(self: Any, inputs: Any, original: Callable[..., Any] = ops.apply_impl) -> Any:
            if any(x.dtype == tl.bfloat16 for x in inputs):
                raise NotImplementedError("interpreter_patch: a reduction or scan over bf16 is not emulated "
                                          "(reduce in fp32, as tl.sum, tl.max and tl.min do)")
            return original(self, inputs)

        ops.apply_impl = apply_impl
