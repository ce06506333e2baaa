"""Quantize one decode token's K/V to the MLX affine layout and store it in a static cache.

A quantized static cache encodes each new token with `quantize_affine` (about fifty small torch
ops for K and V) and copies six planes: at batch-1 decode that is thousands of launches per
token and halves the decode speed. This kernel does it in one launch per layer: one program
per (KV head, K or V) computes each group's statistics in fp32 with the rule of
`mx.quantize` (the scale re-fitted so the edge of larger magnitude is exact; round half to
even), packs the codes LSB first into 32-bit words and writes codes, scales and biases into
slot position % capacity. The result equals `quantize_affine` bit for bit.
"""

from __future__ import annotations

import torch

from hearth.kernels import HAS_TRITON
from hearth.quant.mlx import SCALE_EPSILON, quantize_affine

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _round_half_even(x):
        """torch.round of |x| < 2^22, from floor (the interpreter has no libdevice)."""
        r = tl.floor(x + 0.5)
        tie = (r - x) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(tie & odd, r - 1.0, r)

    @triton.jit
    def _quantize_append_kernel(
        k_ptr,
        v_ptr,
        k_codes_ptr,
        k_scales_ptr,
        k_biases_ptr,
        v_codes_ptr,
        v_scales_ptr,
        v_biases_ptr,
        position_ptr,
        slot_positions_ptr,
        next_ptr,
        capacity,
        epsilon,
        D: tl.constexpr,
        GROUP: tl.constexpr,
        BITS: tl.constexpr,
    ):
        head = tl.program_id(0).to(tl.int64)
        is_value = tl.program_id(1) == 1
        GROUPS: tl.constexpr = D // GROUP
        CODES: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = D // CODES
        LEVELS: tl.constexpr = (1 << BITS) - 1
        position = tl.load(position_ptr)
        slot = position % capacity
        dims = tl.arange(0, D)
        source = tl.where(is_value, v_ptr, k_ptr)
        x = tl.load(source + head * D + dims).to(tl.float32)
        groups = tl.reshape(x, (GROUPS, GROUP))
        high = tl.max(groups, axis=1)
        low = tl.min(groups, axis=1)
        low_is_edge = tl.abs(low) > tl.abs(high)
        # div_rn: IEEE division, as torch does (Triton's `/` is approximate in fp32 on CUDA).
        step = tl.maximum(tl.math.div_rn(high - low, LEVELS * 1.0), epsilon)
        scale = tl.where(low_is_edge, step, -step)
        edge = tl.where(low_is_edge, low, high)
        edge_code = _round_half_even(tl.math.div_rn(edge, scale))
        anchored = edge_code != 0.0
        scale = tl.where(anchored, tl.math.div_rn(edge, edge_code), scale)
        bias = tl.where(anchored, edge, 0.0)
        codes = _round_half_even(tl.math.div_rn(groups - bias[:, None], scale[:, None]))
        codes = tl.minimum(tl.maximum(codes, 0.0), LEVELS).to(tl.uint32)
        # Code j of a word sits at bits j*BITS..: shift each code into place and add (the
        # bit fields are disjoint, so the sum is their OR).
        shifts = (tl.arange(0, CODES) * BITS).to(tl.uint32)
        words = tl.sum(tl.reshape(codes, (WORDS, CODES)) << shifts[None, :], axis=1)
        slot_row = head * capacity + slot
        codes_out = tl.where(is_value, v_codes_ptr, k_codes_ptr)
        scales_out = tl.where(is_value, v_scales_ptr, k_scales_ptr)
        biases_out = tl.where(is_value, v_biases_ptr, k_biases_ptr)
        tl.store(codes_out + slot_row * WORDS + tl.arange(0, WORDS), words)
        group_index = tl.arange(0, GROUPS)
        stored_dtype = scales_out.dtype.element_ty
        tl.store(scales_out + slot_row * GROUPS + group_index, scale.to(stored_dtype))
        tl.store(biases_out + slot_row * GROUPS + group_index, bias.to(stored_dtype))
        if (head == 0) & (tl.program_id(1) == 0):
            tl.store(slot_positions_ptr + slot, position)
            tl.store(next_ptr, position + 1)


def quantize_append_reference(
    position: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    planes: list[torch.Tensor],
    slot_positions: torch.Tensor,
    next_position: torch.Tensor,
    bits: int,
    group_size: int,
) -> None:
    """`quantize_affine` of K and V [1, Hk, 1, D], written to slot position % capacity of the
    six planes (codes, scales, biases of K, then of V) [1, Hk, capacity, ...]."""
    slot = position.reshape(1) % planes[0].shape[2]
    encoded = (*quantize_affine(keys, bits, group_size), *quantize_affine(values, bits, group_size))
    for plane, part in zip(planes, encoded, strict=True):
        as_int = torch.int32 if plane.dtype == torch.uint32 else plane.dtype
        plane.view(as_int).index_copy_(2, slot, part.view(as_int))
    slot_positions.index_copy_(0, slot, position.reshape(1))
    next_position.copy_(position.reshape(()) + 1)


def quantize_append_triton(
    position: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    planes: list[torch.Tensor],
    slot_positions: torch.Tensor,
    next_position: torch.Tensor,
    bits: int,
    group_size: int,
) -> None:
    batch, kv_heads, tokens, head_dim = keys.shape
    assert batch == 1 and tokens == 1, "one token of batch 1"
    assert all(plane.is_contiguous() for plane in planes)
    _quantize_append_kernel[(kv_heads, 2)](
        keys.contiguous(),
        values.contiguous(),
        *planes,
        position,
        slot_positions,
        next_position,
        planes[0].shape[2],
        SCALE_EPSILON,
        D=head_dim,
        GROUP=group_size,
        BITS=bits,
        num_warps=1 if head_dim <= 128 else 2,
    )


KERNEL_BITS = (4, 8)  # widths whose codes fill words exactly (3-, 5-, 6-bit codes straddle)
