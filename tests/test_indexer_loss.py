"""The indexer KL loss attached to a sparse attention: gradients, grad_scale in ctx, threads.

The attention is composed as the pipeline does it: ``sparse_attention``, then
``sparse_attention_head_probs`` of the selected columns, then ``attach_indexer_loss``. The
oracle is plain autograd of ``grad_scale * sum_t KL(p_t || softmax(I_t)) / N`` with a dense
float64 target built from explicit softmax probabilities (sink included).
"""

import threading

import pytest
import torch

from cpkv.backends.reference import sparse_attention, sparse_attention_head_probs
from cpkv.indexer_loss import IndexerLoss, attach_indexer_loss

T, H, D, DV, HI, DI, NC, W, K = 12, 3, 8, 6, 2, 5, 7, 3, 4
SCALE = D**-0.5


def make_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    n_kv = T + NC
    window = torch.stack([torch.arange(t - W + 1, t + 1) for t in range(T)])
    window = torch.where(window >= 0, window, -1)
    selected = torch.stack([torch.randperm(NC, generator=gen)[:K] for _ in range(T)])
    selected[0] = -1  # a query with nothing selected
    selected[1, 2:] = -1  # a partly padded row
    indices = torch.cat([window, torch.where(selected >= 0, selected + T, -1)], dim=1)
    return {
        "q": rnd(T, H, D), "kv": rnd(n_kv, D), "sinks": rnd(H), "q_index": rnd(T, HI, DI),
        "k_index": rnd(NC, DI), "weights": rnd(T, HI), "indices": indices, "selected": selected,
    }


def oracle_kl(inp: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    """sum_t KL(p_t || softmax(I_t)) with the target from an explicit dense softmax."""
    q, kv, idx = inp["q"].detach(), inp["kv"].detach(), inp["indices"]
    keys = kv[idx.clamp(min=0)]
    scores = torch.einsum("thd,tkd->thk", q, keys) * scale
    scores = scores.masked_fill((idx < 0)[:, None, :], float("-inf"))
    with_sink = torch.cat([scores, inp["sinks"].detach()[None, :, None].expand(T, H, 1)], dim=-1)
    probs = torch.softmax(with_sink, dim=-1)[..., :-1].sum(1)[:, W:]
    sel = inp["selected"]
    valid = sel >= 0
    picked = probs.masked_fill(~valid, 0)
    total = 0 * inp["weights"].sum()
    for t in range(T):
        if not bool(valid[t].any()):
            continue
        target = picked[t][valid[t]] / picked[t][valid[t]].sum()
        rows = sel[t][valid[t]]
        dots = torch.einsum("hd,kd->hk", inp["q_index"][t], inp["k_index"][rows]).relu()
        index_scores = (inp["weights"][t][:, None] * dots).sum(0)
        total = total + (target * (target.log() - torch.log_softmax(index_scores, 0))).sum()
    return total


def attach(inp: dict[str, torch.Tensor], grad_scale: float, n_global: int) -> IndexerLoss:
    """Sparse attention over window + selected entries, with the KL loss attached to its output."""
    attn = sparse_attention(inp["q"], inp["kv"], inp["indices"], d_v=DV, scale=SCALE, sinks=inp["sinks"])
    probs = sparse_attention_head_probs(inp["q"], inp["kv"], inp["indices"], attn.lse, scale=SCALE)
    return attach_indexer_loss(
        attn.out, inp["q_index"], inp["k_index"], inp["weights"], inp["selected"], probs[:, W:],
        grad_scale=grad_scale, num_global_queries=n_global,
    )


def run(inp: dict[str, torch.Tensor], grad_scale: float, n_global: int) -> torch.Tensor:
    res = attach(inp, grad_scale, n_global)
    res.out.sum().backward()
    return res.loss


INDEXER_INPUTS = ("q_index", "k_index", "weights")
ATTN_INPUTS = ("q", "kv", "sinks")


@pytest.mark.parametrize(("grad_scale", "n_global"), [(1.0, T), (3.5, 4 * T)])
def test_gradients_equal_plain_autograd(grad_scale: float, n_global: int) -> None:
    inp = make_inputs(0)
    loss = run(inp, grad_scale, n_global)
    ref = make_inputs(0)
    kl = oracle_kl(ref, SCALE)
    attn = sparse_attention(ref["q"], ref["kv"], ref["indices"], d_v=DV, scale=SCALE, sinks=ref["sinks"])
    (attn.out.sum() + grad_scale * kl / n_global).backward()
    assert float(loss) == pytest.approx(float(kl.detach()), rel=1e-6)
    for name in INDEXER_INPUTS + ATTN_INPUTS:
        torch.testing.assert_close(inp[name].grad, ref[name].grad, rtol=1e-9, atol=1e-12, msg=name)
    assert float(inp["q_index"].grad.abs().max()) > 0


def _indexer_grads(grad_scale: float) -> dict[str, torch.Tensor]:
    inp = make_inputs(1)
    run(inp, grad_scale, T)
    return {n: inp[n].grad.clone() for n in INDEXER_INPUTS}


def test_two_calls_in_one_graph_keep_their_own_scale() -> None:
    unit = _indexer_grads(1.0)
    a, b = make_inputs(1), make_inputs(1)
    outs = []
    for inp, scale in ((a, 2.0), (b, 5.0)):
        outs.append(attach(inp, scale, T).out)
    (outs[0].sum() + outs[1].sum()).backward()
    for name in INDEXER_INPUTS:
        torch.testing.assert_close(a[name].grad, 2.0 * unit[name], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(b[name].grad, 5.0 * unit[name], rtol=1e-12, atol=1e-14)


def test_backward_from_two_threads_does_not_mix_scales() -> None:
    unit = _indexer_grads(1.0)
    results: dict[float, dict[str, torch.Tensor]] = {}
    barrier = threading.Barrier(2)

    def worker(scale: float) -> None:
        barrier.wait()
        for _ in range(5):
            results[scale] = _indexer_grads(scale)

    threads = [threading.Thread(target=worker, args=(s,)) for s in (0.5, 7.0)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for scale in (0.5, 7.0):
        for name in INDEXER_INPUTS:
            torch.testing.assert_close(results[scale][name], scale * unit[name], rtol=1e-12, atol=1e-14)


def test_out_unchanged_and_loss_detached() -> None:
    """``out`` keeps its value and its gradient; ``loss`` is detached (its gradient is ignored)."""
    inp = make_inputs(3)
    attn = sparse_attention(inp["q"], inp["kv"], inp["indices"], d_v=DV, scale=SCALE, sinks=inp["sinks"])
    res = attach(inp, 1.0, T)
    assert torch.equal(res.out, attn.out)
    assert res.loss.dim() == 0 and res.loss.dtype == torch.float32 and not res.loss.requires_grad
    assert float(res.loss) == pytest.approx(float(oracle_kl(inp, SCALE).detach()), rel=1e-6)


def test_padding_never_touches_k_index_row_0() -> None:
    """A NaN in k_index row 0, referenced only by -1 padding, changes nothing."""
    inp, ref = make_inputs(4), make_inputs(4)
    sel = inp["selected"]
    for x in (inp, ref):
        x["selected"] = torch.where(sel == 0, -1, sel)  # row 0 is never selected
        x["indices"][:, W:] = torch.where(x["selected"] >= 0, x["selected"] + T, -1)
    with torch.no_grad():
        inp["k_index"][0] = float("nan")
    run(inp, 1.0, T)
    run(ref, 1.0, T)
    assert torch.equal(inp["k_index"].grad[0], torch.zeros(DI, dtype=torch.float64))
    for name in INDEXER_INPUTS:
        torch.testing.assert_close(inp[name].grad, ref[name].grad, rtol=0, atol=0, msg=name)


def test_shapes_are_checked() -> None:
    inp = make_inputs(2)
    with pytest.raises(ValueError, match="selected_probs"):
        attach_indexer_loss(
            inp["q"], inp["q_index"], inp["k_index"], inp["weights"], inp["selected"], torch.zeros(T, K + 1),
            grad_scale=1.0, num_global_queries=T,
        )
    with pytest.raises(ValueError, match="num_global_queries"):
        attach_indexer_loss(
            inp["q"], inp["q_index"], inp["k_index"], inp["weights"], inp["selected"], torch.zeros(T, K),
            grad_scale=1.0, num_global_queries=0,
        )
