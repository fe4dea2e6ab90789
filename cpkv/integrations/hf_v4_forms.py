"""What cpkv reads from Hugging Face's DeepSeek-V4 modules, and the forms it adapts.

Minor releases of ``transformers`` change the internals of their modules (5.25 renamed
``DeepseekV4UnweightedRMSNorm.eps`` to ``variance_epsilon``). The adapter
(:mod:`cpkv.integrations.transformers`, :mod:`cpkv.integrations.transformers_lm`) reads
only what is declared here, and reads whose form differs between the tested releases go
through an accessor here (:func:`rms_norm_eps`). :func:`check_deepseek_v4_forms`, which
:func:`~cpkv.integrations.transformers_lm.enable_deepseek_v4_cp` calls once before any
collective, checks every declared read of every attention module, so an untested release
that moved one fails with one error naming the installed version, the tested range and the
piece, on every rank, instead of an ``AttributeError`` inside a layer.

Tested: :data:`TESTED_TRANSFORMERS` (CI runs the lowest and the newest release pip resolves).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "TESTED_TRANSFORMERS",
    "check_deepseek_v4_forms",
    "deepseek_v4_form_problems",
    "rms_norm_eps",
]

TESTED_TRANSFORMERS: tuple[str, str] = ("5.23.0", "5.25.0")
"""The lowest and highest ``transformers`` releases cpkv's Hugging Face integration is tested with."""

_EPS_NAMES = ("variance_epsilon", "eps")  # 5.25 (both norms), 5.23-5.24 (the unweighted one)


def rms_norm_eps(norm: Any) -> float:
    """The epsilon of a ``DeepseekV4RMSNorm`` / ``DeepseekV4UnweightedRMSNorm``, in any tested release.

    Raises:
        RuntimeError: ``norm`` has neither ``variance_epsilon`` nor ``eps`` as a number.
    """
    for name in _EPS_NAMES:
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise RuntimeError(_message([f"{type(norm).__name__}: no epsilon ({' or '.join(_EPS_NAMES)}, a float)"]))


class _Read(NamedTuple):
    """One attribute path the adapter reads, and the form it needs (``want`` names it in errors)."""

    path: str
    want: str
    ok: Callable[[Any], bool]


def _linear(x: Any) -> bool:
    w = getattr(x, "weight", None)
    return callable(x) and isinstance(w, Tensor) and w.ndim == 2 and all(
        isinstance(getattr(x, a, None), int) for a in ("in_features", "out_features"))


def _norm(x: Any) -> bool:
    return isinstance(getattr(x, "weight", None), Tensor) and _has_eps(x)


def _has_eps(x: Any) -> bool:
    return any(isinstance(getattr(x, n, None), (int, float)) for n in _EPS_NAMES)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _rotary(x: Any) -> bool:
    kinds = getattr(x, "rope_type", None)
    return isinstance(kinds, dict) and all(
        t in kinds and isinstance(getattr(x, f"{t}_inv_freq", None), Tensor)
        and _number(getattr(x, f"{t}_attention_scaling", None)) for t in ("main", "compress"))


def _reads(*rows: tuple[str, str, Callable[[Any], bool]]) -> tuple[_Read, ...]:
    return tuple(_Read(*r) for r in rows)


_LINEAR, _NORM = "a Linear (2-D weight, in_features, out_features)", "an RMSNorm (weight, and variance_epsilon or eps)"
_POOLER = _reads(
    ("compress_rate", "an int", _int), ("head_dim", "an int", _int), ("kv_proj", _LINEAR, _linear),
    ("gate_proj", _LINEAR, _linear), ("position_bias", "a tensor", lambda x: isinstance(x, Tensor)),
    ("kv_norm", _NORM, _norm),
)
COMPRESSOR_READS = _POOLER + _reads(("rotary_emb", "a DeepseekV4RotaryEmbedding (rope_type, *_inv_freq, *_attention_scaling)", _rotary))
INDEXER_READS = COMPRESSOR_READS + _reads(
    ("q_b_proj", _LINEAR, _linear), ("num_heads", "an int", _int),
    ("scorer.softmax_scale", "a float", _number), ("scorer.weights_scaling", "a float", _number),
    ("scorer.weights_proj", _LINEAR, _linear),
)
ATTENTION_READS = _reads(
    ("q_a_proj", _LINEAR, _linear), ("q_a_norm", _NORM, _norm), ("q_b_proj", _LINEAR, _linear),
    ("q_b_norm", "an unweighted RMSNorm (variance_epsilon or eps)", _has_eps),
    ("kv_proj", _LINEAR, _linear), ("kv_norm", _NORM, _norm), ("o_a_proj", _LINEAR, _linear),
    ("o_b_proj", _LINEAR, _linear), ("sinks", "a [heads] tensor", lambda x: isinstance(x, Tensor) and x.ndim == 1),
    ("layer_type", "a str", lambda x: isinstance(x, str)), ("layer_idx", "an int", _int),
    ("num_heads", "an int", _int), ("head_dim", "an int", _int), ("scaling", "a float", _number),
    ("sliding_window", "an int", _int), ("config.index_topk", "an int", _int), ("config.o_groups", "an int", _int),
    ("config.attention_dropout", "a float", _number),
    ("compressor", "None or a compressor module", lambda x: x is None or isinstance(x, torch.nn.Module)),
)
"""Every read of a ``DeepseekV4Attention`` (``COMPRESSOR_READS`` / ``INDEXER_READS``: of its compressor and indexer)."""

_FORWARD_ARGS = ("hidden_states", "position_embeddings", "position_ids", "attention_mask")  # passed by position


def _get(obj: Any, path: str) -> tuple[bool, Any]:
    for name in path.split("."):
        if not hasattr(obj, name):
            return False, None
        obj = getattr(obj, name)
    return True, obj


def _problems(obj: Any, reads: Iterable[_Read], where: str) -> list[str]:
    out = []
    for read in reads:
        found, value = _get(obj, read.path)
        if not found:
            out.append(f"{where}.{read.path}: missing ({read.want})")
        elif not read.ok(value):
            out.append(f"{where}.{read.path}: {type(value).__name__} {value!r:.60}, not {read.want}")
    return out


def _forward_problems(module: Any, where: str) -> list[str]:
    names = list(inspect.signature(type(module).forward).parameters)[1:5]
    return [] if tuple(names) == _FORWARD_ARGS else [
        f"{where}.forward: its first arguments are {names}, not {list(_FORWARD_ARGS)}"]


def deepseek_v4_form_problems(module: Any, where: str = "module", *, forward: bool = True) -> list[str]:
    """What of ``module`` (a ``DeepseekV4Attention``) is not in a form cpkv adapts: one line each, empty if none.

    Checks every attribute and submodule the adapter reads (:data:`ATTENTION_READS`, and its
    compressor's and indexer's), and with ``forward`` that Hugging Face's forward takes the
    arguments cpkv passes on by position. Host-side attribute reads only.

    Args:
        module: the attention module. where: its name in the lines (e.g. ``model.layers.3.self_attn``).
        forward: check the forward's signature too.
    """
    problems = _problems(module, ATTENTION_READS, where)
    compressor = getattr(module, "compressor", None)
    if isinstance(compressor, torch.nn.Module):
        problems += _problems(compressor, COMPRESSOR_READS, f"{where}.compressor")
        indexer = getattr(compressor, "indexer", None)
        if indexer is not None:
            problems += _problems(indexer, INDEXER_READS, f"{where}.compressor.indexer")
    if forward:
        problems += _forward_problems(module, where)
    return problems


def _version() -> str:
    try:
        import transformers
    except ImportError:
        return "not installed"
    return str(transformers.__version__)


def _message(problems: list[str]) -> str:
    low, high = TESTED_TRANSFORMERS
    shown = problems[:8] + ([f"... and {len(problems) - 8} more"] if len(problems) > 8 else [])
    return (
        f"cpkv cannot adapt this Hugging Face DeepSeek-V4 model: installed transformers {_version()}; cpkv's"
        f" integration is tested with transformers {low} through {high}. Install a tested release"
        f" (pip install 'transformers>={low},<={high}') or report the change. Not in the form cpkv adapts:\n  "
        + "\n  ".join(shown)
    )


def check_deepseek_v4_forms(attention: Iterable[tuple[str, Any]], rotary_emb: Any = None, *, forward: bool = True) -> None:
    """Raise unless every named attention module (and the model's rotary embedding) is in a form cpkv adapts.

    Args:
        attention: ``(name, DeepseekV4Attention)`` pairs (``model.named_modules()`` names).
        rotary_emb: the model's ``DeepseekV4RotaryEmbedding``; ``None``: not checked.
        forward: check each module's forward signature too (:func:`deepseek_v4_form_problems`).

    Raises:
        RuntimeError: naming the installed ``transformers`` version, the tested range
            (:data:`TESTED_TRANSFORMERS`) and each missing or changed piece. The same on every
            rank (the check reads the module structure only, before any collective).
    """
    seen: dict[str, None] = {}
    if rotary_emb is not None and not _rotary(rotary_emb):
        seen["model.rotary_emb: not a DeepseekV4RotaryEmbedding (rope_type, *_inv_freq, *_attention_scaling)"] = None
    for name, module in attention:
        for line in deepseek_v4_form_problems(module, name or "model", forward=forward):
            seen[line] = None
    if seen:
        raise RuntimeError(_message(list(seen)))
