"""DeepSeek-V4 layer compression modes (docs/semantics.md)."""

from __future__ import annotations

import enum

from torch import Tensor

from cpkv.checks import check_int

INDEXER_RATIO = 4
"""The compress ratio whose layers use the lightning indexer (DeepSeek-V4)."""


class LayerCompressMode(enum.Enum):
    """What a layer attends to besides its sliding window over the original kv.

    * ``NO_COMPRESS`` (``compress_ratio <= 1``): original kv only.
    * ``INDEXER`` (``compress_ratio == 4``): plus the top-k compressed entries chosen
      by the lightning indexer.
    * ``COMPRESSOR_ONLY`` (any other ratio ``> 1``, V4 uses 128): plus every causally
      visible compressed entry.
    """

    NO_COMPRESS = "no_compress"
    COMPRESSOR_ONLY = "compressor_only"
    INDEXER = "indexer"

    @classmethod
    def from_compress_ratio(cls, compress_ratio: int) -> LayerCompressMode:
        """The mode of a layer with this ``compress_ratio``.

        Raises:
            TypeError: ``compress_ratio`` is not an int.
            ValueError: ``compress_ratio < 0``.

        Example:
            >>> LayerCompressMode.from_compress_ratio(128)
            <LayerCompressMode.COMPRESSOR_ONLY: 'compressor_only'>
        """
        ratio = check_int("compress_ratio", compress_ratio, minimum=0)
        if ratio <= 1:
            return cls.NO_COMPRESS
        return cls.INDEXER if ratio == INDEXER_RATIO else cls.COMPRESSOR_ONLY

    @property
    def compresses(self) -> bool:
        """Whether the layer attends to compressed entries at all."""
        return self is not LayerCompressMode.NO_COMPRESS


def effective_cmp_ratio(compress_ratio: int, compressed_kv: Tensor | None) -> int:
    """The ratio a layer actually runs with this step.

    When the compressor returns ``None`` (no document of the prefix is long enough to
    form one block) the compressed part is skipped and the layer behaves as
    ``NO_COMPRESS``: the effective ratio is 1. Otherwise it is ``compress_ratio``
    (with ratios ``<= 1`` reported as 1).

    Example:
        >>> effective_cmp_ratio(128, None)
        1
    """
    ratio = check_int("compress_ratio", compress_ratio, minimum=0)
    if compressed_kv is None or ratio <= 1:
        return 1
    return ratio
