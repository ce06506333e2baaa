"""KV caches: each class owns its token order, each codec its storage layout."""

from hearth.kv.cache import (
    DENSE,
    DenseCache,
    KVCodec,
    KVView,
    LayerCache,
    LayerSpec,
    RotatingCache,
    layer_specs,
    make_caches,
)
from hearth.kv.policy import KVPolicy, parse_kv_quant
from hearth.kv.quantized import AffineCodec, QuantizedCache, RotatingQuantizedCache
from hearth.kv.turbo import TurboCodec

__all__ = [
    "DENSE",
    "AffineCodec",
    "DenseCache",
    "KVCodec",
    "KVPolicy",
    "KVView",
    "LayerCache",
    "LayerSpec",
    "QuantizedCache",
    "RotatingCache",
    "RotatingQuantizedCache",
    "TurboCodec",
    "layer_specs",
    "make_caches",
    "parse_kv_quant",
]
