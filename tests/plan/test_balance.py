"""layout="balanced": the V4 cost model against a per-key count, and the partitioner against brute force."""

import pytest
import torch

from cpkv.bench.traffic import lognormal_cu_seqlens
from cpkv.plan.balance import COST_SLACK, CostModel, balanced_layout, rank_costs
from cpkv.plan.conventions import seqlens_to_cu_seqlens
from cpkv.plan.layouts import ShardLayout, contiguous_layout, layout_from_ranges

SMALL = CostModel(heads=2, head_dim=3, value_dim=5, window=6, index_topk=3, index_heads=7, index_head_dim=2,
                  csa_ratio=4, hca_ratio=16, swa_layers=1, csa_layers=2, hca_layers=3, causal_layers=1,
                  dense=(("a", 40), ("b", 3)), per_token=0.5)


def _counted_cost(model: CostModel, p: int) -> float:
    """One query at position p, key by key: what each layer attends and what the indexer scores."""
    window = sum(1 for key in range(p + 1) if p - key < model.window)
    csa_entries = sum(1 for j in range(p + 1) if (j + 1) * model.csa_ratio - 1 <= p)  # blocks ending at or before p
    hca_entries = sum(1 for j in range(p + 1) if (j + 1) * model.hca_ratio - 1 <= p)
    attend = model.heads * (model.head_dim + model.value_dim)
    swa = attend * window
    csa = attend * (window + min(model.index_topk, csa_entries)) + model.index_heads * model.index_head_dim * csa_entries
    hca = attend * (window + hca_entries)
    causal = attend * (p + 1)
    attention = model.swa_layers * swa + model.csa_layers * csa + model.hca_layers * hca + model.causal_layers * causal
    dense = sum(macs for _, macs in model.dense)
    return (1 + model.attention_backward) * attention + (1 + model.backward) * dense + model.per_token


def _brute_rank_costs(layout: ShardLayout, model: CostModel) -> torch.Tensor:
    """Every rank's cost summed token by token over its local tokens (independent of rank_costs' closed form)."""
    cu = layout.cu_seqlens
    out = []
    for rank in range(layout.cp_size):
        tokens = layout.local_tokens(rank)
        positions = tokens - cu[torch.searchsorted(cu[1:], tokens, right=True)]
        out.append(float(model.token_costs(positions).sum()))
    return torch.tensor(out, dtype=torch.float64)


def _check_bookkeeping(layout: ShardLayout, cu: torch.Tensor, cp: int) -> None:
    total = int(cu[-1])
    every = torch.cat([layout.local_tokens(r) for r in range(cp)])
    assert torch.equal(every.sort().values, torch.arange(total))  # every token exactly once
    assert sum(layout.local_lens) == total
    for rank in range(cp):
        starts, ends = layout.ranges_of(rank)
        assert bool((ends > starts).all()) and bool((starts[1:] >= ends[:-1]).all())  # non-empty, sorted
        doc_first = torch.searchsorted(cu[1:], starts, right=True)
        doc_last = torch.searchsorted(cu[1:], ends - 1, right=True)
        assert torch.equal(doc_first, doc_last)  # inside one document
    again = layout_from_ranges(cu, cp, layout.starts, layout.ends, layout.ranks)  # already normal
    assert torch.equal(again.starts, layout.starts) and torch.equal(again.ranks, layout.ranks)


@pytest.mark.parametrize("model", [CostModel(), SMALL], ids=["v4-flash", "small"])
def test_token_costs_count_every_key_and_scored_entry(model: CostModel) -> None:
    positions = torch.arange(700)
    expected = torch.tensor([_counted_cost(model, p) for p in positions.tolist()], dtype=torch.float64)
    assert torch.equal(model.token_costs(positions), expected)  # integers (and halves) < 2**53: exact
    assert torch.equal(model.token_costs(positions.view(7, 100).int()), expected.view(7, 100))


@pytest.mark.parametrize("model", [CostModel(), SMALL], ids=["v4-flash", "small"])
def test_prefix_costs_is_the_cumulative_token_cost(model: CostModel) -> None:
    counts = torch.tensor([0, 1, 2, 5, 127, 128, 129, 2047, 2048, 2049, 4100, 20000])
    costs = model.token_costs(torch.arange(20000))
    expected = torch.cat([torch.zeros(1, dtype=torch.float64), costs.cumsum(0)])[counts]
    assert torch.equal(model.prefix_costs(counts), expected)  # integer sums < 2**53: exact in float64


def test_the_default_model_is_v4_flash_and_grows_with_position() -> None:
    model = CostModel()
    assert (model.csa_layers, model.hca_layers, model.swa_layers) == (20, 23, 0)  # DeepseekV4Config().layer_types
    assert model.key_cost == 64 * 1024 and model.index_cost == 64 * 128
    assert 13.2e9 < model.dense_macs < 13.3e9  # the "about 13.2 G forward MACs of dense work per token"
    contiguous = rank_costs(contiguous_layout(torch.tensor([0, 1 << 20]), 8))
    assert bool((contiguous.diff() > 0).all()) and float(contiguous.max() / contiguous.mean()) > 1.5


@pytest.mark.parametrize("cp", [8, 16, 32, 64])
def test_one_long_document_is_balanced_in_cost_and_tokens(cp: int) -> None:
    cu = torch.tensor([0, 1 << 20])
    layout = balanced_layout(cu, cp)
    _check_bookkeeping(layout, cu, cp)
    brute = _brute_rank_costs(layout, CostModel())
    # The closed form agrees with the token sum up to float64 summation (1e-12 relative).
    torch.testing.assert_close(rank_costs(layout), brute, rtol=1e-12, atol=0)
    assert float(brute.max() / brute.mean()) <= 1.02  # the target
    # Rounding to whole tokens: a rank is off its target by at most about two tokens' cost.
    assert float((brute - brute.mean()).abs().max()) <= 2 * float(CostModel().token_costs(cu[-1:] - 1))
    lens = torch.tensor(layout.local_lens, dtype=torch.float64)
    assert float(lens.max() / lens.mean()) <= 1.01  # head-tail pairs: ~1/cp of the tokens each
    assert int(layout.offsets.diff().max()) <= 2


@pytest.mark.parametrize("cp", [8, 32, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lognormal_packs_are_balanced(cp: int, seed: int) -> None:
    cu = lognormal_cu_seqlens(16384 * cp + 13, 2048, seed=seed)  # T not divisible by cp
    model = CostModel()
    layout = balanced_layout(cu, cp, model)
    _check_bookkeeping(layout, cu, cp)
    brute = _brute_rank_costs(layout, model)
    torch.testing.assert_close(rank_costs(layout, model), brute, rtol=1e-12, atol=0)
    assert float(brute.max() / brute.mean()) <= 1.02
    # Each rank is its share within COST_SLACK (cuts placed to move fewer rows) and two tokens' rounding.
    longest = float(model.token_costs(torch.tensor([int(cu.diff().max()) - 1])))
    assert float((brute - brute.mean()).abs().max()) <= COST_SLACK * float(brute.mean()) + 2 * longest
    # Only documents that cross a boundary of the cost line are cut: at most cp - 1 of them.
    holders = torch.zeros(cu.numel() - 1, dtype=torch.int64).index_add_(0, layout.documents, torch.ones_like(layout.documents))
    assert int((holders > 1).sum()) <= cp - 1


def test_per_token_cost_balances_tokens() -> None:
    cu = lognormal_cu_seqlens(8 * 4096, 512, seed=3)
    tokens_only = CostModel(swa_layers=0, csa_layers=0, hca_layers=0, dense=(), per_token=1.0)
    layout = balanced_layout(cu, 8, tokens_only)
    assert max(layout.local_lens) - min(layout.local_lens) <= 1  # cost = tokens: equal tokens
    _check_bookkeeping(layout, cu, 8)


@pytest.mark.parametrize("lengths,cp", [
    ([0, 5, 0, 0, 300, 0], 4),  # empty documents
    ([3, 1, 2], 8),  # documents shorter than cp, fewer tokens than ranks
    ([1], 4),  # a single token
    ([1000, 7, 333], 3),  # T not divisible by cp
    ([17, 0, 400], 1),  # cp 1
    ([0], 4), ([], 2),  # no tokens
])
def test_edge_cases_keep_every_token_once(lengths: list[int], cp: int) -> None:
    cu = seqlens_to_cu_seqlens(lengths, dtype=torch.int64) if lengths else torch.zeros(1, dtype=torch.int64)
    layout = balanced_layout(cu.int(), cp, SMALL)
    assert layout.cp_size == cp and layout.starts.dtype == torch.int64
    _check_bookkeeping(layout, cu, cp)
    torch.testing.assert_close(rank_costs(layout, SMALL), _brute_rank_costs(layout, SMALL), rtol=1e-12, atol=0)
    if cp == 1:
        assert layout.local_lens == (int(cu[-1]),)


def test_bad_arguments_name_the_argument() -> None:
    cu = torch.tensor([0, 10, 20])
    with pytest.raises(TypeError, match="cu_seqlens"):
        balanced_layout(cu.float(), 2)
    with pytest.raises(ValueError, match="cu_seqlens"):
        balanced_layout(torch.tensor([0, 10, 5]), 2)
    with pytest.raises(ValueError, match="cp_size"):
        balanced_layout(cu, 0)
    with pytest.raises(TypeError, match="cp_size"):
        balanced_layout(cu, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cost"):
        balanced_layout(cu, 2, "v4")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="layout"):
        rank_costs(cu)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CostModel.window"):
        CostModel(window=0)
    with pytest.raises(ValueError, match="CostModel.csa_ratio"):
        CostModel(csa_ratio=1)
    with pytest.raises(TypeError, match="CostModel.heads"):
        CostModel(heads=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CostModel.per_token"):
        CostModel(per_token=-1.0)
    with pytest.raises(TypeError, match="CostModel.per_token"):
        CostModel(per_token="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cost something"):
        CostModel(swa_layers=0, csa_layers=0, hca_layers=0, dense=())
    with pytest.raises(ValueError, match="positions"):
        CostModel().token_costs(torch.tensor([3, -1]))
    with pytest.raises(TypeError, match="positions"):
        CostModel().token_costs(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="counts"):
        CostModel().prefix_costs(torch.tensor([-2]))
