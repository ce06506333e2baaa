"""Random GGML blocks of every type Hearth computes on, made by or for the `gguf` package."""

from __future__ import annotations

import numpy as np

# Byte offsets of each K-type block's fp16 fields (d, and dmin where the type has one).
_K_HALVES = {10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}
# Types `gguf.quants.quantize` writes: quantized from random weights.
QUANTIZABLE = (2, 3, 6, 7, 8)


def random_blocks(type_id: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row] of `type_id`: a Gaussian matrix quantized by the `gguf`
    package where it can; else random bytes (every bit pattern of codes and packed scales is a
    valid block) with finite fp16 scales of a weight's magnitude."""
    import gguf

    quant_type = gguf.GGMLQuantizationType(type_id)
    generator = np.random.default_rng(seed)
    if type_id in QUANTIZABLE:
        weight = generator.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return gguf.quants.quantize(weight, quant_type)
    values, nbytes = gguf.GGML_QUANT_SIZES[quant_type]
    blocks = generator.integers(0, 256, (rows * cols // values, nbytes), dtype=np.uint8)
    for offset in _K_HALVES[type_id]:
        halves = (generator.standard_normal(len(blocks)) * 1e-3).astype(np.float16)
        blocks[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
