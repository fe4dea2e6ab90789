"""Train a tiny Megatron-Core model with cpkv as its core attention, at cp 2 on gloo, as in one process.

The model is Megatron's own ``TransformerBlock`` (local, non-TE spec; 2 layers: GQA with
4 query heads over 2 kv heads, RoPE, layer 1 a sliding window of 8 with learnable softmax
offsets, layer 2 dense causal) between a token embedding and an output head, with
:class:`cpkv.integrations.megatron_attention.CPKVCoreAttention` as every layer's core
attention. Each rank runs Megatron's THD recipe:

1. shift the labels **before** sharding (a rank's last token's label lives on the next
   rank), per document (the last token of a document has none);
2. pad every document at its end to a multiple of ``2 * cp`` (TransformerEngine's THD CP
   layout; padding rows carry no label) and describe the batch with ``PackedSeqParams``
   (``cu_seqlens_q`` real, ``cu_seqlens_q_padded`` padded);
3. take the rank's per-document zigzag shard (chunks ``r`` and ``2cp-1-r``), plan it once
   (``plan_from_packed_seq_params``) and hand the plan to every layer inside the
   micro-batch's ``packed_seq_params`` (``with_plan``, with the step's ``StepStatus``);
4. normalise the loss by the global count of labelled tokens, check the step's status (a
   layer call that failed on any rank raises on every rank), sum the gradients over the CP
   group (a wrapper that *averages* over CP ranks needs the loss multiplied by cp), step.

It runs 3 SGD steps at cp 2 (2 gloo ranks, padded) and at cp 1 (one process, the unpadded
batch) in float64 and prints both runs' losses; they agree to rounding. CPU only, 8-10 s
on 2 CPU cores (measured)::

    python examples/megatron_core_attention_cp.py
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cpkv import StepStatus
from cpkv.integrations.megatron import plan_from_packed_seq_params
from cpkv.integrations.megatron_attention import CPKVCoreAttention, with_plan
from cpkv.launch import spawn
from cpkv.plan.conventions import pad_documents, seqlens_to_cu_seqlens
from cpkv.plan.sharding import shard_zigzag_tnd

LENGTHS = [13, 0, 29, 6, 20]  # documents of the packed micro-batch (68 tokens)
VOCAB, HIDDEN, STEPS, LR = 64, 32, 3, 0.5
IGNORE = -100
# Without TransformerEngine and Apex (a CPU machine) megatron-core warns at import and on every config.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex is not installed|full scope is deprecated).*")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[T]`` and their labels, shifted per document before any sharding."""
    ids = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(ids, IGNORE)
    start = 0
    for n in LENGTHS:
        labels[start:start + n - 1] = ids[start + 1:start + n]  # the document's last token has no label
        start += n
    return ids, labels


def rope_embedding(rope: Any, length: int) -> torch.Tensor:
    """Megatron's THD rotary embedding ``rope(length, packed_seq=True)``; on CPU from its frequencies.

    ``RotaryEmbedding.forward`` moves its frequencies to CUDA; on a CPU machine this is its
    ``get_emb`` without that move (non-interleaved RoPE).
    """
    if torch.cuda.is_available():
        return rope(length, packed_seq=True)
    freqs = rope.get_freqs_non_repeated(length)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


class TinyGPT(nn.Module):
    """Embedding, a Megatron TransformerBlock whose core attention is cpkv's, and an output head."""

    def __init__(self, cp: int) -> None:
        super().__init__()
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_block import TransformerBlock
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
            window_size=(7, 0), window_attn_skip_freq=2, softmax_type="learnable", context_parallel_size=cp,
            attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float64, use_cpu_initialization=True,
            apply_rope_fusion=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        )
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = CPKVCoreAttention  # the one change
        torch.manual_seed(0)  # the same weights on every rank and in both runs
        self.embedding = nn.Embedding(VOCAB, HIDDEN)
        self.block = TransformerBlock(config, spec)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0, use_cpu_initialization=True)
        self.double()

    def forward(self, ids: torch.Tensor, packed_seq_params: Any) -> torch.Tensor:
        """Logits ``[t, VOCAB]`` of this rank's ``t`` tokens (Megatron's THD layout: ``[t, 1, hidden]``)."""
        emb = rope_embedding(self.rope, packed_seq_params.max_seqlen_q)
        hidden = self.block(self.embedding(ids)[:, None], attention_mask=None, rotary_pos_emb=emb,
                            packed_seq_params=packed_seq_params)
        logits: torch.Tensor = self.head(hidden[:, 0])
        return logits


def train(rank: int, world: int) -> list[float]:
    """``STEPS`` SGD steps of this rank's shard; returns the global loss of every step."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    cp_group = parallel_state.get_context_parallel_group()
    model = TinyGPT(world)
    ids, labels = batch()
    cu_seqlens = seqlens_to_cu_seqlens(LENGTHS).int()
    if world > 1:  # TE's THD CP layout: every document padded to a multiple of 2*cp
        padded = pad_documents(ids, cu_seqlens, 2 * world)
        padded_labels = torch.full((padded.x.shape[0],), IGNORE).index_copy(0, padded.token_index, labels)
        cu_padded: torch.Tensor | None = padded.cu_seqlens.int()
        ids_local = shard_zigzag_tnd(padded.x, padded.cu_seqlens, world, rank)
        labels_local = shard_zigzag_tnd(padded_labels, padded.cu_seqlens, world, rank)
    else:
        cu_padded, ids_local, labels_local = None, ids, labels
    longest = int((cu_seqlens if cu_padded is None else cu_padded).diff().max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    status = StepStatus(cp_group)  # the layers report failed checks to it (no host sync); checked once per step
    params = with_plan(params, plan_from_packed_seq_params(params, world, rank), status=status)  # once per micro-batch
    num_labels = int((labels != IGNORE).sum())  # global: every rank knows the whole batch's labels
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = model(ids_local, params)
        loss = nn.functional.cross_entropy(logits, labels_local, ignore_index=IGNORE, reduction="sum") / num_labels
        loss.backward()
        status.check()  # a layer call that failed on any rank raises here on every rank, before the step
        for p in model.parameters():  # the whole batch's gradient: the sum over the CP ranks
            if p.grad is not None:
                dist.all_reduce(p.grad, group=cp_group)
        optimizer.step()
        total = loss.detach().clone()
        dist.all_reduce(total, group=cp_group)
        losses.append(float(total))
    parallel_state.destroy_model_parallel()
    return losses


def main() -> None:
    single = spawn(train, 1, timeout=120.0)[0]
    sharded = spawn(train, 2, timeout=120.0)
    worst = 0.0
    for step, (one, two) in enumerate(zip(single, sharded[0])):
        worst = max(worst, abs(one - two))
        print(f"step {step}: loss cp=1 (one process, unpadded) {one:.15f}   cp=2 (padded, zigzag) {two:.15f}")
    print(f"max |loss difference| over {STEPS} steps: {worst:.1e} (float64)")
    if worst > 1e-12 or sharded[0] != sharded[1]:
        raise SystemExit("cp=2 differs from cp=1")


if __name__ == "__main__":
    main()
