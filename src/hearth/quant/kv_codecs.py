"""How a KV cache stores each token: dense, or MLX affine codes (TurboQuant: `quant.turbo`).

A codec maps K/V [batch, kv_heads, tokens, head_dim] to planes [batch, kv_heads, tokens, ...]
and back; all-zero planes decode to zeros. Each token is encoded on its own, so slicing along
the token axis never splits a group. Maths only: the caches that hold planes live in `kv/`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from hearth.quant.mlx import AffineSpec, dequantize_affine, quantize_affine


class KVCodec(Protocol):
    """How tokens are stored: K/V [batch, kv_heads, tokens, head_dim] <-> planes.

    Each plane is [batch, kv_heads, tokens, ...]; all-zero planes decode to zeros, so a
    cache's unwritten (padding) slots read as zero.
    """

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]: ...

    def decode(
        self, planes: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def signature(self) -> str: ...

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError if this layout cannot store vectors of `head_dim`."""
        ...


class DenseCodec:
    """K and V stored as they come: the planes are the tensors attention reads."""

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return keys, values

    def decode(
        self, planes: Sequence[torch.Tensor], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return planes[0], planes[1]

    def signature(self) -> str:
        return "dense"

    def check_head_dim(self, head_dim: int) -> None:
        return None


DENSE = DenseCodec()


AFFINE_PLANES = 3  # packed codes, scales, biases


@dataclass(frozen=True)
class AffineCodec:
    """K and V each stored as `mx.quantize(x, group_size, bits)` would produce them: per
    token and KV head, packed codes plus a scale and a bias per group along head_dim (what
    mlx-lm's QuantizedKVCache stores), head_dim·b/8 bytes of codes plus 2·head_dim/g scale
    and bias values in the model dtype, for K and for V."""

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


# Position of an empty slot: in the future of every query, so causality hides it.
EMPTY_POSITION = 2**62
