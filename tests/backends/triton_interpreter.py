"""Import cpkv's Triton kernels under Triton's CPU interpreter (a helper of the ``test_triton_*`` files).

``tests/backends/conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported;
:func:`interpreted_kernels` checks that it took effect (skips otherwise, naming the cause).
Triton 3.6's interpreter turns runtime loop bounds into ints with ``int(size-1 array)``, an
error since NumPy 2.4; the helper patches that one conversion (in the test process only).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("triton")

from triton.runtime import interpreter  # noqa: E402


def _patch_index() -> None:
    if getattr(interpreter, "_cpkv_index_patch", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._cpkv_index_patch = True


def interpreted_kernels() -> ModuleType:
    """:mod:`cpkv.backends.triton.kernels`, every kernel an interpreted (CPU) function, or a skip."""
    import cpkv.backends.triton.kernels as kernels

    if not isinstance(kernels.sparse_fwd_kernel, interpreter.InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (see tests/backends/conftest.py)")
    _patch_index()
    return kernels
