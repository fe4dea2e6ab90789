"""Learned gated pooling of ``m`` tokens into one compressed kv entry (docs/semantics.md)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from cpkv.plan.segments import CompressedPlan
from cpkv.v4.rope import apply_rope


class Compressor(nn.Module):
    """Gated pooling compressor, computed in fp32.

    Entry ``j`` of a document pools block ``j`` (tokens ``j*m .. (j+1)*m - 1`` from the
    document start): ``C_j[c] = sum_i softmax_i(z_i[c]) * a_i[c]`` with ``a = Wkv x``,
    ``z = Wgate x + ape[i mod m]``. With ``overlap`` (V4 uses it for ``m = 4``)
    ``Wkv``, ``Wgate`` and ``ape`` are ``2 * head_dim`` wide and entry ``j`` pools 2m
    slots: the previous block's first-half channels and this block's second-half
    channels (the previous block is empty, score -inf, for ``j = 0``). Then RMSNorm and
    RoPE on the last ``rope_dim`` channels at position ``j * m``. Trailing partial
    blocks produce no entry.
    """

    def __init__(
        self, hidden: int, head_dim: int, ratio: int, *, rope_dim: int, rope_base: float, overlap: bool | None = None
    ) -> None:
        super().__init__()
        if ratio < 2:
            raise ValueError(f"ratio must be >= 2 for a compressor, got {ratio}")
        self.ratio, self.head_dim, self.rope_dim, self.rope_base = ratio, head_dim, rope_dim, rope_base
        self.input_dim = hidden
        self.overlap = ratio == 4 if overlap is None else overlap
        width = head_dim * (2 if self.overlap else 1)
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.randn(ratio, width) * 0.1)
        self.norm_weight = nn.Parameter(torch.ones(head_dim))

    @property
    def prev_blocks(self) -> int:
        """Earlier blocks of the same document each entry reads: 1 with the overlap, else 0."""
        return 1 if self.overlap else 0

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``a``, ``z`` (without ``ape``) of every row of ``x`` -> ``[T_kv, width]`` each, fp32 (fp64 for fp64 input).

        Projecting the rows before gathering them into blocks keeps one fp32 copy of ``x``
        (shared by both projections and saved once for backward), not one ``[N_c, m, hidden]``
        copy per block gather.
        """
        tokens = x.float() if x.dtype != torch.float64 else x
        dtype = tokens.dtype
        return nn.functional.linear(tokens, self.wkv.weight.to(dtype)), nn.functional.linear(tokens, self.wgate.weight.to(dtype))

    def forward(self, x: Tensor, plan: CompressedPlan) -> Tensor | None:
        """Compress the packed kv-prefix inputs ``x``.

        Args:
            x: ``[T_kv, hidden]`` compressor inputs of the kv prefix segments (packed,
                each segment starting at its document start).
            plan: the :class:`CompressedPlan` of these segments at ``self.ratio``.

        Returns:
            ``[N_c, head_dim]`` entries in document order (fp32, fp64 for fp64 input), or
            ``None`` when no segment holds a full block (under ``torch.compile``, ``[0, head_dim]``:
            the graph does not branch on the packing).
        """
        if plan.ratio != self.ratio:
            raise ValueError(f"plan.ratio ({plan.ratio}) must equal the compressor's ratio ({self.ratio})")
        if not torch.compiler.is_compiling() and plan.num_entries == 0:  # compiled: [0, head_dim], no branch
            return None
        slots = torch.arange(self.ratio, device=x.device)
        rows = plan.block_starts[:, None] + slots
        a_rows, z_rows = self._project(x)
        ape = self.ape.to(a_rows.dtype)
        a, z = a_rows[rows], z_rows[rows] + ape
        if self.overlap:
            d = self.head_dim
            prev = (rows - self.ratio).clamp(min=0)
            a_prev, z_prev = a_rows[prev], z_rows[prev] + ape
            first = (plan.entry_positions == 0)[:, None, None]
            # halves by split, whose backward concatenates: a slice's backward scatters into zeros, and
            # inductor's reinplacing of that scatter guards on the block count being < 2 (a recompile)
            (a_prev, _), (_, a), (z_prev, _), (_, z) = (torch.split(t, d, dim=-1) for t in (a_prev, a, z_prev, z))
            z_prev = z_prev.masked_fill(first, float("-inf"))
            a = torch.cat([a_prev.masked_fill(first, 0.0), a], dim=1)
            z = torch.cat([z_prev, z], dim=1)
        pooled = (torch.softmax(z, dim=1) * a).sum(dim=1)
        normed = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight.to(pooled.dtype)
        positions = plan.entry_positions[: normed.shape[0]]  # compiled: the rows' own size (no guard on N_c < 2)
        return apply_rope(normed, positions, rope_dim=self.rope_dim, base=self.rope_base)
