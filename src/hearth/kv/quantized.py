"""MLX affine KV layout: per token and head, packed codes, scales and biases per group.

Groups run along head_dim, so each token is quantized on its own (as `mx.quantize` does on
[..., head_dim] K/V, which is what mlx-lm's QuantizedKVCache stores). Per token and KV head a
b-bit cache of group g costs head_dim·b/8 bytes of codes plus 2·head_dim/g scale/bias
values in the model dtype, for K and for V. The torch path dequantizes on read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hearth.kv.cache import DenseCache, RotatingCache
from hearth.quant.mlx import AffineSpec, dequantize_affine, quantize_affine

AFFINE_PLANES = 3  # packed codes, scales, biases


@dataclass(frozen=True)
class AffineCodec:
    """K and V each stored as `mx.quantize(x, group_size, bits)` would produce them."""

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        AffineSpec(self.bits, self.group_size)  # rejects widths and groups MLX lacks

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.group_size:
            raise ValueError(
                f"KV quantization with group size {self.group_size} needs a head_dim that is a "
                f"multiple of it; this layer has head_dim {head_dim}"
            )

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*self.quantize(keys), *self.quantize(values))

    def decode(
        self, planes: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dequantize(planes[:AFFINE_PLANES]), self.dequantize(planes[AFFINE_PLANES:])

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return quantize_affine(x, self.bits, self.group_size)

    def dequantize(self, planes: Sequence[torch.Tensor]) -> torch.Tensor:
        packed, scales, biases = planes
        return dequantize_affine(packed, scales, biases, self.bits, self.group_size)

    def signature(self) -> str:
        return f"affine:b{self.bits}:g{self.group_size}"


class QuantizedCache(DenseCache):
    """A full-attention cache in the affine layout (dense for the first `quantize_after`)."""

    def __init__(
        self, bits: int = 4, group_size: int = 64, quantize_after: int = 0, step: int = 256
    ) -> None:
        super().__init__(step, AffineCodec(bits, group_size), quantize_after)


class RotatingQuantizedCache(RotatingCache):
    """A sliding-window ring in the affine layout."""

    def __init__(
        self,
        window: int,
        bits: int = 4,
        group_size: int = 64,
        quantize_after: int = 0,
        capacity: int | None = None,
    ) -> None:
        super().__init__(window, capacity, AffineCodec(bits, group_size), quantize_after)
