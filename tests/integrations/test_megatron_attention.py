"""CPKVCoreAttention inside real megatron-core layers at cp 2 (gloo, fp64) against the whole batch in one process.

The 2-rank group shared with the other test modules (tests/shared_spawn.py: spawning and
importing megatron-core cost seconds) runs every multi-rank check. Each check builds a
megatron-core layer from Megatron's local (non-TE) spec twice: with :class:`CPKVCoreAttention`
at cp 2 on a padded THD batch (every document padded at its end to a multiple of 2*cp, laid
out in Megatron's per-document zigzag, RoPE applied by Megatron's attention over the padded
cu_seqlens), and, with the same weights, with :class:`DenseCoreAttention` (below: Megatron's
unfused softmax math, its ``SoftmaxOne`` for the offsets and its
``is_layer_window_attention``, dense per document) at cp 1 in one process on the *unpadded*
batch. The padding rows of the cp run hold random junk. Compared: the real rows' outputs, the
real rows' input gradients (padding rows must get exactly zero), and every parameter gradient
summed over the CP ranks (what CP gradient reduction computes). The loss is
``sum(out[real] * w)`` with fixed random ``w``, so every output row feeds it. The block check runs two
micro-batches, each with its plan carried in its ``packed_seq_params`` (``with_plan``), both
forwards under activation checkpointing before one backward. A V4 INDEXER layer (cpkv.v4) at
cp 2 on a padded batch planned from ``PackedSeqParams`` checks that padding does not count in
the indexer loss.

The kv heads: a sweep of 16-query-head layers over 1 (MQA), 2, 4, 8 (GQA) and 16 (MHA) kv
heads, and the MLA layer (per-head keys and values), each at cp 2, 3 and 4 (the shared group of each size),
with windows, learnable or off-by-one offsets, padding and every ``cp_comm_type`` cpkv maps
(``None``, ``"p2p"``, ``"all_gather"``, ``"a2a"``: both exchanges), built from
``get_gpt_decoder_block_spec`` through ``use_cpkv_core_attention``. Their cpkv collectives are
counted: a GQA layer makes those of an MQA one (one all-gather and its reduce-scatter).

The zigzag rows are written here with plain loops over documents (TransformerEngine's
``thd_get_partitioned_indices``: rank r holds chunks r and 2cp-1-r of every padded document),
independently of cpkv's sharding.

Megatron's ``RotaryEmbedding.get_emb`` moves its frequencies to ``torch.cuda.current_device()``;
on CPU the tests compute the same embedding with its ``get_freqs_non_repeated``, and, around
MLA (which builds and runs its own RotaryEmbedding), make ``torch.cuda.current_device()``
return the CPU (and unset megatron-core's ``HAVE_TE`` flag of MLA, wrongly set without
TransformerEngine). TransformerEngine is not installed: the local spec is Megatron's
pure-torch one.

Tolerance (float64, eps = 2.2e-16): every compared value is O(1) and a sum of at most a few
thousand O(1) products, computed in other orders on the two sides (online softmax merged by
LSE vs one dense softmax, rank sums of gradients), so rounding differences stay below
~1e3 * eps ~ 2e-13 (measured: <= 7.1e-15); 1e-11 leaves margin, while any semantic error
(a key too many or too few, another window, a missing sink, another head-to-group map,
padding counted in the indexer loss) moves results by more than 1e-4.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint


pytest.importorskip("megatron.core", reason="megatron-core (test extra) is missing")

from cpkv.integrations.megatron import plan_from_packed_seq_params  # noqa: E402
from cpkv.commstats import count_bytes  # noqa: E402
from cpkv.integrations.megatron_attention import (  # noqa: E402
    PLAN_ATTRIBUTE, CPKVCoreAttention, megatron_exchange, megatron_window, plan_of, use_cpkv_core_attention, with_plan,
)
from tests.shared_spawn import shared_spawn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:full scope is deprecated")  # megatron-core's TransformerConfig

CP = 2
TOL = 1e-11
# Real lengths and TE-style padding to multiples of 2*CP: an empty document, documents
# shorter than a chunk, one that is all padding (TE may pad an empty document).
REAL = [5, 11, 0, 8, 3, 0, 6]
PADDED = [8, 12, 0, 8, 4, 4, 8]
REAL_2, PADDED_2 = [17, 2, 9], [20, 4, 12]  # a second micro-batch, laid out otherwise
WIDE_CPS = [3, 4]  # one more spawn per cp: the heads sweep and MLA
# The heads sweep: 16 query heads over ng kv heads (MQA, GQA 2/4/8, MHA), each with its
# cp_comm_type (None: all-gather; "p2p"/"a2a": the need exchange), window (left) and softmax.
HEADS_SWEEP: dict[str, tuple[int, str | None, int | None, str]] = {
    "mqa": (1, None, 5, "learnable"),
    "gqa2": (2, "p2p", 5, "off-by-one"),
    "gqa4": (4, None, 5, "learnable"),
    "gqa8": (8, "all_gather", None, "learnable"),
    "mha": (16, "a2a", 3, "vanilla"),
}


def _padded(real: list[int], cp: int) -> list[int]:
    """TE-style padding of ``real`` to multiples of 2*cp; the empty document 5 is padded to one whole 2*cp (all padding)."""
    multiple = 2 * cp
    return [multiple if (i == 5 and n == 0) else -(-n // multiple) * multiple for i, n in enumerate(real)]


def _cu(lengths: list[int]) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def _zigzag_rows(real: list[int], padded: list[int], cp: int, rank: int) -> tuple[list[int], list[int]]:
    """Rank ``rank``'s rows: (index of the row's token in the unpadded batch or -1 for padding, padded-batch token)."""
    unpadded, tokens = [], []
    start, real_start = 0, 0
    for n_real, n_padded in zip(real, padded):
        chunk = n_padded // (2 * cp)
        for c in (rank, 2 * cp - 1 - rank):
            for i in range(c * chunk, (c + 1) * chunk):
                tokens.append(start + i)
                unpadded.append(real_start + i if i < n_real else -1)
        start += n_padded
        real_start += n_real
    return unpadded, tokens


def _megatron() -> SimpleNamespace:
    with warnings.catch_warnings():  # megatron-core warns that TransformerEngine and Apex are missing
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state
        from megatron.core.fusions.fused_softmax import SoftmaxOne
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
        from megatron.core.packed_seq_params import PackedSeqParams
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
        from megatron.core.transformer.utils import is_layer_window_attention
    return SimpleNamespace(**{k: v for k, v in locals().items()})


class DenseCoreAttention(nn.Module):
    """The oracle: Megatron's unfused core-attention math, dense per THD document, in one process.

    As ``DotProductAttention``: keys and values repeated over the query groups
    (``repeat_interleave``), logits scaled by ``softmax_scale`` (default ``1/sqrt(hk)``), the
    causal mask intersected with Megatron's sliding window (keys ``[i - left, i + right]``) on
    the layers ``is_layer_window_attention`` selects, then ``softmax`` or Megatron's
    ``SoftmaxOne`` with the offsets. It shares no code with cpkv.
    """

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: Any = None,
                 pg_collection: Any = None) -> None:
        super().__init__()
        mc = _megatron()
        self.scale = softmax_scale
        self.softmax_type = config.softmax_type
        sliding = mc.is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.window = config.window_size if sliding else None
        self.softmax_one = mc.SoftmaxOne
        if self.softmax_type == "learnable":
            self.softmax_offset = nn.Parameter(torch.zeros(config.num_attention_heads, dtype=config.params_dtype))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        p = packed_seq_params
        cu = (p.cu_seqlens_q if p.cu_seqlens_q_padded is None else p.cu_seqlens_q_padded).tolist()
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        scale = self.scale if self.scale is not None else query.shape[-1] ** -0.5
        outs = []
        for s, e in zip(cu[:-1], cu[1:]):
            scores = torch.einsum("ihd,jhd->hij", query[s:e], key[s:e]) * scale
            i = torch.arange(e - s)
            allowed = i[None, :] <= i[:, None]
            if self.window is not None:
                allowed &= i[None, :] >= i[:, None] - self.window[0]
            scores = scores.masked_fill(~allowed, float("-inf"))
            if self.softmax_type == "vanilla":
                probs = torch.softmax(scores, dim=-1)
            else:
                offset = self.softmax_offset if self.softmax_type == "learnable" else scores.new_zeros(scores.shape[0])
                probs = self.softmax_one(-1, offset)(scores[None])[0]
            outs.append(torch.einsum("hij,jhd->ihd", probs, value[s:e]))
        out = torch.cat(outs) if outs else query.new_zeros(0, query.shape[1], value.shape[-1])
        return out.reshape(out.shape[0], -1)


def _rope(mc: SimpleNamespace, dim: int, length: int) -> torch.Tensor:
    """Megatron's RotaryEmbedding(dim).get_emb(length) computed on CPU (get_emb itself moves to CUDA)."""
    rope = mc.RotaryEmbedding(kv_channels=dim, rotary_percent=1.0, use_cpu_initialization=True)
    freqs = rope.get_freqs_non_repeated(length)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def _params(mc: SimpleNamespace, real: list[int], padded: list[int] | None) -> Any:
    cu, cu_p = _cu(real), None if padded is None else _cu(padded)
    longest = max(padded or real)
    return mc.PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_p,
                              cu_seqlens_kv_padded=cu_p, max_seqlen_q=longest, max_seqlen_kv=longest)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


class MicroBatch(NamedTuple):
    """One micro-batch of a check: its documents, how each side runs it, its input and loss weights."""

    real: list[int]
    padded: list[int]
    run_cp: Callable[[torch.Tensor], torch.Tensor]
    run_ref: Callable[[torch.Tensor], torch.Tensor]
    x_full: torch.Tensor  # [sum(real), ...] the unpadded batch's input
    w_full: torch.Tensor  # its loss weights


def _layer_batch(mc: SimpleNamespace, layer: nn.Module, ref: nn.Module, padded: list[int], hidden: int, seed: int,
                 emb: torch.Tensor | None = None) -> MicroBatch:
    """REAL's documents (padded as ``padded`` on the CP side) through ``layer`` and the unpadded ``ref``, float64 inputs."""
    params, params_ref = _params(mc, REAL, padded), _params(mc, REAL, None)
    rope = {} if emb is None else {"rotary_pos_emb": emb}
    gen = torch.Generator().manual_seed(seed)
    x_full = torch.randn(sum(REAL), 1, hidden, generator=gen, dtype=torch.float64)
    w_full = torch.randn(sum(REAL), 1, hidden, generator=gen, dtype=torch.float64)
    return MicroBatch(
        REAL, padded,
        lambda x: layer(x, attention_mask=None, packed_seq_params=params, **rope)[0],
        lambda x: ref(x, attention_mask=None, packed_seq_params=params_ref, **rope)[0],
        x_full, w_full,
    )


def _compare(name: str, rank: int, cp_module: nn.Module, ref_module: nn.Module, batches: list[MicroBatch],
             group: Any, cp: int = CP) -> dict[str, float]:
    """Run every micro-batch forward on both sides, then one backward of their summed losses; this rank's errors.

    Errors: of the real rows' outputs and input gradients, of every parameter gradient summed
    over the CP ranks; and the largest input gradient of a padding row.
    """
    cp_loss, ref_loss, kept = 0.0, 0.0, []
    for i, mb in enumerate(batches):
        unpadded, _ = _zigzag_rows(mb.real, mb.padded, cp, rank)
        rows = torch.tensor(unpadded)
        real, pad = torch.nonzero(rows >= 0).flatten(), torch.nonzero(rows < 0).flatten()
        gen = torch.Generator().manual_seed(100 + 10 * i + rank)
        x_local = torch.randn(rows.numel(), *mb.x_full.shape[1:], generator=gen, dtype=mb.x_full.dtype) * 3  # junk
        x_local[real] = mb.x_full[rows[real]]
        x_local.requires_grad_(True)
        x_ref = mb.x_full.clone().requires_grad_(True)
        out, ref = mb.run_cp(x_local), mb.run_ref(x_ref)
        cp_loss = cp_loss + (out[real] * mb.w_full[rows[real]]).sum()
        ref_loss = ref_loss + (ref * mb.w_full).sum()
        kept.append((rows, real, pad, x_local, x_ref, out, ref))
    assert isinstance(cp_loss, torch.Tensor) and isinstance(ref_loss, torch.Tensor)
    cp_loss.backward()
    ref_loss.backward()
    errors = {"out": 0.0, "dx": 0.0, "dx_padding": 0.0, "padding_rows": 0.0, "out_scale": 0.0}
    for rows, real, pad, x_local, x_ref, out, ref in kept:
        assert x_local.grad is not None and x_ref.grad is not None
        errors["out"] = max(errors["out"], _max_err(out[real], ref.detach()[rows[real]]))
        errors["dx"] = max(errors["dx"], _max_err(x_local.grad[real], x_ref.grad[rows[real]]))
        errors["dx_padding"] = max(errors["dx_padding"], float(x_local.grad[pad].abs().max()) if pad.numel() else 0.0)
        errors["padding_rows"] += float(pad.numel())
        errors["out_scale"] = max(errors["out_scale"], float(ref.detach().abs().max()))
    grads = dict(ref_module.named_parameters())
    param_err, checked = 0.0, 0
    for pname, param in cp_module.named_parameters():
        assert param.grad is not None, pname
        summed = param.grad.clone()
        dist.all_reduce(summed, group=group)
        ref_grad = grads[pname].grad
        assert ref_grad is not None, pname
        param_err = max(param_err, _max_err(summed, ref_grad))
        checked += 1
    errors.update(dparams=param_err, num_params=float(checked))
    return {f"{name}/{key}": value for key, value in errors.items()}


def _groups(mc: SimpleNamespace, rank: int, cp: int = CP) -> tuple[Any, Any]:
    """Megatron's groups at cp (parallel_state) and a one-rank collection for the single-process reference."""
    singles = [dist.new_group([r]) for r in range(cp)]
    one = singles[rank]
    fields = ("tp", "pp", "cp", "tp_cp", "mp", "embd", "pos_embd", "dp", "dp_cp", "ep", "expt_tp", "tp_ep",
              "tp_ep_pp", "expt_dp", "tp_dp_cp")
    reference = mc.ProcessGroupCollection(**{f: one for f in fields}, hcp=[one])
    return mc.ProcessGroupCollection.use_mpu_process_groups(), reference


def _config(mc: SimpleNamespace, cp: int, cls: Any = None, **overrides: Any) -> Any:
    base: dict[str, Any] = dict(
        num_layers=1, hidden_size=24, num_attention_heads=4, num_query_groups=2, kv_channels=6, ffn_hidden_size=32,
        use_cpu_initialization=True, params_dtype=torch.float64, attention_dropout=0.0, hidden_dropout=0.0,
        context_parallel_size=cp, apply_rope_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
    )
    base.update(overrides)
    return (cls or mc.TransformerConfig)(**base)


def _layer_pair(mc: SimpleNamespace, spec: Any, pgs: tuple[Any, Any], config_cp: Any, config_ref: Any) -> tuple[Any, Any]:
    cp_spec, ref_spec = copy.deepcopy(spec), copy.deepcopy(spec)
    cp_spec.submodules.self_attention.submodules.core_attention = CPKVCoreAttention
    ref_spec.submodules.self_attention.submodules.core_attention = DenseCoreAttention
    torch.manual_seed(0)
    ref = mc.build_module(ref_spec, config=config_ref, layer_number=1, pg_collection=pgs[1]).double()
    layer = mc.build_module(cp_spec, config=config_cp, layer_number=1).double()
    with torch.no_grad():  # random offsets (Megatron initialises them with init_method; any value must work)
        for module in (ref, layer):
            for name, p in module.named_parameters():
                if name.endswith("softmax_offset"):
                    p.copy_(torch.linspace(-1.0, 1.5, p.numel(), dtype=p.dtype))
    layer.load_state_dict(ref.state_dict())
    return layer, ref


def _gqa_layer_case(mc: SimpleNamespace, rank: int, pgs: tuple[Any, Any]) -> dict[str, float]:
    """A TransformerLayer: GQA (4 heads, 2 groups), sliding window (left 5), learnable offsets, RoPE, per-call plans."""
    options = dict(window_size=(5, 0), softmax_type="learnable")
    layer, ref = _layer_pair(mc, mc.get_gpt_layer_local_spec(), pgs, _config(mc, CP, **options), _config(mc, 1, **options))
    assert isinstance(layer.self_attention.core_attention, CPKVCoreAttention)
    assert layer.self_attention.core_attention.window == 6
    sharded = layer.sharded_state_dict(metadata={"dp_cp_group": pgs[0].dp_cp})  # Megatron's dist checkpoint
    assert "self_attention.core_attention.softmax_offset" in sharded
    emb = _rope(mc, 6, max(PADDED))
    batch = _layer_batch(mc, layer, ref, PADDED, 24, 7, emb)
    return _compare("gqa", rank, layer, ref, [batch], pgs[0].cp)


def _block_case(mc: SimpleNamespace, rank: int, pgs: tuple[Any, Any]) -> dict[str, float]:
    """A 2-layer TransformerBlock: MQA, layer 1 sliding (left 3) / layer 2 dense, off-by-one; two micro-batches.

    Each micro-batch is planned once and its plan carried in its packed_seq_params
    (``with_plan``); the cp side runs both forwards under activation checkpointing
    (``torch.utils.checkpoint``, non-reentrant) before one backward, so every recomputation
    must find its own micro-batch's plan.
    """
    options = dict(num_layers=2, num_query_groups=1, window_size=(3, 0), window_attn_skip_freq=2, softmax_type="off-by-one")
    spec = mc.get_gpt_layer_local_spec()
    cp_spec, ref_spec = copy.deepcopy(spec), copy.deepcopy(spec)
    cp_spec.submodules.self_attention.submodules.core_attention = CPKVCoreAttention
    ref_spec.submodules.self_attention.submodules.core_attention = DenseCoreAttention
    torch.manual_seed(1)
    ref = mc.TransformerBlock(_config(mc, 1, **options), ref_spec, pg_collection=pgs[1]).double()
    block = mc.TransformerBlock(_config(mc, CP, **options), cp_spec).double()
    block.load_state_dict(ref.state_dict())
    windows = [layer.self_attention.core_attention.window for layer in block.layers]
    assert windows == [4, None], windows
    gen = torch.Generator().manual_seed(8)
    batches = []
    for real, padded in ((REAL, PADDED), (REAL_2, PADDED_2)):
        emb = _rope(mc, 6, max(padded))
        params = _params(mc, real, padded)
        carried = with_plan(params, plan_from_packed_seq_params(params, CP, rank))
        params_ref = _params(mc, real, None)

        def run_cp(x: torch.Tensor, emb: torch.Tensor = emb, carried: Any = carried) -> torch.Tensor:
            out: torch.Tensor = checkpoint(
                block, x, attention_mask=None, rotary_pos_emb=emb, packed_seq_params=carried, use_reentrant=False
            )
            return out

        def run_ref(x: torch.Tensor, emb: torch.Tensor = emb, params_ref: Any = params_ref) -> torch.Tensor:
            out: torch.Tensor = ref(x, attention_mask=None, rotary_pos_emb=emb, packed_seq_params=params_ref)
            return out

        x_full = torch.randn(sum(real), 1, 24, generator=gen, dtype=torch.float64)
        w_full = torch.randn(sum(real), 1, 24, generator=gen, dtype=torch.float64)
        batches.append(MicroBatch(real, padded, run_cp, run_ref, x_full, w_full))
    return _compare("block", rank, block, ref, batches, pgs[0].cp)


def _mla_case(mc: SimpleNamespace, rank: int, pgs: tuple[Any, Any], cp: int = CP) -> dict[str, float]:
    """An MLA TransformerLayer (per-head keys qk 6 + rope 4, values 5; q and kv low rank), learnable offsets."""
    options: dict[str, Any] = dict(
        multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=10, qk_head_dim=6, qk_pos_emb_head_dim=4,
        v_head_dim=5, rope_type="rope", num_query_groups=4, kv_channels=None, softmax_type="learnable",
        window_size=(6, 0),
    )
    spec = mc.get_gpt_layer_local_spec(multi_latent_attention=True)
    # MLA builds and runs its own RotaryEmbedding, which places its frequencies on
    # torch.cuda.current_device(): on this CPU machine, that device is the CPU. Without
    # TransformerEngine, megatron-core 0.16 still sets multi_latent_attention.HAVE_TE (its TE
    # extension module imports) with TELinear = None, and isinstance(..., None) fails: unset it.
    with mock.patch("torch.cuda.current_device", return_value="cpu"), \
            mock.patch("megatron.core.transformer.multi_latent_attention.HAVE_TE", False):
        layer, ref = _layer_pair(mc, spec, pgs, _config(mc, cp, mc.MLATransformerConfig, **options),
                                 _config(mc, 1, mc.MLATransformerConfig, **options))
        assert layer.self_attention.core_attention.v_channels == 5
        padded = _padded(REAL, cp)
        batch = _layer_batch(mc, layer, ref, padded, 24, 9)
        with count_bytes() as counter:
            errors = _compare("mla", rank, layer, ref, [batch], pgs[0].cp, cp)
        return {**errors, "mla/collectives": float(counter.num_calls)}


def _heads_case(mc: SimpleNamespace, rank: int, cp: int, pgs: tuple[Any, Any], name: str) -> dict[str, float]:
    """A TransformerLayer with 16 query heads over HEADS_SWEEP[name]'s kv heads, cp_comm_type, window and softmax.

    Built from a block spec through ``use_cpkv_core_attention`` (the cp side) on a padded batch;
    the layer's collectives (forward + backward) and bytes are counted.
    """
    groups, comm, left, softmax = HEADS_SWEEP[name]
    options: dict[str, Any] = dict(num_attention_heads=16, num_query_groups=groups, kv_channels=4, hidden_size=32,
                                   window_size=None if left is None else (left, 0), softmax_type=softmax)
    config_cp = _config(mc, cp, cp_comm_type=comm, **options)
    spec = mc.get_gpt_decoder_block_spec(config_cp, use_transformer_engine=False)
    cp_spec = use_cpkv_core_attention(spec).layer_specs[0]
    ref_spec = copy.deepcopy(spec.layer_specs[0])
    ref_spec.submodules.self_attention.submodules.core_attention = DenseCoreAttention
    torch.manual_seed(groups)
    ref = mc.build_module(ref_spec, config=_config(mc, 1, **options), layer_number=1, pg_collection=pgs[1]).double()
    layer = mc.build_module(cp_spec, config=config_cp, layer_number=1).double()
    with torch.no_grad():
        for module in (ref, layer):
            for pname, p in module.named_parameters():
                if pname.endswith("softmax_offset"):
                    p.copy_(torch.linspace(-1.0, 1.5, p.numel(), dtype=p.dtype))
    layer.load_state_dict(ref.state_dict())
    core = layer.self_attention.core_attention
    assert isinstance(core, CPKVCoreAttention) and core.exchange == megatron_exchange(comm)
    padded = _padded(REAL, cp)
    emb = _rope(mc, 4, max(padded))
    batch = _layer_batch(mc, layer, ref, padded, 32, 20 + groups, emb)
    with count_bytes() as counter:
        errors = _compare(name, rank, layer, ref, [batch], pgs[0].cp, cp)
    return {**errors, f"{name}/collectives": float(counter.num_calls), f"{name}/bytes": float(counter.total)}


def _heads_checks(mc: SimpleNamespace, rank: int, cp: int, pgs: tuple[Any, Any]) -> dict[str, float]:
    results: dict[str, float] = {}
    for name in HEADS_SWEEP:
        results.update(_heads_case(mc, rank, cp, pgs, name))
    return results


def _indexer_padding_case(rank: int, group: Any) -> dict[str, float]:
    """cpkv.v4 INDEXER layer at cp 2 on a padded batch (plan from PackedSeqParams) vs the unpadded batch in one process.

    The indexer's KL loss injects gradients whatever the upstream gradient: padding queries
    would add theirs, and N would count them. Here real rows, the summed KL loss and every
    gradient (the indexer's included) must equal the unpadded batch's.
    """
    from cpkv.v4 import V4Attention, V4Config, reference_forward

    real, padded = [13, 0, 22, 7, 30, 0], [16, 0, 24, 8, 32, 4]
    cu_real = _cu(real)
    params = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real,
                             cu_seqlens_q_padded=_cu(padded), cu_seqlens_kv_padded=_cu(padded))
    packed = plan_from_packed_seq_params(params, CP, rank, compress_ratios=[4])
    layer = V4Attention(V4Config(compress_ratio=4, topk=3, window=8), seed=3).double()
    ref_layer = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(12)
    x_full = torch.randn(sum(real), 64, generator=gen, dtype=torch.float64)
    w_full = torch.randn(sum(real), 64, generator=gen, dtype=torch.float64)
    unpadded, _ = _zigzag_rows(real, padded, CP, rank)
    rows = torch.tensor(unpadded)
    real_rows = torch.nonzero(rows >= 0).flatten()
    assert torch.equal(packed.real_rows, real_rows)
    x_local = torch.randn(rows.numel(), 64, generator=gen, dtype=torch.float64) * 3
    x_local[real_rows] = x_full[rows[real_rows]]
    x_local.requires_grad_(True)
    result = layer(x_local, packed.plan, group, backend="reference", grad_scale=2.0)
    (result.out[real_rows] * w_full[rows[real_rows]]).sum().backward()
    x_ref = x_full.clone().requires_grad_(True)
    ref = reference_forward(ref_layer, x_ref, cu_real, grad_scale=2.0)
    (ref.out * w_full).sum().backward()
    assert result.indexer_loss is not None and ref.indexer_loss is not None
    loss = result.indexer_loss.double().clone()
    dist.all_reduce(loss, group=group)
    grads = dict(ref_layer.named_parameters())
    param_err, indexer_err = 0.0, 0.0
    for name, p in layer.named_parameters():
        summed = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(summed, group=group)
        ref_grad = grads[name].grad
        err = _max_err(summed, torch.zeros_like(p) if ref_grad is None else ref_grad)
        param_err = max(param_err, err)
        if name.startswith("indexer."):
            indexer_err = max(indexer_err, err)
    pad = torch.nonzero(rows < 0).flatten()
    assert x_local.grad is not None and x_ref.grad is not None
    return {
        "indexer/out": _max_err(result.out[real_rows], ref.out.detach()[rows[real_rows]]),
        "indexer/dx": _max_err(x_local.grad[real_rows], x_ref.grad[rows[real_rows]]),
        "indexer/dx_padding": float(x_local.grad[pad].abs().max()),
        "indexer/dparams": param_err,
        "indexer/dparams_indexer": indexer_err,
        "indexer/num_global_queries_minus_real": float(packed.plan.num_global_queries - sum(real)),
        "indexer/loss": abs(float(loss) - float(ref.indexer_loss)) / max(1.0, abs(float(ref.indexer_loss))),
        "indexer/indexer_grad_scale": max(float(grads[n].grad.abs().max()) for n in grads
                                          if n.startswith("indexer.") and grads[n].grad is not None),
    }


def _padding_disagreement_case(rank: int, group: Any) -> dict[str, float]:
    """plan_attention(group=...) compares the padding across ranks: the same total, spread otherwise, raises."""
    from cpkv.plan import plan_attention

    padding = torch.tensor([1, 2] if rank == 0 else [2, 1])
    try:
        plan_attention(_cu([8, 4]), CP, rank, group=group, padding=padding)
    except ValueError as error:
        return {"padding/disagreement_raised": float("differ between the ranks" in str(error))}
    return {"padding/disagreement_raised": 0.0}


def _all_checks(rank: int, world: int) -> dict[str, float]:
    torch.set_default_dtype(torch.float64)
    mc = _megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mc.parallel_state.initialize_model_parallel(context_parallel_size=world)
        pgs = _groups(mc, rank)
        results: dict[str, float] = {}
        results.update(_gqa_layer_case(mc, rank, pgs))
        results.update(_block_case(mc, rank, pgs))
        results.update(_mla_case(mc, rank, pgs))
        results.update(_indexer_padding_case(rank, pgs[0].cp))
        results.update(_padding_disagreement_case(rank, pgs[0].cp))
        results.update(_heads_checks(mc, rank, world, pgs))
        mc.parallel_state.destroy_model_parallel()
    return results


def _wide_checks(rank: int, world: int) -> dict[str, float]:
    """The heads sweep and MLA at cp = world (3 or 4)."""
    torch.set_default_dtype(torch.float64)
    mc = _megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mc.parallel_state.initialize_model_parallel(context_parallel_size=world)
        pgs = _groups(mc, rank, world)
        results = _heads_checks(mc, rank, world, pgs)
        results.update(_mla_case(mc, rank, pgs, world))
        mc.parallel_state.destroy_model_parallel()
    return results


CP_CHECK = shared_spawn(_all_checks, CP, timeout=240.0)
WIDE_CHECKS = {cp: shared_spawn(_wide_checks, cp, timeout=300.0) for cp in WIDE_CPS}


@pytest.fixture(scope="module")
def cp_results(request: pytest.FixtureRequest) -> list[dict[str, float]]:
    return CP_CHECK.run(request)


@pytest.fixture(scope="module", params=WIDE_CPS)
def wide_results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, float]]]:
    return request.param, WIDE_CHECKS[request.param].run(request)


def _assert_matches(results: list[dict[str, float]], case: str) -> None:
    """Every rank's errors of ``case`` within TOL, padding rows exactly zero, real values compared."""
    for rank, errors in enumerate(results):
        mine = {k.split("/", 1)[1]: v for k, v in errors.items() if k.startswith(case + "/")}
        assert mine["out"] <= TOL and mine["dx"] <= TOL and mine["dparams"] <= TOL, (case, rank, mine)
        assert mine["dx_padding"] == 0.0, (case, rank, mine)
        assert mine["num_params"] >= 8 and mine["out_scale"] > 0.1, (case, mine)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [*HEADS_SWEEP, "mla"])
def test_kv_heads_through_megatron_layers_at_cp2_to_4(cp_results: list[dict[str, float]],
                                                      wide_results: tuple[int, list[dict[str, float]]], case: str) -> None:
    """MQA, GQA 2/4/8, MHA (16 query heads) and MLA's per-head keys and values, one attention_forward per layer."""
    for cp, results in ((CP, cp_results), wide_results):
        _assert_matches(results, case)
        padding = sum(_padded(REAL, cp)) - sum(REAL)
        assert sum(errors[f"{case}/padding_rows"] for errors in results) == padding, (cp, case)


@pytest.mark.timeout(300)
def test_a_gqa_layer_makes_the_collectives_of_an_mqa_one(cp_results: list[dict[str, float]],
                                                         wide_results: tuple[int, list[dict[str, float]]]) -> None:
    """All kv heads travel in one all-gather (and its reduce-scatter): 2 collectives per layer forward + backward
    at 1, 4 and 128-style per-head kv (MLA), bytes proportional to the kv heads."""
    for cp, results in ((CP, cp_results), wide_results):
        for errors in results:
            assert errors["mqa/collectives"] == errors["gqa4/collectives"] == errors["mla/collectives"] == 2.0, (cp, errors)
            assert errors["gqa4/bytes"] == 4 * errors["mqa/bytes"] > 0, (cp, errors)


@pytest.mark.parametrize("case", ["gqa", "block", "mla", "indexer"])
def test_layer_at_cp2_equals_the_unpadded_batch_in_one_process(cp_results: list[dict[str, float]], case: str) -> None:
    for rank, errors in enumerate(cp_results):
        mine = {k.split("/", 1)[1]: v for k, v in errors.items() if k.startswith(case + "/")}
        assert mine["out"] <= TOL, (rank, mine)
        assert mine["dx"] <= TOL, (rank, mine)
        assert mine["dparams"] <= TOL, (rank, mine)
        assert mine["dx_padding"] == 0.0, (rank, mine)  # padding rows feed nothing real: exactly zero
        if case != "indexer":
            assert mine["num_params"] >= 8 and mine["out_scale"] > 0.1, mine  # the comparison saw real values
    if case != "indexer":  # every padding row of the batches was checked on some rank
        padding = sum(PADDED) - sum(REAL) + (sum(PADDED_2) - sum(REAL_2) if case == "block" else 0)
        assert sum(errors[f"{case}/padding_rows"] for errors in cp_results) == padding


def test_padding_does_not_count_in_the_indexer_loss(cp_results: list[dict[str, float]]) -> None:
    """N counts real tokens only and padding queries add nothing to the KL loss or its gradients."""
    for errors in cp_results:
        assert errors["indexer/num_global_queries_minus_real"] == 0.0, errors
        assert errors["indexer/dparams_indexer"] <= TOL, errors
        assert errors["indexer/indexer_grad_scale"] > 1e-6, errors  # the indexer does get gradients
        # The logged loss is a float32 value (AttentionOutput.indexer_loss): float32 precision.
        assert errors["indexer/loss"] <= 1e-6, errors


def test_ranks_that_disagree_on_padding_raise(cp_results: list[dict[str, float]]) -> None:
    assert [errors["padding/disagreement_raised"] for errors in cp_results] == [1.0] * CP


# ------------------------------------------------------------------ single-process checks


class _Group:
    def __init__(self, size: int, rank: int = 0) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _pgs(cp: int = 2, tp: int = 1) -> SimpleNamespace:
    return SimpleNamespace(tp=_Group(tp), cp=_Group(cp))


def _plain_config(**overrides: Any) -> Any:
    mc = _megatron()
    fields: dict[str, Any] = dict(num_layers=1, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                                  attention_dropout=0.0, context_parallel_size=2)
    fields.update(overrides)
    return mc.TransformerConfig(**fields)


def _build(config: Any = None, **kwargs: Any) -> CPKVCoreAttention:
    mc = _megatron()
    arguments: dict[str, Any] = dict(layer_number=1, attn_mask_type=mc.AttnMaskType.causal, attention_type="self",
                                     pg_collection=_pgs())
    arguments.update(kwargs)
    return CPKVCoreAttention(config if config is not None else _plain_config(), **arguments)


@pytest.mark.parametrize(
    ("config_overrides", "kwargs", "match"),
    [
        (dict(attention_dropout=0.1), {}, "attention dropout must be 0"),
        ({}, dict(attention_dropout=0.2), "attention dropout must be 0"),
        (dict(window_size=(4, 2)), {}, "the right window must be 0"),
        (dict(window_size=(-2, 0)), {}, "left window must be >= -1"),
        ({}, dict(attention_type="cross"), "attention_type must be 'self'"),
        ({}, dict(attn_mask_type="no_mask"), "attn_mask_type must be AttnMaskType.causal"),
        ({}, dict(softmax_scale=-1.0), "softmax_scale must be a finite positive"),
        ({}, dict(pg_collection=_pgs(cp=4)), "CP group has size 4"),
        (dict(num_attention_heads=6, num_query_groups=3, kv_channels=4), dict(pg_collection=_pgs(tp=2)),
         "multiples of the tensor-parallel size 2"),
        ({}, dict(cp_comm_type="a2a+p2p"), r"cp_comm_type='a2a\+p2p' has no cpkv exchange"),
        ({}, dict(cp_comm_type=["p2p"]), "has no cpkv exchange"),
    ],
)
def test_unsupported_configurations_raise(config_overrides: dict[str, Any], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _build(_plain_config(**config_overrides), **kwargs)


def test_constructor_accepts_what_megatron_passes() -> None:
    mc = _megatron()
    config = _plain_config(softmax_type="learnable", window_size=(7, 0), window_attn_skip_freq=[1, 0])
    module = _build(config, attn_mask_type=mc.AttnMaskType.padding_causal, softmax_scale=0.3, k_channels=4,
                    v_channels=4, cp_comm_type="a2a")
    assert module.window == 8 and module.softmax_scale == 0.3
    assert module.softmax_offset is not None and tuple(module.softmax_offset.shape) == (4,)
    assert [name for name, _ in module.named_parameters()] == ["softmax_offset"]  # Megatron's parameter name
    assert _build(config, layer_number=2).window is None
    assert _build(_plain_config()).softmax_offset is None


@pytest.mark.parametrize("window_size", [None, (0, 0), (1, 0), (9, 0), (-1, 0)])
@pytest.mark.parametrize("skip", [None, 2, 3, [1, 0, 1]])
def test_megatron_window_follows_megatron(window_size: Any, skip: Any) -> None:
    """Megatron's is_layer_window_attention picks the sliding layers; (left, 0) sees left earlier keys."""
    mc = _megatron()
    for layer_number in (1, 2, 3):
        sliding = mc.is_layer_window_attention(window_size, skip, layer_number)
        expected = window_size[0] + 1 if sliding and window_size[0] >= 0 else None
        assert megatron_window(window_size, skip, layer_number) == expected


def _tensors(t: int = 4, heads: int = 4, groups: int = 2, hk: int = 4, hv: int = 4) -> tuple[torch.Tensor, ...]:
    return torch.randn(t, heads, hk), torch.randn(t, groups, hk), torch.randn(t, groups, hv)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(packed_seq_params=None), ValueError, "qkv_format='thd' is required"),
        (dict(packed_seq_params=SimpleNamespace(qkv_format="sbhd")), ValueError, "qkv_format='thd' is required"),
        (dict(attention_bias=torch.zeros(1)), ValueError, "attention_bias must be None"),
        (dict(attn_mask_type="arbitrary"), ValueError, "attn_mask_type must be None"),
        (dict(value=None), ValueError, "value=None"),
        (dict(query=torch.randn(4, 3, 4)), ValueError, "must be a multiple of the key/value heads"),
        (dict(key=torch.randn(4, 2, 5)), ValueError, "must agree"),
        (dict(query=torch.randn(4, 4)), ValueError, "query must have shape"),
    ],
)
def test_forward_rejects_what_it_cannot_run(change: dict[str, Any], error: type[Exception], match: str) -> None:
    module = _build()
    q, k, v = _tensors()
    cu = _cu([8])
    arguments: dict[str, Any] = dict(query=q, key=k, value=v, attention_mask=None, packed_seq_params=SimpleNamespace(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None))
    arguments.update(change)
    with pytest.raises(error, match=match):
        module(**arguments)


def test_with_plan_carries_the_plan_and_checks_it() -> None:
    mc = _megatron()
    params = _params(mc, REAL, PADDED)
    packed = plan_from_packed_seq_params(params, 2, 1)
    carried = with_plan(params, packed)
    assert type(carried) is type(params) and getattr(carried, PLAN_ATTRIBUTE) is packed
    assert not hasattr(params, PLAN_ATTRIBUTE)  # the original is untouched
    assert plan_of(carried, 2, 1) is packed
    planned = plan_of(params, 2, 1)  # without one, planned per call: the same plan data
    assert torch.equal(planned.real_rows, packed.real_rows) and torch.equal(planned.plan.q_positions, packed.plan.q_positions)
    with pytest.raises(ValueError, match="cp_size=2, cp_rank=1; this layer's CP group has size 2, rank 0"):
        plan_of(carried, 2, 0)
    with pytest.raises(ValueError, match="not made from its params.cu_seqlens_q_padded"):
        with_plan(_params(mc, REAL, PADDED), packed)
    other = copy.copy(carried)
    other.cu_seqlens_q_padded = other.cu_seqlens_q_padded.clone()
    with pytest.raises(ValueError, match="not made from its params.cu_seqlens_q_padded"):
        plan_of(other, 2, 1)
    with pytest.raises(TypeError, match="PackedPlan"):
        with_plan(params, packed.plan)  # type: ignore[arg-type]
    setattr(other, PLAN_ATTRIBUTE, "plan")
    with pytest.raises(TypeError, match="must be a PackedPlan"):
        plan_of(other, 2, 1)



@pytest.mark.parametrize(("comm", "exchange"), [("allgather", "allgather"), ("all_gather", "allgather"), ("p2p", "need"),
                                                ("a2a", "need"), (None, None)])
def test_cp_comm_type_maps_onto_an_exchange(comm: str | None, exchange: str | None) -> None:
    assert megatron_exchange(comm) == exchange
    assert _build(cp_comm_type=comm).exchange == exchange


def test_a_carried_plan_must_have_the_layers_exchange() -> None:
    mc = _megatron()
    params = _params(mc, REAL, PADDED)
    carried = with_plan(params, plan_from_packed_seq_params(params, 2, 1))  # all-gather
    assert plan_of(carried, 2, 1, exchange="allgather").plan.exchange == "allgather"
    with pytest.raises(ValueError, match="uses exchange='allgather' but this layer's cp_comm_type asks for 'need'"):
        plan_of(carried, 2, 1, exchange="need", window=4)
    planned = plan_of(params, 2, 1, exchange="need", window=4)  # planned per call: the layer's window's halo
    assert planned.plan.exchange == "need" and 4 in planned.plan.kv


def test_use_cpkv_core_attention_swaps_every_layer_of_a_block_spec() -> None:
    mc = _megatron()
    config = _plain_config(num_layers=3, num_query_groups=2)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    # get_gpt_decoder_block_spec's result (it needs Megatron's parallel state: the cp runs above build from it)
    block = TransformerBlockSubmodules(layer_specs=get_gpt_decoder_layer_specs(config, use_transformer_engine=False))
    swapped = use_cpkv_core_attention(block)
    assert type(swapped) is type(block) and len(swapped.layer_specs) == 3
    assert all(s.submodules.self_attention.submodules.core_attention is CPKVCoreAttention for s in swapped.layer_specs)
    assert all(s.submodules.self_attention.submodules.core_attention is not CPKVCoreAttention for s in block.layer_specs)
    with_options = use_cpkv_core_attention(list(block.layer_specs), backend="reference")
    core = with_options[0].submodules.self_attention.submodules.core_attention
    assert core.module is CPKVCoreAttention and core.params == {"backend": "reference"}
    layer = use_cpkv_core_attention(mc.get_gpt_layer_local_spec(multi_latent_attention=True))  # MLA's submodules too
    assert layer.submodules.self_attention.submodules.core_attention is CPKVCoreAttention
    with pytest.raises(ValueError, match="no layer of the dict has"):
        use_cpkv_core_attention({"layers": []})
