"""plan_from_packed_seq_params against TransformerEngine's documented THD zigzag split.

TransformerEngine (``thd_get_partitioned_indices``, used by Megatron's
``get_thd_batch_on_this_cp_rank``) cuts every padded document into ``2 * cp`` chunks and
gives rank ``r`` chunks ``r`` and ``2cp-1-r``; the real tokens are each padded document's
first ``cu_seqlens_q`` length. The expectations below are written with plain loops over
documents, independently of cpkv's sharding code.
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

FIELDS = ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
          "max_seqlen_q", "max_seqlen_kv")


def _packed_seq_params_class() -> Any:
    with warnings.catch_warnings():  # megatron.core warns that TransformerEngine and Apex are missing
        warnings.simplefilter("ignore")
        module = pytest.importorskip("megatron.core.packed_seq_params", reason="megatron-core (test extra) is missing")
    return module.PackedSeqParams


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
        assert packed.plan.layout == "zigzag"
        assert packed.plan.local_len == len(tokens) == sum(padded) // cp
        assert packed.cu_seqlens.tolist() == _cu(padded).tolist()
        assert packed.plan.q_positions.tolist() == positions
        assert packed.real_rows.dtype == torch.int64
        assert packed.real_rows.tolist() == [row for row, r in enumerate(is_real) if r]
        # The plan is plan_attention's zigzag plan of the padded batch, nothing else.
        ref = plan_attention(_cu(padded), cp, rank, layout="zigzag")
        assert torch.equal(packed.plan.gather_rows, ref.gather_rows)
        shards.append(tokens)
    # Every padded-batch token lives on exactly one rank.
    assert sorted(t for shard in shards for t in shard) == list(range(sum(padded)))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_unpadded_batch_is_contiguous(cp: int) -> None:
    real = [0, 3, 5 * cp - 3, 0, 2 * cp]
    for rank in range(cp):
        packed = plan_from_packed_seq_params(_params(real, None), cp, rank)
        assert packed.plan.layout == "contiguous"
        assert packed.real_rows.tolist() == list(range(sum(real) // cp))
        assert packed.cu_seqlens is not None and packed.cu_seqlens.tolist() == _cu(real).tolist()


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_layout_override_and_plan_options_pass_through(cp: int) -> None:
    real = [2 * cp, 0, 6 * cp]
    zigzag = plan_from_packed_seq_params(_params(real, None), cp, cp - 1, layout="zigzag")
    assert zigzag.plan.layout == "zigzag" and zigzag.real_rows.numel() == zigzag.plan.local_len
    tokens, positions, _ = _te_zigzag(real, real, cp, cp - 1)
    assert zigzag.plan.q_positions.tolist() == positions
    need = plan_from_packed_seq_params(_params(real, None), cp, 0, exchange="need", windows=[4], compress_ratios=[4])
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
         ValueError, "divisible by 2\\*cp_size"),
        (dict(cu_seqlens_q_padded=torch.tensor([0, 4, 8]), cu_seqlens_kv_padded=torch.tensor([0, 4, 8])),
         ValueError, "padded length >= the real one"),
        (dict(local_cp_size=4), ValueError, "local_cp_size"),
    ],
)
def test_invalid_params_name_the_field(overrides: dict[str, Any], error: type[Exception], match: str) -> None:
    params = _params([3, 5], [4, 8], **overrides)
    with pytest.raises(error, match=match):
        plan_from_packed_seq_params(params, 2, 0)


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
    if sum(real) % cp == 0:
        assert plan_from_packed_seq_params(unpadded, cp, 0).plan.layout == "contiguous"
