"""KV caches: each class owns its token order, each codec its storage layout."""

from hearth.kv.cache import (
    DENSE,
    CacheSpec,
    DenseCache,
    KVCodec,
    KVView,
    LayerCache,
    RotatingCache,
    make_caches,
)
from hearth.kv.policy import KVPolicy, parse_kv_quant
from hearth.kv.quantized import QuantizedCache, RotatingQuantizedCache
from hearth.quant.kv_codecs import AffineCodec
from hearth.quant.turbo import TurboCodec

__all__ = [
    "DENSE",
    "AffineCodec",
    "CacheSpec",
    "DenseCache",
    "KVCodec",
    "KVPolicy",
    "KVView",
    "LayerCache",
    "QuantizedCache",
    "RotatingCache",
    "RotatingQuantizedCache",
    "TurboCodec",
    "make_caches",
    "parse_kv_quant",
]
