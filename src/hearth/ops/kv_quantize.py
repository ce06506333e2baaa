"""Quantize one decode token's K/V and store it in a static cache: MLX affine or TuroQuant.

A quantized static cache encodes each new token with `quantize_affine` (about fifty small torch
ops for K and V) and copies six planes: at batch-1 decode that is thousands of launches per
token and halves the decode speed. This kernel does it in one launch per layer: one program
per (KV head, K or V) computes each group's statistics in fp32 with the rule of
`mx.quantize` (the scale re-fitted so the edge of larger magnitude is exact; round half to
even), packs the codes LSB first into 32-bit words and writes codes, scales and biases into
slot position % capacity. The result equals `quantize_affine` bit for bit.

TurboQuant planes (kv/turbo.py) take two more launches: the rotation (kernels/hadamard.py,
one matmul on the GPU) and the codebook coder below (σ per 32-group rounded to
fp16, codes = how many Lloyd–Max boundaries lie below each normalised coordinate, packed LSB
first at any width, also 3 bits straddling words). Its σ sums in a different order than
torch, so a σ can differ from `encode_rotated`'s by one fp16 ulp (and then a code rarely).
"""

from __future__ import annotations

from functools import cache

import torch

from hearth.ops import HAS_TRITON
from hearth.ops.hadamard import rotate_rows
from hearth.ops.launch import launch_kernel
from hearth.quant.mlx import SCALE_EPSILON, quantize_affine
from hearth.quant.turbo import CODEBOOKS, GROUP, TurboCodec

_FP16_MAX = float(torch.finfo(torch.float16).max)
_FP32_TINY = float(torch.finfo(torch.float32).tiny)

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
        WRITES_POSITION: tl.constexpr,
    ):
        """Grid (KV heads, 1 or 2): K only (TurboQuant's affine keys), or K and V."""
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
        if WRITES_POSITION:  # noqa: SIM102 - a compile-time switch around a runtime test
            if (head == 0) & (tl.program_id(1) == 0):
                tl.store(slot_positions_ptr + slot, position)
                tl.store(next_ptr, position + 1)

    @triton.jit
    def _pack(codes, D: tl.constexpr, BITS: tl.constexpr, WORDS_BLOCK: tl.constexpr):
        """Codes [D] (uint32, < 2^BITS) as the LSB-first bit stream of D·BITS/32 words, in a
        block of WORDS_BLOCK (a power of two; the words past the stream are 0)."""
        # Code j starts at bit j·BITS; its share of word w is shifted by j·BITS − 32·w.
        shift = tl.arange(0, D)[None, :] * BITS - tl.arange(0, WORDS_BLOCK)[:, None] * 32
        wide = codes.to(tl.uint64)[None, :]
        left = wide << tl.maximum(shift, 0).to(tl.uint64)
        right = wide >> tl.maximum(-shift, 0).to(tl.uint64)
        part = tl.where(shift >= 0, left, right) & 0xFFFFFFFF
        part = tl.where((shift > -BITS) & (shift < 32), part, 0)
        return tl.sum(part, axis=1).to(tl.uint32)  # disjoint bit fields: the sum is the OR

    @triton.jit
    def _codebook_append_kernel(
        rotated_ptr,
        codes_ptr,
        sigma_ptr,
        boundaries_ptr,
        position_ptr,
        slot_positions_ptr,
        next_ptr,
        capacity,
        fp16_max,
        fp32_tiny,
        D: tl.constexpr,
        BITS: tl.constexpr,
        WORDS_BLOCK: tl.constexpr,
        WRITES_POSITION: tl.constexpr,
    ):
        """One program per KV head: code a rotated row [D] into slot position % capacity."""
        head = tl.program_id(0).to(tl.int64)
        GROUPS: tl.constexpr = D // 32
        WORDS: tl.constexpr = D * BITS // 32
        position = tl.load(position_ptr)
        slot = position % capacity
        y = tl.load(rotated_ptr + head * D + tl.arange(0, D))
        groups = tl.reshape(y, (GROUPS, 32))
        sigma = tl.sqrt_rn(tl.math.div_rn(tl.sum(groups * groups, axis=1), 32.0))
        sigma = tl.minimum(sigma, fp16_max).to(tl.float16)
        divisor = tl.maximum(sigma.to(tl.float32), fp32_tiny)
        normalised = tl.math.div_rn(groups, divisor[:, None])
        codes = tl.zeros((GROUPS, 32), tl.uint32)
        for b in tl.static_range((1 << BITS) - 1):
            codes += (normalised > tl.load(boundaries_ptr + b)).to(tl.uint32)
        words = _pack(tl.reshape(codes, (D,)), D, BITS, WORDS_BLOCK)
        slot_row = head * capacity + slot
        word_index = tl.arange(0, WORDS_BLOCK)
        tl.store(codes_ptr + slot_row * WORDS + word_index, words, mask=word_index < WORDS)
        tl.store(sigma_ptr + slot_row * GROUPS + tl.arange(0, GROUPS), sigma)
        if WRITES_POSITION:  # noqa: SIM102 - a compile-time switch around a runtime test
            if head == 0:
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
    encoded = (*quantize_affine(keys, bits, group_size), *quantize_affine(values, bits, group_size))
    _store(position, encoded, planes, slot_positions, next_position)


def _store(
    position: torch.Tensor,
    encoded: tuple[torch.Tensor, ...],
    planes: list[torch.Tensor],
    slot_positions: torch.Tensor,
    next_position: torch.Tensor,
) -> None:
    """Write one token's encoded planes into slot position % capacity; move the counter."""
    slot = position.reshape(1) % planes[0].shape[2]
    for plane, part in zip(planes, encoded, strict=True):
        as_int = torch.int32 if plane.dtype == torch.uint32 else plane.dtype  # no uint32 copy
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
    launch_kernel(
        _quantize_append_kernel,
        (kv_heads, 2),
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
        WRITES_POSITION=True,
        num_warps=1 if head_dim <= 128 else 2,
    )


@cache
def _boundaries(bits: int, device: torch.device) -> torch.Tensor:
    return CODEBOOKS[bits][1].to(device)


def turbo_append_reference(
    position: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    planes: list[torch.Tensor],
    slot_positions: torch.Tensor,
    next_position: torch.Tensor,
    codec: TurboCodec,
) -> None:
    """`codec.encode` of K and V [1, Hk, 1, D], written to slot position % capacity."""
    _store(position, codec.encode(keys, values), planes, slot_positions, next_position)


def turbo_append_triton(
    position: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    planes: list[torch.Tensor],
    slot_positions: torch.Tensor,
    next_position: torch.Tensor,
    codec: TurboCodec,
) -> None:
    """Three or four launches: rotate, code values; affine keys, or rotate and code them."""
    batch, kv_heads, tokens, head_dim = keys.shape
    assert batch == 1 and tokens == 1, "one token of batch 1"
    capacity = planes[0].shape[2]
    *key_planes, value_codes, value_sigma = planes
    warps = 1 if head_dim <= 128 else 2

    def code(
        rows: torch.Tensor, codes: torch.Tensor, sigma: torch.Tensor, bits: int, last: bool
    ) -> None:
        launch_kernel(
            _codebook_append_kernel,
            (kv_heads,),
            rotate_rows(rows).contiguous(),
            codes,
            sigma,
            _boundaries(bits, rows.device),
            position,
            slot_positions,
            next_position,
            capacity,
            _FP16_MAX,
            _FP32_TINY,
            D=head_dim,
            BITS=bits,
            WORDS_BLOCK=triton.next_power_of_2(head_dim * bits // 32),
            WRITES_POSITION=last,  # the last launch moves the position on
            num_warps=warps,
        )

    code(values.reshape(kv_heads, head_dim), value_codes, value_sigma, codec.value_bits, False)
    if codec.key_kind == "t":
        code(keys.reshape(kv_heads, head_dim), *key_planes, codec.key_bits, True)
        return
    launch_kernel(
        _quantize_append_kernel,
        (kv_heads, 1),
        keys.contiguous(),
        keys,
        *key_planes,
        *key_planes,
        position,
        slot_positions,
        next_position,
        capacity,
        SCALE_EPSILON,
        D=head_dim,
        GROUP=GROUP,
        BITS=codec.key_bits,
        WRITES_POSITION=True,
        num_warps=warps,
    )


KERNEL_BITS = (4, 8)  # affine widths whose codes fill words exactly (3-, 5-, 6-bit straddle)


def turbo_kernel_mismatch(
    codec: TurboCodec, head_dim: int, dtype: torch.dtype, device: str
) -> str | None:
    """Why the TurboQuant append kernels cannot stand in for `codec.encode` on `device`, or
    None when they can. Checked on random tokens by what matters downstream: the K and V each
    path's planes decode to. The kernels may round a tie or a scale's last bit the other way
    (σ and min/max sum in another order), so planes need not be bit-equal; each decoded plane
    must be as close to the input as the reference's is (within 2% RMS error), and the two
    decodes must differ by at most a few elements' worth of one quantization step."""
    generator = torch.Generator().manual_seed(0)
    keys, values = (
        torch.randn(1, 4, 1, head_dim, generator=generator).mul(2).to(dtype).to(device)
        for _ in range(2)
    )
    sample = torch.zeros_like(keys)
    decoded = []
    for append in (turbo_append_triton, turbo_append_reference):
        encoded = codec.encode(sample, sample)
        planes = [p.new_zeros((*p.shape[:2], 4, *p.shape[3:])) for p in encoded]
        slots = torch.zeros(4, dtype=torch.long, device=device)
        counter = torch.zeros((), dtype=torch.long, device=device)
        append(torch.tensor([1], device=device), keys, values, planes, slots, counter, codec)
        decoded.append(codec.decode([p[:, :, 1:2] for p in planes], torch.float32))
    for name, original, got, expected in zip(
        ("keys", "values"), (keys, values), *decoded, strict=True
    ):
        original = original.float()
        got_error = (got - original).square().mean().sqrt().item()
        expected_error = (expected - original).square().mean().sqrt().item()
        if not got_error <= 1.02 * expected_error + 1e-6:
            return f"{name}: kernel RMS error {got_error:.3g} vs encode {expected_error:.3g}"
    return None


@cache
def turbo_kernel_agrees(codec: TurboCodec, head_dim: int, dtype: torch.dtype, device: str) -> bool:
    """Whether the append kernels may be used on `device` (see `turbo_kernel_mismatch`);
    checked once per codec, head size, dtype and device, before any graph capture."""
    return turbo_kernel_mismatch(codec, head_dim, dtype, device) is None
