"""Dense and rotating (sliding-window) KV caches.

Tensors are laid out [batch, kv_heads, tokens, head_dim]. `update_and_fetch` stores the new
keys/values and returns a `KVView` of what attention must read, with each key's absolute
position so the model can build the causal and sliding-window mask without knowing the
storage order.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from hearth.config import SLIDING_ATTENTION, Gemma4Config, ModelConfig

# Position of an empty slot: in the future of every query, so causality hides it.
_EMPTY = 2**62


class KVView(NamedTuple):
    """Keys and values to attend over.

    `keys[:, :, :length]` are real; rows past `length` are zero padding that keeps tensor
    shapes the same across decode steps (CPU matmul kernels are compiled per shape).
    `positions` holds the absolute position of each real key; None means the keys are
    positions 0..length-1 in order, or, for a single query, that every real key is visible.
    """

    keys: torch.Tensor
    values: torch.Tensor
    length: int
    positions: torch.Tensor | None

    def real(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class LayerCache(Protocol):
    offset: int

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> KVView:
        """Store new K/V and return what attention reads."""
        ...

    def trim(self, tokens: int) -> None: ...

    @property
    def nbytes(self) -> int: ...


class DenseCache:
    """Grows in steps of `step` tokens; keys are stored in position order."""

    def __init__(self, step: int = 256) -> None:
        self.step = step
        self.offset = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, needed: int) -> None:
        capacity = 0 if self._keys is None else self._keys.shape[2]
        if needed <= capacity:
            return
        new_capacity = -(-needed // self.step) * self.step
        grown_k = keys.new_zeros((*keys.shape[:2], new_capacity, keys.shape[3]))
        grown_v = values.new_zeros((*values.shape[:2], new_capacity, values.shape[3]))
        if self._keys is not None and self._values is not None:
            grown_k[:, :, : self.offset] = self._keys[:, :, : self.offset]
            grown_v[:, :, : self.offset] = self._values[:, :, : self.offset]
        self._keys, self._values = grown_k, grown_v

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> KVView:
        end = self.offset + keys.shape[2]
        self._reserve(keys, values, end)
        assert self._keys is not None and self._values is not None
        self._keys[:, :, self.offset : end] = keys
        self._values[:, :, self.offset : end] = values
        self.offset = end
        return KVView(self._keys, self._values, end, None)

    def trim(self, tokens: int) -> None:
        self.offset -= min(tokens, self.offset)

    @property
    def nbytes(self) -> int:
        if self._keys is None or self._values is None:
            return 0
        per_token = self._keys[:, :, :1].nbytes + self._values[:, :, :1].nbytes
        return per_token * self.offset


class RotatingCache:
    """A ring of `capacity` slots for a sliding-window layer.

    A prefill longer than the ring attends over the old slots plus all new tokens at once,
    then keeps only the newest `capacity`; positions tell the mask which slots are in window.
    """

    def __init__(self, window: int, capacity: int | None = None) -> None:
        self.window = window
        self.capacity = capacity or window
        if self.capacity < window:
            raise ValueError("a rotating cache must hold at least its window")
        self.offset = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        shape = (*keys.shape[:2], self.capacity)
        self._keys = keys.new_zeros((*shape, keys.shape[3]))
        self._values = values.new_zeros((*shape, values.shape[3]))
        self._positions = torch.full((self.capacity,), _EMPTY, dtype=torch.long, device=keys.device)

    def update_and_fetch(self, keys: torch.Tensor, values: torch.Tensor) -> KVView:
        if self._keys is None:
            self._allocate(keys, values)
        assert self._keys is not None and self._values is not None and self._positions is not None
        count, start = keys.shape[2], self.offset
        if count == 1:
            self._write(keys, values, start)
            self.offset += 1
            filled = min(self.offset, self.capacity)
            if self.capacity == self.window:
                # Every filled slot is within the window of this query: no mask needed.
                # Slots fill in order from 0, so the filled ones are the first `filled`.
                return KVView(self._keys, self._values, filled, None)
            return KVView(self._keys, self._values, self.capacity, self._positions)
        positions = torch.arange(start, start + count, device=keys.device)
        all_keys = torch.cat([self._keys, keys], dim=2)
        all_values = torch.cat([self._values, values], dim=2)
        all_positions = torch.cat([self._positions, positions])
        kept = min(count, self.capacity)
        self._write(keys[:, :, -kept:], values[:, :, -kept:], start + count - kept)
        self.offset += count
        return KVView(all_keys, all_values, all_keys.shape[2], all_positions)

    def _write(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Store tokens at positions start.. (at most `capacity`), wrapping around the ring once."""
        assert self._keys is not None and self._values is not None and self._positions is not None
        count, slot = keys.shape[2], start % self.capacity
        first = min(count, self.capacity - slot)
        for source, ring_slot, length in ((0, slot, first), (first, 0, count - first)):
            if length == 0:
                continue
            ring = slice(ring_slot, ring_slot + length)
            self._keys[:, :, ring] = keys[:, :, source : source + length]
            self._values[:, :, ring] = values[:, :, source : source + length]
            self._positions[ring] = torch.arange(
                start + source, start + source + length, device=self._positions.device
            )

    def trim(self, tokens: int) -> None:
        """Drop the newest `tokens`; refused when the window needs slots already overwritten."""
        new_offset = self.offset - min(tokens, self.offset)
        oldest_needed = max(0, new_offset - self.window + 1)
        oldest_kept = max(0, self.offset - self.capacity)
        if oldest_needed < oldest_kept:
            raise ValueError(
                f"cannot trim {tokens} tokens: the ring of {self.capacity} no longer holds them"
            )
        if self._positions is not None:
            self._positions[self._positions >= new_offset] = _EMPTY
        self.offset = new_offset

    @property
    def nbytes(self) -> int:
        if self._keys is None or self._values is None:
            return 0
        stored = min(self.offset, self.capacity)
        return (self._keys[:, :, :1].nbytes + self._values[:, :, :1].nbytes) * stored


def make_caches(config: ModelConfig) -> list[LayerCache]:
    """One cache per layer that computes K/V: rotating on sliding-window layers, dense on full.

    Gemma 4's KV-sharing layers come last and read their donor's cache, so they get none.
    """
    kinds = config.cache_layer_types if isinstance(config, Gemma4Config) else config.layer_types
    return [
        RotatingCache(config.sliding_window) if kind == SLIDING_ATTENTION else DenseCache()
        for kind in kinds
    ]
