"""Bytes a model's KV caches take, before any exists: what `--memory-budget` admits and
`hearth inspect` reports.

Each layer that computes K/V allocates as its eager cache does (`make_caches`): a
full-attention layer grows in steps of `GROWTH_STEP` tokens, a sliding-window layer takes
its whole ring (and the ring's positions) with the first token, and each token costs what
its layer's codec stores. Gemma 4's KV-sharing layers own no cache. Quantized layers store
dense K/V until `quantize_after` tokens, so those dense bytes count too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hearth.kv.cache import DENSE, GROWTH_STEP, CacheSpec, KVCodec
from hearth.kv.policy import KVPolicy

POSITION_BYTES = 8  # a ring slot's position, int64


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
    quantize_after: int

    @classmethod
    def of(
        cls, specs: Sequence[CacheSpec], dtype: torch.dtype, policy: KVPolicy | None = None
    ) -> KVFootprint:
        policy = policy or KVPolicy()
        layers = []
        for spec in specs:
            heads = spec.kv_heads
            codec = policy.codec_of(spec.index, spec.window)
            layers.append(
                LayerBytes(
                    token_bytes(DENSE, heads, spec.head_dim, dtype),
                    token_bytes(codec, heads, spec.head_dim, dtype),
                    spec.window,
                )
            )
        quantized = any(layer.stored != layer.dense for layer in layers)
        return cls(tuple(layers), policy.quantize_after if quantized else 0)

    def bytes_at(self, tokens: int) -> int:
        """The most bytes the caches hold on the way to `tokens` tokens of context: at
        `tokens`, or, if quantized layers wait for `quantize_after` tokens, when they still
        hold those dense."""
        if tokens < self.quantize_after:
            return self._reserved(tokens, dense=True)
        held_dense = self._reserved(self.quantize_after, dense=True) if self.quantize_after else 0
        return max(held_dense, self._reserved(tokens, dense=False))

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

    def _reserved(self, tokens: int, dense: bool) -> int:
        if tokens == 0:
            return 0
        total = 0
        for layer in self.layers:
            per_token = layer.dense if dense else layer.stored
            if layer.window is None:
                total += per_token * -(-tokens // GROWTH_STEP) * GROWTH_STEP
            else:
                total += (per_token + POSITION_BYTES) * layer.window
        return total
