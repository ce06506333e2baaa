"""Static KV caches: fixed buffers written at device-side positions.

Nothing in `update_and_fetch` depends on Python state that changes between decode steps, so
a decode step over these caches can be captured once in a CUDA graph and replayed. Each cache
keeps its own next-position counter on the device; attention reads the first `view_length`
slots (a bucket the graph runner sets, so one graph serves many steps) and masks the rest by
position.
"""

from __future__ import annotations

import torch

from hearth.kernels import kernel_enabled
from hearth.kernels.kv_write import append_token_triton
from hearth.kv.cache import EMPTY_POSITION, KVView


class StaticCache:
    """`capacity` slots in position order (full layers) or a ring of `window` slots."""

    def __init__(self, capacity: int, window: int | None = None) -> None:
        self.window = window
        self.capacity = window if window is not None else capacity
        self.view_length = self.capacity
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._next: torch.Tensor | None = None

    def _allocate(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        shape = (*keys.shape[:2], self.capacity)
        self._keys = keys.new_zeros((*shape, keys.shape[3]))
        self._values = values.new_zeros((*shape, values.shape[3]))
        self._positions = torch.full((self.capacity,), EMPTY_POSITION, device=keys.device)
        self._next = torch.zeros((), dtype=torch.long, device=keys.device)

    @property
    def offset(self) -> int:
        """Tokens stored so far (reads the device counter: not for the hot path)."""
        return 0 if self._next is None else int(self._next)

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        if self._keys is None:
            self._allocate(keys, values)
        assert self._keys is not None and self._values is not None
        assert self._positions is not None and self._next is not None
        count = keys.shape[2]
        if count == 1 and positions is not None and kernel_enabled(keys):
            # One launch instead of ~7: the decode step's hot path.
            append_token_triton(
                positions, keys, values, self._keys, self._values, self._positions, self._next
            )
            return self._view()
        positions = self._next + torch.arange(count, device=keys.device)  # own counter
        ring_prefill = self.window is not None and count > 1
        if ring_prefill:
            # As RotatingCache: attend over the old slots and every new token, keep the newest.
            view = KVView(
                torch.cat([self._keys, keys], dim=2),
                torch.cat([self._values, values], dim=2),
                self.capacity + count,
                torch.cat([self._positions, positions]),
            )
        kept = min(count, self.capacity)
        slots = positions[-kept:] % self.capacity
        self._keys.index_copy_(2, slots, keys[:, :, -kept:])
        self._values.index_copy_(2, slots, values[:, :, -kept:])
        self._positions.index_copy_(0, slots, positions[-kept:])
        self._next.add_(count)
        return view if ring_prefill else self._view()

    def _view(self) -> KVView:
        assert self._keys is not None and self._values is not None
        assert self._positions is not None
        length = self.capacity if self.window is not None else self.view_length
        return KVView(
            self._keys[:, :, :length],
            self._values[:, :, :length],
            length,
            self._positions[:length],
        )

    def reset(self, offset: int = 0) -> None:
        """Forget tokens from `offset` on (a graph's warm-up step wrote one)."""
        if self._next is None or self._positions is None:
            return
        self._positions[self._positions >= offset] = EMPTY_POSITION
        self._next.fill_(offset)

    def trim(self, tokens: int) -> None:
        self.reset(max(0, self.offset - tokens))

    @property
    def nbytes(self) -> int:
        if self._keys is None or self._values is None:
            return 0
        per_token = self._keys[:, :, :1].nbytes + self._values[:, :, :1].nbytes
        return per_token * min(self.offset, self.capacity)

    def signature(self) -> str:
        return "static" if self.window is None else "static-ring"
