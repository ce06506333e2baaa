"""The paged KV pool: K/V in fixed-size blocks shared by many sequences, each holding a block
table, with block-level prefix sharing.

Layers that store K/V alike (window, KV heads, head_dim, codec) form a *group*; each group has
one `BlockPool` whose storage is, per layer of the group and per codec plane,
[num_blocks, kv_heads, block_size, ...]: block b of a group holds the same `block_size`
positions for every layer of the group. A sequence (`PagedSequence`) holds one block table per
group, the logical block i (positions i·block_size .. (i+1)·block_size − 1) mapped to a block
of that group's pool.

Block size. Every group uses the same token count (`DEFAULT_BLOCK_SIZE` = 16), though a
block's bytes differ per group (Gemma 4's full layers: head_dim 512 and fewer KV heads): one
block index then names the same token range in every group, so one hash chain over the
prompt's tokens serves every group's prefix cache and one admission count (blocks of tokens)
covers them all. 16 divides every Gemma sliding window (512, 1024), so a window frees whole
blocks as it moves; a sequence wastes under one block per group in its last, partly filled
block; a prefix hit is found at 16-token granularity (the shortest prefix the prompt cache ever
reused); and it is the key tile a decode kernel reads per step.

Sliding-window groups free each block once it falls wholly out of the window (nothing a later
query sees is in it), so a sequence holds about window/block_size + 1 of them whatever its
length; full-attention groups keep every block. Gemma 4's KV-sharing layers own no cache:
they read their donor's view, as with `LayerCache`.

Prefix cache. A full block of known tokens gets a hash covering its tokens and its parent's
hash (so a hash names the whole prefix up to the block's end). A block's reference count is
the number of sequences whose tables hold it; at zero a hashed block stays in its pool's
cache, least recently freed evicted first when a block is needed. A sequence reuses hashed
blocks only whole and only up to a block boundary, and writes only past them, so a shared
block is never written. On a sliding group only the blocks within the window before the hit
point are needed (the earlier ones may have been evicted): a hit stops where they are missing.

The torch reference reads a view by gathering the table's blocks (`PagedLayerCache`); what a
layer attends over is what `LayerCache` gives it: a prompt's first chunk its exact K/V, every
later chunk K/V as stored.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hearth.kv.cache import CacheSpec, DecodeSlot, KVView, PagedTables, StoredKV
from hearth.kv.footprint import token_bytes
from hearth.kv.policy import KVPolicy
from hearth.ops import kernel_enabled
from hearth.ops.kv_write import paged_append_fits, paged_append_triton
from hearth.quant.kv_codecs import KVCodec

DEFAULT_BLOCK_SIZE = 16
Hash = bytes


@dataclass(frozen=True)
class CacheGroup:
    """Layers whose caches have one shape: their window, KV heads, head_dim and codec.
    `members`: their indices in the model's `cache_specs` (the caches list)."""

    window: int | None
    kv_heads: int
    head_dim: int
    codec: KVCodec
    members: tuple[int, ...]

    def token_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one token's K/V in every layer of the group."""
        per_layer = token_bytes(self.codec, self.kv_heads, self.head_dim, dtype)
        return per_layer * len(self.members)


def cache_groups(specs: Sequence[CacheSpec], policy: KVPolicy) -> list[CacheGroup]:
    """The model's layers grouped by cache shape, in the order each group first appears."""
    keys: dict[tuple[int | None, int, int, str], list[int]] = {}
    codecs: dict[tuple[int | None, int, int, str], KVCodec] = {}
    for position, spec in enumerate(specs):
        codec = policy.codec_of(spec.index, spec.window)
        codec.check_head_dim(spec.head_dim)
        key = (spec.window, spec.kv_heads, spec.head_dim, codec.signature())
        keys.setdefault(key, []).append(position)
        codecs[key] = codec
    return [
        CacheGroup(key[0], key[1], key[2], codecs[key], tuple(members))
        for key, members in keys.items()
    ]


def block_hashes(ids: Sequence[int], block_size: int, parent: Hash = b"") -> list[Hash]:
    """The hash chain of `ids`' full blocks: each block's covers its tokens and its parent's
    (`parent`: the hash of the block before `ids`, if any)."""
    hashes: list[Hash] = []
    for start in range(0, len(ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(b",".join(str(i).encode() for i in ids[start : start + block_size]))
        parent = digest.digest()
        hashes.append(parent)
    return hashes


class BlockPool:
    """One group's blocks: storage per layer and codec plane, a free list, reference counts
    and the cache of hashed blocks (free ones evicted least recently freed first)."""

    def __init__(
        self,
        group: CacheGroup,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.group = group
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        sample = torch.zeros(1, group.kv_heads, 1, group.head_dim, dtype=dtype, device=device)
        encoded = group.codec.encode(sample, sample)
        # planes[layer][plane]: [num_blocks, kv_heads, block_size, ...]. Left uninitialised
        # (a large pool costs no memory until used): a view reads only written slots.
        self.planes: list[list[torch.Tensor]] = [
            [p.new_empty((num_blocks, p.shape[1], block_size, *p.shape[3:])) for p in encoded]
            for _ in group.members
        ]
        self.refcounts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # never-hashed free blocks, a stack
        # Blocks zeroed on their first allocation (see `allocate`).
        self._zeroed = bytearray(num_blocks)
        self._hash_of: dict[int, Hash] = {}
        self._block_of: dict[Hash, int] = {}
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # hashed, refcount 0: LRU

    @property
    def block_bytes(self) -> int:
        return sum(p[0].nbytes for layer in self.planes for p in layer)

    @property
    def free_blocks(self) -> int:
        """Blocks an allocation may take: never used, or cached and unreferenced."""
        return len(self._free) + len(self._cached_free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def cached_blocks(self) -> int:
        return len(self._block_of)

    def allocate(self) -> int:
        """A block for new tokens (reference count 1); an unhashed free one first, else the
        least recently freed cached one, whose hash is forgotten."""
        if self._free:
            block = self._free.pop()
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        else:
            raise MemoryError("the block pool is exhausted")
        self.refcounts[block] = 1
        if not self._zeroed[block]:
            # A batched decode step reads whole blocks, masked by position: the slots past a
            # sequence's last token must hold numbers (a reference that weighs them by 0 must
            # not meet NaN in never-written memory). Once per block, on its first use.
            self._zeroed[block] = 1
            torch._foreach_zero_([_indexable(p)[block] for layer in self.planes for p in layer])
        return block

    def share(self, block_hash: Hash) -> int | None:
        """The cached block of `block_hash`, one more reference taken; None if not cached."""
        block = self._block_of.get(block_hash)
        if block is None:
            return None
        if self.refcounts[block] == 0:
            del self._cached_free[block]
        self.refcounts[block] += 1
        return block

    def holds(self, block_hash: Hash) -> bool:
        return block_hash in self._block_of

    def register(self, block: int, block_hash: Hash) -> None:
        """Name a full block by its hash (a block of that hash already cached stays the one
        found: this one then stays anonymous)."""
        if block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def release(self, block: int) -> None:
        """Drop one reference; at zero a hashed block stays cached, another goes free."""
        assert self.refcounts[block] > 0, f"block {block} released twice"
        self.refcounts[block] -= 1
        if self.refcounts[block]:
            return
        if block in self._hash_of:
            self._cached_free[block] = None
        else:
            self._free.append(block)

    # -- storage

    def write(
        self, layer: int, blocks: torch.Tensor, slots: torch.Tensor, parts: Sequence[torch.Tensor]
    ) -> None:
        """Store encoded tokens (each plane [1, kv_heads, tokens, ...]) at (block, slot):
        dense K/V on a GPU in one launch, else an indexed write per plane."""
        planes = self.planes[layer]
        if len(parts) == 2 and kernel_enabled(parts[0]) and paged_append_fits(*parts, *planes):
            paged_append_triton(*parts, *planes, blocks, slots)
            return
        for plane, part in zip(planes, parts, strict=True):
            _indexable(plane)[blocks, :, slots] = _indexable(part[0]).transpose(0, 1)

    def gather(self, layer: int, blocks: list[int]) -> list[torch.Tensor]:
        """The planes of `blocks` in order, as one sequence: [1, kv_heads, n·block_size, ...].
        Consecutive blocks (the common case: a sequence's blocks come off the free list in
        order) are a slice, and with one KV head a view: no copy."""
        first = blocks[0]
        consecutive = blocks == list(range(first, first + len(blocks)))
        index = None
        if not consecutive:
            index = torch.tensor(blocks, dtype=torch.long, device=self.planes[layer][0].device)
        gathered = []
        for plane in self.planes[layer]:
            # [n, kv_heads, block_size, ...]
            if index is None:
                part = plane[first : first + len(blocks)]
            elif plane.dtype == torch.uint32:  # CUDA has no uint32 index kernel
                part = plane.view(torch.int32)[index].view(torch.uint32)
            else:
                part = plane[index]
            gathered.append(part.transpose(0, 1).flatten(1, 2).unsqueeze(0))
        return gathered


class KVPool:
    """Every group's `BlockPool` for one model, dtype and KV policy."""

    def __init__(
        self,
        specs: Sequence[CacheSpec],
        policy: KVPolicy,
        dtype: torch.dtype,
        blocks: Sequence[int],
        block_size: int = DEFAULT_BLOCK_SIZE,
        device: torch.device | str = "cpu",
    ) -> None:
        self.specs = list(specs)
        self.groups = cache_groups(specs, policy)
        if len(blocks) != len(self.groups):
            raise ValueError(f"{len(self.groups)} cache groups, {len(blocks)} block counts")
        self.block_size = block_size
        self.dtype = dtype
        self.pools = [
            BlockPool(group, count, block_size, dtype, device)
            for group, count in zip(self.groups, blocks, strict=True)
        ]
        # The caches list's index → (group, layer within the group).
        self.place: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(self.groups):
            for layer, member in enumerate(group.members):
                self.place[member] = (g, layer)
        self.hit_tokens = 0  # tokens served from cached blocks (counted by the scheduler)
        self._trash: list[int] | None = None

    def trash_blocks(self) -> list[int]:
        """One block per group that no sequence ever holds, taken on the first call: where
        the padded rows of a batched decode step write (and read) their K/V."""
        if self._trash is None:
            self._trash = [pool.allocate() for pool in self.pools]
        return self._trash

    @classmethod
    def for_budget(
        cls,
        specs: Sequence[CacheSpec],
        policy: KVPolicy,
        dtype: torch.dtype,
        budget_bytes: int,
        max_sequences: int,
        chunk: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        device: torch.device | str = "cpu",
        max_context: int | None = None,
    ) -> KVPool:
        """A pool of at most `budget_bytes`: sliding groups get what `max_sequences`
        sequences' windows (plus a prefill chunk) need, where there are full groups at most
        as many blocks as the full groups get, so that when the budget is short both run out
        at the same length (a window's): Gemma 4's sliding layers are most of the layers and
        hold most of a short sequence's bytes, so an equal split of bytes left them the
        first to run out. Full groups, which hold every token, share the rest equally in
        blocks (each group's count is the same: they hold the same token ranges).
        `max_context`: the longest sequence (a model's positions), which bounds a window's
        blocks when the window and a chunk are longer."""
        groups = cache_groups(specs, policy)
        block_bytes = [g.token_bytes(dtype) * block_size for g in groups]
        sliding = [i for i, g in enumerate(groups) if g.window is not None]
        full = [i for i, g in enumerate(groups) if g.window is None]
        counts = [0] * len(groups)
        left = budget_bytes
        if sliding:
            per_sliding = sum(block_bytes[i] for i in sliding)
            per_full = sum(block_bytes[i] for i in full)
            share = budget_bytes * per_sliding // (per_sliding + per_full)
            widest = max(groups[i].window or 0 for i in sliding)
            one = window_blocks(widest, chunk, block_size)
            if max_context is not None:
                one = min(one, -(-max_context // block_size))
            wanted = max_sequences * one
            # At least one sequence's window where the budget holds it: else nothing would run.
            count = min(wanted, max(share // per_sliding, min(one, budget_bytes // per_sliding)))
            for i in sliding:
                counts[i] = count
            left -= count * per_sliding
        if full:
            count = left // sum(block_bytes[i] for i in full)
            for i in full:
                counts[i] = count
        return cls(specs, policy, dtype, counts, block_size, device)

    # -- sizes

    def blocks_of(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def peak_blocks(self, group: int, tokens: int, chunk: int) -> int:
        """The most blocks one sequence of `tokens` holds at once in `group` (prefilled in
        chunks of at most `chunk`)."""
        window = self.groups[group].window
        full = self.blocks_of(tokens)
        if window is None:
            return full
        return min(full, window_blocks(window, chunk, self.block_size))

    def fits(self, tokens: int, chunk: int) -> bool:
        """Whether one sequence of `tokens` fits the whole pool."""
        return all(
            self.peak_blocks(g, tokens, chunk) <= pool.num_blocks
            for g, pool in enumerate(self.pools)
        )

    def longest_context(self, chunk: int) -> int:
        """The most tokens one sequence can reach in the whole pool."""
        fits, over = 0, 1 << 24
        while over - fits > 1:
            middle = (fits + over) // 2
            if self.fits(middle, chunk):
                fits = middle
            else:
                over = middle
        return fits

    @property
    def total_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def used_blocks(self) -> int:
        """Blocks sequences hold or the prefix cache keeps (the trash blocks left out)."""
        return sum(pool.used_blocks for pool in self.pools) - len(self._trash or ())

    @property
    def nbytes(self) -> int:
        return sum(pool.block_bytes * pool.num_blocks for pool in self.pools)

    @property
    def cached_blocks(self) -> int:
        """Blocks named by a hash (in use or not): what a prefix may reuse."""
        return sum(pool.cached_blocks for pool in self.pools)

    @property
    def cached_bytes(self) -> int:
        return sum(pool.cached_blocks * pool.block_bytes for pool in self.pools)

    def describe(self) -> str:
        """The pool in words: blocks of `block_size` tokens per group."""
        groups = ", ".join(
            f"{pool.num_blocks} {'full' if group.window is None else 'sliding'}"
            for group, pool in zip(self.groups, self.pools, strict=True)
        )
        return f"blocks of {self.block_size} tokens: {groups}"

    def sequence(self) -> PagedSequence:
        return PagedSequence(self)


def default_pool_bytes(
    specs: Sequence[CacheSpec],
    policy: KVPolicy,
    dtype: torch.dtype,
    max_sequences: int,
    max_context: int,
    chunk: int,
    device: torch.device,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> int:
    """A pool for `max_sequences` sequences at the model's whole context, at most half the
    memory free now (RAM on a CPU, the GPU's on CUDA)."""
    per_sequence = 0
    for group in cache_groups(specs, policy):
        tokens = max_context
        if group.window is not None:
            tokens = min(max_context, window_blocks(group.window, chunk, block_size) * block_size)
        per_sequence += group.token_bytes(dtype) * tokens
    return min(max_sequences * per_sequence, free_memory_bytes(device) // 2)


def free_memory_bytes(device: torch.device) -> int:
    """Memory free now on `device` (a CPU's available RAM)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages) * int(os.sysconf("SC_PAGE_SIZE")) if pages else 2**33


def window_blocks(window: int, chunk: int, block_size: int) -> int:
    """The most blocks a sliding layer holds for one sequence: the `window` keys before a
    chunk, the chunk's own, and a block each end may straddle."""
    return -(-(window + chunk) // block_size) + 1


class PagedSequence:
    """One sequence's block tables (one per group), its caches and its hashed blocks.

    Before a forward stores `n` tokens, `reserve(n)` takes the blocks they land in (all or
    nothing); after it, `after_forward()` frees the sliding groups' blocks that left the
    window and names the blocks that filled up (with `ids`, the tokens' cache ids)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.tables: list[list[int | None]] = [[] for _ in pool.groups]
        self.tokens = 0  # positions whose K/V are stored (or, after `reserve`, will be)
        self.stored = 0
        self.hashes: list[Hash] = []  # of the sequence's full blocks, in order
        # Per group, the logical blocks below this index are released (or were never held).
        self._released = [0] * len(pool.groups)
        self.caches = [
            PagedLayerCache(self, *pool.place[index], window=spec.window)
            for index, spec in enumerate(pool.specs)
        ]

    # -- blocks

    def needed(self, new_tokens: int) -> list[int]:
        """Blocks each group must allocate for `new_tokens` more tokens."""
        last = self.pool.blocks_of(self.tokens + new_tokens)
        return [max(0, last - len(table)) for table in self.tables]

    def can_reserve(self, new_tokens: int) -> bool:
        return all(
            need <= pool.free_blocks
            for need, pool in zip(self.needed(new_tokens), self.pool.pools, strict=True)
        )

    def reserve(self, new_tokens: int) -> bool:
        """Take the blocks `new_tokens` more tokens land in; False (nothing taken) if some
        group has too few free."""
        if not self.can_reserve(new_tokens):
            return False
        last = self.pool.blocks_of(self.tokens + new_tokens)
        for table, pool in zip(self.tables, self.pool.pools, strict=True):
            while len(table) < last:
                table.append(pool.allocate())
        self.tokens += new_tokens
        return True

    def growth(self, tokens: int, chunk: int) -> list[int]:
        """Per group, the blocks beyond those held that growing to `tokens` in chunks of at
        most `chunk` takes at its peak (a sliding group: its window's worth)."""
        return [
            max(0, self.pool.peak_blocks(g, tokens, chunk) - sum(b is not None for b in table))
            for g, table in enumerate(self.tables)
        ]

    def can_grow_to(self, tokens: int, chunk: int, promised: Sequence[int] = ()) -> bool:
        """Whether the free blocks cover growing to `tokens` in chunks of at most `chunk`,
        besides the blocks per group `promised` to other sequences (their `growth`)."""
        promised = list(promised) or [0] * len(self.tables)
        return all(
            need + other <= pool.free_blocks
            for need, other, pool in zip(
                self.growth(tokens, chunk), promised, self.pool.pools, strict=True
            )
        )

    def after_forward(self, ids: Sequence[int]) -> None:
        """The reserved tokens are stored: name the blocks now full (`ids`: the cache ids of
        the tokens so far; none needed unless `fills_a_block`), then free sliding blocks out of
        every later query's window (hashed ones stay cached for a later prefix hit)."""
        for cache in self.caches:
            cache.flush()
        self.stored = self.tokens
        size = self.pool.block_size
        full = min(self.stored, len(ids)) // size
        if full > len(self.hashes):
            known = len(self.hashes)
            parent = self.hashes[-1] if self.hashes else b""
            self.hashes += block_hashes(ids[known * size : full * size], size, parent)
            for table, pool in zip(self.tables, self.pool.pools, strict=True):
                for i in range(known, full):
                    block = table[i]
                    if block is not None:
                        pool.register(block, self.hashes[i])
        for g, (table, pool, group) in enumerate(
            zip(self.tables, self.pool.pools, self.pool.groups, strict=True)
        ):
            if group.window is None:
                continue
            # A ring keeps the `window` tokens before the next one (the oldest of them hidden
            # from every later query, but attended over, masked, as a ring does).
            first_needed = min(max(0, self.stored - group.window) // size, len(table))
            for i in range(self._released[g], first_needed):
                block = table[i]
                if block is not None:
                    pool.release(block)
                    table[i] = None
            self._released[g] = max(self._released[g], first_needed)

    @property
    def fills_a_block(self) -> bool:
        """Whether the tokens reserved complete a block not yet named: `after_forward` then
        needs the cache ids (building them costs the whole context)."""
        return self.tokens // self.pool.block_size > len(self.hashes)

    def free(self) -> None:
        """Give every block back (hashed ones stay cached until evicted)."""
        for table, pool in zip(self.tables, self.pool.pools, strict=True):
            for block in table:
                if block is not None:
                    pool.release(block)
            table.clear()
        self.tokens = self.stored = 0
        self.hashes = []
        self._released = [0] * len(self.tables)
        for cache in self.caches:
            cache.offset = 0
            cache.flush_discarded()

    def adopt_prefix(self, ids: Sequence[int], most: int) -> int:
        """Share the cached blocks of the longest prefix of `ids` (at most `most` tokens, in
        whole blocks) that every group still holds (a sliding group: the blocks within the
        window before the prefix's end); the tokens taken. Only on an empty sequence."""
        assert self.tokens == 0, "a prefix goes into an empty sequence"
        size = self.pool.block_size
        hashes = block_hashes(ids[: (most // size) * size], size)
        count = len(hashes)
        while count and not self._usable(hashes, count):
            count -= 1
        if not count:
            return 0
        tokens = count * size
        for table, pool, group in zip(self.tables, self.pool.pools, self.pool.groups, strict=True):
            first = 0 if group.window is None else max(0, tokens - group.window) // size
            for i in range(count):
                table.append(pool.share(hashes[i]) if i >= first else None)
        self.hashes = hashes[:count]
        self.tokens = self.stored = tokens
        for cache in self.caches:
            cache.offset = tokens
        return tokens

    def _usable(self, hashes: list[Hash], count: int) -> bool:
        size = self.pool.block_size
        tokens = count * size
        for pool, group in zip(self.pool.pools, self.pool.groups, strict=True):
            first = 0 if group.window is None else max(0, tokens - group.window) // size
            if not all(pool.holds(hashes[i]) for i in range(first, count)):
                return False
        return True

    def held(self, group: int) -> list[int]:
        """The group's logical blocks held, in order."""
        return [i for i, block in enumerate(self.tables[group]) if block is not None]


class BlockSlot(NamedTuple):
    """`PagedLayerCache.decode_blocks`: a decode token's K/V go into position `position` of
    the blocks of `table` (the sequence's table for the layer's group, a block id per logical
    block, None where freed) in the pool planes `keys`/`values` [num_blocks, kv_heads,
    block_size, head_dim]; attention reads the positions of `runs` ([start, end) each) in
    order."""

    keys: torch.Tensor
    values: torch.Tensor
    table: list[int | None]
    position: int
    runs: tuple[tuple[int, int], ...]


class PagedLayerCache:
    """One layer's view of a `PagedSequence`: the `LayerCache` interface a model calls."""

    def __init__(self, sequence: PagedSequence, group: int, layer: int, window: int | None) -> None:
        self.sequence = sequence
        self.group = group
        self.layer = layer
        self.window = window
        self.offset = 0
        pool = sequence.pool.pools[group]
        self.codec = pool.group.codec
        self._pool = pool
        # A token a kernel wrote into a `decode_slot` buffer, not yet in its block.
        self._pending: tuple[torch.Tensor, torch.Tensor, int, int] | None = None

    @property
    def is_fresh(self) -> bool:
        return self.offset == 0

    def decode_write(self, positions: torch.Tensor) -> None:
        """No fused GPU kernel writes a paged cache: K/V come to `update_and_fetch`."""
        return None

    def takes_decode_slots(self) -> bool:
        """Whether `decode_slot` gives room (the native CPU layer step): dense K/V."""
        return self.codec.signature() == "dense"

    def decode_slot(self, sample: torch.Tensor) -> DecodeSlot | None:
        """Room for one token for a kernel that writes K/V and attends in one call (the
        native CPU step, one sequence): the keys a query at `offset` sees, itself included,
        copied out as a `LayerCache` holds them (a sliding layer's window in ring-slot order),
        its own slot to be written. The kernel's token goes into its block at `flush`
        (`PagedSequence.after_forward`)."""
        if not self.takes_decode_slots():
            return None
        position = self.offset
        runs = self._decode_runs(position)
        # The token's own slot reads what its reserved block holds: the kernel overwrites it.
        # The kernel needs a private buffer: a read of consecutive blocks can be a view of the
        # pool itself (a gather of scattered ones is a copy already).
        pool = {plane.untyped_storage().data_ptr() for plane in self._pool.planes[self.layer]}
        keys, values = (
            part.clone(memory_format=torch.contiguous_format)
            if part.untyped_storage().data_ptr() in pool
            else part.contiguous()
            for part in self._read(runs)
        )
        slot = 0
        for start, end in runs:
            if start <= position < end:
                slot += position - start
                break
            slot += end - start
        self._pending = (keys, values, slot, position)
        self.offset = position + 1
        return DecodeSlot(keys, values, slot, keys.shape[2])

    def _decode_runs(self, position: int) -> list[tuple[int, int]]:
        """The runs of positions a decode query at `position` sees, itself included, in the
        order a `LayerCache` holds them (a sliding layer's window in ring-slot order)."""
        if position + 1 > self.sequence.tokens:
            raise RuntimeError("paged cache: a token stored past the blocks reserved for it")
        if self.window is None:
            return [(0, position + 1)]
        return _ring_runs(max(0, position - self.window + 1), position + 1, self.window)

    def decode_blocks(self) -> BlockSlot | None:
        """Where one token goes for a kernel that writes K/V and attends in one call, reading
        and writing the pool's blocks in place (the native CPU step): the layer's planes, the
        token's position (its block already reserved) and the runs of positions a query
        there sees, itself included, in the order `decode_slot` copies them out (a sliding
        layer's window in ring-slot order), so a kernel summing over them in that order
        matches its sums over the copy bit for bit. None where the K/V are not stored dense."""
        if not self.takes_decode_slots():
            return None
        position = self.offset
        runs = self._decode_runs(position)
        self.offset = position + 1
        keys, values = self._pool.planes[self.layer]
        return BlockSlot(keys, values, self.sequence.tables[self.group], position, tuple(runs))

    def flush_discarded(self) -> None:
        """Forget a `decode_slot` token (its sequence let its blocks go)."""
        self._pending = None

    def flush(self) -> None:
        """Store the token a kernel wrote into the last `decode_slot` in its block."""
        if self._pending is None:
            return
        keys, values, slot, position = self._pending
        self._pending = None
        size = self._pool.block_size
        block = self.sequence.tables[self.group][position // size]
        device = keys.device
        blocks = torch.tensor([block], dtype=torch.long, device=device)
        slots = torch.tensor([position % size], dtype=torch.long, device=device)
        token = (keys[:, :, slot : slot + 1], values[:, :, slot : slot + 1])
        self._pool.write(self.layer, blocks, slots, token)

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        """Store new K/V (positions from `offset` on, blocks already reserved) and return
        what attention reads: a first chunk its exact K/V, otherwise the stored blocks."""
        count = keys.shape[2]
        start = self.offset
        if start + count > self.sequence.tokens:
            raise RuntimeError("paged cache: tokens stored past the blocks reserved for them")
        size = self._pool.block_size
        table = self.sequence.tables[self.group]
        # Every token is written, even one a sliding window drops right after: its block may
        # be hashed and served to a later prefix hit.
        new_positions = torch.arange(start, start + count)
        logical = (new_positions // size).tolist()
        blocks = torch.tensor([table[i] for i in logical], dtype=torch.long, device=keys.device)
        slots = (new_positions % size).to(keys.device)
        self._pool.write(self.layer, blocks, slots, self.codec.encode(keys, values))
        self.offset = start + count
        if start == 0:
            return KVView(keys, values, count, None)
        return self.view(start)

    def view(self, start: int) -> KVView:
        """What a chunk stored from `start` attends over, decoded, laid out as a `LayerCache`
        lays it out (so both attend in one order and agree to the bit): a full layer its
        tokens in order; a sliding layer the `window` tokens before the chunk in ring-slot
        order (position p in slot p % window), then the chunk's own."""
        end = self.offset
        if self.window is None:
            keys, values = self._read([(0, end)])
            return KVView(keys, values, end, None)
        window = self.window
        if end - start == 1:  # one query: the ring's tokens, every one visible to it
            first = max(0, end - window)
            keys, values = self._read(_ring_runs(first, end, window))
            return KVView(keys, values, end - first, None)
        first = max(0, start - window)
        runs = [*_ring_runs(first, start, window), (start, end)]
        keys, values = self._read(runs)
        ring = torch.cat([torch.arange(a, b) for a, b in runs[:-1]] or [torch.arange(0)])
        positions = torch.cat([ring, torch.arange(start, end)]).to(keys.device)
        return KVView(keys, values, positions.shape[0], positions)

    def _read(self, runs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V stored at the positions of `runs` ([start, end) each, all held), in that
        order, decoded."""
        size = self._pool.block_size
        table = self.sequence.tables[self.group]
        runs = [(a, b) for a, b in runs if b > a]
        first = min(a for a, _ in runs) // size
        last = (max(b for _, b in runs) - 1) // size
        blocks = table[first : last + 1]
        assert all(block is not None for block in blocks), "a needed block was freed"
        planes = self._pool.gather(self.layer, blocks)  # type: ignore[arg-type]
        base = first * size
        planes = [
            torch.cat([plane[:, :, a - base : b - base] for a, b in runs], dim=2)
            if len(runs) > 1
            else plane[:, :, runs[0][0] - base : runs[0][1] - base]
            for plane in planes
        ]
        return self.codec.decode(planes, self._pool.dtype)

    @property
    def nbytes(self) -> int:
        per_block = sum(p[0].nbytes for p in self._pool.planes[self.layer])
        return per_block * len(self.sequence.held(self.group))


def _ring_runs(first: int, end: int, window: int) -> list[tuple[int, int]]:
    """Positions first..end-1 (at most `window` of them) in the order a ring of `window`
    slots holds them (position p in slot p % window): one or two runs of positions."""
    wrap = first + (-first) % window  # the first position in slot 0
    if wrap <= first or wrap >= end:
        return [(first, end)]
    return [(wrap, end), (first, wrap)]


def _indexable(plane: torch.Tensor) -> torch.Tensor:
    """Indexed writes have no uint32 kernel: move packed words as int32 (same bits)."""
    return plane.view(torch.int32) if plane.dtype == torch.uint32 else plane


class BatchTables:
    """The device inputs of one batched decode step of B rows over a pool of `block_size`
    blocks (`PagedBatch` layers read them): per group a block table [B, max_blocks] int32,
    each row's query position [B] int64. Static tensors: a CUDA graph captured over them
    replays with what the host copied in. `prepare` (at the start of each forward, inside a
    captured one) derives each row's write target (block, slot) from them on the device."""

    def __init__(
        self, block_size: int, tables: Sequence[torch.Tensor], positions: torch.Tensor
    ) -> None:
        self.block_size = block_size
        self.tables = list(tables)
        self.positions = positions
        self.targets: list[tuple[torch.Tensor, torch.Tensor]] = []

    def prepare(self) -> None:
        logical = (self.positions // self.block_size).unsqueeze(1)
        slots = self.positions % self.block_size
        self.targets = [
            (table.gather(1, logical).squeeze(1).long(), slots) for table in self.tables
        ]


class PagedBatch:
    """One layer's K/V for a batched decode step of B sequences over a paged pool, one token
    each (the forward's B tokens side by side): `update_and_fetch` encodes the B new tokens
    and stores them with one indexed write per plane (no host reads: graph-capturable), and
    returns a view of the pool's planes with the tables and positions, which attention
    reads through `ops.paged_attention`. `group`: the layer's group in `batch`, whose blocks
    `pool` holds; `layer`: its index within the group."""

    def __init__(
        self, batch: BatchTables, group: int, pool: BlockPool, layer: int, window: int | None
    ) -> None:
        self.batch = batch
        self.group = group
        self.layer = layer
        self.window = window
        self._pool = pool
        self.codec = pool.group.codec

    def decode_write(self, positions: torch.Tensor) -> None:
        """No fused kernel writes the pool: K/V come to `update_and_fetch`."""
        return None

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        """Store keys/values [1, kv_heads, B, head_dim] (row b's at its position) and return
        the view attention reads."""
        blocks, slots = self.batch.targets[self.group]
        self._pool.write(self.layer, blocks, slots, self.codec.encode(keys, values))
        return self.view()

    def view(self) -> KVView:
        planes = tuple(self._pool.planes[self.layer])
        tables = PagedTables(self.batch.tables[self.group], self.batch.positions)
        return KVView(None, None, 0, None, StoredKV(planes, self.codec), paged=tables)
