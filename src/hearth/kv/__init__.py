"""KV caches: one class for every layer kind and use, each codec its storage layout."""

from hearth.kv.cache import CacheSpec, KVView, LayerCache, make_caches
from hearth.kv.policy import KVPolicy, parse_kv_quant
from hearth.quant.kv_codecs import DENSE, AffineCodec, KVCodec
from hearth.quant.turbo import TurboCodec

__all__ = [
    "DENSE",
    "AffineCodec",
    "CacheSpec",
    "KVCodec",
    "KVPolicy",
    "KVView",
    "LayerCache",
    "TurboCodec",
    "make_caches",
    "parse_kv_quant",
]
