"""Weight-only quantization (int8 per row, int4 per group) for memory-bound CPU decode."""

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

__all__ = [
    "HAS_INT4_KERNEL",
    "HAS_INT8_KERNEL",
    "Int4Linear",
    "Int8Linear",
    "QuantizedEmbeddingHead",
    "dequantize_int4_groups",
    "dequantize_int8_rows",
    "quantize_int4_groups",
    "quantize_int8_rows",
    "quantize_model",
]
