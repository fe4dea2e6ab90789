"""Import cpkv's Triton kernels under Triton's CPU interpreter (a helper of the ``test_triton_*`` files).

``tests/backends/conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported;
:func:`interpreted_kernels` checks that it took effect (skips otherwise, naming the cause) and
applies ``benchmarks/interpreter_patch.py`` in the test process: Triton 3.6's interpreter
turns runtime loop bounds into ints with ``int(size-1 array)`` (an error since NumPy 2.4), and
runs bf16 on its raw uint16 patterns (``tl.dot`` multiplies the integers); the patch fixes both,
so the kernels run in bf16 (and fp8) as on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from interpreter_patch import patch_interpreter  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


def interpreted_kernels() -> ModuleType:
    """:mod:`cpkv.backends.triton.kernels`, every kernel an interpreted (CPU) function, or a skip."""
    import cpkv.backends.triton.kernels as kernels

    if not isinstance(kernels.sparse_fwd_kernel, interpreter.InterpretedFunction):
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (see tests/backends/conftest.py)")
    patch_interpreter()
    return kernels
