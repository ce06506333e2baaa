"""Q/K norms, rotary embedding and the V norm of one attention layer, in one kernel.

After the stacked QKV projection [tokens, (Hq + Hk + Hv)·D], Gemma normalises each query and
key head (RMSNorm with a learned multiplier), rotates both (RoPE, NeoX half layout), and —
Gemma 4 — RMS-normalises V without a weight (on k_eq_v layers V is the raw K projection).
Eagerly that is ~20 launches per layer; here one program per (token, head) does it all and
writes Q, K and V as separate contiguous tensors.

Roundings follow the eager path where they matter: the normed head is rounded to the
activations' dtype before rotation; the rotation itself is computed in fp32 and rounded once
(eager rounds each of its three ops: differences are within one ulp of the dtype).
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import torch

from hearth.ops import HAS_TRITON, kernel_enabled, native, pdl_options
from hearth.ops.launch import launch_kernel
from hearth.ops.norm import rms_norm_reference


class ValueMode(IntEnum):
    """What the kernel does with V."""

    ABSENT = 0  # a KV-sharing layer: the projection holds only Q
    RAW = 1  # Gemma 3: V as projected
    UNIT_NORM = 2  # Gemma 4: V RMS-normalised without a weight
    UNIT_NORM_OF_K = 3  # Gemma 4 k_eq_v: V is the raw K projection, RMS-normalised


class CacheWrite(NamedTuple):
    """Where a decode step's K/V go instead of new tensors: a dense static cache's buffers.

    K and V land in slot position % capacity of [1, Hk, capacity, D]; the slot's position is
    recorded and the cache's next-position counter set to position + 1.
    """

    position: torch.Tensor  # [1] int64, on the device
    key_buffer: torch.Tensor
    value_buffer: torch.Tensor
    slot_positions: torch.Tensor
    next_position: torch.Tensor


if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer

    @triton.jit
    def _norm_rope_kernel(
        qkv_ptr,
        q_weight_ptr,
        k_weight_ptr,
        cos_ptr,
        sin_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        position_ptr,
        slot_positions_ptr,
        next_ptr,
        capacity,
        eps,
        row_width,
        Q_HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        D: tl.constexpr,
        V_MODE: tl.constexpr,
        WRITE_CACHE: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_producer(PDL)
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dims = tl.arange(0, D)
        half: tl.constexpr = D // 2
        partner = (dims + half) % D
        row = qkv_ptr + token * row_width
        if head < Q_HEADS + KV_HEADS:
            is_query = head < Q_HEADS
            source = row + head * D
            x = tl.load(source + dims).to(tl.float32)
            x_partner = tl.load(source + partner).to(tl.float32)
            inverse_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            if is_query:
                w = tl.load(q_weight_ptr + dims)
                w_partner = tl.load(q_weight_ptr + partner)
            else:
                w = tl.load(k_weight_ptr + dims)
                w_partner = tl.load(k_weight_ptr + partner)
            dtype = q_ptr.dtype.element_ty
            normed = (x * inverse_rms * w).to(dtype).to(tl.float32)
            normed_partner = (x_partner * inverse_rms * w_partner).to(dtype).to(tl.float32)
            cos = tl.load(cos_ptr + token * D + dims).to(tl.float32)
            sin = tl.load(sin_ptr + token * D + dims).to(tl.float32)
            sign = tl.where(dims < half, -1.0, 1.0)
            rotated = (normed * cos + sign * normed_partner * sin).to(dtype)
            if is_query:
                tl.store(q_ptr + (token * Q_HEADS + head) * D + dims, rotated)
            elif WRITE_CACHE:
                position = tl.load(position_ptr)
                slot = position % capacity
                tl.store(k_ptr + ((head - Q_HEADS) * capacity + slot) * D + dims, rotated)
                if head == Q_HEADS:
                    tl.store(slot_positions_ptr + slot, position)
                    tl.store(next_ptr, position + 1)
            else:
                tl.store(k_ptr + (token * KV_HEADS + head - Q_HEADS) * D + dims, rotated)
        else:
            kv_head = head - Q_HEADS - KV_HEADS
            if V_MODE == 3:
                source = row + (Q_HEADS + kv_head) * D
            else:
                source = row + (Q_HEADS + KV_HEADS + kv_head) * D
            v = tl.load(source + dims)
            if V_MODE >= 2:
                vf = v.to(tl.float32)
                v = vf * tl.rsqrt(tl.sum(vf * vf, axis=0) / D + eps)
            if WRITE_CACHE:
                slot = tl.load(position_ptr) % capacity
                target = v_ptr + (kv_head * capacity + slot) * D + dims
            else:
                target = v_ptr + (token * KV_HEADS + kv_head) * D + dims
            tl.store(target, v.to(v_ptr.dtype.element_ty))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (NeoX layout): x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def norm_rope_reference(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    value_mode: ValueMode,
    cache_write: CacheWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q [T, Hq, D], k [T, Hk, D] or None, v [T, Hk, D] or None) as the eager model makes them.

    `qkv` is [T, width]; cos/sin are [T, D]. With `cache_write` (one token), K and V go
    into the cache instead and come back as None.
    """
    tokens = qkv.shape[0]
    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    cos, sin = cos[:, None, :], sin[:, None, :]
    q = qkv[:, :q_width].view(tokens, q_heads, head_dim)
    q = apply_rotary(rms_norm_reference(q, q_weight, eps), cos, sin)
    if value_mode == ValueMode.ABSENT:
        return q, None, None
    raw_k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, head_dim)
    k = apply_rotary(rms_norm_reference(raw_k, k_weight, eps), cos, sin)
    if value_mode == ValueMode.UNIT_NORM_OF_K:
        v = rms_norm_reference(raw_k, None, eps)
    else:
        v = qkv[:, q_width + kv_width : q_width + 2 * kv_width].view(tokens, kv_heads, head_dim)
        v = rms_norm_reference(v, None, eps) if value_mode == ValueMode.UNIT_NORM else v
    if cache_write is not None:
        position, key_buffer, value_buffer, slot_positions, next_position = cache_write
        slot = position.reshape(1) % key_buffer.shape[2]
        key_buffer.index_copy_(2, slot, k.transpose(0, 1)[None])
        value_buffer.index_copy_(2, slot, v.transpose(0, 1)[None])
        slot_positions.index_copy_(0, slot, position.reshape(1))
        next_position.copy_(position.reshape(()) + 1)
        return q, None, None
    return q, k, v.contiguous()


def _warps(head_dim: int) -> int:
    return 2 if head_dim <= 256 else 4


def norm_rope_triton(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    value_mode: ValueMode,
    cache_write: CacheWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    source = qkv.contiguous()
    tokens = source.shape[0]
    q = source.new_empty((tokens, q_heads, head_dim))
    has_kv = value_mode != ValueMode.ABSENT
    if cache_write is not None:
        assert has_kv and tokens == 1, "a cache write is one token's K and V"
        position, k, v, slot_positions, next_position = cache_write
        capacity = k.shape[2]
    else:
        k = source.new_empty((tokens, kv_heads, head_dim)) if has_kv else q
        v = source.new_empty((tokens, kv_heads, head_dim)) if has_kv else q
        position = slot_positions = next_position = q  # unread placeholders
        capacity = 1
    heads = q_heads + (2 * kv_heads if has_kv else 0)
    launch_kernel(
        _norm_rope_kernel,
        (tokens, heads),
        source,
        q_weight,
        k_weight if k_weight is not None else q_weight,
        cos.contiguous(),
        sin.contiguous(),
        q,
        k,
        v,
        position,
        slot_positions,
        next_position,
        capacity,
        eps,
        source.shape[1],
        Q_HEADS=q_heads,
        KV_HEADS=kv_heads,
        D=head_dim,
        V_MODE=int(value_mode),
        WRITE_CACHE=cache_write is not None,
        num_warps=_warps(head_dim),
        **pdl_options(source),
    )
    if cache_write is not None or not has_kv:
        return q, None, None
    return q, k, v


def norm_rope(
    qkv: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    value_mode: ValueMode,
    cache_write: CacheWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Normed and rotated Q and K, and V, of a stacked QKV projection [T, width].

    With `cache_write`, K and V are written into a dense static cache instead (one token).
    """
    if kernel_enabled(qkv):
        run = norm_rope_triton
    elif (
        value_mode == ValueMode.RAW
        and k_weight is not None
        and cache_write is None
        and qkv.dim() == 2
        and qkv.shape[1] == (q_heads + 2 * kv_heads) * head_dim
        and (kernels := native.for_cpu_bf16(qkv, cos, sin)) is not None
    ):
        # A CPU bf16 step: one native call with the reference's roundings.
        return kernels.norm_rope(
            qkv.contiguous(), q_heads, kv_heads, head_dim, q_weight, k_weight,
            cos.contiguous(), sin.contiguous(), eps,
        )  # fmt: skip
    elif (
        value_mode == ValueMode.RAW
        and k_weight is not None
        and cache_write is None
        and qkv.dim() == 2
        and qkv.shape[0] == 1
        and qkv.shape[1] == (q_heads + 2 * kv_heads) * head_dim
        and q_weight.dtype == k_weight.dtype == torch.float32
        and (kernels := native.for_cpu_fp32_row(qkv, cos, sin)) is not None
    ):
        # A CPU fp32 decode step: one native call, the reference's ops in fp32.
        return kernels.norm_rope(
            qkv.contiguous(), q_heads, kv_heads, head_dim, q_weight.contiguous(),
            k_weight.contiguous(), cos.contiguous(), sin.contiguous(), eps,
        )  # fmt: skip
    else:
        run = norm_rope_reference
    return run(
        qkv, q_heads, kv_heads, head_dim, q_weight, k_weight, cos, sin, eps, value_mode,
        cache_write,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# RoPE tables: cos and sin of a chunk's positions. Eagerly each table kind is seven launches a
# decode step (the cast, the product, the concatenation, cos, sin, two casts), none of them
# PDL; Gemma 3 and Gemma 4 have two kinds. Here it is one launch a kind. torch's cos/sin and
# Triton's are the same fp32 functions on the GPU (`benchmarks/gpu_trig_bits.py` compares
# them angle by angle), so the tables are the reference's bit for bit.


def rotary_tables_reference(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [T, 1, 2·F] of angles ``position · inv_freq`` repeated over both halves (NeoX
    layout), computed in fp32 and cast to `dtype`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_tables_reference`, one kernel on CUDA."""
    if kernel_enabled(positions):
        return rotary_tables_triton(positions, inv_freq, dtype)
    return rotary_tables_reference(positions, inv_freq, dtype)


if HAS_TRITON:

    @triton.jit
    def _rotary_tables_kernel(
        positions_ptr, inv_freq_ptr, cos_ptr, sin_ptr,
        FREQS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Row t of cos and sin: ``cos(p_t · f_j)`` at columns j and FREQS + j."""
        wait_for_producer(PDL)  # the positions: `start` + an arange, from the step's launches
        token = tl.program_id(0)
        j = tl.arange(0, BLOCK)
        ok = j < FREQS
        angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(
            inv_freq_ptr + j, mask=ok, other=0.0
        )
        row = token.to(tl.int64) * (2 * FREQS) + j
        cos = tl.cos(angle).to(cos_ptr.dtype.element_ty)
        sin = tl.sin(angle).to(sin_ptr.dtype.element_ty)
        tl.store(cos_ptr + row, cos, mask=ok)
        tl.store(cos_ptr + row + FREQS, cos, mask=ok)
        tl.store(sin_ptr + row, sin, mask=ok)
        tl.store(sin_ptr + row + FREQS, sin, mask=ok)

    def rotary_tables_triton(
        positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, freqs = positions.numel(), inv_freq.numel()
        cos = torch.empty(tokens, 1, 2 * freqs, dtype=dtype, device=positions.device)
        sin = torch.empty_like(cos)
        launch_kernel(_rotary_tables_kernel, (tokens,),
            positions.reshape(-1), inv_freq.float(), cos, sin,
            FREQS=freqs, BLOCK=triton.next_power_of_2(freqs), num_warps=1,
            **pdl_options(positions),
        )  # fmt: skip
        return cos, sin
