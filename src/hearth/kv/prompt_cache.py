"""The prompt cache: KV caches of finished requests, kept in a byte-capped LRU and reused by the
next request whose prompt shares a token prefix with theirs (mlx_lm.server's LRUPromptCache).

An entry is the prompt a request was prefilled from and a snapshot of its caches taken right
after that prefill, at the prompt boundary: sliding-window rings cannot be trimmed back past
their window, so caches that went on to hold the reply could not serve the next turn of a long
conversation. A new prompt looks for the entry sharing the longest token prefix with it:

* the entry's whole prompt is a prefix of the new one (an agent's next turn, a repeat): the
  entry is taken out of the LRU (one request owns a cache at a time) and used as it is (a
  repeat trims one token, which a ring can always do);
* only part of it is shared (the same system prompt, then a different question): a copy of the
  caches is trimmed, and the entry stays for the conversation it belongs to.

Either way only the rest of the prompt is prefilled (an agent's next turn: the reply and the
new message). When a ring cannot trim back to the shared prefix, the request starts from empty
caches (a miss, never a wrong reuse). Prefixes shorter than `MIN_SHARED_TOKENS` (the chat
template's opening, a BOS) are not worth a copy and count as misses.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hearth.kv.cache import LayerCache

DEFAULT_MAX_BYTES = 2 * 2**30
DEFAULT_MAX_ENTRIES = 10
MIN_SHARED_TOKENS = 16


@dataclass(frozen=True)
class Reuse:
    """Caches for one request, already holding its first `cached_tokens` prompt tokens (None:
    none given, the runner makes its own)."""

    caches: list[LayerCache] | None
    cached_tokens: int


@dataclass(frozen=True)
class _Entry:
    tokens: tuple[int, ...]
    caches: list[LayerCache]
    nbytes: int


def common_prefix_length(left: Sequence[int], right: Sequence[int]) -> int:
    length = 0
    for a, b in zip(left, right, strict=False):
        if a != b:
            break
        length += 1
    return length


def caches_nbytes(caches: Sequence[LayerCache]) -> int:
    return sum(cache.nbytes for cache in caches)


class PromptCache:
    """At most `max_entries` entries and `max_bytes` of KV, least recently stored evicted first.

    Changed by the generation worker, read by /stats: the lock keeps the entries consistent.
    """

    def __init__(
        self, max_bytes: int = DEFAULT_MAX_BYTES, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_key = 0
        self._nbytes = 0  # a running total, so /stats never waits for the lock
        self._lock = threading.Lock()

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def take(self, prompt_ids: Sequence[int]) -> Reuse:
        """Caches for `prompt_ids`: the best entry trimmed to the shared prefix, else none
        (the runner makes its own)."""
        with self._lock:
            reused = self._take_longest_prefix(prompt_ids)
        if reused is not None:
            self.hits += 1
            return reused
        self.misses += 1
        return Reuse(None, 0)

    def put(self, prompt_ids: Sequence[int], caches: list[LayerCache]) -> None:
        """Keep a finished request's caches, evicting the oldest entries to fit the limits."""
        nbytes = caches_nbytes(caches)
        if nbytes > self.max_bytes or self.max_entries == 0:
            return  # it would evict everything and still not fit
        with self._lock:
            self._entries[self._next_key] = _Entry(tuple(prompt_ids), caches, nbytes)
            self._next_key += 1
            self._nbytes += nbytes
            self._evict_to_fit()

    def _take_longest_prefix(self, prompt_ids: Sequence[int]) -> Reuse | None:
        lengths = {
            key: common_prefix_length(entry.tokens, prompt_ids)
            for key, entry in self._entries.items()
        }
        best = max(lengths, key=lengths.__getitem__, default=None)
        if best is None:
            return None
        # One prompt token is always left to prefill: the first sampled token needs its logits.
        reusable = min(lengths[best], len(prompt_ids) - 1)
        if reusable < MIN_SHARED_TOKENS:
            return None
        entry = self._entries[best]
        if lengths[best] == len(entry.tokens):
            del self._entries[best]
            self._nbytes -= entry.nbytes
            caches = entry.caches
        else:
            self._entries.move_to_end(best)  # used: the least recently used go first
            caches = copy_caches(entry.caches)
        return Reuse(caches, reusable) if _trim_to(caches, reusable) else None

    def _evict_to_fit(self) -> None:
        while self._entries and (
            self._nbytes > self.max_bytes or len(self._entries) > self.max_entries
        ):
            _, oldest = self._entries.popitem(last=False)
            self._nbytes -= oldest.nbytes


def copy_caches(caches: list[LayerCache]) -> list[LayerCache]:
    with torch.inference_mode():  # the caches' tensors were made in inference mode
        return copy.deepcopy(caches)


def snapshot_caches(caches: list[LayerCache]) -> list[LayerCache]:
    """Copies of a request's caches to keep, holding just their tokens as stored (a graph
    decoder's pinned caches are sized for its whole context)."""
    with torch.inference_mode():  # the caches' tensors were made in inference mode
        return [cache.compacted() for cache in caches]


def _trim_to(caches: list[LayerCache], tokens: int) -> bool:
    """Trim every cache to its first `tokens`; false if a ring no longer holds them."""
    try:
        with torch.inference_mode():  # the caches' tensors were made in inference mode
            for cache in caches:
                cache.trim(cache.offset - tokens)
    except ValueError:
        return False
    return True
