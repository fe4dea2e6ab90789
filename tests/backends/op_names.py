"""A dispatch mode that records the name of every aten and custom op that runs under it (tests' view of a call)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpNames(TorchDispatchMode):
    """``with OpNames() as ops: ...`` then ``ops.names``: e.g. ``["aten.detach", "cpkv_triton.indexer_topk"]``, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))
