"""A decode step of B sequences over the paged K/V pool, replayed from CUDA graphs per
batch-size bucket.

The step is one forward over the B new tokens side by side, each layer a `kv.paged.PagedBatch`:
it stores the B tokens' K/V into their blocks with one indexed write per plane and attention
reads each row's blocks through its row of a block table (`ops.paged_attention`). Nothing in
it reads the host, so on a GPU it is captured once per bucket and replayed: one launch per
step. A bucket is a row count of the plan's `batch_buckets` (the smallest holding B; the spare
rows padded: token 0 at position 0, their tables pointing at a "trash" block per group that the
pool keeps for them) and a table width in blocks: powers of two from 16 (256 tokens) up to
`max_blocks`, which covers the longest context the pool holds. The width is the smallest
holding every row's table, so a batch of short requests copies and reads short tables (and
the attention kernel's grid, which may depend on the width, stays small), and a graph stays
valid whatever the lengths within its width.

Static inputs per width: per group a block table [rows, width] int32, and (shared) the tokens
and positions [2, rows] int64. The host keeps them in pinned memory and writes only what
changed since that width's last step (a new row whole, a known row its new blocks); each step
copies them over in 1 + groups copies (the first `bucket` rows of each table) and replays.
Without graphs (a CPU, or a fallback) the same forward runs eagerly over exactly B rows (or,
with `pad`, a bucket's, as a graph would).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hearth.kv.paged import BatchTables, KVPool, PagedBatch, PagedSequence
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.graphs import _warm_up_and_capture

log = logging.getLogger("hearth.runtime.batch_graphs")


def _padding() -> object:
    """What a padded row holds (a weak reference's call: compared by identity)."""
    return _padding


NARROWEST_TABLE = 16  # blocks: the first table width


def _nothing() -> None:
    return None


class _Tables:
    """One table width's block tables, on the host (pinned on a GPU) and the device, and what
    each row holds: its sequence (weakly: a decoder keeps no sequence, so no pool, alive) and
    the blocks of each group's table written so far."""

    def __init__(
        self, groups: int, rows: int, width: int, device: torch.device, copies: bool
    ) -> None:
        self.width = width
        pinned = copies and device.type == "cuda"
        self.host = torch.zeros((groups, rows, width), dtype=torch.int32, pin_memory=pinned)
        self.array = self.host.numpy()
        self.device = self.host.to(device, copy=True) if copies else self.host
        self.held: list[Callable[[], object]] = [_nothing] * rows
        self.written = [[0] * groups for _ in range(rows)]


class BatchDecoder:
    """Batched decode steps of up to `rows` sequences of `pool` (see the module doc); from
    graphs with `graphs`, else eagerly, over exactly B rows or (`pad`, as a graph would) the
    bucket's. `copies`: the inputs in host buffers copied to the device's each step (None: on
    a GPU; a CPU test may ask for it, else the host's are the device's)."""

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        plan: ExecutionPlan,
        rows: int,
        graphs: bool,
        pad: bool = False,
        copies: bool | None = None,
    ) -> None:
        self.model = model
        self.plan = plan
        self.rows = rows
        self.graphs = graphs
        self.pad = pad or graphs
        self.device = model.device
        longest = min(
            pool.longest_context(plan.prefill_chunk), model.config.max_position_embeddings
        )
        self.max_blocks = pool.blocks_of(longest) + 1
        widths, width = [], NARROWEST_TABLE
        while width < self.max_blocks:
            widths.append(width)
            width *= 2
        self.widths = [*widths, self.max_blocks]
        self._groups = len(pool.groups)
        on_gpu = self.device.type == "cuda"
        self._copies = on_gpu if copies is None else copies
        pinned = self._copies and on_gpu
        self._host_meta = torch.zeros((2, rows), dtype=torch.long, pin_memory=pinned)
        self._meta_np = self._host_meta.numpy()
        self._meta = self._host_meta.to(self.device, copy=True) if self._copies else self._host_meta
        self._copied = torch.cuda.Event() if pinned else None
        self._tables: dict[int, _Tables] = {}
        self._trash = pool.trash_blocks() if self.pad else None
        # The pool is not kept (the runner keys its decoders on it weakly): only its blocks.
        self._block_size = pool.block_size
        self._layout = [
            (group, pool.pools[group], layer, spec.window)
            for spec, (group, layer) in zip(
                pool.specs, (pool.place[i] for i in range(len(pool.specs))), strict=True
            )
        ]
        Key = tuple[int, int]  # (rows, table width)
        self._layers: dict[Key, tuple[BatchTables, list[PagedBatch]]] = {}
        self._graphs: dict[Key, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool: object = None
        self.capture_seconds = 0.0  # spent capturing graphs (a benchmark leaves it out)

    def bucket(self, count: int) -> int | None:
        """The bucket a step of `count` rows runs at (padded), or None (exactly its rows)."""
        if not self.pad:
            return None
        return next((b for b in self.plan.batch_buckets if count <= b <= self.rows), None)

    def width(self, sequences: Sequence[PagedSequence]) -> int:
        """The narrowest table width holding every sequence's tables."""
        longest = max(len(table) for sequence in sequences for table in sequence.tables)
        if longest > self.max_blocks:
            raise RuntimeError("a sequence outgrew the batch decoder's block tables")
        return next(width for width in self.widths if width >= longest)

    @torch.inference_mode()
    def step(
        self,
        sequences: Sequence[PagedSequence],
        tokens: Sequence[int] | torch.Tensor,
        positions: Sequence[int],
    ) -> torch.Tensor:
        """Logits [B, vocab] after one token of each sequence (its blocks reserved) at its
        position. From a graph, a view of its output: valid until the next step. `tokens` may
        be a tensor [B] on the device (the last step's samples, not yet read by the host)."""
        count = len(sequences)
        if count > self.rows:
            raise ValueError(f"a batch of {count} rows in a decoder of {self.rows}")
        key = (self.bucket(count) or count, self.width(sequences))
        if self.graphs and key not in self._graphs:
            self._capture(key)  # on failure: eager from now on
        tables = self._tables_of(key[1])
        on_device = isinstance(tokens, torch.Tensor)
        self._fill(tables, sequences, [0] * count if on_device else tokens, positions, key[0])
        self._upload(tables, key[0])
        if on_device:
            self._meta[0, :count].copy_(tokens)  # after the upload: it wins
        if self.graphs and key in self._graphs:
            graph, logits = self._graphs[key]
            graph.replay()
            logits = logits[:count]
        else:
            logits = self._forward(key)[:count]
        for sequence, position in zip(sequences, positions, strict=True):
            for cache in sequence.caches:
                cache.offset = position + 1
        return logits

    # -- host buffers

    def _tables_of(self, width: int) -> _Tables:
        if width not in self._tables:
            self._tables[width] = _Tables(self._groups, self.rows, width, self.device, self._copies)
        return self._tables[width]

    def _fill(
        self,
        tables: _Tables,
        sequences: Sequence[PagedSequence],
        tokens: Sequence[int],
        positions: Sequence[int],
        rows: int,
    ) -> None:
        """Write what changed into the host buffers; pad rows `len(sequences)` to `rows`
        (pointing at the trash blocks)."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the buffers
        array, meta = tables.array, self._meta_np
        for row, (sequence, token, position) in enumerate(
            zip(sequences, tokens, positions, strict=True)
        ):
            meta[0, row] = token
            meta[1, row] = position
            known = tables.held[row]() is sequence
            written = tables.written[row]
            for group, table in enumerate(sequence.tables):
                start, end = (written[group] if known else 0), len(table)
                if end > start:  # a freed (None) entry: any block, never read
                    array[group, row, start:end] = [block or 0 for block in table[start:end]]
                written[group] = end
            tables.held[row] = weakref.ref(sequence)
        for row in range(len(sequences), rows):
            meta[:, row] = 0
            if tables.held[row] is _padding:
                continue
            assert self._trash is not None, "padded rows need the pool's trash blocks"
            for group, block in enumerate(self._trash):
                array[group, row, 0] = block
            tables.held[row] = _padding

    def _upload(self, tables: _Tables, rows: int) -> None:
        """The host buffers' first `rows` rows to the device: one copy per group and one of
        the tokens and positions (nothing where they are the same tensors)."""
        if not self._copies:
            return
        for group in range(self._groups):
            tables.device[group, :rows].copy_(tables.host[group, :rows], non_blocking=True)
        self._meta.copy_(self._host_meta, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    # -- the forward

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        """Logits [rows, vocab] of the first `rows` rows as the buffers hold them."""
        batch, layers = self._layers_of(key)
        batch.prepare()
        ids = self._meta[0, : key[0]].unsqueeze(0)
        return self.model(ids, layers, positions=batch.positions)[0]

    def _layers_of(self, key: tuple[int, int]) -> tuple[BatchTables, list[PagedBatch]]:
        if key not in self._layers:
            rows, width = key
            device = self._tables_of(width).device
            tables = [device[group, :rows] for group in range(self._groups)]
            batch = BatchTables(self._block_size, tables, self._meta[1, :rows])
            layers = [PagedBatch(batch, *place) for place in self._layout]
            self._layers[key] = (batch, layers)
        return self._layers[key]

    def _capture(self, key: tuple[int, int]) -> None:
        """Capture the step at `key`'s rows and width, every row padded while capturing (the
        warm-up run and the capture write only into the trash blocks); on failure decode
        eagerly from now on."""
        started = time.perf_counter()
        tables = self._tables_of(key[1])
        self._fill(tables, [], [], [], key[0])
        self._upload(tables, key[0])
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        try:
            graph, logits = _warm_up_and_capture(
                lambda: self._forward(key), lambda: None, self._graph_pool
            )
        except RuntimeError:
            log.exception("batched decode graph capture failed; decoding eagerly")
            self.graphs = False
            return
        finally:
            self.capture_seconds += time.perf_counter() - started
        self._graphs[key] = (graph, logits)
