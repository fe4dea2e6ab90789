"""plan_from_packed_seq_params against TransformerEngine's documented THD zigzag split and Megatron's RoPE.

TransformerEngine (``thd_get_partitioned_indices``, used by Megatron's
``get_thd_batch_on_this_cp_rank``) cuts every document of the padded cu_seqlens (of
``cu_seqlens_q`` when they are unset) into ``2 * cp`` chunks and gives rank ``r`` chunks
``r`` and ``2cp-1-r``; the real tokens are each padded document's first ``cu_seqlens_q``
length. The expectations below are written with plain loops over documents, independently
of cpkv's sharding code. TransformerEngine is not installed (and
``get_thd_batch_on_this_cp_rank`` asserts it at cp > 1), so Megatron itself is consulted
through its pure-torch THD RoPE (``apply_rotary_pos_emb`` with ``apply_rope_fusion=False``),
which assumes the same per-rank order: it yields each local row's document position, and,
given one frequency per packed token, the row's packed token index.
"""

from __future__ import annotations

import dataclasses
import random
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cpkv import plan_attention
from cpkv.integrations.megatron import PackedPlan, plan_from_packed_seq_params
from cpkv.plan.sharding import shard_zigzag_tnd

FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
          "max_seqlen_q", "max_seqlen_kv")


def _packed_seq_params_class() -> Any:
    with warnings.catch_warnings():  # megatron.core warns that TransformerEngine and Apex are missing
        warnings.simplefilter("ignore")
        module = pytest.importorskip("megatron.core.packed_seq_params", reason="megatron-core (test extra) is missing")
    return module.PackedSeqParams


class _CPGroup:
    """The two methods Megatron's THD RoPE calls on its ``cp_group``."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _megatron_rope_rows(cu_seqlens: torch.Tensor, cp: int, rank: int) -> tuple[list[int], list[int]]:
    """(packed token index, document position) of each of ``rank``'s rows, read back from Megatron's THD RoPE.

    The input rows are ``[1, 0]`` rotated by ``freqs[p] = p * 2**-12`` (float64, angles below
    pi for p < 12800): ``atan2`` of the output recovers ``p`` to ~1e-12, far below the 0.5 that
    rounding tolerates. With ``len(freqs) == T`` Megatron indexes ``freqs`` by packed token
    ("exact mapping"), otherwise by position within the document.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rope = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils", reason="megatron-core is missing")
        config_module = pytest.importorskip("megatron.core.transformer.transformer_config")
        config = config_module.TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, apply_rope_fusion=False)
    total = int(cu_seqlens[-1])
    rows = torch.zeros(total // cp, 1, 2, dtype=torch.float64)
    rows[..., 0] = 1.0
    step = 2.0**-12
    out = []
    for n in (total, total + 1):
        freqs = (torch.arange(n, dtype=torch.float64) * step).view(n, 1, 1, 1).expand(n, 1, 1, 2).contiguous()
        rotated = rope.apply_rotary_pos_emb(rows, freqs, config, cu_seqlens=cu_seqlens, cp_group=_CPGroup(cp, rank))
        out.append(torch.round(torch.atan2(rotated[:, 0, 1], rotated[:, 0, 0]) / step).long().tolist())
    return out[0], out[1]


def _cu(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def _params(real: list[int], padded: list[int] | None, **overrides: Any) -> SimpleNamespace:
    cu, cu_padded = _cu(real), None if padded is None else _cu(padded)
    fields: dict[str, Any] = dict(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu.clone(), cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=None if cu_padded is None else cu_padded.clone(),
        max_seqlen_q=max(real, default=0), max_seqlen_kv=max(real, default=0),
    )
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _batch(cp: int, seed: int) -> tuple[list[int], list[int]]:
    """Real lengths (zero-length documents included) and TE's padding to multiples of 2*cp."""
    rng = random.Random(seed)
    real = [rng.choice([0, 1, 2 * cp - 1, 2 * cp, rng.randint(1, 9 * cp)]) for _ in range(rng.randint(1, 6))]
    padded = [(n + 2 * cp - 1) // (2 * cp) * (2 * cp) for n in real]
    if seed % 2:  # TE may also pad a document by whole extra chunks, or pad an empty one
        padded = [p + 2 * cp * rng.randint(0, 1) for p in padded]
    return real, padded


def _te_zigzag(real: list[int], padded: list[int], cp: int, rank: int) -> tuple[list[int], list[int], list[int]]:
    """Rank ``rank``'s rows under TE: (padded-batch token, position in its document, is real) per row."""
    tokens, positions, is_real = [], [], []
    start = 0
    for n_real, n_padded in zip(real, padded):
        chunk = n_padded // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            for i in range(c * chunk, (c + 1) * chunk):
                tokens.append(start + i)
                positions.append(i)
                is_real.append(int(i < n_real))
        start += n_padded
    return tokens, positions, is_real


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(6))
def test_padded_batch_is_te_zigzag(cp: int, seed: int) -> None:
    real, padded = _batch(cp, seed)
    shards = []
    for rank in range(cp):
        packed = plan_from_packed_seq_params(_params(real, padded), cp, rank)
        tokens, positions, is_real = _te_zigzag(real, padded, cp, rank)
        layout = "zigzag" if cp > 1 else "contiguous"  # at cp 1 both hold every token in order
        assert packed.plan.layout == layout
        assert packed.plan.local_len == len(tokens) == sum(padded) // cp
        assert packed.cu_seqlens.tolist() == _cu(padded).tolist()
        assert packed.plan.q_positions.tolist() == positions
        assert packed.real_rows.dtype == torch.int64
        assert packed.real_rows.tolist() == [row for row, r in enumerate(is_real) if r]
        # The plan is plan_attention's plan of the padded batch, nothing else.
        ref = plan_attention(_cu(padded), cp, rank, layout=layout)
        if ref.gather_rows is None:
            assert packed.plan.gather_rows is None
        else:
            assert packed.plan.gather_rows is not None and torch.equal(packed.plan.gather_rows, ref.gather_rows)
        assert torch.equal(packed.plan.q_positions, ref.q_positions)
        shards.append(tokens)
    # Every padded-batch token lives on exactly one rank.
    assert sorted(t for shard in shards for t in shard) == list(range(sum(padded)))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_unpadded_batch_is_te_zigzag(cp: int) -> None:
    """Without padded cu_seqlens Megatron still shards per document in zigzag at cp > 1 (issue 17)."""
    real = [0, 2 * cp, 6 * cp, 0, 4 * cp]
    shards = []
    for rank in range(cp):
        packed = plan_from_packed_seq_params(_params(real, None), cp, rank)
        tokens, positions, _ = _te_zigzag(real, real, cp, rank)
        assert packed.plan.layout == ("zigzag" if cp > 1 else "contiguous")
        assert packed.plan.q_positions.tolist() == positions
        assert packed.real_rows.tolist() == list(range(sum(real) // cp))
        assert packed.cu_seqlens.tolist() == _cu(real).tolist()
        shards.append(tokens)
    assert sorted(t for shard in shards for t in shard) == list(range(sum(real)))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_plan_matches_megatron_rope(cp: int, padded: bool) -> None:
    """Megatron's own per-rank token order (its THD RoPE over the cu_seqlens it plans on) is the plan's."""
    real = [2 * cp, 0, 6 * cp - (2 * cp - 1 if padded else 0), 4 * cp]
    padded_lengths = [(n + 2 * cp - 1) // (2 * cp) * (2 * cp) for n in real] if padded else None
    params = _params(real, padded_lengths)
    # Megatron's attention passes cu_seqlens_q_padded to RoPE when set, else cu_seqlens_q.
    cu = params.cu_seqlens_q if params.cu_seqlens_q_padded is None else params.cu_seqlens_q_padded
    total = int(cu[-1])
    for rank in range(cp):
        packed = plan_from_packed_seq_params(params, cp, rank)
        megatron_tokens, megatron_positions = _megatron_rope_rows(cu, cp, rank)
        assert packed.plan.q_positions.tolist() == megatron_positions
        assert shard_zigzag_tnd(torch.arange(total), packed.cu_seqlens, cp, rank).tolist() == megatron_tokens
        assert megatron_tokens == _te_zigzag(real, padded_lengths or real, cp, rank)[0]


@pytest.mark.parametrize("cp", [2, 3])
def test_zigzag_lengths_not_multiples_of_2cp_name_the_field(cp: int) -> None:
    real = [2 * cp, 2 * cp + 1, 2 * cp - 1]
    with pytest.raises(ValueError, match="params.cu_seqlens_q:") as unpadded:
        plan_from_packed_seq_params(_params(real, None), cp, 0)
    message = str(unpadded.value)
    for part in (f"2*cp_size = {2 * cp}", "document 1", f"length {2 * cp + 1}", "cu_seqlens_q_padded",
                 "layout='contiguous'"):
        assert part in message
    padded = [2 * cp, 4 * cp, 2 * cp + 2]
    with pytest.raises(ValueError, match="params.cu_seqlens_q_padded:") as in_padded:
        plan_from_packed_seq_params(_params(real, padded), cp, cp - 1)
    assert "document 2" in str(in_padded.value) and f"length {2 * cp + 2}" in str(in_padded.value)
    # Asked for explicitly, the contiguous layout plans the same batch (T = 6cp is divisible by cp).
    contiguous = plan_from_packed_seq_params(_params(real, None), cp, 0, layout="contiguous")
    assert contiguous.plan.layout == "contiguous" and contiguous.real_rows.tolist() == list(range(6))


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_layout_override_and_plan_options_pass_through(cp: int) -> None:
    real = [2 * cp, 0, 6 * cp]
    zigzag = plan_from_packed_seq_params(_params(real, None), cp, cp - 1, layout="zigzag")
    assert zigzag.plan.layout == "zigzag" and zigzag.real_rows.numel() == zigzag.plan.local_len
    tokens, positions, _ = _te_zigzag(real, real, cp, cp - 1)
    assert zigzag.plan.q_positions.tolist() == positions
    # Unpadded batch laid out contiguously on request: rank r holds packed tokens [r*T/cp, (r+1)*T/cp).
    unpadded = plan_from_packed_seq_params(_params(real, None), cp, cp - 1, layout="contiguous")
    starts = [0, 2 * cp, 2 * cp]
    contiguous_positions = [t - max(s for s in starts if s <= t) for t in range((cp - 1) * 8, cp * 8)]
    assert unpadded.plan.layout == "contiguous" and unpadded.plan.q_positions.tolist() == contiguous_positions
    need = plan_from_packed_seq_params(
        _params(real, None), cp, 0, layout="contiguous", exchange="need", windows=[4], compress_ratios=[4]
    )
    assert (need.plan.exchange, need.plan.windows, need.plan.compress_ratios) == ("need", (4,), (4,))
    # Padded batch laid out contiguously on request: padding rows still named.
    contiguous = plan_from_packed_seq_params(_params([1, 3], [4 * cp, 4 * cp]), cp, 0, layout="contiguous")
    assert contiguous.plan.layout == "contiguous"
    local = range(8)  # rank 0 holds padded-batch tokens [0, 8cp / cp)
    expected = [row for row, t in enumerate(local) if (t < 4 * cp and t < 1) or (t >= 4 * cp and t - 4 * cp < 3)]
    assert contiguous.real_rows.tolist() == expected


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (dict(qkv_format="sbhd"), ValueError, "qkv_format"),
        (dict(cu_seqlens_kv=torch.tensor([0, 2, 8], dtype=torch.int32)), ValueError, "cu_seqlens_kv must equal"),
        (dict(cu_seqlens_kv_padded=torch.tensor([0, 8, 12], dtype=torch.int32)), ValueError, "cu_seqlens_kv_padded"),
        (dict(cu_seqlens_kv_padded=None), ValueError, "cu_seqlens_kv_padded"),
        (dict(cu_seqlens_q=None), ValueError, "cu_seqlens_q must be set"),
        (dict(cu_seqlens_q=torch.tensor([0.0, 3.0, 8.0])), TypeError, "cu_seqlens_q"),
        (dict(cu_seqlens_q=[0, 3, 8]), TypeError, "cu_seqlens_q"),
        (dict(cu_seqlens_q_padded=torch.tensor([0, 4, 10]), cu_seqlens_kv_padded=torch.tensor([0, 4, 10])),
         ValueError, "params.cu_seqlens_q_padded: layout='zigzag'.* multiple of 2\\*cp_size = 4"),
        (dict(cu_seqlens_q=torch.tensor([1, 3, 8]), cu_seqlens_kv=torch.tensor([1, 3, 8])),
         ValueError, "params.cu_seqlens_q must start with 0"),
        (dict(cu_seqlens_kv=torch.tensor([0, 5, 3])), ValueError, "params.cu_seqlens_kv must be non-decreasing"),
        (dict(cu_seqlens_q_padded=torch.tensor([[0, 4, 12]])), ValueError, "params.cu_seqlens_q_padded must have shape"),
        (dict(cu_seqlens_kv_padded=torch.tensor([], dtype=torch.int64)), ValueError,
         "params.cu_seqlens_kv_padded must hold at least the leading 0"),
        (dict(layout="contiguous", cu_seqlens_q_padded=torch.tensor([0, 4, 9]),
              cu_seqlens_kv_padded=torch.tensor([0, 4, 9])),
         ValueError, "params.cu_seqlens_q_padded: layout='contiguous' needs the packed token count divisible"),
        (dict(layout="bshd"), ValueError, "layout must be None or one of"),
        (dict(cu_seqlens_q_padded=torch.tensor([0, 4, 8]), cu_seqlens_kv_padded=torch.tensor([0, 4, 8])),
         ValueError, "padded length >= the real one"),
        (dict(local_cp_size=4), ValueError, "local_cp_size"),
    ],
)
def test_invalid_params_name_the_field(overrides: dict[str, Any], error: type[Exception], match: str) -> None:
    overrides = dict(overrides)
    layout = overrides.pop("layout", None)
    params = _params([3, 5], [4, 8], **overrides)
    with pytest.raises(error, match=match):
        plan_from_packed_seq_params(params, 2, 0, layout=layout)


def test_missing_attribute_is_a_type_error() -> None:
    params = _params([3, 5], None)
    del params.cu_seqlens_kv
    with pytest.raises(TypeError, match="cu_seqlens_kv"):
        plan_from_packed_seq_params(params, 2, 0)


def test_field_names_match_megatron() -> None:
    fields = {f.name for f in dataclasses.fields(_packed_seq_params_class())}
    assert set(FIELDS) <= fields


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_real_packed_seq_params(cp: int) -> None:
    cls = _packed_seq_params_class()
    real, padded = _batch(cp, seed=3)
    cu, cu_padded = _cu(real), _cu(padded)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        params = cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                     cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    for rank in range(cp):
        packed = plan_from_packed_seq_params(params, cp, rank)
        assert isinstance(packed, PackedPlan)
        _, positions, is_real = _te_zigzag(real, padded, cp, rank)
        assert packed.plan.q_positions.tolist() == positions
        assert packed.real_rows.tolist() == [row for row, r in enumerate(is_real) if r]
    unpadded = cls(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(real), max_seqlen_kv=max(real))
    if cp == 1:
        assert plan_from_packed_seq_params(unpadded, cp, 0).plan.layout == "contiguous"
    else:  # these real lengths are not all multiples of 2cp: Megatron's zigzag cannot shard them
        assert any(n % (2 * cp) for n in real)
        with pytest.raises(ValueError, match="params.cu_seqlens_q: layout='zigzag'"):
            plan_from_packed_seq_params(unpadded, cp, 0)
