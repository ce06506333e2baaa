"""Static KV caches: fixed buffers written at device-side positions.

Nothing in `update_and_fetch` depends on Python state that changes between decode steps, so
a decode step over these caches can be captured once in a CUDA graph and replayed. Each cache
keeps its own next-position counter on the device; attention reads the first `view_length`
slots (a bucket the graph runner sets, so one graph serves many steps) and masks the rest by
position.

Slots hold tokens encoded by a `KVCodec` (dense, affine, TurboQuant), as the dynamic caches
do, with their default policy: the first update (the prompt's first chunk) attends over
exact K/V, every later one over K/V as stored. A one-token step on the GPU returns a view of
the stored planes, which the decode-attention kernel reads without decoding them.
"""

from __future__ import annotations

import torch

from hearth.kv.cache import DENSE, EMPTY_POSITION, CacheContents, KVCodec, KVView, StoredKV
from hearth.kv.quantized import AffineCodec
from hearth.ops import kernel_enabled
from hearth.ops.kv_quantize import KERNEL_BITS as AFFINE_APPEND_BITS
from hearth.ops.kv_quantize import (
    quantize_append_triton,
    turbo_append_triton,
    turbo_kernel_agrees,
)
from hearth.ops.kv_write import append_token_triton
from hearth.ops.rope import CacheWrite
from hearth.quant.turbo import TurboCodec


def _as_indexable(plane: torch.Tensor) -> torch.Tensor:
    """`index_copy_` has no uint32 kernel: copy packed words as int32 (same bits)."""
    return plane.view(torch.int32) if plane.dtype == torch.uint32 else plane


class StaticCache:
    """`capacity` slots in position order (full layers) or a ring of `window` slots."""

    def __init__(self, capacity: int, window: int | None = None, codec: KVCodec = DENSE) -> None:
        self.window = window
        self.capacity = window if window is not None else capacity
        self.view_length = self.capacity
        self.codec = codec
        self._planes: list[torch.Tensor] = []
        self._dtype = torch.float32
        self._positions: torch.Tensor | None = None
        self._next: torch.Tensor | None = None
        # Nothing stored since construction or `reset(0)`: the next chunk is a prompt's first,
        # attended over its exact K/V.
        self._fresh = True
        # Set by a graph runner around a padded first chunk: how many of the chunk's tokens
        # are real (a device scalar, read at replay); the rest is padding, never stored.
        self.real_tokens: torch.Tensor | None = None

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        sample = self.codec.encode(keys[:, :, :1], values[:, :, :1])
        self._planes = [p.new_zeros((*p.shape[:2], self.capacity, *p.shape[3:])) for p in sample]
        self._dtype = values.dtype
        self._positions = torch.full((self.capacity,), EMPTY_POSITION, device=keys.device)
        self._next = torch.zeros((), dtype=torch.long, device=keys.device)

    @property
    def offset(self) -> int:
        """Tokens stored so far (reads the device counter: not for the hot path)."""
        return 0 if self._next is None else int(self._next)

    @property
    def is_fresh(self) -> bool:
        """Nothing stored since construction or `reset(0)`."""
        return self._fresh

    def mark_filled(self) -> None:
        """A replayed graph stored a chunk here (its Python side ran only at capture)."""
        self._fresh = False

    @property
    def is_dense(self) -> bool:
        return self.codec is DENSE

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        if not self._planes:
            self._allocate(keys, values)
        first, self._fresh = self._fresh, False
        assert self._positions is not None and self._next is not None
        count = keys.shape[2]
        if self.real_tokens is not None and count > 1:
            if first:
                return self._store_padded_chunk(keys, values, self.real_tokens)
            return self._store_padded_continuation(keys, values, self.real_tokens)
        if count == 1 and positions is not None and self.is_dense and kernel_enabled(keys):
            # One launch instead of ~7: the decode step's hot path.
            key_plane, value_plane = self._planes
            append_token_triton(
                positions, keys, values, key_plane, value_plane, self._positions, self._next
            )
            return self._view(stored=True)
        if count == 1 and positions is not None and self._turbo_kernel_applies(keys):
            # Three or four launches instead of ~150 torch ops: rotate, code, store.
            assert isinstance(self.codec, TurboCodec)
            turbo_append_triton(
                positions, keys, values, self._planes, self._positions, self._next, self.codec
            )
            return self._view(stored=True)
        if count == 1 and positions is not None and self._affine_kernel_applies(keys):
            # One launch instead of ~100 torch ops: quantize and store in the MLX layout.
            assert isinstance(self.codec, AffineCodec)
            quantize_append_triton(
                positions,
                keys,
                values,
                self._planes,
                self._positions,
                self._next,
                self.codec.bits,
                self.codec.group_size,
            )
            return self._view(stored=True)
        new_positions = self._next + torch.arange(count, device=keys.device)
        ring_prefill = self.window is not None and count > 1
        if first:
            # Nothing is stored yet: attend over exact K/V, as the dynamic caches do. A fresh
            # cache starts at position 0, so the keys are 0..count-1 in order (positions None),
            # which lets a GPU prefill use SDPA's causal flash kernel.
            view = KVView(keys, values, count, None)
        elif ring_prefill:
            # As RotatingCache: attend over the old slots and every new token, keep the newest.
            old_keys, old_values = self._decoded(self.capacity)
            new_keys, new_values = self._roundtrip(keys, values)
            view = KVView(
                torch.cat([old_keys, new_keys], dim=2),
                torch.cat([old_values, new_values], dim=2),
                self.capacity + count,
                torch.cat([self._positions, new_positions]),
            )
        kept = min(count, self.capacity)
        slots = new_positions[-kept:] % self.capacity
        encoded = self.codec.encode(keys[:, :, -kept:], values[:, :, -kept:])
        for plane, part in zip(self._planes, encoded, strict=True):
            _as_indexable(plane).index_copy_(2, slots, _as_indexable(part))
        self._positions.index_copy_(0, slots, new_positions[-kept:])
        self._next.add_(count)
        # Quantized planes are decoded for prefill chunks (attended by SDPA) and on the CPU.
        if first or ring_prefill:
            return view
        return self._view(stored=count == 1 and kernel_enabled(keys))

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
            gathered = _as_indexable(part).index_select(2, source)
            mask = kept.view(1, 1, span, *([1] * (part.dim() - 3)))
            stored = torch.where(mask, gathered, torch.zeros_like(gathered))
            _as_indexable(plane)[:, :, :span].copy_(stored)
        empty = torch.full_like(newest, EMPTY_POSITION)
        self._positions[:span].copy_(torch.where(kept, newest, empty))
        self._next.copy_(real)
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
            return self._view(stored=False)
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
        return view

    def _newest_held(self, span: int, last: torch.Tensor, device: torch.device) -> torch.Tensor:
        """For slots 0..span-1, which hold positions s, s + capacity, ...: the newest of them
        up to `last` (negative where none is)."""
        slots = torch.arange(span, device=device)
        return slots + self.capacity * torch.div(last - slots, self.capacity, rounding_mode="floor")

    def _turbo_kernel_applies(self, keys: torch.Tensor) -> bool:
        if not isinstance(self.codec, TurboCodec) or not kernel_enabled(keys):
            return False
        # Checked once per device against the codec before it is trusted (before any graph
        # capture: a graph's warm-up step runs first).
        return turbo_kernel_agrees(self.codec, keys.shape[-1], keys.dtype, str(keys.device))

    def _affine_kernel_applies(self, keys: torch.Tensor) -> bool:
        codec = self.codec
        return (
            isinstance(codec, AffineCodec)
            and codec.bits in AFFINE_APPEND_BITS
            and kernel_enabled(keys)
        )

    def decode_write(self, positions: torch.Tensor) -> CacheWrite | None:
        """Where a one-token step may write its K/V directly (the fused norm + RoPE kernel
        writes them), then call `view_after_write`; None when this cache cannot take that:
        not yet allocated, quantized, or not on the GPU."""
        if not self._planes or not self.is_dense or not kernel_enabled(self._planes[0]):
            return None
        assert self._positions is not None and self._next is not None
        key_plane, value_plane = self._planes
        return CacheWrite(positions, key_plane, value_plane, self._positions, self._next)

    def view_after_write(self) -> KVView:
        return self._view(stored=True)

    def _roundtrip(
        self, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_dense:
            return keys, values
        return self.codec.decode(self.codec.encode(keys, values), values.dtype)

    def _decoded(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        planes = [plane[:, :, :length] for plane in self._planes]
        return self.codec.decode(planes, self._dtype)

    def _view(self, stored: bool) -> KVView:
        """The first `view_length` slots (the whole ring on window layers).

        `stored`: a quantized cache hands attention its planes instead of decoded K/V.
        """
        assert self._positions is not None
        length = self.capacity if self.window is not None else self.view_length
        positions = self._positions[:length]
        if self.is_dense or not stored:
            keys, values = self._decoded(length)
            return KVView(keys, values, length, positions)
        planes = tuple(plane[:, :, :length] for plane in self._planes)
        return KVView(None, None, length, positions, StoredKV(planes, self.codec))

    def contents(self) -> CacheContents:
        assert self._positions is not None, "an empty cache"
        return CacheContents(
            StoredKV(tuple(self._planes), self.codec), self._dtype, self._positions
        )

    def load(self, contents: CacheContents) -> None:
        """Hold what a dynamic cache holds (a prompt-cache hit, then decoded through graphs).

        Planes are copied as they are when the codecs agree, re-encoded otherwise.
        """
        source, dtype, positions = contents
        self._fresh = False
        keys, values = source.codec.decode(source.planes, dtype)
        if not self._planes:
            self._allocate(keys, values)
        assert self._positions is not None and self._next is not None
        same_layout = source.codec.signature() == self.codec.signature()
        planes = source.planes if same_layout else self.codec.encode(keys, values)
        filled = positions != EMPTY_POSITION
        if self.window is not None and bool(filled.any()):
            # A larger ring may hold more than this one: keep the newest `capacity` tokens.
            filled &= positions > positions[filled].max() - self.capacity
        slots = positions[filled] % self.capacity
        for plane, part in zip(self._planes, planes, strict=True):
            _as_indexable(plane).index_copy_(2, slots, _as_indexable(part)[:, :, filled])
        self._positions.fill_(EMPTY_POSITION)
        self._positions.index_copy_(0, slots, positions[filled])
        self._next.fill_(int(positions[filled].max()) + 1 if bool(filled.any()) else 0)

    def reset(self, offset: int = 0) -> None:
        """Forget tokens from `offset` on (a graph's warm-up step wrote one)."""
        if offset == 0:
            self._fresh = True
        if self._next is None or self._positions is None:
            return
        if offset == 0:
            self._positions.fill_(EMPTY_POSITION)  # no mask: nothing waits for the device
        else:
            self._positions[self._positions >= offset] = EMPTY_POSITION
        self._next.fill_(offset)

    def trim(self, tokens: int) -> None:
        self.reset(max(0, self.offset - tokens))

    @property
    def nbytes(self) -> int:
        per_token = sum(plane[:, :, :1].nbytes for plane in self._planes)
        return per_token * min(self.offset, self.capacity)

    def signature(self) -> str:
        kind = "static" if self.window is None else "static-ring"
        return kind if self.is_dense else f"{kind}:{self.codec.signature()}"
