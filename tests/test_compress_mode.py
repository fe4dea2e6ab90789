"""LayerCompressMode from compress_ratio and the compressor-None fallback."""

import pytest
import torch

from cpkv.compress_mode import LayerCompressMode, effective_cmp_ratio


@pytest.mark.parametrize(
    ("ratio", "mode"),
    [
        (0, LayerCompressMode.NO_COMPRESS),
        (1, LayerCompressMode.NO_COMPRESS),
        (4, LayerCompressMode.INDEXER),
        (2, LayerCompressMode.COMPRESSOR_ONLY),
        (8, LayerCompressMode.COMPRESSOR_ONLY),
        (128, LayerCompressMode.COMPRESSOR_ONLY),
    ],
)
def test_mode_from_ratio(ratio: int, mode: LayerCompressMode) -> None:
    assert LayerCompressMode.from_compress_ratio(ratio) is mode
    assert mode.compresses == (ratio > 1)


def test_effective_ratio_falls_back_to_one_without_compressed_kv() -> None:
    entries = torch.zeros(3, 8)
    assert effective_cmp_ratio(128, entries) == 128
    assert effective_cmp_ratio(4, entries) == 4
    assert effective_cmp_ratio(128, None) == 1
    assert effective_cmp_ratio(0, None) == 1
