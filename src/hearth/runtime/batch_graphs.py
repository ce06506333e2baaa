"""A decode step of B sequences over the paged K/V pool, replayed from CUDA graphs per
batch-size bucket.

The step is one forward over the B new tokens side by side, each layer a `kv.paged.PagedBatch`:
it stores the B tokens' K/V into their blocks with one indexed write per plane and attention
reads each row's blocks through its row of a block table (`ops.paged_attention`). Nothing in
it reads the host, so on a GPU it is captured once per bucket of the plan's `batch_buckets`
(the smallest holding B; the spare rows padded: token 0 at position 0, their table pointing at
a "trash" block per group that the pool keeps for them) and replayed: one launch per step.

Static inputs, sized once per pool: per group a block table [rows, max_blocks] int32, where
max_blocks covers the longest context the pool holds (so a graph stays valid whatever the
lengths), and the tokens and positions [2, rows] int64. The host keeps them in pinned memory
and writes only what changed since the last step (a new row whole, a known row its new blocks);
each step copies them over in 1 + groups copies (the first `bucket` rows of each table) and
replays. Without graphs (a CPU, or a fallback) the same forward runs eagerly over exactly B rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from hearth.kv.paged import BatchTables, KVPool, PagedBatch, PagedSequence
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.graphs import _warm_up_and_capture

log = logging.getLogger("hearth.runtime.batch_graphs")

_PADDING = object()  # what a padded row holds (compared by identity)


class BatchDecoder:
    """Batched decode steps of up to `rows` sequences of `pool` (see the module doc); from
    graphs with `graphs`, else eagerly, over exactly B rows or (`pad`, as a graph would) the
    bucket's."""

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        plan: ExecutionPlan,
        rows: int,
        graphs: bool,
        pad: bool = False,
    ) -> None:
        self.model = model
        self.plan = plan
        self.rows = rows
        self.graphs = graphs
        self.pad = pad or graphs
        device = model.device
        longest = min(
            pool.longest_context(plan.prefill_chunk), model.config.max_position_embeddings
        )
        self.max_blocks = pool.blocks_of(longest) + 1
        groups = len(pool.groups)
        pinned = device.type == "cuda"
        self._host_tables = torch.zeros(
            (groups, rows, self.max_blocks), dtype=torch.int32, pin_memory=pinned
        )
        self._host_meta = torch.zeros((2, rows), dtype=torch.long, pin_memory=pinned)
        self._tables_np = self._host_tables.numpy()
        self._meta_np = self._host_meta.numpy()
        if pinned:
            self._tables = self._host_tables.to(device)
            self._meta = self._host_meta.to(device)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
        else:
            self._tables, self._meta, self._copied = self._host_tables, self._host_meta, None
        # What each row of the host buffers holds: its sequence and the blocks of each group's
        # table written so far (a known row gets only its new ones).
        self._held: list[object] = [None] * rows
        self._written = [[0] * groups for _ in range(rows)]
        self._trash = pool.trash_blocks() if self.pad else None
        # The pool is not kept (the runner keys its decoders on it weakly): only its blocks.
        self._block_size = pool.block_size
        self._layout = [
            (group, pool.pools[group], layer, spec.window)
            for spec, (group, layer) in zip(
                pool.specs, (pool.place[i] for i in range(len(pool.specs))), strict=True
            )
        ]
        self._layers: dict[int, tuple[BatchTables, list[PagedBatch]]] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool: object = None

    def bucket(self, count: int) -> int | None:
        """The bucket a step of `count` rows runs at (padded), or None (exactly its rows)."""
        if not self.pad:
            return None
        return next((b for b in self.plan.batch_buckets if count <= b <= self.rows), None)

    @torch.inference_mode()
    def step(
        self, sequences: Sequence[PagedSequence], tokens: Sequence[int], positions: Sequence[int]
    ) -> torch.Tensor:
        """Logits [B, vocab] after one token of each sequence (its blocks reserved) at its
        position. From a graph, a view of its output: valid until the next step."""
        count = len(sequences)
        if count > self.rows:
            raise ValueError(f"a batch of {count} rows in a decoder of {self.rows}")
        rows = self.bucket(count) or count
        if self.graphs and rows not in self._graphs:
            self._capture(rows)  # on failure: eager from now on
        self._fill(sequences, tokens, positions, rows)
        self._upload(rows)
        if self.graphs and rows in self._graphs:
            graph, logits = self._graphs[rows]
            graph.replay()
            logits = logits[:count]
        else:
            logits = self._forward(rows)[:count]
        for sequence, position in zip(sequences, positions, strict=True):
            for cache in sequence.caches:
                cache.offset = position + 1
        return logits

    # -- host buffers

    def _fill(
        self,
        sequences: Sequence[PagedSequence],
        tokens: Sequence[int],
        positions: Sequence[int],
        rows: int,
    ) -> None:
        """Write the rows that changed into the host buffers; pad rows `len(sequences)` to
        `rows` (pointing at the trash blocks)."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the buffers
        tables, meta = self._tables_np, self._meta_np
        for row, (sequence, token, position) in enumerate(
            zip(sequences, tokens, positions, strict=True)
        ):
            meta[0, row] = token
            meta[1, row] = position
            known = self._held[row] is sequence
            written = self._written[row]
            for group, table in enumerate(sequence.tables):
                start, end = (written[group] if known else 0), len(table)
                if end > self.max_blocks:
                    raise RuntimeError("a sequence outgrew the batch decoder's block tables")
                if end > start:
                    tables[group, row, start:end] = [b or 0 for b in table[start:end]]
                written[group] = end
            self._held[row] = sequence
        for row in range(len(sequences), rows):
            if self._held[row] is _PADDING:
                continue
            assert self._trash is not None, "padded rows need the pool's trash blocks"
            meta[:, row] = 0
            for group, block in enumerate(self._trash):
                tables[group, row, 0] = block
            self._held[row] = _PADDING

    def _upload(self, rows: int) -> None:
        """The host buffers' first `rows` rows to the device: one copy per group and one of
        the tokens and positions (nothing on a CPU, where they are the same tensors)."""
        if self._copied is None:
            return
        for group in range(self._tables.shape[0]):
            self._tables[group, :rows].copy_(self._host_tables[group, :rows], non_blocking=True)
        self._meta.copy_(self._host_meta, non_blocking=True)
        self._copied.record()

    # -- the forward

    def _forward(self, rows: int) -> torch.Tensor:
        """Logits [rows, vocab] of the first `rows` rows as the buffers hold them."""
        batch, layers = self._layers_of(rows)
        batch.prepare()
        ids = self._meta[0, :rows].unsqueeze(0)
        return self.model(ids, layers, positions=batch.positions)[0]

    def _layers_of(self, rows: int) -> tuple[BatchTables, list[PagedBatch]]:
        if rows not in self._layers:
            tables = [self._tables[group, :rows] for group in range(self._tables.shape[0])]
            batch = BatchTables(self._block_size, tables, self._meta[1, :rows])
            layers = [PagedBatch(batch, *place) for place in self._layout]
            self._layers[rows] = (batch, layers)
        return self._layers[rows]

    def _capture(self, bucket: int) -> None:
        """Capture the step at `bucket` rows, all padded while capturing (the warm-up run and
        the capture write only into the trash blocks); on failure decode eagerly from now."""
        self._fill([], [], [], bucket)
        self._upload(bucket)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        try:
            graph, logits = _warm_up_and_capture(
                lambda: self._forward(bucket), lambda: None, self._graph_pool
            )
        except RuntimeError:
            log.exception("batched decode graph capture failed; decoding eagerly")
            self.graphs = False
            return
        self._graphs[bucket] = (graph, logits)
