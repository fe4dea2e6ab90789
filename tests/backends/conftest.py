"""Setup of tests/backends: the ``test_triton_*`` files run cpkv's Triton kernels on CPU.

Triton reads ``TRITON_INTERPRET`` when it decorates its kernels (its own standard library's
included), that is when ``triton`` is first imported, which torch does lazily (for example
with ``torch._dynamo``). Collection imports this file before any test runs, so setting it
here makes every Triton kernel of the session an interpreted one (torch on CPU compiles with
its C++ backend and never launches Triton). Set ``TRITON_INTERPRET=0`` yourself to opt out.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
