"""The grouped MoE matmul's plan on the GPU: a counting sort of the (token, slot) pairs by expert.

`grouped_matmul.plan_experts_reference` builds the plan from torch ops (a stable argsort, a
count per expert, three cumulative sums, gathers and a searchsorted): about twenty launches a
layer, whose host time, several times their GPU time, showed in a MoE prefill. Here it is
three kernels, with the same result bit for bit (the sort is stable: pairs of one expert keep
their order):

1. per chunk of CHUNK pairs, a count per expert (one-hot sums), and a share of the row table
   filled with the padding index;
2. one program: the chunk counts turned into each chunk's first row per expert, the experts'
   segments padded to whole tiles, and the expert of every tile;
3. per chunk, each pair's rank among the chunk's pairs of its expert (a cumulative sum of the
   one-hot rows), which with the offsets from 2 is its row.

Everything stays on the device and the launch grid depends only on host ints, so nothing
waits for the GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hearth.ops import HAS_TRITON
from hearth.ops.launch import launch_kernel

# Pairs per program in passes 1 and 3: a [CHUNK, experts] one-hot tile (128 experts: 16K
# ints over CHUNK_WARPS warps, 64 a thread).
CHUNK = 128
CHUNK_WARPS = 8
# Pass 2 is one program, a chain of dependent loop steps: per step, chunks' counts read and
# tiles placed (each against every expert), on OFFSETS_WARPS warps. The row table's padding
# is written by pass 1's programs in parallel, FILL_BLOCK entries a step, which takes that
# work off pass 2's serial chain (whose scans of the counts are most of its time).
CHUNK_BLOCK = 64
TILE_BLOCK = 128
OFFSETS_WARPS = 8
FILL_BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _one_hot(ids_ptr, chunk, pairs, CHUNK: tl.constexpr, EXPERTS_BLOCK: tl.constexpr):
        """The chunk's pair indices, their experts, and the one-hot ``[CHUNK, EXPERTS_BLOCK]``
        of those experts (all-zero rows past the last pair)."""
        pair = chunk * CHUNK + tl.arange(0, CHUNK)
        valid = pair < pairs
        expert = tl.load(ids_ptr + pair, mask=valid, other=-1)
        one_hot = (expert[:, None] == tl.arange(0, EXPERTS_BLOCK)[None, :]).to(tl.int32)
        return pair, valid, expert, one_hot

    @triton.jit
    def _count_kernel(
        ids_ptr,
        counts_ptr,
        rows_ptr,
        pairs,
        row_count,
        CHUNK: tl.constexpr,
        EXPERTS_BLOCK: tl.constexpr,
        FILL_BLOCK: tl.constexpr,
    ):
        """The chunk's count per expert, and its strided share of the row table's padding
        (`pairs` in every entry, FILL_BLOCK at a time; pass 3 overwrites the real rows)."""
        chunk = tl.program_id(0)
        _, _, _, one_hot = _one_hot(ids_ptr, chunk, pairs, CHUNK, EXPERTS_BLOCK)
        columns = tl.arange(0, EXPERTS_BLOCK)
        tl.store(counts_ptr + chunk * EXPERTS_BLOCK + columns, tl.sum(one_hot, axis=0))
        entry = tl.arange(0, FILL_BLOCK)
        padding = tl.zeros([FILL_BLOCK], tl.int32) + pairs
        start = chunk * FILL_BLOCK
        while start < row_count:
            tl.store(rows_ptr + start + entry, padding, mask=start + entry < row_count)
            start += tl.num_programs(0) * FILL_BLOCK

    @triton.jit
    def _offsets_kernel(
        counts_ptr,
        starts_ptr,
        tile_experts_ptr,
        chunks,
        experts,
        tiles,
        BLOCK_M: tl.constexpr,
        EXPERTS_BLOCK: tl.constexpr,
        CHUNK_BLOCK: tl.constexpr,
        TILE_BLOCK: tl.constexpr,
    ):
        """starts[c, e]: the row of chunk c's first pair of expert e (the expert's padded
        segment start plus the pairs of e in earlier chunks); tile_experts as searchsorted
        (right) of the tile starts in the segment ends. The chunk counts are read CHUNK_BLOCK
        chunks at a time: a loop is not pipelined, so each step waits for its loads."""
        columns = tl.arange(0, EXPERTS_BLOCK)
        totals = tl.zeros([EXPERTS_BLOCK], tl.int32)
        first = 0
        while first < chunks:
            chunk = first + tl.arange(0, CHUNK_BLOCK)
            at = counts_ptr + chunk[:, None] * EXPERTS_BLOCK + columns[None, :]
            totals += tl.sum(tl.load(at, mask=(chunk < chunks)[:, None], other=0), axis=0)
            first += CHUNK_BLOCK
        padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        segment_end = tl.cumsum(padded, axis=0)
        running = segment_end - padded
        # Lanes past the last expert never end a segment below any tile start.
        segment_end = tl.where(columns < experts, segment_end, 2147483647)
        first = 0
        while first < chunks:
            chunk = first + tl.arange(0, CHUNK_BLOCK)
            offsets = chunk[:, None] * EXPERTS_BLOCK + columns[None, :]
            chunk_ok = (chunk < chunks)[:, None]
            counts = tl.load(counts_ptr + offsets, mask=chunk_ok, other=0)
            before = tl.cumsum(counts, axis=0) - counts  # this block's earlier chunks
            tl.store(starts_ptr + offsets, running[None, :] + before, mask=chunk_ok)
            running += tl.sum(counts, axis=0)
            first += CHUNK_BLOCK
        start = 0
        while start < tiles:
            tile = start + tl.arange(0, TILE_BLOCK)
            ended = (segment_end[None, :] <= (tile * BLOCK_M)[:, None]).to(tl.int32)
            tl.store(tile_experts_ptr + tile, tl.sum(ended, axis=1), mask=tile < tiles)
            start += TILE_BLOCK

    @triton.jit
    def _place_kernel(
        ids_ptr, starts_ptr, rows_ptr, pairs, CHUNK: tl.constexpr, EXPERTS_BLOCK: tl.constexpr
    ):
        chunk = tl.program_id(0)
        pair, valid, expert, one_hot = _one_hot(ids_ptr, chunk, pairs, CHUNK, EXPERTS_BLOCK)
        # Inclusive count of each expert down the chunk; a pair's own column less one is its
        # rank among the chunk's pairs of that expert.
        rank = tl.sum(tl.cumsum(one_hot, axis=0) * one_hot, axis=1) - 1
        start = tl.load(starts_ptr + chunk * EXPERTS_BLOCK + expert, mask=valid, other=0)
        tl.store(rows_ptr + start + rank, pair, mask=valid)

    def sort_pairs_triton(
        flat_ids: Tensor, num_experts: int, block_m: int, tiles: int
    ) -> tuple[Tensor, Tensor]:
        """(rows ``[tiles * block_m]`` int32, tile_experts ``[tiles]`` int32) for the pairs'
        experts `flat_ids` ``[pairs]``, as `grouped_matmul.plan_experts_reference` makes them."""
        pairs = flat_ids.numel()
        device = flat_ids.device
        ids = flat_ids.to(torch.int32).contiguous()
        experts_block = triton.next_power_of_2(num_experts)
        chunks = triton.cdiv(pairs, CHUNK)
        counts = torch.empty(chunks, experts_block, dtype=torch.int32, device=device)
        starts = torch.empty_like(counts)
        rows = torch.empty(tiles * block_m, dtype=torch.int32, device=device)
        tile_experts = torch.empty(tiles, dtype=torch.int32, device=device)
        one_hot = {"CHUNK": CHUNK, "EXPERTS_BLOCK": experts_block, "num_warps": CHUNK_WARPS}
        launch_kernel(
            _count_kernel,
            (chunks,),
            ids,
            counts,
            rows,
            pairs,
            rows.numel(),
            **one_hot,
            FILL_BLOCK=FILL_BLOCK,
        )
        launch_kernel(
            _offsets_kernel,
            (1,),
            counts,
            starts,
            tile_experts,
            chunks,
            num_experts,
            tiles,
            BLOCK_M=block_m,
            EXPERTS_BLOCK=experts_block,
            CHUNK_BLOCK=CHUNK_BLOCK,
            TILE_BLOCK=TILE_BLOCK,
            num_warps=OFFSETS_WARPS,
        )
        launch_kernel(_place_kernel, (chunks,), ids, starts, rows, pairs, **one_hot)
        return rows, tile_experts
