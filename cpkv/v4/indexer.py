"""The lightning indexer: scores compressed entries for each query (docs/semantics.md)."""

from __future__ import annotations

from torch import Tensor, nn

from cpkv.plan.segments import CompressedPlan
from cpkv.v4.compressor import Compressor
from cpkv.v4.rope import apply_rope


class Indexer(nn.Module):
    """Indexer queries, weights and its own compressed keys (ratio 4, overlapping).

    ``I[t, j] = sum_h w[t, h] * relu(q_I[t, h] . k_I[j])`` with ``w`` already scaled by
    ``D_I^-1/2 * H_I^-1/2``. Callers pass **detached** inputs: the indexer learns only
    from its KL loss.
    """

    def __init__(self, hidden: int, heads: int, head_dim: int, *, rope_dim: int, rope_base: float, ratio: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rope_dim, self.rope_base = heads, head_dim, rope_dim, rope_base
        self.input_dim = hidden
        self.wq = nn.Linear(hidden, heads * head_dim, bias=False)
        self.wweights = nn.Linear(hidden, heads, bias=False)
        self.compressor = Compressor(hidden, head_dim, ratio, rope_dim=rope_dim, rope_base=rope_base)

    @property
    def ratio(self) -> int:
        """The compress ratio of the indexer keys."""
        return self.compressor.ratio

    @property
    def prev_blocks(self) -> int:
        """Earlier blocks each key entry reads (its compressor's)."""
        return self.compressor.prev_blocks

    @property
    def key_dim(self) -> int:
        """``D_I``: width of the keys and of each query head."""
        return self.head_dim

    @property
    def feature_dim(self) -> int:
        """Width of the features the queries come from (the hidden states)."""
        return self.input_dim

    def queries(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``q_I`` ``[T, H_I, D_I]`` (RoPE at ``positions``) and scaled weights ``[T, H_I]``."""
        q = self.wq(x).unflatten(-1, (self.heads, self.head_dim))
        q = apply_rope(q, positions, rope_dim=self.rope_dim, base=self.rope_base)
        weights = self.wweights(x) * (self.head_dim**-0.5 * self.heads**-0.5)
        return q, weights

    def keys(self, x: Tensor, plan: CompressedPlan) -> Tensor | None:
        """Compressed indexer keys ``[N_c, D_I]`` of the kv-prefix inputs ``x``, or ``None``."""
        keys: Tensor | None = self.compressor(x, plan)
        return keys
