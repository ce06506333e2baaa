"""GGML blocks dequantized in torch against the `gguf` package, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_blocks_data import random_blocks
from hearth.quant.gguf_blocks import BLOCK_FORMATS, dequantize_blocks


@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS))
def test_dequantize_blocks_equals_the_gguf_package_bit_for_bit(type_id: int) -> None:
    """Every value, fp32 bits included (-0.0 vs 0.0 too): the same products in the same order."""
    import gguf

    raw = random_blocks(type_id, rows=8, cols=512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id))
    got = dequantize_blocks(type_id, torch.from_numpy(raw)).numpy()
    assert got.shape == expected.shape == (8, 512)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_dequantize_blocks_refuses_partial_blocks() -> None:
    with pytest.raises(ValueError, match="Q8_0 rows must be uint8 whole blocks of 34 bytes"):
        dequantize_blocks(8, torch.zeros(2, 33, dtype=torch.uint8))
