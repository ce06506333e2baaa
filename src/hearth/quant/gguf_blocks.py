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


# ---------------------------------------------------------------------------------------------
# Planar layouts: a lossless repack of a row's blocks for the GPU GEMV (`hearth.ops.gguf_matmul`)
#
# A planar row holds the same numbers as the file's blocks, grouped by kind so that a GEMV reads
# each with one wide load and decodes a code with one AND|OR of the exponent trick: the codes
# as little-endian 32-bit words, then each scale kind as a plane in K order, then zero bytes up
# to a multiple of 16 (at most 15 a row: 2 bytes on a 3840-wide Q6_K row, none on most).
# Every plane but Q4_K's holds the file's bits as they are; Q4_K's twelve bytes of packed 6-bit
# scales and mins become 16 (one byte each): 148 bytes per 256 values, +2.8% on the file.
# Gemma 3 12B in Q4_K_M: 7.29 GB of tensor bytes in the file, 7.44 GB planar (+2.1%).
# Within each 32-value group the codes are interleaved across its words: code j of the group's
# word w is value 32g + WPG·j + w (WPG words a group). The values code j of a thread's words
# pairs with are then adjacent in x, one vector load for all of them, in the activations' own
# order (the affine kernel's K-order words needed x reordered first).
#
# * Q4_0: 4 words a group (nibble j at bit 4j) | d fp16 per 32.
# * Q8_0: 8 words a group (byte j at bit 8j, stored as q + 128: unsigned, so the exponent
#   trick needs no sign) | d fp16 per 32.
# * Q4_K: 4 words a group | 6-bit scale per 32 (uint8) | 6-bit min per 32 (uint8) | d fp16 per
#   256 | dmin fp16 per 256.
# * Q6_K: low nibbles, 4 words a group | high 2 bits, 2 words a group: bits 4j + 2e of word h
#   are those of code j of low word 2h + e | int8 scale per 16 | d fp16 per 256.

# Layout id of a type's planar rows: PLANAR + its GGML type id (a plain id is the file's bytes).
PLANAR = 256
PLANAR_TYPES = (2, 8, 12, 14)
ROW_ALIGNMENT = 16


def planar_layout(type_id: int) -> int:
    return PLANAR + type_id


def stored_type(layout: int) -> int:
    """The GGML type id of a layout id (plain or planar)."""
    return layout % PLANAR


def is_planar(layout: int) -> bool:
    return layout >= PLANAR


# Bytes a planar layout takes per block (the file's, but Q4_K's unpacked scales and mins).
_PLANAR_BLOCK_BYTES = {2: 18, 8: 34, 12: 148, 14: 210}


def planar_row_bytes(type_id: int, k: int) -> int:
    """Bytes of a planar row of k values, rounded up to ROW_ALIGNMENT."""
    planes = k // BLOCK_FORMATS[type_id].values * _PLANAR_BLOCK_BYTES[type_id]
    return -(-planes // ROW_ALIGNMENT) * ROW_ALIGNMENT


def planar_values(layout: int, row_bytes: int) -> int:
    """Values a row of `row_bytes` holds in a layout (a planar row's padding is less than one
    block)."""
    type_id = stored_type(layout)
    block = BLOCK_FORMATS[type_id]
    nbytes = _PLANAR_BLOCK_BYTES[type_id] if is_planar(layout) else block.nbytes
    return row_bytes // nbytes * block.values


def planar_offsets(type_id: int, k: int) -> dict[str, int]:
    """Byte offset in a planar row of k values of each plane after the codes (at 0)."""
    groups = k // 32
    if type_id in (2, 8):
        return {"d": groups * (16 if type_id == 2 else 32)}
    if type_id == 12:
        codes = groups * 16
        return {"scales": codes, "mins": codes + groups, "d": codes + 2 * groups,
                "dmin": codes + 2 * groups + k // 128}  # fmt: skip
    if type_id == 14:
        return {"high": groups * 16, "scales": groups * 24, "d": groups * 26}
    raise ValueError(f"{BLOCK_FORMATS[type_id].name} has no planar layout")


def _interleaved_words(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [n, groups, 32] in value order -> the words' bytes [n, groups * 4 * bits]:
    code j of word w of a group is value WPG·j + w, at bit bits·j (little-endian)."""
    n, groups, _ = codes.shape
    per_word = 32 // bits
    words = codes.reshape(n, groups, per_word, 32 // per_word).transpose(2, 3)  # [.., w, j]
    # 4 bits: byte b of a word holds codes 2b (low nibble) and 2b + 1.
    packed = words if bits == 8 else words[..., 0::2] | (words[..., 1::2] << 4)
    return packed.contiguous().reshape(n, -1)


def _codes_of_words(raw: Tensor, groups: int, bits: int) -> Tensor:
    """`_interleaved_words`'s inverse: codes [n, groups, 32] in value order."""
    n = raw.shape[0]
    per_word = 32 // bits
    packed = raw.reshape(n, groups, 32 // per_word, 4)  # [.., w, byte]
    if bits == 8:
        words = packed
    else:
        words = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, groups, -1, 8)
    return words.transpose(2, 3).contiguous().reshape(n, groups, 32)


def _q6_k_codes(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Q6_K blocks [n, 210] -> (low nibbles, high 2 bits) [n, 256] (uint8) in value order."""
    n = blocks.shape[0]
    low = (_shifted(blocks[:, :128], [0, 4], (n, -1, 1, 64)) & 0x0F).reshape(n, 256)
    high = (_shifted(blocks[:, 128:192], [0, 2, 4, 6], (n, -1, 1, 32)) & 3).reshape(n, 256)
    return low, high


def _q6_k_high_words(high: Tensor) -> Tensor:
    """High 2-bit codes [n, groups, 32] -> bytes [n, groups * 8]: bits 4j + 2e of word h hold
    code j of low word 2h + e (value 4j + 2h + e)."""
    n, groups, _ = high.shape
    codes = high.reshape(n, groups, 4, 2, 2, 2)  # [.., byte b, j % 2, h, e]: j = 2b + j % 2
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8, device=high.device)
    packed = (codes << shifts[:, None, :]).sum(dim=(3, 5), dtype=torch.uint8)  # [.., b, h]
    return packed.transpose(2, 3).contiguous().reshape(n, -1)


def _q6_k_high_codes(raw: Tensor, groups: int) -> Tensor:
    n = raw.shape[0]
    packed = raw.reshape(n, groups, 2, 4).transpose(2, 3)  # [.., b, h]
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8, device=raw.device)
    codes = (packed[:, :, :, None, :, None] >> shifts[:, None, :]) & 3  # [.., b, j%2, h, e]
    return codes.reshape(n, groups, 32)


def to_planar(type_id: int, blocks: Tensor) -> Tensor:
    """A type's stored rows (uint8 [n, bytes]) -> planar rows [n, `planar_row_bytes`]."""
    block = BLOCK_FORMATS[type_id]
    n = blocks.shape[0]
    k = blocks.shape[1] // block.nbytes * block.values
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % block.nbytes:
        raise ValueError(f"{block.name} rows must be uint8 whole blocks of {block.nbytes} bytes")
    groups = k // 32
    raw = blocks.reshape(n * (k // block.values), block.nbytes)
    planes: list[Tensor]
    if type_id == 2:
        codes = torch.cat([raw[:, 2:] & 0x0F, raw[:, 2:] >> 4], dim=1)
        planes = [_interleaved_words(codes.reshape(n, groups, 32), 4), raw[:, :2]]
    elif type_id == 8:
        codes = raw[:, 2:] ^ 0x80  # int8 bits -> q + 128
        planes = [_interleaved_words(codes.reshape(n, groups, 32), 8), raw[:, :2]]
    elif type_id == 12:
        scales, mins = k_scales_and_mins(raw[:, 4:16])
        codes = (_shifted(raw[:, 16:], [0, 4], (raw.shape[0], -1, 1, 32)) & 0x0F).reshape(n, -1)
        planes = [_interleaved_words(codes.reshape(n, groups, 32), 4), scales, mins]
        planes += [raw[:, 0:2], raw[:, 2:4]]
    elif type_id == 14:
        low, high = _q6_k_codes(raw)
        planes = [_interleaved_words(low.reshape(n, groups, 32), 4)]
        planes += [_q6_k_high_words(high.reshape(n, groups, 32)), raw[:, 192:208], raw[:, 208:]]
    else:
        raise ValueError(f"{block.name} has no planar layout")
    row = torch.cat([plane.reshape(n, -1) for plane in planes], dim=1)
    padding = planar_row_bytes(type_id, k) - row.shape[1]
    return torch.cat([row, row.new_zeros(n, padding)], dim=1) if padding else row


def from_planar(type_id: int, planar: Tensor) -> Tensor:
    """`to_planar`'s inverse: the file's bytes of each row."""
    block = BLOCK_FORMATS[type_id]
    n = planar.shape[0]
    k = planar_values(planar_layout(type_id), planar.shape[1])
    groups, count = k // 32, k // block.values
    at = planar_offsets(type_id, k)

    def plane(name: str, width: int) -> Tensor:
        return planar[:, at[name] : at[name] + width * count].reshape(n * count, width)

    if type_id in (2, 8):
        bits = 4 if type_id == 2 else 8
        codes = _codes_of_words(planar[:, : at["d"]], groups, bits).reshape(n * count, 32)
        codes = codes[:, :16] | (codes[:, 16:] << 4) if type_id == 2 else codes ^ 0x80
        raw = torch.cat([plane("d", 2), codes], dim=1)
    elif type_id == 12:
        codes = _codes_of_words(planar[:, : at["scales"]], groups, 4).reshape(n * count, 8, 32)
        qs = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales, mins = plane("scales", 8), plane("mins", 8)
        d_bytes = scales[:, :4] | ((scales[:, 4:] >> 4) << 6)
        m_bytes = mins[:, :4] | ((mins[:, 4:] >> 4) << 6)
        shared = (scales[:, 4:] & 0x0F) | ((mins[:, 4:] & 0x0F) << 4)
        raw = torch.cat([plane("d", 2), plane("dmin", 2), d_bytes, m_bytes, shared], dim=1)
        raw = torch.cat([raw, qs.reshape(n * count, 128)], dim=1)
    elif type_id == 14:
        low = _codes_of_words(planar[:, : at["high"]], groups, 4).reshape(n * count, 2, 2, 64)
        ql = low[:, :, 0] | (low[:, :, 1] << 4)  # [.., half, 64]: nibbles of values 64c + i
        high = _q6_k_high_codes(planar[:, at["high"] : at["scales"]], groups)
        high = high.reshape(n * count, 2, 4, 32)  # [.., half, c, i]: value 128 half + 32c + i
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=planar.device)
        qh = (high << shifts[:, None]).sum(dim=2, dtype=torch.uint8)
        raw = torch.cat([ql.reshape(-1, 128), qh.reshape(-1, 64), plane("scales", 16)], dim=1)
        raw = torch.cat([raw, plane("d", 2)], dim=1)
    else:
        raise ValueError(f"{block.name} has no planar layout")
    return raw.reshape(n, count * block.nbytes)


def dequantize_layout(layout: int, rows: Tensor) -> Tensor:
    """fp32 values of rows in a layout (`dequantize_blocks` for the file's bytes)."""
    if is_planar(layout):
        rows = from_planar(stored_type(layout), rows.reshape(-1, rows.shape[-1]))
    return dequantize_blocks(stored_type(layout), rows)
