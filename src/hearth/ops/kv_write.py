"""Append one decode token's K/V to a static cache in one launch.

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
