"""Weight quantization: MLX affine groups (checkpoint format) and CPU int8/int4 decode paths."""

from hearth.quant.cpu import (
    HAS_INT4_KERNEL,
    HAS_INT8_KERNEL,
    Int4Linear,
    Int8Linear,
    QuantizedEmbeddingHead,
    dequantize_int4_groups,
    dequantize_int8_rows,
    quantize_int4_groups,
    quantize_int8_rows,
    quantize_model,
)
from hearth.quant.mlx import (
    AffineSpec,
    MLXQuantization,
    MLXQuantizedEmbedding,
    MLXQuantizedExperts,
    MLXQuantizedLinear,
    dequantize_affine,
    pack_codes,
    parse_quantization,
    quantize_affine,
    unpack_codes,
)

__all__ = [
    "HAS_INT4_KERNEL",
    "HAS_INT8_KERNEL",
    "AffineSpec",
    "Int4Linear",
    "Int8Linear",
    "MLXQuantization",
    "MLXQuantizedEmbedding",
    "MLXQuantizedExperts",
    "MLXQuantizedLinear",
    "QuantizedEmbeddingHead",
    "dequantize_affine",
    "dequantize_int4_groups",
    "dequantize_int8_rows",
    "pack_codes",
    "parse_quantization",
    "quantize_affine",
    "quantize_int4_groups",
    "quantize_int8_rows",
    "quantize_model",
    "unpack_codes",
]
