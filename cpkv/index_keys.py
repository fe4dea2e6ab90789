"""The lightning indexer's keys (and queries) in the layer's dtypes: float32, bfloat16, or fp8 e4m3 with a scale.

DeepSeek's indexer keeps its keys in fp8 (e4m3) with one fp32 scale per key, and scores with
fp8 queries (one scale per token and head). A layer states the dtypes in
``AttentionSpec.index_key_dtype`` and ``AttentionSpec.index_query_dtype`` (queries are rounded
per ``(t, h)`` row by :func:`round_index_queries`, the keys' rounding; they never travel);
cpkv then applies the same rounding everywhere
(the single-process oracle, the all-gather exchange, the need exchange), so equivalence stays
exact, and the need exchange sends the keys in that format (docs/semantics.md, "The indexer
and its KL loss"):

* ``None``: the indexer's compute dtype (fp32, fp64 for fp64 inputs), no rounding;
* ``torch.float32`` / ``torch.bfloat16``: rounded to that dtype;
* ``torch.float8_e4m3fn``: per key ``scale = amax(|k|) / 448`` (fp32), payload ``k / scale`` in e4m3;
  on the wire one row is the ``D`` payload bytes followed by the scale's 4 bytes.

Rounding is straight-through for the gradient (the indexer learns as if unrounded). The
gradients of exchanged keys travel back in the compute dtype, so the indexer's parameter
gradients stay exactly those of one process (backward-only traffic of ``N_recv * D * 4`` bytes).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from cpkv.collectives import BackwardOrder, exchange_backward_op, exchange_sized_backward_op, group_name, resolve_group
from cpkv.plan.routes import Routes

INDEX_KEY_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
_CODES = {None: 0, torch.float32: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3}


def check_index_key_dtype(name: str, dtype: object) -> torch.dtype | None:
    """Return ``dtype`` if it is ``None`` or one of :data:`INDEX_KEY_DTYPES`, else raise ``ValueError``."""
    if dtype is not None and dtype not in INDEX_KEY_DTYPES:
        raise ValueError(f"{name} must be None or one of {INDEX_KEY_DTYPES}, got {dtype!r}")
    return dtype


def key_code(dtype: torch.dtype | None) -> int:
    """The integer code of a key dtype (what the custom ops take)."""
    return _CODES[dtype]


def _fp8_scale(keys: Tensor) -> Tensor:
    amax = keys.detach().abs().amax(-1, keepdim=True).float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def pack(keys: Tensor, code: int) -> Tensor:
    """Keys ``[N, D]`` -> their wire rows (fp32 ``[N, D]``, bf16 ``[N, D]``, or uint8 ``[N, D + 4]`` for fp8)."""
    if code == 3:
        scale = _fp8_scale(keys)
        payload = (keys.float() / scale).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.cat([payload, scale.contiguous().view(torch.uint8)], dim=1)
    return keys.to(torch.bfloat16 if code == 2 else torch.float32) if code else keys


def unpack(rows: Tensor, code: int, dim: int, dtype: torch.dtype) -> Tensor:
    """Wire rows -> keys ``[N, dim]`` in ``dtype`` (the inverse of :func:`pack`, up to its rounding)."""
    if code == 3:
        payload = rows[:, :dim].contiguous().view(torch.float8_e4m3fn).float()
        scale = rows[:, dim:].contiguous().view(torch.float32)
        return (payload * scale).to(dtype)
    return rows.to(dtype)


@torch.library.custom_op("cpkv::round_index_keys", mutates_args=())
def _round(keys: Tensor, code: int) -> Tensor:
    return unpack(pack(keys, code), code, keys.shape[-1], keys.dtype).clone()


@_round.register_fake
def _(keys: Tensor, code: int) -> Tensor:
    return torch.empty_like(keys)


def _round_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    return grad, None


_round.register_autograd(_round_backward)


def round_index_keys(keys: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``keys`` ``[N, D]`` after a round trip through ``dtype`` (same dtype as ``keys``; gradient straight through)."""
    if dtype is None:
        return keys
    result: Tensor = _round(keys, key_code(dtype))
    return result


def round_index_queries(queries: Tensor, dtype: torch.dtype | None) -> Tensor:
    """Indexer queries ``[T, H_I, D_I]`` rounded per ``(t, h)`` row as :func:`round_index_keys` rounds a key.

    fp8: one scale per token and head (``amax / 448`` over ``D_I``), DeepSeek's query format.
    Same dtype as ``queries``; gradient straight through; ``None``: ``queries`` itself.
    """
    if dtype is None:
        return queries
    return round_index_keys(queries.reshape(-1, queries.shape[-1]), dtype).reshape(queries.shape)


@torch.library.custom_op("cpkv::exchange_index_keys", mutates_args=())
def _exchange_keys(
    keys: Tensor, token: Tensor, send_rows: Tensor, send_splits: list[int], recv_splits: list[int], group: str, code: int
) -> tuple[Tensor, Tensor]:
    rows = pack(keys.index_select(0, send_rows), code).contiguous()
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows, list(recv_splits), list(send_splits), group=resolve_group(group))
    return unpack(out, code, keys.shape[-1], keys.dtype), token.new_zeros(())


@_exchange_keys.register_fake
def _(
    keys: Tensor, token: Tensor, send_rows: Tensor, send_splits: list[int], recv_splits: list[int], group: str, code: int
) -> tuple[Tensor, Tensor]:
    return keys.new_empty((sum(recv_splits), keys.shape[-1])), token.new_empty(())


def _exchange_keys_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    keys, _token, send_rows, ctx.send_splits, ctx.recv_splits, ctx.group, ctx.code = inputs
    ctx.num_rows = keys.shape[0]
    ctx.save_for_backward(send_rows)


def _exchange_keys_grad(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor | None, ...]:
    (send_rows,) = ctx.saved_tensors
    back, grad_token = exchange_backward_op(
        grad, grad_token, send_rows, ctx.num_rows, ctx.send_splits, ctx.recv_splits, ctx.group
    )
    return back, grad_token, None, None, None, None, None


_exchange_keys.register_autograd(_exchange_keys_grad, setup_context=_exchange_keys_setup)


@torch.library.custom_op("cpkv::exchange_index_keys_sized", mutates_args=())
def _exchange_keys_sized(
    keys: Tensor, token: Tensor, send_rows: Tensor, host_splits: Tensor, recv_shape: Tensor, group: str, code: int
) -> tuple[Tensor, Tensor]:
    send_splits, recv_splits = host_splits.tolist()  # host data of the plan: no device sync
    return _exchange_keys(keys, token, send_rows, send_splits, recv_splits, group, code)  # type: ignore[no-any-return]


@_exchange_keys_sized.register_fake
def _(
    keys: Tensor, token: Tensor, send_rows: Tensor, host_splits: Tensor, recv_shape: Tensor, group: str, code: int
) -> tuple[Tensor, Tensor]:
    return keys.new_empty((recv_shape.shape[0], keys.shape[-1])), token.new_empty(())


def _exchange_keys_sized_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    keys, _token, send_rows, host_splits, _shape, ctx.group, _code = inputs
    ctx.num_rows = keys.shape[0]
    ctx.save_for_backward(send_rows, host_splits)


def _exchange_keys_sized_grad(ctx: Any, grad: Tensor, grad_token: Tensor) -> tuple[Tensor | None, ...]:
    send_rows, host_splits = ctx.saved_tensors
    back, grad_token = exchange_sized_backward_op(grad, grad_token, send_rows, ctx.num_rows, host_splits, ctx.group)
    return back, grad_token, None, None, None, None, None


_exchange_keys_sized.register_autograd(_exchange_keys_sized_grad, setup_context=_exchange_keys_sized_setup)


def exchange_index_keys(
    keys: Tensor, routes: Routes, group: Any, dtype: torch.dtype | None, *, order: BackwardOrder | None = None
) -> Tensor:
    """Send indexer keys ``[N, D]`` along ``routes`` in the wire format of ``dtype``; return the received keys.

    The received keys equal ``round_index_keys`` of the sender's keys, in ``keys.dtype``.
    Backward: gradients go back along the same routes, in ``keys.dtype``.
    """
    if not torch.compiler.is_compiling() and not routes.any_traffic:  # compiled: no branch on the packing
        return keys.new_zeros((0, *keys.shape[1:]))
    token = order.token if order is not None else keys.new_zeros((), dtype=torch.float32)
    if torch.compiler.is_compiling() and routes.host_splits is not None and routes.recv_shape is not None:
        out, token = _exchange_keys_sized(  # compiled: no int of the packing in the graph
            keys, token, routes.send_rows.to(keys.device), routes.host_splits, routes.recv_shape, group_name(group),
            key_code(dtype),
        )
    else:
        out, token = _exchange_keys(
            keys, token, routes.send_rows.to(keys.device), list(routes.send_splits), list(routes.recv_splits),
            group_name(group), key_code(dtype),
        )
    if order is not None:
        order.token = token
    received: Tensor = out
    return received
