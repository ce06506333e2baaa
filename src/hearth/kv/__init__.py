"""KV caches: each class owns its storage layout (update, fetch, trim, bytes)."""

from hearth.kv.cache import DenseCache, LayerCache, RotatingCache, make_caches

__all__ = ["DenseCache", "LayerCache", "RotatingCache", "make_caches"]
