"""Bytes a model's KV caches take, before any exists: what `--memory-budget` admits and
`hearth inspect` reports.

Each layer that stores K/V allocates as its eager cache does (`LayerCache`): a full-attention
layer grows in steps of `GROWTH_STEP` slots, a sliding-window layer takes its whole ring with
the first token, and each slot costs what its layer's codec stores plus its position.
Gemma 4's KV-sharing layers own no cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hearth.kv.cache import GROWTH_STEP, CacheSpec
from hearth.kv.policy import KVPolicy
from hearth.quant.kv_codecs import DENSE, KVCodec

POSITION_BYTES = 8  # a slot's position, int64


def token_bytes(codec: KVCodec, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V in `codec`'s layout (every plane, scales included)."""
    sample = torch.zeros(1, kv_heads, 1, head_dim, dtype=dtype)
    return sum(plane.nbytes for plane in codec.encode(sample, sample))


@dataclass(frozen=True)
class LayerBytes:
    dense: int  # a token's K/V as it comes
    stored: int  # a token's K/V in the layer's layout
    window: int | None  # a sliding layer's ring; None: every token


@dataclass(frozen=True)
class KVFootprint:
    """The caches' bytes as a function of the context, for one model, dtype and policy."""

    layers: tuple[LayerBytes, ...]

    @classmethod
    def of(
        cls, specs: Sequence[CacheSpec], dtype: torch.dtype, policy: KVPolicy | None = None
    ) -> KVFootprint:
        policy = policy or KVPolicy()
        layers = []
        for spec in specs:
            codec = policy.codec_of(spec.index, spec.window)
            layers.append(
                LayerBytes(
                    token_bytes(DENSE, spec.kv_heads, spec.head_dim, dtype),
                    token_bytes(codec, spec.kv_heads, spec.head_dim, dtype),
                    spec.window,
                )
            )
        return cls(tuple(layers))

    def bytes_at(self, tokens: int) -> int:
        """The bytes the caches hold at a context of `tokens` (they never shrink before)."""
        if tokens == 0:
            return 0
        total = 0
        for layer in self.layers:
            slots = layer.window or -(-tokens // GROWTH_STEP) * GROWTH_STEP
            total += (layer.stored + POSITION_BYTES) * slots
        return total

    def longest_context(self, room_bytes: int, max_context: int) -> int:
        """The most tokens, up to `max_context`, whose caches fit in `room_bytes` (0 if none:
        a negative room, or one under the first token's allocation)."""
        if room_bytes < 0:
            return 0
        fits, over = 0, max_context + 1  # the bytes never shrink as the context grows
        while over - fits > 1:
            middle = (fits + over) // 2
            if self.bytes_at(middle) <= room_bytes:
                fits = middle
            else:
                over = middle
        return fits
