"""GGML block formats dequantized in torch, bit for bit as the `gguf` package does it in fp32.

Every type here is, per block, int codes times a scale per group of 16 or 32 values, minus an
offset per group (zero for the symmetric types): w = fl(fl(scale · q) - offset), each scale
itself one fp32 product of the block's fp16 numbers and its packed small integers, in the
`gguf` package's order (`gguf.quants.<TYPE>.dequantize_blocks`). Block layouts are llama.cpp's
(ggml-common.h). The native kernels (`hearth.ops.native`) compute the same values; this is
their reference and the path where they do not run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BlockFormat:
    """A GGML block type: its name, values and bytes per block."""

    name: str
    values: int
    nbytes: int


# GGML type id -> format, for the types Hearth computes on as stored.
BLOCK_FORMATS: dict[int, BlockFormat] = {
    2: BlockFormat("Q4_0", 32, 18),
    3: BlockFormat("Q4_1", 32, 20),
    6: BlockFormat("Q5_0", 32, 22),
    7: BlockFormat("Q5_1", 32, 24),
    8: BlockFormat("Q8_0", 32, 34),
    10: BlockFormat("Q2_K", 256, 84),
    11: BlockFormat("Q3_K", 256, 110),
    12: BlockFormat("Q4_K", 256, 144),
    13: BlockFormat("Q5_K", 256, 176),
    14: BlockFormat("Q6_K", 256, 210),
}


def _half(blocks: Tensor, start: int) -> Tensor:
    """The fp16 number at byte `start` of each block, widened to fp32 (exact): [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifted(packed: Tensor, shifts: list[int], shape: tuple[int, ...]) -> Tensor:
    """`packed` (uint8) reshaped to `shape` with a shift axis before its last, shifted right by
    each of `shifts` along it (the `gguf` package's broadcast unpacking)."""
    amounts = torch.tensor(shifts, dtype=torch.uint8, device=packed.device)
    amounts = amounts.reshape(len(shifts), 1)
    return packed.reshape(shape) >> amounts


def _nibbles(qs: Tensor, n: int) -> Tensor:
    """Each 16 bytes' low nibbles then their high nibbles: [n, 32 per 16 bytes] (uint8)."""
    return (_shifted(qs, [0, 4], (n, -1, 1, 16)) & 0x0F).reshape(n, -1)


def _high_bits(qh: Tensor, n: int) -> Tensor:
    """Bit i of the little-endian uint32 `qh` [n, 4 bytes] for i = 0..31: [n, 32] (uint8)."""
    word = qh.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    bits = torch.arange(32, device=qh.device)
    return ((word[:, None] >> bits) & 1).to(torch.uint8).reshape(n, 32)


def _q4_0(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 2:], n).to(torch.int8) - 8
    return _half(blocks, 0) * q.float()


def _q4_1(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    q = _nibbles(blocks[:, 4:], n).float()
    return (_half(blocks, 0) * q) + _half(blocks, 2)


def _q5_0(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    q = (_nibbles(blocks[:, 6:], n) | (_high_bits(blocks[:, 2:6], n) << 4)).to(torch.int8) - 16
    return _half(blocks, 0) * q.float()


def _q5_1(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    q = (_nibbles(blocks[:, 8:], n) | (_high_bits(blocks[:, 4:8], n) << 4)).float()
    return (_half(blocks, 0) * q) + _half(blocks, 2)


def _q8_0(blocks: Tensor) -> Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * _half(blocks, 0)


def _q2_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _half(blocks, 80), _half(blocks, 82)
    step = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    offset = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (_shifted(qs, [0, 2, 4, 6], (n, -1, 1, 32)) & 3).reshape(n, 16, 16).float()
    return (step * q - offset).reshape(n, 256)


def _q3_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    hmask, qs, packed = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _half(blocks, 108)
    low = _shifted(packed[:, :8], [0, 4], (n, 1, 8)).reshape(n, 16)
    high = _shifted(packed[:, 8:], [0, 2, 4, 6], (n, 1, 4)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    step = (d * scales.float()).reshape(n, 16, 1)
    low_bits = _shifted(qs, [0, 2, 4, 6], (n, -1, 1, 32)).reshape(n, 16, 16) & 3
    high_bit = (_shifted(hmask, list(range(8)), (n, -1, 1, 32)).reshape(n, 16, 16) & 1) ^ 1
    q = (low_bits.to(torch.int8) - (high_bit << 2).to(torch.int8)).float()
    return (step * q).reshape(n, 256)


def k_scales_and_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (scales, mins) [n, 8] (uint8)."""
    n = packed.shape[0]
    parts = packed.reshape(n, 3, 4)
    d, m, m_d = parts[:, 0], parts[:, 1], parts[:, 2]
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _q4_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    scales, mins = k_scales_and_mins(blocks[:, 4:16])
    step = (_half(blocks, 0) * scales.float()).reshape(n, 8, 1)
    offset = (_half(blocks, 2) * mins.float()).reshape(n, 8, 1)
    q = (_shifted(blocks[:, 16:], [0, 4], (n, -1, 1, 32)) & 0x0F).reshape(n, 8, 32).float()
    return (step * q - offset).reshape(n, 256)


def _q5_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    scales, mins = k_scales_and_mins(blocks[:, 4:16])
    step = (_half(blocks, 0) * scales.float()).reshape(n, 8, 1)
    offset = (_half(blocks, 2) * mins.float()).reshape(n, 8, 1)
    low = (_shifted(blocks[:, 48:], [0, 4], (n, -1, 1, 32)) & 0x0F).reshape(n, 8, 32)
    high = (_shifted(blocks[:, 16:48], list(range(8)), (n, -1, 1, 32)) & 1).reshape(n, 8, 32)
    q = (low | (high << 4)).float()
    return (step * q - offset).reshape(n, 256)


def _q6_k(blocks: Tensor) -> Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    step = (_half(blocks, 208) * scales).reshape(n, 16, 1)
    low = (_shifted(blocks[:, :128], [0, 4], (n, -1, 1, 64)) & 0x0F).reshape(n, 8, 32)
    high = (_shifted(blocks[:, 128:192], [0, 2, 4, 6], (n, -1, 1, 32)) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
    return (step * q).reshape(n, 256)


_DEQUANTIZERS: dict[int, Callable[[Tensor], Tensor]] = {
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    8: _q8_0,
    10: _q2_k,
    11: _q3_k,
    12: _q4_k,
    13: _q5_k,
    14: _q6_k,
}


def dequantize_blocks(type_id: int, raw: Tensor) -> Tensor:
    """Stored blocks (uint8, [..., bytes], each row whole blocks) of a type in `BLOCK_FORMATS`
    -> fp32 values [..., values], as `gguf.quants.dequantize` computes them."""
    block = BLOCK_FORMATS[type_id]
    if raw.dtype != torch.uint8 or raw.shape[-1] % block.nbytes:
        raise ValueError(f"{block.name} rows must be uint8 whole blocks of {block.nbytes} bytes")
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, block.nbytes)
    values = _DEQUANTIZERS[type_id](blocks)
    return values.reshape(*lead, raw.shape[-1] // block.nbytes * block.values)
