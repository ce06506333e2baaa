"""Caches in the MLX affine layout (`quant.kv_codecs.AffineCodec`), named as mlx-lm names them."""

from __future__ import annotations

from hearth.kv.cache import DenseCache, RotatingCache
from hearth.quant.kv_codecs import AffineCodec


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
