"""Decode attention of B sequences at once over a paged K/V pool (`kv.paged`): one query token
per sequence, each reading its own blocks through its row of a block table.

Pool planes are laid out [num_blocks, kv_heads, block_size, width] (width: head_dim for dense
K/V, or an encoded plane's width, as `decode_attention.PlaneFormat` describes). Row b's key at
absolute position p lives in block `block_tables[b, p // block_size]`, slot `p % block_size`.
It is visible to row b's query iff p <= query_positions[b] and, with a window,
query_positions[b] - p < window. Table entries of blocks no visible key lives in (a sliding
layer's freed blocks, the unused tail of a row) may hold any valid block index: they are
never read. A padded row (a CUDA-graph bucket larger than the batch) points at any block and
position 0; its output is ignored.

`paged_decode_attention` dispatches to the Triton kernel on a GPU and to the torch reference
elsewhere; CPU tests call `paged_decode_attention_kernel` under Triton's interpreter.

The kernel is `decode_attention`'s split-K kernel with its rows gathered through the table:
one program per (row b, KV head, split of slots), all query heads of the KV head in it (GQA),
the same tile helpers (`_attend_block`: every plane format decoded in registers) and the same
deterministic merge launch. A tile of BLOCK_N slots (16 = one block, or 32/64 spanning 2-4
blocks) loads each slot's block index from the table and reads its row at that block's base:
within a block the slots are contiguous, so the loads stay coalesced along head_dim.

Split plan: the grid and the number of splits depend only on shapes, never on data, so a
CUDA graph replays the call as sequences grow:
* a sliding layer's splits are sized for `window + block_size` slots, counted from the row's
  first visible block `(qpos - window + 1) // block_size` (nothing before it is read);
* a full layer's splits are sized for the table's `max_blocks * block_size` slots.
On the device each row reads its query position and deals its tiles, from that first block
to the query, evenly over the splits: a short row in a long table keeps every split busy,
and a split left without tiles loads nothing and writes an empty partial (weight 0).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hearth.ops import kernel_enabled, pdl_options
from hearth.ops.decode_attention import (
    _KIND_CODES,
    _LOG2E,
    _WRITE_OUTPUT,
    LaunchConfig,
    PlaneFormat,
    _as_words,
    _centroids,
    _check_planes,
    _finish_mode,
    _padded,
    _resolve,
    _split_plan,
    decode_attention_reference,
    rotate_query,
    unrotate_output,
)
from hearth.ops.launch import launch_kernel

try:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer
    from hearth.ops.decode_attention import (
        NO_SCORE,
        _attend_block,
        _empty_accumulator,
        _finish_split,
        _merge_kernel,
        _query_tile,
    )
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def _check_tables(
    q: torch.Tensor, block_tables: torch.Tensor, query_positions: torch.Tensor
) -> None:
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if query_positions.shape != (batch,) or query_positions.dtype != torch.long:
        raise ValueError(
            f"query_positions must be int64 [{batch}], got {query_positions.dtype} "
            f"{tuple(query_positions.shape)}"
        )


def paged_decode_attention_reference(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Torch reference: gather each row's blocks into one sequence of slots numbered by
    position, then `decode_attention_reference` (fp32 softmax) per row -> [B, Hq, D]."""
    _check_tables(q, block_tables, query_positions)
    block_size = key_planes[0].shape[2]
    outputs = []
    for row in range(q.shape[0]):
        table = block_tables[row].long()
        positions = torch.arange(table.shape[0] * block_size, device=q.device)

        outputs.append(
            decode_attention_reference(
                q[row : row + 1],
                _gathered(key_planes, table),
                _gathered(value_planes, table),
                key_format,
                value_format,
                positions,
                query_positions[row],
                window,
                scale,
            )
        )
    return torch.cat(outputs)


def _gathered(planes: Sequence[torch.Tensor], table: torch.Tensor) -> list[torch.Tensor]:
    """A row's blocks as one sequence: [max_blocks, Hkv, block_size, w] planes ->
    [1, Hkv, max_blocks * block_size, w]."""
    return [_gather_blocks(p, table).transpose(0, 1).flatten(1, 2).unsqueeze(0) for p in planes]


def _gather_blocks(plane: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """`plane[table]`; packed uint32 codes move as int32 (CUDA has no uint32 index kernel)."""
    if plane.dtype == torch.uint32:
        return plane.view(torch.int32)[table].view(torch.uint32)
    return plane[table]


def paged_decode_attention(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token per sequence) over the pool's blocks -> [B, Hq, D]
    in q's dtype. `block_tables` [B, max_blocks] int32, `query_positions` [B] int64, both on
    q's device. On a GPU: graph-capturable (launch shapes depend on B, max_blocks and the
    window only)."""
    args = (
        q, key_planes, value_planes, key_format, value_format, block_tables, query_positions,
        window, scale,
    )  # fmt: skip
    if kernel_enabled(q):
        return paged_decode_attention_kernel(*args)
    return paged_decode_attention_reference(*args)


def paged_decode_attention_kernel(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None,
    scale: float,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The Triton path of `paged_decode_attention` (any device Triton runs on: CUDA, or the
    CPU under TRITON_INTERPRET=1): rotates q for codebook keys and un-rotates the output for
    codebook values. `config` pins tiles or splits (tests, sweeps); the defaults are
    `decode_attention`'s for the same head size, formats and (row x KV head) count."""
    config = LaunchConfig() if config is None else config
    query = rotate_query(q).to(q.dtype) if key_format.rotated else q
    out = _paged_rotated(
        query, key_planes, value_planes, key_format, value_format, block_tables,
        query_positions, window, scale, config,
    )  # fmt: skip
    return unrotate_output(out).to(q.dtype) if value_format.rotated else out


def paged_split_plan(
    batch: int,
    kv_heads: int,
    max_blocks: int,
    block_size: int,
    window: int | None,
    block_n: int,
    device: torch.device,
    config: LaunchConfig | None = None,
) -> tuple[int, int]:
    """(most slots a split reads, splits) of a launch, sized for `window + block_size` slots
    for a sliding layer (no more than the table holds), for the whole table for a full one."""
    config = LaunchConfig() if config is None else config
    table_slots = max_blocks * block_size
    span = table_slots if window is None else min(table_slots, window + block_size)
    return _split_plan(span, batch * kv_heads, block_n, device, config)


def _paged_rotated(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None,
    scale: float,
    config: LaunchConfig,
) -> torch.Tensor:
    """The launches: q already rotated for codebook keys; output [B, Hq, D] in the rotated
    space (fp32) for codebook values, else in q's dtype."""
    _check_tables(q, block_tables, query_positions)
    batch, query_heads, head_dim = q.shape
    num_blocks, kv_heads, block_size = key_planes[0].shape[:3]
    shape = (num_blocks, kv_heads, block_size, head_dim)
    _check_planes("keys", key_planes, key_format, shape)
    _check_planes("values", value_planes, value_format, shape)
    if query_heads % kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"unsupported heads/head_dim: {query_heads}/{kv_heads}, {head_dim}")
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    max_blocks = block_tables.shape[1]
    groups = query_heads // kv_heads
    launch = _resolve(config, head_dim, key_format, value_format, batch * kv_heads)
    chunk, splits = paged_split_plan(
        batch, kv_heads, max_blocks, block_size, window, launch.block_n, q.device, config
    )
    finish = _finish_mode(splits)

    device = q.device
    out_dtype = torch.float32 if value_format.rotated else q.dtype
    out = torch.empty(batch, query_heads, head_dim, dtype=out_dtype, device=device)
    partial_rows = 0 if finish == _WRITE_OUTPUT else batch * query_heads * splits
    part_acc = torch.empty(partial_rows, head_dim, device=device)
    part_max = torch.empty(partial_rows, device=device)
    part_sum = torch.empty_like(part_max)
    k0, k1, k2 = _padded(key_planes)
    v0, v1, v2 = _padded(value_planes)
    k_centroids = _centroids(key_format.bits if key_format.rotated else 1, device)
    v_centroids = _centroids(value_format.bits if value_format.rotated else 1, device)
    # Element offsets of a block's rows in int32 unless a plane is too large for them.
    wide = max(p.numel() for p in (*key_planes, *value_planes)) >= 2**31
    # fp32 operands would default to TF32 on the GPU; half types take no precision option.
    precision = "ieee" if q.dtype == torch.float32 else None
    launch_kernel(_paged_split_kernel, (batch * kv_heads, splits),
        q, q.stride(0), q.stride(1),
        _as_words(k0), k1, k2, *k0.stride()[:3], *k1.stride()[:3],
        _as_words(v0), v1, v2, *v0.stride()[:3], *v1.stride()[:3],
        k_centroids, v_centroids,
        block_tables, block_tables.stride(0), query_positions, 0 if window is None else window,
        part_acc, part_max, part_sum, out,
        max_blocks * block_size, splits, scale * _LOG2E,
        KV_HEADS=kv_heads, GROUPS=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)),
        HEAD_DIM=head_dim, BLOCK_N=launch.block_n, CHUNK=chunk, BLOCK_SIZE=block_size,
        K_FORMAT=_KIND_CODES[key_format.kind], K_BITS=key_format.bits,
        K_GROUP=key_format.group_size,
        V_FORMAT=_KIND_CODES[value_format.kind], V_BITS=value_format.bits,
        V_GROUP=value_format.group_size,
        HAS_WINDOW=window is not None, WIDE_OFFSETS=wide, PRECISION=precision, FINISH=finish,
        DEVICE_LOOP=q.is_cuda,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_options(q),
    )  # fmt: skip
    if finish == _WRITE_OUTPUT:
        return out
    # As in decode_attention: every split of a BLOCK_D slice of one head in one program.
    block_s = max(16, triton.next_power_of_2(splits))
    block_d = min(head_dim, 64, max(16, 8192 // block_s))
    launch_kernel(_merge_kernel, (batch * query_heads, head_dim // block_d),
        part_acc, part_max, part_sum, out, splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4, **pdl_options(q),
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _paged_tile(
        query, query_sums, running_max, running_sum, acc, tile, stop, qpos, window, table,
        scale_log2, k0, k1, k2, k_centroids, v0, v1, v2, v_centroids,
        stride_k0blk, stride_k0s, stride_k1blk, stride_k1s,
        stride_v0blk, stride_v0s, stride_v1blk, stride_v1s,
        HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        K_FORMAT: tl.constexpr, K_BITS: tl.constexpr, K_GROUP: tl.constexpr,
        V_FORMAT: tl.constexpr, V_BITS: tl.constexpr, V_GROUP: tl.constexpr,
        HAS_WINDOW: tl.constexpr, WIDE_OFFSETS: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """`_attend_block` over slots tile .. tile + BLOCK_N of a row: each slot's block from
        the row's table, its rows at that block's base (slots before `stop` only, and within
        the window)."""
        slots = tile + tl.arange(0, BLOCK_N)
        inside = slots < stop
        visible = inside
        if HAS_WINDOW:
            visible = visible & (qpos - slots < window)
        block = tl.load(table + slots // BLOCK_SIZE, mask=inside, other=0)
        if WIDE_OFFSETS:
            block = block.to(tl.int64)
        offset = slots % BLOCK_SIZE
        return _attend_block(
            query, query_sums, running_max, running_sum, acc,
            block * stride_k0blk + offset * stride_k0s,
            block * stride_k1blk + offset * stride_k1s,
            block * stride_v0blk + offset * stride_v0s,
            block * stride_v1blk + offset * stride_v1s,
            visible, scale_log2,
            k0, k1, k2, k_centroids, v0, v1, v2, v_centroids,
            HEAD_DIM, BLOCK_N, K_FORMAT, K_BITS, K_GROUP,
            V_FORMAT, V_BITS, V_GROUP, PRECISION,
        )  # fmt: skip

    @triton.jit
    def _paged_split_kernel(
        q,
        stride_qb,
        stride_qh,
        k0,
        k1,
        k2,
        stride_k0blk,
        stride_k0h,
        stride_k0s,
        stride_k1blk,
        stride_k1h,
        stride_k1s,
        v0,
        v1,
        v2,
        stride_v0blk,
        stride_v0h,
        stride_v0s,
        stride_v1blk,
        stride_v1h,
        stride_v1s,
        k_centroids,
        v_centroids,
        tables,
        stride_table,
        query_positions,
        window,
        part_acc,
        part_max,
        part_sum,
        out,
        table_slots,
        splits,
        scale_log2,
        KV_HEADS: tl.constexpr,
        GROUPS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        K_FORMAT: tl.constexpr,
        K_BITS: tl.constexpr,
        K_GROUP: tl.constexpr,
        V_FORMAT: tl.constexpr,
        V_BITS: tl.constexpr,
        V_GROUP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        WIDE_OFFSETS: tl.constexpr,
        PRECISION: tl.constexpr,
        FINISH: tl.constexpr,
        DEVICE_LOOP: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """(max, sum, acc) of one split of row b's slots for one KV head's query heads,
        rows gathered through the block table; FINISH as in `decode_attention`."""
        batch_head = tl.program_id(0)
        split = tl.program_id(1)
        batch = batch_head // KV_HEADS
        kv_head = batch_head % KV_HEADS
        wait_for_producer(PDL)

        query, query_sums, heads, group_mask = _query_tile(
            q, batch, kv_head, stride_qb, stride_qh,
            GROUPS, BLOCK_G, HEAD_DIM, K_FORMAT, K_BITS, K_GROUP,
        )  # fmt: skip
        # Positions fit int32 (a table of 2^31 slots is far beyond any pool).
        qpos = tl.load(query_positions + batch).to(tl.int32)

        k0 += kv_head * stride_k0h
        k1 += kv_head * stride_k1h
        k2 += kv_head * stride_k1h
        v0 += kv_head * stride_v0h
        v1 += kv_head * stride_v1h
        v2 += kv_head * stride_v1h
        table = tables + batch * stride_table

        running_max = tl.full([BLOCK_G], NO_SCORE, tl.float32)
        running_sum = tl.zeros([BLOCK_G], tl.float32)
        acc, acc_dims, acc_heads, acc_mask = _empty_accumulator(
            heads, group_mask, BLOCK_G, HEAD_DIM, V_FORMAT, V_BITS, V_GROUP
        )
        if HAS_WINDOW:
            # The row's first visible block: nothing before it is read.
            first = tl.maximum(qpos - window + 1, 0) // BLOCK_SIZE * BLOCK_SIZE
        else:
            first = qpos * 0
        # The row's tiles from `first` to its query, dealt evenly over the splits (whole
        # tiles, at most CHUNK slots each): a short row in a long table keeps every split
        # busy rather than only the first few; splits beyond its tiles run no iteration.
        last = tl.minimum(qpos + 1, table_slots)
        tiles = (last - first + BLOCK_N - 1) // BLOCK_N
        start = first + (split * tiles // splits) * BLOCK_N
        stop = tl.minimum(first + ((split + 1) * tiles // splits) * BLOCK_N, last)
        if DEVICE_LOOP:
            # Trip count read on the device: no iteration past the query, and the loop
            # still pipelines its loads (a branch per tile would stop that).
            for tile in range(start, stop, BLOCK_N):
                running_max, running_sum, acc = _paged_tile(
                    query, query_sums, running_max, running_sum, acc, tile, stop, qpos, window,
                    table, scale_log2, k0, k1, k2, k_centroids, v0, v1, v2, v_centroids,
                    stride_k0blk, stride_k0s, stride_k1blk, stride_k1s,
                    stride_v0blk, stride_v0s, stride_v1blk, stride_v1s,
                    HEAD_DIM, BLOCK_N, BLOCK_SIZE, K_FORMAT, K_BITS, K_GROUP,
                    V_FORMAT, V_BITS, V_GROUP, HAS_WINDOW, WIDE_OFFSETS, PRECISION,
                )  # fmt: skip
        else:
            # Triton's interpreter cannot take a tensor as a range bound: the same tiles,
            # as a fixed loop over the chunk that skips those at or past `stop`.
            for step in range(0, CHUNK, BLOCK_N):
                if start + step < stop:
                    running_max, running_sum, acc = _paged_tile(
                        query, query_sums, running_max, running_sum, acc, start + step, stop,
                        qpos, window, table, scale_log2,
                        k0, k1, k2, k_centroids, v0, v1, v2, v_centroids,
                        stride_k0blk, stride_k0s, stride_k1blk, stride_k1s,
                        stride_v0blk, stride_v0s, stride_v1blk, stride_v1s,
                        HEAD_DIM, BLOCK_N, BLOCK_SIZE, K_FORMAT, K_BITS, K_GROUP,
                        V_FORMAT, V_BITS, V_GROUP, HAS_WINDOW, WIDE_OFFSETS, PRECISION,
                    )  # fmt: skip

        _finish_split(
            running_max, running_sum, acc, heads, group_mask, acc_dims, acc_heads, acc_mask,
            batch * KV_HEADS * GROUPS, split, splits, out, part_max, part_sum, part_acc,
            HEAD_DIM, V_FORMAT, FINISH,
        )  # fmt: skip
