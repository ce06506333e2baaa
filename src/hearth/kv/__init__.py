"""KV caches: each class owns its storage layout (update, fetch, trim, bytes)."""

from hearth.kv.cache import DenseCache, KVView, LayerCache, RotatingCache, make_caches

__all__ = ["DenseCache", "KVView", "LayerCache", "RotatingCache", "make_caches"]
