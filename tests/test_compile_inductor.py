"""Inductor compiles the compressed-layer pieces once over changing sizes (issue 47).

Two mechanisms of inductor (not of Dynamo or AOTAutograd alone, so tests/test_compile_packings.py,
which runs ``aot_eager``, cannot see them), each checked on the smallest piece that shows it, with
``torch.fx.experimental._config.backed_size_oblivious`` set as the docs ask:

* a saved activation ``[T, K]`` whose ``K`` is dynamic has a symbolic stride, which AOTAutograd
  fixes to its first value under ``backed_size_oblivious`` (the compiled backward then asserts
  ``stride 13 == 14`` at the next width): the sparse op saves its indices flat. Checked: the
  reference sparse attention compiled over index widths 6, 5, 9, against eager.
* a slice's backward scatters into zeros, and inductor's reinplacing of that scatter guards on the
  sliced tensor's first size being below 2 or not: the compressor splits its halves instead.
  Checked: the overlapping (ratio 4) compressor compiled over 1, 3, 0 and 2 blocks keeps one graph,
  cpkv's own and Hugging Face's CSA compressor through cpkv's adapter (where transformers is installed).

Inductor on CPU needs a C++ compiler: skipped without one. One spawn of its own (Dynamo's
configuration stays out of the other tests' processes).
"""

from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from cpkv.launch import spawn

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor on CPU needs a C++ compiler")


def _over_block_counts(
    pooler: Any, params: torch.nn.Module, width: int, head_dim: int, gen: torch.Generator
) -> tuple[list[float], list[int]]:
    """``pooler`` (x ``[N_in, width]``, a ratio-4 ``CompressedPlan``) compiled with inductor over 1, 3, 0, 2
    blocks: per step the max abs difference (output, input and parameter gradients) to eager, and the graphs."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from cpkv.plan.segments import CompressedPlan

    def pool(x: torch.Tensor, plan: CompressedPlan) -> torch.Tensor:
        out: torch.Tensor | None = pooler(x, plan)
        return out if out is not None else x.new_zeros(0, head_dim)  # eager: None for no block

    compiled = torch.compile(pool, fullgraph=True, backend="inductor")
    torch._dynamo.reset()
    counters.clear()
    errors, graphs = [], []
    for blocks in (1, 3, 0, 2):
        starts = torch.arange(blocks, dtype=torch.int64) * 4 + 4
        plan = CompressedPlan(ratio=4, block_starts=starts, entry_positions=starts - 4, num_entries=blocks)
        x = torch.randn(4 * blocks + 6, width, generator=gen)
        results = []
        for fn in (compiled, pool):
            params.zero_grad(set_to_none=True)
            leaf = x.clone().requires_grad_(True)
            for t in (leaf, starts, plan.entry_positions):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            out = fn(leaf, plan)
            if out.requires_grad:  # eager's stand-in for no block has no graph
                out.sum().backward()
            grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (leaf, *params.parameters())]
            results.append([out.detach(), *grads])
        errors.append(max(float((c - e).abs().max()) if c.numel() else 0.0 for c, e in zip(*results)))
        graphs.append(int(counters["stats"]["unique_graphs"]))
    return errors, graphs


def _runs(rank: int, world: int) -> dict[str, Any]:
    import torch._dynamo
    import torch._functorch.config
    import torch._inductor.config
    import torch.fx.experimental._config
    from torch._dynamo.utils import counters

    from cpkv.backends.reference import ReferenceBackend
    from cpkv.v4.compressor import Compressor

    torch.fx.experimental._config.backed_size_oblivious = True
    torch._inductor.config.fx_graph_cache = False  # compile what the ops are now, not a cached graph
    torch._functorch.config.enable_autograd_cache = False
    gen = torch.Generator().manual_seed(0)
    ops = ReferenceBackend()

    def sparse(q: torch.Tensor, kv: torch.Tensor, window: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        indices = torch.cat([window, extra], dim=1)  # a saved activation [T, 2 + K], K dynamic
        out: torch.Tensor = ops.sparse_attention(q, kv, indices, d_v=3, scale=0.5, sinks=None).out
        return out

    errors, graphs = [], []
    compiled = torch.compile(sparse, fullgraph=True, backend="inductor")
    torch._dynamo.reset()
    counters.clear()
    for width in (6, 5, 9):
        q, kv = torch.randn(7, 2, 4, generator=gen), torch.randn(12, 4, generator=gen)
        window = torch.randint(-1, 12, (7, 2), generator=gen)
        extra = torch.randint(-1, 12, (7, width), generator=gen)
        torch._dynamo.maybe_mark_dynamic(extra, 1)
        grad = torch.randn(7, 2, 3, generator=gen)
        results = []
        for fn in (compiled, sparse):
            leaves = [q.clone().requires_grad_(True), kv.clone().requires_grad_(True)]
            out = fn(*leaves, window, extra)
            out.backward(grad)
            results.append([out.detach(), *(x.grad for x in leaves)])
        errors.append(max(float((c - e).abs().max()) for c, e in zip(*results)))
        graphs.append(int(counters["stats"]["unique_graphs"]))
    report: dict[str, Any] = {"sparse_errors": errors, "sparse_graphs": graphs}

    comp = Compressor(8, 4, 4, rope_dim=2, rope_base=10.0)
    assert comp.overlap
    errors, graphs = _over_block_counts(comp, comp, 8, comp.head_dim, gen)
    report.update(compressor_errors=errors, compressor_graphs=graphs)
    try:
        from cpkv.bench.hf_compile import hf_model
        from cpkv.integrations.transformers import DeepseekV4Compressor
    except ImportError:  # no transformers>=5.23: the Hugging Face compressor is not checked
        return report
    model = hf_model()
    layer = next(layer for layer in model.model.layers if layer.self_attn.layer_type == "compressed_sparse_attention")
    module = layer.self_attn.compressor
    errors, graphs = _over_block_counts(DeepseekV4Compressor(module), module, module.kv_proj.in_features, module.head_dim, gen)
    report.update(hf_errors=errors, hf_graphs=graphs)
    return report


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    result: dict[str, Any] = spawn(_runs, 1, timeout=400.0)[0]
    return result


@pytest.mark.timeout(420)
def test_sparse_attention_backward_over_index_widths(report: dict[str, Any]) -> None:
    # fp32 against fp32 eager: the same ops (the custom op is opaque to inductor), so round-off only
    assert max(report["sparse_errors"]) <= 1e-5, report
    assert report["sparse_graphs"][-1] <= 2, report


@pytest.mark.timeout(420)
def test_compressor_keeps_one_graph_over_block_counts(report: dict[str, Any]) -> None:
    # fp32 against fp32 eager, fused differently by inductor: round-off of a few ulps of O(1) values
    assert max(report["compressor_errors"]) <= 1e-5, report
    assert report["compressor_graphs"][-1] == 1, report


@pytest.mark.timeout(420)
def test_hf_compressor_keeps_one_graph_over_block_counts(report: dict[str, Any]) -> None:
    if "hf_graphs" not in report:
        pytest.skip("transformers>=5.23 (the transformers/test extra) is missing")
    # Hugging Face's CSA compressor through cpkv's adapter, the same mechanism as the compressor's
    assert max(report["hf_errors"]) <= 1e-5, report
    assert report["hf_graphs"][-1] == 1, report
