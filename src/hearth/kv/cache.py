"""Dense and rotating (sliding-window) KV caches, over a pluggable per-token storage codec.

Tensors are laid out [batch, kv_heads, tokens, head_dim]. `update_and_fetch` stores the new
keys/values and returns a `KVView` of what attention must read, with each key's absolute
position so the model can build the causal and sliding-window mask without knowing the
storage order.

A `KVCodec` decides how each token is stored (plain tensors, affine codes, TurboQuant codes:
see kv/quantized.py and kv/turbo.py); the caches own the token order (growth, ring, trim).
Every codec encodes each token on its own, so token-axis slicing never splits a group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from hearth.quant.kv_codecs import DENSE, EMPTY_POSITION, KVCodec


class StoredKV(NamedTuple):
    """A cache's slots as stored: the codec's planes, for kernels that read them directly."""

    planes: tuple[torch.Tensor, ...]
    codec: KVCodec


class CacheContents(NamedTuple):
    """What a cache holds, for copying into another cache: its slots as stored, the dtype
    they decode to, and each slot's position (EMPTY_POSITION for an unused slot)."""

    stored: StoredKV
    dtype: torch.dtype
    positions: torch.Tensor


class KVView(NamedTuple):
    """Keys and values to attend over.

    `keys[:, :, :length]` are real; rows past `length` are zero padding that keeps tensor
    shapes the same across decode steps (CPU matmul kernels are compiled per shape).
    `positions` holds the absolute position of each real key; None means the keys are
    positions 0..length-1 in order, or, for a single query, that every real key is visible.
    `stored`: when set (a quantized static cache at a GPU decode step), keys and values are
    None and attention reads the encoded planes instead.
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None
    length: int
    positions: torch.Tensor | None
    stored: StoredKV | None = None

    def real(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None, "an encoded view"
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class DecodeSlot(NamedTuple):
    """Where one decode token's K/V go when a kernel writes them itself: slot `slot` of the
    dense planes `keys`/`values` [batch, kv_heads, slots, head_dim]; attention then reads
    slots 0..length-1 (every one visible to the token)."""

    keys: torch.Tensor
    values: torch.Tensor
    slot: int
    length: int


class TokenPlanes:
    """A cache's slots, encoded: dense until `quantize_after` tokens, then in `codec`.

    The switch happens after the update that reaches the threshold (so with 0, the prefill
    attends over exact K/V and is encoded right after), by re-encoding what is stored.
    """

    def __init__(self, codec: KVCodec, quantize_after: int) -> None:
        self.target = codec
        self.quantize_after = quantize_after
        self.codec: KVCodec = DENSE
        self.planes: list[torch.Tensor] = []
        self.dtype = torch.float32

    @property
    def capacity(self) -> int:
        return self.planes[0].shape[2] if self.planes else 0

    def reserve(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, keep: int) -> None:
        """Reallocate to `capacity` zero slots shaped like an encoded token, keeping `keep`."""
        sample = self.codec.encode(keys[:, :, :1], values[:, :, :1])
        grown = [p.new_zeros((*p.shape[:2], capacity, *p.shape[3:])) for p in sample]
        for new, old in zip(grown, self.planes, strict=False):
            new[:, :, :keep] = old[:, :, :keep]
        self.planes, self.dtype = grown, values.dtype

    def write(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        encoded = self.codec.encode(keys, values)
        for plane, part in zip(self.planes, encoded, strict=True):
            plane[:, :, slot : slot + part.shape[2]] = part

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot decoded (unwritten ones as zeros), in the dtype K/V came in."""
        return self.codec.decode(self.planes, self.dtype)

    def roundtrip(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as they read back once stored, for tokens attended before they are written."""
        return self.codec.decode(self.codec.encode(keys, values), values.dtype)

    def settle(self, offset: int) -> None:
        """Switch to the target codec once `offset` tokens are stored past the threshold."""
        if self.codec is self.target or offset < self.quantize_after or not self.planes:
            return
        keys, values = self.read()
        self.codec = self.target
        self.planes = list(self.codec.encode(keys, values))

    def bytes_per_slot(self) -> int:
        return sum(plane[:, :, :1].nbytes for plane in self.planes)

    def reserved_bytes(self) -> int:
        return sum(plane.nbytes for plane in self.planes)

    @property
    def stays_dense(self) -> bool:
        """Whether tokens are stored as they come, now and later (the planes are K/V)."""
        return self.codec is DENSE and self.target is DENSE

    def signature(self) -> str:
        return self.codec.signature()


class LayerCache(Protocol):
    offset: int

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        """Store new K/V and return what attention reads.

        `positions` (device tensor [tokens]) are the new tokens' absolute positions; caches
        that track their own offset may ignore it.
        """
        ...

    def trim(self, tokens: int) -> None: ...

    @property
    def nbytes(self) -> int: ...

    def signature(self) -> str:
        """The storage layout, e.g. "dense", "affine:b4:g64", "rotating:turbo:k8v3"."""
        ...

    def contents(self) -> CacheContents:
        """The slots as stored, with their positions (to continue in a static cache)."""
        ...

    def load(self, contents: CacheContents) -> None:
        """Hold what another cache's `contents` hold (this one empty)."""
        ...


# Slots a dense cache grows by: fewer, larger reallocations as a context grows.
GROWTH_STEP = 256


class DenseCache:
    """Grows in steps of `step` tokens; keys are stored in position order."""

    def __init__(
        self, step: int = GROWTH_STEP, codec: KVCodec = DENSE, quantize_after: int = 0
    ) -> None:
        self.step = step
        self.offset = 0
        self._store = TokenPlanes(codec, quantize_after)

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        end = self.offset + keys.shape[2]
        self._grow_to(end, keys, values)
        self._store.write(self.offset, keys, values)
        self.offset = end
        view = KVView(*self._store.read(), end, None)
        self._store.settle(end)
        return view

    def takes_decode_slots(self) -> bool:
        """Whether `decode_slot` gives room (tokens stored dense)."""
        return self._store.stays_dense

    def decode_slot(self, sample: torch.Tensor) -> DecodeSlot | None:
        """Room for one more token, for a kernel to write (`sample`: K or V shaped like that
        token); None when tokens are not stored dense. The token counts as stored."""
        if not self.takes_decode_slots():
            return None
        end = self.offset + 1
        self._grow_to(end, sample, sample)
        keys, values = self._store.planes
        slot, self.offset = self.offset, end
        return DecodeSlot(keys, values, slot, end)

    def _grow_to(self, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Room for slots 0..end-1, grown in whole steps (shaped like `keys`/`values`)."""
        if end > self._store.capacity:
            capacity = -(-end // self.step) * self.step
            self._store.reserve(keys, values, capacity, keep=self.offset)

    def trim(self, tokens: int) -> None:
        self.offset -= min(tokens, self.offset)

    def load(self, contents: CacheContents) -> None:
        """Hold what `contents` holds (positions 0..n-1), e.g. a static cache's prompt."""
        keys, values, first = ordered_tokens(contents)
        if first != 0:
            raise ValueError(f"a dense cache holds positions from 0, not from {first}")
        _check_empty(self.offset)
        if keys.shape[2]:
            self.update_and_fetch(keys, values)

    def contents(self) -> CacheContents:
        planes = tuple(plane[:, :, : self.offset] for plane in self._store.planes)
        device = planes[0].device if planes else None
        positions = torch.arange(self.offset, device=device)
        return CacheContents(StoredKV(planes, self._store.codec), self._store.dtype, positions)

    @property
    def nbytes(self) -> int:
        return self._store.bytes_per_slot() * self.offset

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated: the slots grown so far, stored or not."""
        return self._store.reserved_bytes()

    def signature(self) -> str:
        return self._store.signature()


class RotatingCache:
    """A ring of `capacity` slots for a sliding-window layer.

    A prefill longer than the ring attends over the old slots plus all new tokens at once,
    then keeps only the newest `capacity`; positions tell the mask which slots are in window.
    Position p always sits in slot p % capacity.
    """

    def __init__(
        self,
        window: int,
        capacity: int | None = None,
        codec: KVCodec = DENSE,
        quantize_after: int = 0,
    ) -> None:
        self.window = window
        self.capacity = capacity or window
        if self.capacity < window:
            raise ValueError("a rotating cache must hold at least its window")
        self.offset = 0
        self._store = TokenPlanes(codec, quantize_after)
        self._positions: torch.Tensor | None = None

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        self._allocate(keys, values)
        one = keys.shape[2] == 1
        view = self._decode_step(keys, values) if one else self._prefill(keys, values)
        self._store.settle(self.offset)
        return view

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The ring's slots and positions, made on first use (shaped like `keys`/`values`)."""
        if self._positions is None:
            self._store.reserve(keys, values, self.capacity, keep=0)
            self._positions = torch.full(
                (self.capacity,), EMPTY_POSITION, dtype=torch.long, device=keys.device
            )

    def _decode_step(self, keys: torch.Tensor, values: torch.Tensor) -> KVView:
        assert self._positions is not None
        self._write(keys, values, self.offset)
        self.offset += 1
        filled = min(self.offset, self.capacity)
        ring_keys, ring_values = self._store.read()
        if self.capacity == self.window:
            # Every filled slot is within the window of this query: no mask needed.
            # Slots fill in order from 0, so the filled ones are the first `filled`.
            return KVView(ring_keys, ring_values, filled, None)
        return KVView(ring_keys, ring_values, self.capacity, self._positions)

    def takes_decode_slots(self) -> bool:
        """Whether `decode_slot` gives room: stored dense in a ring of exactly the window
        (where every filled slot is visible, as in `_decode_step`)."""
        return self.capacity == self.window and self._store.stays_dense

    def decode_slot(self, sample: torch.Tensor) -> DecodeSlot | None:
        """Room for one more token, for a kernel to write (`sample`: K or V shaped like that
        token); None unless `takes_decode_slots`. The token counts as stored."""
        if not self.takes_decode_slots():
            return None
        self._allocate(sample, sample)
        assert self._positions is not None
        slot = self.offset % self.capacity
        self._positions[slot] = self.offset
        self.offset += 1
        keys, values = self._store.planes
        return DecodeSlot(keys, values, slot, min(self.offset, self.capacity))

    def _prefill(self, keys: torch.Tensor, values: torch.Tensor) -> KVView:
        assert self._positions is not None
        count, start = keys.shape[2], self.offset
        positions = torch.arange(start, start + count, device=keys.device)
        ring_keys, ring_values = self._store.read()
        # Before the ring wraps, position p sits in slot p < start and every later slot is
        # empty: attending over the empty ones only costs time (a fresh prompt's first chunk
        # would attend over a whole ring of them).
        filled = min(start, self.capacity)
        new_keys, new_values = self._store.roundtrip(keys, values)
        all_keys = torch.cat([ring_keys[:, :, :filled], new_keys], dim=2)
        all_values = torch.cat([ring_values[:, :, :filled], new_values], dim=2)
        all_positions = torch.cat([self._positions[:filled], positions])
        kept = min(count, self.capacity)
        self._write(keys[:, :, -kept:], values[:, :, -kept:], start + count - kept)
        self.offset += count
        return KVView(all_keys, all_values, all_keys.shape[2], all_positions)

    def _write(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Store tokens at positions start.. (at most `capacity`), wrapping around the ring once."""
        assert self._positions is not None
        count, slot = keys.shape[2], start % self.capacity
        first = min(count, self.capacity - slot)
        for source, ring_slot, length in ((0, slot, first), (first, 0, count - first)):
            if length == 0:
                continue
            part = slice(source, source + length)
            self._store.write(ring_slot, keys[:, :, part], values[:, :, part])
            self._positions[ring_slot : ring_slot + length] = torch.arange(
                start + source, start + source + length, device=self._positions.device
            )

    def load(self, contents: CacheContents) -> None:
        """Hold what `contents` holds (consecutive positions, the ring's newest `capacity`
        kept), e.g. a static ring's prompt."""
        keys, values, first = ordered_tokens(contents)
        _check_empty(self.offset)
        if keys.shape[2]:
            self.offset = first  # the tokens go in at their own positions (slot p % capacity)
            self.update_and_fetch(keys, values)

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
            self._positions[self._positions >= new_offset] = EMPTY_POSITION
        self.offset = new_offset

    @property
    def nbytes(self) -> int:
        return self._store.bytes_per_slot() * min(self.offset, self.capacity)

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated: the whole ring and its positions from the first token on."""
        positions = 0 if self._positions is None else self._positions.nbytes
        return self._store.reserved_bytes() + positions

    def contents(self) -> CacheContents:
        assert self._positions is not None, "an empty ring"
        stored = StoredKV(tuple(self._store.planes), self._store.codec)
        return CacheContents(stored, self._store.dtype, self._positions)

    def signature(self) -> str:
        return f"rotating:{self._store.signature()}"


def ordered_tokens(contents: CacheContents) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The keys and values `contents` holds, decoded, in position order, and the first
    position; ValueError unless the positions are consecutive (what every cache holds)."""
    (planes, codec), dtype, positions = contents
    keys, values = codec.decode(planes, dtype)
    filled = positions != EMPTY_POSITION
    held, order = positions[filled].sort()
    first = int(held[0]) if held.numel() else 0
    expected = torch.arange(first, first + held.numel(), device=held.device)
    if not torch.equal(held, expected):
        raise ValueError("a cache's positions must be consecutive")
    slots = filled.nonzero().flatten()[order]
    return keys[:, :, slots], values[:, :, slots], first


def _check_empty(offset: int) -> None:
    if offset:
        raise ValueError("contents load into an empty cache only")


class CacheSpec(NamedTuple):
    """What a model declares about one layer that stores K/V (`Model.cache_specs`): all a
    cache factory, a footprint or a KV layout check needs to know of it."""

    index: int
    kind: str
    kv_heads: int
    head_dim: int
    window: int | None  # a sliding-window layer's window; None: attends to every token


CacheFactory = Callable[[CacheSpec], LayerCache]


def dense_cache(spec: CacheSpec) -> LayerCache:
    """Rotating on sliding-window layers, dense on full-attention layers."""
    return DenseCache() if spec.window is None else RotatingCache(spec.window)


def make_caches(
    specs: Sequence[CacheSpec], factory: CacheFactory = dense_cache
) -> list[LayerCache]:
    """One cache per layer that stores K/V (`Model.cache_specs`), built by `factory` (e.g. a
    `KVPolicy`)."""
    return [factory(spec) for spec in specs]
