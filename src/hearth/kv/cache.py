"""A layer's KV cache: slots of tokens encoded by a codec, each slot's absolute position.

One class serves every use. A full-attention layer keeps position p in slot p; a
sliding-window layer keeps a ring, p in slot p % capacity. Tensors are laid out
[batch, kv_heads, slots, ...]. `update_and_fetch` stores new keys/values and returns a `KVView`
of what attention must read, with each key's position where the order or the window needs it,
so the model builds the causal and sliding-window mask without knowing the storage order.

Eager (a CPU, or a GPU step outside a CUDA graph), a full layer's slots grow in steps of
`GROWTH_STEP` as tokens come and attention reads exactly the stored tokens. Pinned (`pin`, by a
CUDA-graph decoder), the slots are allocated once and nothing a decode step does depends on
Python state: the write position is a device counter, and attention reads the first
`view_length` slots (a bucket the decoder sets, so one graph serves many steps), masked by
position. A prompt cache keeps eager caches and a graph decoder copies them into its pinned
ones as stored: the same layout, no conversion.

The first chunk stored in an empty cache (a prompt's) is attended over its exact K/V; every
later one over K/V as stored, which for a quantized codec means decoded from its codes. At a
GPU decode step attention reads the stored planes themselves (the decode kernel decodes them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from hearth.ops import kernel_enabled
from hearth.ops.kv_quantize import KERNEL_BITS as AFFINE_APPEND_BITS
from hearth.ops.kv_quantize import quantize_append_triton, turbo_append_triton, turbo_kernel_agrees
from hearth.ops.kv_write import append_token_triton
from hearth.ops.rope import CacheWrite
from hearth.quant.kv_codecs import DENSE, EMPTY_POSITION, AffineCodec, KVCodec
from hearth.quant.turbo import TurboCodec

# Slots a full-attention layer's eager cache grows by: fewer, larger reallocations.
GROWTH_STEP = 256


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


class PagedTables(NamedTuple):
    """Where B sequences' keys live in a paged pool (`kv.paged`), for a batched decode step:
    `tables` [B, max_blocks] int32 (row b's logical block i → pool block), `positions` [B]
    int64 (each row's query position), both on the device."""

    tables: torch.Tensor
    positions: torch.Tensor


class KVView(NamedTuple):
    """Keys and values to attend over.

    `keys[:, :, :length]` are real; rows past `length` are zero padding that keeps tensor
    shapes the same across decode steps (CPU matmul kernels are compiled per shape).
    `positions` holds the absolute position of each key; None means the keys are positions
    0..length-1 in order, or, for a single query, that every real key is visible. `stored`:
    when set (a GPU decode step), keys and values are None and attention reads the planes.
    `mask`: when set (several sequences' keys side by side), which keys each query may see,
    boolean [queries, length]; it replaces the mask made from positions. `paged`: when set
    (a batched decode step over a paged pool, `stored` then holds the pool's planes), one
    query per sequence, each reading its own blocks through its table row. `segments`: when
    set (several sequences' prompt chunks in one forward, keys and values then None), each
    sequence's own view and the run of the forward's queries that reads it, in order.
    """

    keys: torch.Tensor | None
    values: torch.Tensor | None
    length: int
    positions: torch.Tensor | None
    stored: StoredKV | None = None
    mask: torch.Tensor | None = None
    paged: PagedTables | None = None
    segments: tuple[Segment, ...] | None = None

    def real(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None, "an encoded view"
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]


class Segment(NamedTuple):
    """One sequence's part of a ragged forward's view (`KVView.segments`): what its `queries`
    queries (a run of the forward's, in order) attend over, and whether its last query goes on
    through the layers that only the last positions need (its logits are asked)."""

    view: KVView
    queries: int
    last_needed: bool


class DecodeSlot(NamedTuple):
    """Where one decode token's K/V go when a kernel writes them itself: slot `slot` of the
    dense planes `keys`/`values` [batch, kv_heads, slots, head_dim]; attention then reads
    slots 0..length-1 (every one visible to the token)."""

    keys: torch.Tensor
    values: torch.Tensor
    slot: int
    length: int


class CacheSpec(NamedTuple):
    """What a model declares about one layer that stores K/V (`Model.cache_specs`): all a
    cache factory, a footprint or a KV layout check needs to know of it."""

    index: int
    kind: str
    kv_heads: int
    head_dim: int
    window: int | None  # a sliding-window layer's window; None: attends to every token


class LayerCache:
    """One layer's slots: a ring of `window` slots, or full-attention slots that grow (eager)
    or are fixed at `pin`'s capacity."""

    def __init__(
        self, window: int | None = None, codec: KVCodec = DENSE, step: int = GROWTH_STEP
    ) -> None:
        self.window = window
        self.codec = codec
        self.step = step
        self.capacity = 0  # slots allocated (a ring: its window, from the first token on)
        # Tokens stored, the next token's position; None after a padded chunk stored on the
        # device, until read back (`offset`) or set by the graph decoder that replays it.
        self._offset: int | None = 0
        self.pinned = False
        self._pinned_capacity = 0
        # Pinned: the full layers' slots attention reads, set by the graph decoder.
        self.view_length = 0
        # Set by a graph decoder around a padded first chunk: how many of the chunk's tokens
        # are real (a device scalar, read at replay); the rest is padding, never stored.
        self.real_tokens: torch.Tensor | None = None
        self._planes: list[torch.Tensor] = []
        self._dtype = torch.float32
        self._positions: torch.Tensor | None = None
        # The next position on the device: what a pinned cache's captured steps write at.
        self._next: torch.Tensor | None = None

    @classmethod
    def pinned_at(
        cls, capacity: int, window: int | None = None, codec: KVCodec = DENSE
    ) -> LayerCache:
        """A cache of `capacity` slots fixed from the start (see `pin`)."""
        cache = cls(window, codec)
        cache.pin(capacity)
        return cache

    # -- allocation

    def pin(self, capacity: int) -> None:
        """Fix the slots at `capacity` (a ring keeps its window) for a CUDA-graph decoder:
        from now on no step reallocates or reads Python state."""
        self.pinned = True
        self.view_length = capacity if self.window is None else 0
        self._pinned_capacity = capacity

    def _reserve(self, keys: torch.Tensor, values: torch.Tensor, slots: int) -> None:
        """Room for `slots` slots, shaped like an encoded token of `keys`/`values`."""
        if self.window is not None:
            wanted = self.window
        elif self.pinned:
            wanted = self._pinned_capacity
        else:
            wanted = -(-slots // self.step) * self.step
        if self._planes and wanted <= self.capacity:
            return
        sample = self.codec.encode(keys[:, :, :1], values[:, :, :1])
        grown = [p.new_zeros((*p.shape[:2], wanted, *p.shape[3:])) for p in sample]
        positions = torch.full((wanted,), EMPTY_POSITION, device=keys.device)
        for new, old in zip(grown, self._planes, strict=False):
            new[:, :, : self.capacity] = old
        if self._positions is not None:
            positions[: self.capacity] = self._positions
        else:
            self._next = torch.zeros((), dtype=torch.long, device=keys.device)
            self._dtype = values.dtype
        self._planes, self._positions, self.capacity = grown, positions, wanted

    @property
    def offset(self) -> int:
        """Tokens stored: the next token's position (read from the device after a padded
        chunk, which stores as many as its device-side count of real tokens)."""
        if self._offset is None:
            self._offset = 0 if self._next is None else int(self._next)
        return self._offset

    @offset.setter
    def offset(self, tokens: int) -> None:
        self._offset = tokens

    @property
    def is_dense(self) -> bool:
        return self.codec is DENSE

    @property
    def is_fresh(self) -> bool:
        """Nothing stored since construction or `reset(0)`: the next chunk is a prompt's
        first, attended over its exact K/V."""
        return self.offset == 0

    # -- writing

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        """Store new K/V (positions from `offset` on) and return what attention reads.

        `positions` (device [tokens]): the new tokens' positions, which a captured decode step
        reads at replay (`offset` is not updated by a replay)."""
        count = keys.shape[2]
        first = self.is_fresh
        self._reserve(keys, values, self.offset + count)
        assert self._positions is not None and self._next is not None
        if self.real_tokens is not None and count > 1:
            padded = self._store_padded_chunk if first else self._store_padded_continuation
            return padded(keys, values, self.real_tokens)
        if count == 1 and positions is not None and self._append_kernel(keys, values, positions):
            self.offset += 1
            return self._stored_view()
        view = None
        if first:
            # Nothing is stored yet: attend over exact K/V. A fresh cache starts at position 0,
            # so the keys are 0..count-1 in order (positions None), which lets a GPU prefill
            # use SDPA's causal flash kernel.
            view = KVView(keys, values, count, None)
        elif self.window is not None and count > 1:
            view = self._ring_prefill_view(keys, values)
        self._write(keys, values)
        if view is not None:
            return view
        if count == 1 and kernel_enabled(keys):
            return self._stored_view()
        return self._read_view()

    def _append_kernel(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> bool:
        """Store one token with a GPU kernel where one takes this layout (one launch for
        ~7-150 torch ops); False where none does."""
        if not kernel_enabled(keys):
            return False
        planes, slot_positions, next_position = self._planes, self._positions, self._next
        if self.is_dense:
            key_plane, value_plane = planes
            append_token_triton(
                positions, keys, values, key_plane, value_plane, slot_positions, next_position
            )
            return True
        codec = self.codec
        if isinstance(codec, TurboCodec):
            # Checked once per device against the codec before it is trusted (before any
            # graph capture: a graph's warm-up step runs first).
            if not turbo_kernel_agrees(codec, keys.shape[-1], keys.dtype, str(keys.device)):
                return False
            turbo_append_triton(
                positions, keys, values, planes, slot_positions, next_position, codec
            )
            return True
        if isinstance(codec, AffineCodec) and codec.bits in AFFINE_APPEND_BITS:
            quantize_append_triton(
                positions,
                keys,
                values,
                planes,
                slot_positions,
                next_position,
                codec.bits,
                codec.group_size,
            )
            return True
        return False

    def _write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store tokens at positions offset.. (a ring keeps the newest `capacity` of them)."""
        assert self._positions is not None and self._next is not None
        count = keys.shape[2]
        kept = min(count, self.capacity)
        start = self._next if self.pinned else self.offset
        new_positions = start + torch.arange(count - kept, count, device=keys.device)
        slots = new_positions % self.capacity if self.window is not None else new_positions
        encoded = self.codec.encode(keys[:, :, -kept:], values[:, :, -kept:])
        for plane, part in zip(self._planes, encoded, strict=True):
            _indexable(plane).index_copy_(2, slots, _indexable(part))
        self._positions.index_copy_(0, slots, new_positions)
        self._next.add_(count)
        self.offset += count

    def _ring_prefill_view(self, keys: torch.Tensor, values: torch.Tensor) -> KVView:
        """A chunk after stored tokens on a ring: it attends over the old slots and every new
        token at once (then keeps the newest `capacity`). Before the ring wraps, position p
        sits in slot p < offset and every later slot is empty: those are left out."""
        assert self._positions is not None
        count = keys.shape[2]
        filled = self.capacity if self.pinned else min(self.offset, self.capacity)
        old_keys, old_values = self._decoded(filled)
        new_keys, new_values = self._roundtrip(keys, values)
        start = self._next if self.pinned else self.offset
        new_positions = start + torch.arange(count, device=keys.device)
        return KVView(
            torch.cat([old_keys, new_keys], dim=2),
            torch.cat([old_values, new_values], dim=2),
            filled + count,
            torch.cat([self._positions[:filled], new_positions]),
        )

    def _store_padded_chunk(
        self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor
    ) -> KVView:
        """A prompt's first chunk, padded past its `real` tokens, stored as if only those had
        come: each slot takes the newest real token it would hold (on a ring, the last
        `window` of them), every other slot zeros at an empty position. Shapes do not depend
        on `real`, so one CUDA graph serves every prompt length up to the chunk's."""
        assert self._positions is not None and self._next is not None
        count = keys.shape[2]
        # A full cache's slots past the chunk stay empty (fresh, or reset to empty); a chunk
        # longer than the cache reaches past it only with padding (real < capacity).
        span = self.capacity if self.window is not None else min(count, self.capacity)
        newest = self._newest_held(span, real - 1, keys.device)
        kept = newest >= 0
        source = newest.clamp(0, count - 1)
        for plane, part in zip(self._planes, self.codec.encode(keys, values), strict=True):
            gathered = _indexable(part).index_select(2, source)
            mask = kept.view(1, 1, span, *([1] * (part.dim() - 3)))
            stored = torch.where(mask, gathered, torch.zeros_like(gathered))
            _indexable(plane)[:, :, :span].copy_(stored)
        empty = torch.full_like(newest, EMPTY_POSITION)
        self._positions[:span].copy_(torch.where(kept, newest, empty))
        self._next.copy_(real)
        self._offset = None
        return KVView(keys, values, count, None)

    def _store_padded_continuation(
        self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor
    ) -> KVView:
        """A chunk after the stored tokens (a prompt-cache hit's new ones), padded past its
        `real` tokens: attended as the unpadded chunk would be (the padding comes after
        every real query, so causal masking hides it), stored as if only the real tokens had
        come. Dense planes only. A full cache needs room for the whole padded chunk (its
        padding rows land as zeros at empty positions); a ring's slots each take the newest
        real position they would hold, or keep their token."""
        assert self._positions is not None and self._next is not None and self.is_dense
        count = keys.shape[2]
        start = self._next.clone()
        offsets = torch.arange(count, device=keys.device)
        new_positions = start + offsets
        if self.window is None:
            is_real = offsets < real
            empty = torch.full_like(new_positions, EMPTY_POSITION)
            for plane, part in zip(self._planes, (keys, values), strict=True):
                mask = is_real.view(1, 1, count, 1)
                plane.index_copy_(2, new_positions, torch.where(mask, part, torch.zeros_like(part)))
            self._positions.index_copy_(
                0, new_positions, torch.where(is_real, new_positions, empty)
            )
            self._next.add_(real)
            self._offset = None
            return self._read_view()
        old_keys, old_values = self._decoded(self.capacity)
        view = KVView(
            torch.cat([old_keys, keys], dim=2),
            torch.cat([old_values, values], dim=2),
            self.capacity + count,
            torch.cat([self._positions, new_positions]),
        )
        newest = self._newest_held(self.capacity, start + real - 1, keys.device)
        from_chunk = newest >= start
        source = (newest - start).clamp(0, count - 1)
        for plane, part in zip(self._planes, (keys, values), strict=True):
            mask = from_chunk.view(1, 1, self.capacity, 1)
            plane.copy_(torch.where(mask, part.index_select(2, source), plane))
        self._positions.copy_(torch.where(from_chunk, newest, self._positions))
        self._next.add_(real)
        self._offset = None
        return view

    def _newest_held(self, span: int, last: torch.Tensor, device: torch.device) -> torch.Tensor:
        """For slots 0..span-1, which hold positions s, s + capacity, ...: the newest of them
        up to `last` (negative where none is)."""
        slots = torch.arange(span, device=device)
        return slots + self.capacity * torch.div(last - slots, self.capacity, rounding_mode="floor")

    # -- kernels that write the cache themselves

    def decode_write(self, positions: torch.Tensor) -> CacheWrite | None:
        """Where a one-token GPU step may write its K/V directly (the fused norm + RoPE kernel
        writes them), then call `view_after_write`; None when this cache cannot take that:
        not yet allocated, quantized, not on the GPU, or out of slots."""
        planes = self._planes
        if not planes or not self.is_dense or not kernel_enabled(planes[0]):
            return None
        if self.window is None and not self.pinned and self.offset >= self.capacity:
            return None  # an eager cache grows first, in `update_and_fetch`
        assert self._positions is not None and self._next is not None
        key_plane, value_plane = planes
        return CacheWrite(positions, key_plane, value_plane, self._positions, self._next)

    def view_after_write(self) -> KVView:
        self.offset += 1
        return self._stored_view()

    def takes_decode_slots(self) -> bool:
        """Whether `decode_slot` gives room: an eager cache storing K/V dense, a full layer or
        a ring of exactly its window (where every filled slot is visible to the token)."""
        return self.is_dense and not self.pinned

    def decode_slot(self, sample: torch.Tensor) -> DecodeSlot | None:
        """Room for one more token for a kernel to write (`sample`: K or V shaped like that
        token); None unless `takes_decode_slots`. The token counts as stored."""
        if not self.takes_decode_slots():
            return None
        self._reserve(sample, sample, self.offset + 1)
        assert self._positions is not None and self._next is not None
        position = self.offset
        slot = position % self.capacity if self.window is not None else position
        self._positions[slot] = position
        self.offset = position + 1
        keys, values = self._planes
        return DecodeSlot(keys, values, slot, min(self.offset, self.capacity))

    # -- reading

    def _read_view(self) -> KVView:
        """What a chunk after stored tokens attends over, decoded: eager, exactly the stored
        tokens (a full layer's in position order; a ring's all visible to one query when it
        holds just its window); pinned, the first `view_length` slots masked by position."""
        assert self._positions is not None
        if self.pinned:
            length = self.capacity if self.window is not None else self.view_length
            return KVView(*self._decoded(length), length, self._positions[:length])
        keys, values = self._decoded(self.capacity)
        if self.window is None:
            return KVView(keys, values, self.offset, None)
        filled = min(self.offset, self.capacity)
        return KVView(keys, values, filled, None)

    def _stored_view(self) -> KVView:
        """A GPU decode step's view: the planes as stored (dense ones are K/V themselves),
        with every slot's position, for the decode kernel."""
        assert self._positions is not None
        if self.window is not None:
            length = self.capacity
        else:
            length = self.view_length if self.pinned else self.offset
        positions = self._positions[:length]
        if self.is_dense:
            keys, values = (plane[:, :, :length] for plane in self._planes)
            return KVView(keys, values, length, positions)
        planes = tuple(plane[:, :, :length] for plane in self._planes)
        return KVView(None, None, length, positions, StoredKV(planes, self.codec))

    def _roundtrip(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V as they read back once stored, for tokens attended before they are written."""
        if self.is_dense:
            return keys, values
        return self.codec.decode(self.codec.encode(keys, values), values.dtype)

    def _decoded(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        planes = [plane[:, :, :length] for plane in self._planes]
        return self.codec.decode(planes, self._dtype)

    # -- bookkeeping

    def reset(self, offset: int = 0) -> None:
        """Forget tokens from `offset` on (a graph's warm-up step wrote one)."""
        self.offset = offset
        if self._next is None or self._positions is None:
            return
        if offset == 0:
            self._positions.fill_(EMPTY_POSITION)  # no mask: nothing waits for the device
        else:
            self._positions[self._positions >= offset] = EMPTY_POSITION
        self._next.fill_(offset)

    def trim(self, tokens: int) -> None:
        """Drop the newest `tokens`; refused when the window needs slots already overwritten."""
        new_offset = self.offset - min(tokens, self.offset)
        if self.window is not None:
            oldest_needed = max(0, new_offset - self.window + 1)
            oldest_kept = max(0, self.offset - self.capacity)
            if oldest_needed < oldest_kept:
                raise ValueError(
                    f"cannot trim {tokens} tokens: the ring of {self.capacity} no longer holds them"
                )
        self.reset(new_offset)

    def contents(self) -> CacheContents:
        """The slots as stored, with their positions (to copy into another cache)."""
        assert self._positions is not None, "an empty cache"
        return CacheContents(
            StoredKV(tuple(self._planes), self.codec), self._dtype, self._positions
        )

    def load(self, contents: CacheContents) -> None:
        """Hold what another cache of this layout holds, copied as stored (a prompt-cache
        hit going into a graph decoder's pinned caches, or a pinned cache's tokens kept)."""
        source, dtype, positions = contents
        if source.codec.signature() != self.codec.signature():
            raise ValueError(
                f"a {source.codec.signature()} cache cannot load into a "
                f"{self.codec.signature()} one"
            )
        if self.offset:
            raise ValueError("contents load into an empty cache only")
        filled = positions != EMPTY_POSITION
        newest = int(positions[filled].max()) + 1 if bool(filled.any()) else 0
        if self.window is None and int(filled.sum()) != newest:
            first = int(positions[filled].min())
            raise ValueError(f"a full-attention cache holds positions from 0, not from {first}")
        if self.window is not None and newest:
            # A larger ring may hold more than this one: keep the newest `capacity` tokens.
            filled &= positions >= newest - self.window
        sample = source.codec.decode([plane[:, :, :1] for plane in source.planes], dtype)
        self._reserve(*sample, newest)
        assert self._positions is not None and self._next is not None
        self._dtype = dtype
        held = positions[filled]
        slots = held % self.capacity if self.window is not None else held
        for plane, part in zip(self._planes, source.planes, strict=True):
            _indexable(plane).index_copy_(2, slots, _indexable(part)[:, :, filled])
        self._positions.fill_(EMPTY_POSITION)
        self._positions.index_copy_(0, slots, held)
        self._next.fill_(newest)
        self.offset = newest

    def compacted(self) -> LayerCache:
        """An eager copy holding just the stored tokens (a pinned cache's slots are sized for
        a whole context): what a prompt cache keeps."""
        copy = LayerCache(self.window, self.codec, self.step)
        if self._positions is not None and self.offset:
            copy.load(self.contents())
        return copy

    @property
    def nbytes(self) -> int:
        """Bytes of the tokens held (K/V as stored)."""
        per_token = sum(plane[:, :, :1].nbytes for plane in self._planes)
        return per_token * min(self.offset, self.capacity)

    @property
    def reserved_bytes(self) -> int:
        """Bytes allocated: the slots and their positions, stored or not."""
        positions = 0 if self._positions is None else self._positions.nbytes
        return sum(plane.nbytes for plane in self._planes) + positions

    def signature(self) -> str:
        """The storage layout, e.g. "full:dense", "ring:affine:b4:g64"."""
        kind = "full" if self.window is None else "ring"
        return f"{kind}:{self.codec.signature()}"


def _indexable(plane: torch.Tensor) -> torch.Tensor:
    """`index_copy_` has no uint32 kernel: copy packed words as int32 (same bits)."""
    return plane.view(torch.int32) if plane.dtype == torch.uint32 else plane


CacheFactory = Callable[[CacheSpec], LayerCache]


def dense_cache(spec: CacheSpec) -> LayerCache:
    """A cache storing K/V as they come: a ring on sliding-window layers."""
    return LayerCache(spec.window)


def make_caches(
    specs: Sequence[CacheSpec], factory: CacheFactory = dense_cache
) -> list[LayerCache]:
    """One cache per layer that stores K/V (`Model.cache_specs`), built by `factory` (e.g. a
    `KVPolicy`)."""
    return [factory(spec) for spec in specs]
