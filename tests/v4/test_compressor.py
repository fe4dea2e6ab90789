"""The gated-pooling compressor against a literal per-document, per-block loop."""

import pytest
import torch

from cpkv.plan.segments import plan_segments
from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.v4 import Compressor, apply_rope


def loop_compressor(comp: Compressor, x: torch.Tensor, lengths: list[int]) -> torch.Tensor | None:
    """SEMANTICS section 5, written out with Python loops over documents, blocks and slots."""
    m, d = comp.ratio, comp.head_dim
    a_all = x.double() @ comp.wkv.weight.double().T
    z_all = x.double() @ comp.wgate.weight.double().T
    entries, positions, start = [], [], 0
    for n in lengths:
        for j in range(n // m):
            slots_a, slots_z = [], []
            for i in range(m):
                tok = start + j * m + i
                z = z_all[tok] + comp.ape[i].double()
                if comp.overlap:
                    if j == 0:
                        slots_a.insert(i, torch.zeros(d, dtype=torch.float64))
                        slots_z.insert(i, torch.full((d,), float("-inf"), dtype=torch.float64))
                    else:
                        prev = start + (j - 1) * m + i
                        slots_a.insert(i, a_all[prev, :d])
                        slots_z.insert(i, z_all[prev, :d] + comp.ape[i, :d].double())
                    slots_a.append(a_all[tok, d:])
                    slots_z.append(z[d:])
                else:
                    slots_a.append(a_all[tok])
                    slots_z.append(z)
            a, z = torch.stack(slots_a), torch.stack(slots_z)
            pooled = (torch.softmax(z, dim=0) * a).sum(0)
            pooled = pooled / torch.sqrt(pooled.pow(2).mean() + 1e-6) * comp.norm_weight.double()
            entries.append(pooled)
            positions.append(j * m)
        start += n
    if not entries:
        return None
    return apply_rope(torch.stack(entries), torch.tensor(positions), rope_dim=comp.rope_dim, base=comp.rope_base)


@pytest.mark.parametrize("ratio", [2, 4, 8])
def test_compressor_matches_loop(ratio: int) -> None:
    torch.manual_seed(0)
    lengths = [3, 0, 17, 8, 1, 12]
    comp = Compressor(16, 8, ratio, rope_dim=4, rope_base=100.0).double()
    x = torch.randn(sum(lengths), 16, dtype=torch.float64)
    cu = seqlens_to_cu_seqlens(lengths)
    segments = plan_segments(cu, cu, compress_ratios=[ratio])
    plan = segments.compressed[0]
    got = comp(x, plan)
    expected = loop_compressor(comp, x, lengths)
    assert got is not None and expected is not None
    assert segments.visible[0].cu_seqlens.tolist() == seqlens_to_cu_seqlens([n // ratio for n in lengths]).tolist()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_overlap_only_for_ratio_four_by_default() -> None:
    assert Compressor(8, 4, 4, rope_dim=2, rope_base=10.0).overlap
    assert not Compressor(8, 4, 8, rope_dim=2, rope_base=10.0).overlap
    assert Compressor(8, 4, 4, rope_dim=2, rope_base=10.0).wkv.weight.shape == (8, 8)


def test_no_full_block_returns_none() -> None:
    cu = seqlens_to_cu_seqlens([3, 0, 2])
    plan = plan_segments(cu, cu, compress_ratios=[4]).compressed[0]
    assert Compressor(8, 4, 4, rope_dim=2, rope_base=10.0)(torch.randn(5, 8), plan) is None


def test_prefix_entries_equal_full_document_entries() -> None:
    """Compressing a document's causal prefix gives the first entries of the whole document."""
    torch.manual_seed(1)
    comp = Compressor(16, 8, 4, rope_dim=4, rope_base=100.0).double()
    x = torch.randn(30, 16, dtype=torch.float64)
    full_cu = torch.tensor([0, 30])
    prefix_cu = torch.tensor([0, 13])
    full = comp(x, plan_segments(full_cu, full_cu, compress_ratios=[4]).compressed[0])
    prefix = comp(x[:13], plan_segments(prefix_cu, prefix_cu, compress_ratios=[4]).compressed[0])
    assert full is not None and prefix is not None and prefix.shape[0] == 3
    torch.testing.assert_close(prefix, full[:3], rtol=0, atol=0)
