"""Append decode tokens' K/V to a cache in one launch: one token to a static cache
(`append_token_triton`), or one token of each of B rows to a paged pool's blocks
(`paged_append_triton`).

`LayerCache.update_and_fetch` eagerly costs ~7 launches per layer (slot arithmetic, three
`index_copy_`, the counter); at batch 1 that is hundreds of launches per token. This kernel
reads the token's absolute position from the device (so it can be captured in a CUDA graph),
writes K and V into slot position % capacity, records the position, and sets the cache's
next-position counter to position + 1.
"""

from __future__ import annotations

import torch

from hearth.ops import HAS_TRITON, pdl_options
from hearth.ops.launch import launch_kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer

    @triton.jit
    def _append_kernel(
        position_ptr,
        k_ptr,
        v_ptr,
        keys_ptr,
        values_ptr,
        positions_ptr,
        next_ptr,
        capacity,
        D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_producer(PDL)
        head = tl.program_id(0).to(tl.int64)
        position = tl.load(position_ptr)
        slot = position % capacity
        dims = tl.arange(0, D)
        target = (head * capacity + slot) * D + dims
        tl.store(keys_ptr + target, tl.load(k_ptr + head * D + dims))
        tl.store(values_ptr + target, tl.load(v_ptr + head * D + dims))
        if head == 0:
            tl.store(positions_ptr + slot, position)
            tl.store(next_ptr, position + 1)

    @triton.jit
    def _paged_append_kernel(
        k_ptr,
        v_ptr,
        blocks_ptr,
        slots_ptr,
        keys_ptr,
        values_ptr,
        stride_head,
        stride_row,
        stride_block,
        stride_plane_head,
        stride_slot,
        D: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_producer(PDL)
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        block = tl.load(blocks_ptr + row).to(tl.int64)
        slot = tl.load(slots_ptr + row).to(tl.int64)
        dims = tl.arange(0, D)
        source = head * stride_head + row * stride_row + dims
        target = block * stride_block + head * stride_plane_head + slot * stride_slot + dims
        tl.store(keys_ptr + target, tl.load(k_ptr + source))
        tl.store(values_ptr + target, tl.load(v_ptr + source))


def append_token_reference(
    position: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    positions: torch.Tensor,
    next_position: torch.Tensor,
) -> None:
    """Write K/V [1, Hk, 1, D] at slot position % capacity of [1, Hk, capacity, D] buffers."""
    slot = position.reshape(1) % key_buffer.shape[2]
    key_buffer.index_copy_(2, slot, keys)
    value_buffer.index_copy_(2, slot, values)
    positions.index_copy_(0, slot, position.reshape(1))
    next_position.copy_(position.reshape(()) + 1)


def append_token_triton(
    position: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    positions: torch.Tensor,
    next_position: torch.Tensor,
) -> None:
    batch, kv_heads, capacity, head_dim = key_buffer.shape
    assert batch == 1 and keys.shape[2] == 1, "one token of batch 1"
    assert key_buffer.is_contiguous() and value_buffer.is_contiguous()
    launch_kernel(
        _append_kernel,
        (kv_heads,),
        position,
        keys.contiguous(),
        values.contiguous(),
        key_buffer,
        value_buffer,
        positions,
        next_position,
        capacity,
        D=head_dim,
        num_warps=1 if head_dim <= 256 else 2,
        **pdl_options(keys),
    )


def paged_append_reference(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_plane: torch.Tensor,
    value_plane: torch.Tensor,
    blocks: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Write row b's K/V (of [1, Hk, B, D]) at (blocks[b], slots[b]) of the pool's planes
    [num_blocks, Hk, block_size, D]."""
    key_plane[blocks, :, slots] = keys[0].transpose(0, 1)
    value_plane[blocks, :, slots] = values[0].transpose(0, 1)


def paged_append_fits(
    keys: torch.Tensor, values: torch.Tensor, key_plane: torch.Tensor, value_plane: torch.Tensor
) -> bool:
    """Whether `paged_append_triton` takes these: planes of the tokens' dtype, a power-of-two
    head dim, contiguous last dims and K/V laid out alike."""
    head_dim = key_plane.shape[-1]
    return (
        keys.dtype == values.dtype == key_plane.dtype == value_plane.dtype
        and keys.shape == values.shape
        and keys.stride() == values.stride()
        and key_plane.stride() == value_plane.stride()
        and keys.shape[-1] == head_dim
        and head_dim & (head_dim - 1) == 0
        and keys.stride(-1) == 1
        and key_plane.stride(-1) == 1
    )


def paged_append_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_plane: torch.Tensor,
    value_plane: torch.Tensor,
    blocks: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """`paged_append_reference` in one launch (one program per row and KV head), where
    the indexed writes cost a transpose and an index_put per plane."""
    _, kv_heads, rows, head_dim = keys.shape
    launch_kernel(
        _paged_append_kernel,
        (rows, kv_heads),
        keys,
        values,
        blocks,
        slots,
        key_plane,
        value_plane,
        keys.stride(1),
        keys.stride(2),
        key_plane.stride(0),
        key_plane.stride(1),
        key_plane.stride(2),
        D=head_dim,
        num_warps=1 if head_dim <= 256 else 2,
        **pdl_options(keys),
    )
