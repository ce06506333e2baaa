"""Weight-only int8 / int4 schemes for CPU decode, as PyTorch's packed-matmul ops read them.

Decode on CPU is memory-bandwidth bound, so shrinking the weights that every token reads is the
whole win: int8 halves the bytes of a bf16 weight, int4 quarters them. The layers that compute
on them are `hearth.layers.int8` (``aten._weight_int8pack_mm``,
``aten._weight_int4pack_mm_for_cpu``, the native int8 row kernel); this module is the maths.

Schemes (W is [out, in]; every dequantized value below is computed exactly as the kernels do):

* int8, symmetric per output row: ``w ≈ q * s`` with ``q`` in [-127, 127] and ``s`` in bf16.
  The x86 int8 kernel (aten/src/ATen/native/cpu/int8mm_kernel.cpp) forms ``q * s`` in fp32
  and accumulates ``x · (q * s)`` in fp32.
* int4, asymmetric per group of ``group_size`` inputs: ``w ≈ (q - 8) * s + z`` with ``q`` in
  [0, 15] and bf16 ``s``, ``z`` stored as ``scales_and_zeros[in // group, out] = (s, z)``.
  This is the dequantization of PyTorch's CPU int4 kernel (aten/src/ATen/native/cpu/
  int4mm_kernel.cpp: a lookup table maps the nibble to ``q - 8`` in [-8, 7], then
  ``fmadd(q - 8, scale, zero)`` in fp32).

Both ``(q - 8) * s`` and ``q * s`` are exact in fp32 (at most 4 + 8 and 8 + 8 significant bits),
so ``dequantize()`` reproduces the kernels' weights bit for bit, fma or not.
"""

from __future__ import annotations

import torch
from torch import Tensor

INT4_GROUP_SIZES = (32, 64, 128)
INT8_MAX = 127
INT4_LEVELS = 15  # codes 0..15
INT4_OFFSET = 8  # the int4 kernel reads code q as q - 8
# The int4 kernel tiles the output dimension by 16 (its packing checks it).
INT4_KERNEL_OUT_MULTIPLE = 16
# The AVX-512 int8 kernel steps through K by 16 with no tail loop: any other K reads past the
# row and returns garbage (seen on torch 2.13), so such layers take the reference path.
INT8_KERNEL_IN_MULTIPLE = 16
# ... and it uses aligned 256-bit loads on x: a misaligned input segfaults.
KERNEL_ALIGNMENT_BYTES = 64
# Floor for scales: keeps all-zero rows/groups finite and stays a normal bf16 number.
SCALE_FLOOR = torch.finfo(torch.bfloat16).tiny


def _has_aten_op(name: str) -> bool:
    return hasattr(torch.ops.aten, name)


# Modules read these when built, so tests can patch them to exercise the fallback paths.
HAS_INT8_KERNEL = _has_aten_op("_weight_int8pack_mm")
HAS_INT4_KERNEL = _has_aten_op("_weight_int4pack_mm_for_cpu") and _has_aten_op(
    "_convert_weight_to_int4pack_for_cpu"
)


def aligned(tensor: Tensor) -> Tensor:
    """``tensor`` itself when its data is 64-byte aligned, else a fresh (aligned) copy."""
    if tensor.data_ptr() % KERNEL_ALIGNMENT_BYTES == 0:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _round_up_to_bf16(values: Tensor) -> Tensor:
    """Smallest bf16 >= each fp32 value, so a stored scale never shrinks the covered range."""
    rounded = values.to(torch.bfloat16)
    bumped = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.float() < values, bumped, rounded)


# ---------------------------------------------------------------------------------------------
# int8, symmetric per output row


def quantize_int8_rows(weight: Tensor, chunk_rows: int = 16384) -> tuple[Tensor, Tensor]:
    """``(q int8 [out, in], scales bf16 [out])`` with ``|w - q * s| <= s / 2`` per element.

    Rows are independent, so they are quantized `chunk_rows` at a time: the fp32 temporaries
    of a 262144-row embedding would otherwise need 2 GB on top of the weight.
    """
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.bfloat16, device=weight.device)
    for start in range(0, weight.shape[0], chunk_rows):
        rows = weight[start : start + chunk_rows].detach().float()
        amax = rows.abs().amax(dim=1)
        # Rounding the scale up keeps |w| / s <= 127, so the clamp never adds error.
        chunk_scales = _round_up_to_bf16((amax / INT8_MAX).clamp_min(SCALE_FLOOR))
        codes = torch.round(rows / chunk_scales.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        q[start : start + chunk_rows] = codes.to(torch.int8)
        scales[start : start + chunk_rows] = chunk_scales
    return q, scales


def dequantize_int8_rows(q: Tensor, scales: Tensor) -> Tensor:
    return q.float() * scales.float()[:, None]


# ---------------------------------------------------------------------------------------------
# int4, asymmetric per group along the input dimension


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not divisible by group_size {group_size}")


def _int4_scales_and_zeros(groups: Tensor) -> tuple[Tensor, Tensor]:
    """bf16 (scale, zero) per group of ``groups [out, n_groups, group]`` (fp32)."""
    low = groups.amin(dim=2)
    high = groups.amax(dim=2)
    # Centre the 16 levels on [low, high]: code 0 at low, code 15 at high.
    scale = ((high - low) / INT4_LEVELS).clamp_min(SCALE_FLOOR)
    zero = (low + INT4_OFFSET * scale).to(torch.bfloat16)
    # Rounding zero to bf16 shifts the grid; widen the step so it still reaches low and high.
    needed = torch.maximum(
        scale,
        torch.maximum(
            (zero.float() - low) / INT4_OFFSET, (high - zero.float()) / (INT4_LEVELS - INT4_OFFSET)
        ),
    )
    return _round_up_to_bf16(needed), zero


def quantize_int4_groups(weight: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """``(codes uint8 [out, in] in 0..15, scales_and_zeros bf16 [in // group, out, 2])``.

    Dequantizes as ``(q - 8) * s + z`` with ``|w - deq| <= s / 2`` up to fp32 rounding.
    """
    out_features, in_features = weight.shape
    check_group_size(in_features, group_size)
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    scale, zero = _int4_scales_and_zeros(groups)
    steps = (groups - zero.float()[..., None]) / scale.float()[..., None]
    codes = torch.round(steps + INT4_OFFSET).clamp_(0, INT4_LEVELS)
    scales_and_zeros = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
    return codes.to(torch.uint8).reshape(out_features, in_features), scales_and_zeros


def dequantize_int4_groups(codes: Tensor, scales_and_zeros: Tensor, group_size: int) -> Tensor:
    out_features, in_features = codes.shape
    groups = codes.float().reshape(out_features, in_features // group_size, group_size)
    scale = scales_and_zeros[..., 0].transpose(0, 1).float()[..., None]
    zero = scales_and_zeros[..., 1].transpose(0, 1).float()[..., None]
    return ((groups - INT4_OFFSET) * scale + zero).reshape(out_features, in_features)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Portable layout for builds without the int4 kernel: byte j = code 2j | code 2j+1 << 4."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def codes_from_kernel_layout(packed: Tensor, in_features: int, group_size: int) -> Tensor:
    """Read the codes back through the kernel itself, since its tiling is ISA-specific.

    With scale 1 and zero 0 every dequantized weight is the integer q - 8, which fp32
    accumulation and the bf16 output hold exactly; an identity input then returns W^T.
    """
    out_features = packed.shape[0]
    unit = torch.zeros(in_features // group_size, out_features, 2, dtype=torch.bfloat16)
    unit[..., 0] = 1.0
    identity = torch.eye(in_features, dtype=torch.bfloat16)
    weight_t = torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, group_size, unit)
    return (weight_t.t() + INT4_OFFSET).to(torch.uint8)
