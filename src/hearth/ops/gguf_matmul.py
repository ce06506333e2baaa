"""Matmuls that read GGUF (GGML) blocks on the GPU, as the file stores them or repacked.

Two layouts of a weight's rows, each exactly the file's numbers (`hearth.quant.gguf_blocks`
is the torch reference of both); a kernel takes a layout id: the GGML type id for the file's
bytes, `PLANAR` + the type id for planar rows.

* **File rows** (every type of `BLOCK_FORMATS`): uint8 ``[N, K / values per block * bytes
  per block]``, unpacked in registers as stored.
* **Planar rows** (Q4_0, Q8_0, Q4_K, Q6_K, which a `GGUFKernelLinear` repacks at load:
  `to_planar`, lossless): per row, the codes as 32-bit words, then each scale kind as a plane
  in K order; within a 32-value group code j of word w is value 32g + WPG·j + w (WPG words a
  group). The memory is the file's (Q4_K: +2.8%, its 6-bit scales and mins a byte each; rows
  padded to 16 bytes).

Every kernel decodes a weight to fp32 exactly as `gguf.quants.dequantize` does. Every product
there is exact in fp32 (an fp16 scale times a small integer code, times another small integer:
at most 23 significant bits), so the only rounding of a weight is its one subtraction of an
offset (Q4_K's dmin·m and the like), which an FMA contraction leaves the same: the kernels see
the file's weights bit for bit. Integer codes become floats by the exponent trick (a code
ORed into the mantissa of 2^(23 - P) at its bit P, then 2^(23 - P) taken off), not a
conversion per weight (I2F issues at a quarter of the FMA rate).

* **GEMV** (1..4 rows: decode, a few speculative rows), each program ``BLOCK_N`` weight rows
  and a slice of K's steps, fp32 sums, the output rounded once to the activations' dtype; a
  weight with few rows (o, down) splits K so that enough bytes are in flight (`gemv_split`);
  the last program of a row block to arrive adds the slices in order. No host sync: CUDA
  graphs capture it.
  - On file rows, a step is 256 values of each row decoded into a [BLOCK_N, groups, values]
    tile and multiplied with x: 9.2 SASS instructions a weight for Q4_K, 12.9 for Q6_K, 9.8
    for Q4_0, 6.9 for Q8_0 at one activation row (`benchmarks/lab/inspect_gguf_sass.py`).
  - On planar rows (`_planar_gemv_kernel`) a step is 8 groups; its tiles are [groups, rows,
    4 words], so a thread holds 16 bytes of codes of each of several rows, and for each code
    position j one vector load of 4 adjacent x values serves all of them. The budget a
    weight: one LOP3 and one FADD make the exact code (Q6_K: two LOP3s join the nibble and
    the two high bits into one field), then Q4_K forms the weight with one FMA,
    fl(d·sc · q - dmin·m) (d·sc and dmin·m formed once a group: exact, an fp16 times a 6-bit
    integer), and adds x times it with a second; the symmetric types (w = s·q, exact) add
    x·q and scale each group's sums (Q6_K: each 16 values') once. Floors of 4 (Q4_K, Q6_K)
    and 3 (Q4_0, Q8_0) instructions; the sm_90 SASS of the loop at one activation row and
    64 weight rows counts Q4_K 5.2, Q6_K 5.9, Q4_0 4.0, Q8_0 4.5 (x's bf16 to fp32, one
    shift a word moving codes past bit 23 down, pointers, scale loads make the rest;
    benchmarks/results/gguf_planar_sass-2026-12-07.md).
* **Dot** (5..32 rows: batched decode, short prompts): each program decodes a step of
  ``BLOCK_N`` rows, rounds it to the activations' dtype (bf16, as the prefill below) and feeds
  it to a tensor-core `tl.dot` against 16 or 32 activation rows; fp32 sums. fp32 activations
  take an IEEE fp32 dot (no TF32), so their weights stay exact.
* **Dequantize** (prefill, more rows): a step of rows decoded to the activations' dtype (bf16:
  what HF transformers itself computes with when it loads a GGUF in bf16) into a scratch tile,
  then cuBLAS multiplies; a tile of rows at a time bounds the scratch for a large head.
* **Rows** (token tables): the dequantize kernel reading the rows a list of ids names.

Every type of `hearth.quant.gguf_blocks.BLOCK_FORMATS` has a kernel (`KERNEL_TYPES`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from hearth.ops import HAS_TRITON, pdl_options
from hearth.ops.launch import launch_kernel
from hearth.quant.gguf_blocks import (
    BLOCK_FORMATS,
    ROW_ALIGNMENT,
    dequantize_layout,
    is_planar,
    planar_offsets,
    planar_row_bytes,
    planar_values,
    stored_type,
)

# GGML type ids the Triton kernels decode: every type of `BLOCK_FORMATS` (Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).
KERNEL_TYPES = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14)
# Rows of activations the GEMV takes; up to DOT_MAX_ROWS the fused dequantize-and-dot kernel
# (batched decode, short prompts: the blocks read once, no scratch); more are a dequantized
# tile and cuBLAS.
GEMV_MAX_ROWS = 4
DOT_MAX_ROWS = 32
# Values one step of a kernel decodes per weight row.
STEP_VALUES = 256
# Scratch a prefill dequantizes at a time (bytes of the activations' dtype): a whole layer's
# stacked projection of a 12B model in one tile, a 262144-row head in several.
TILE_BYTES = 256 << 20


# ---------------------------------------------------------------------------------------------
# Torch references


def gguf_matmul_reference(x: Tensor, type_id: int, blocks: Tensor) -> Tensor:
    """``x @ W.T`` with W the exact fp32 values of `blocks` (file or planar rows: `type_id`
    is a layout id), in fp32, cast to x's dtype."""
    weight = dequantize_layout(type_id, blocks)
    return F.linear(x.float(), weight).to(x.dtype)


def gguf_rows_reference(ids: Tensor, type_id: int, blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows `ids` of a block table, dequantized exactly, in `dtype`: ``[*ids.shape, K]``."""
    rows = dequantize_layout(type_id, blocks[ids.reshape(-1)])
    return rows.reshape(*ids.shape, rows.shape[-1]).to(dtype)


# ---------------------------------------------------------------------------------------------
# The block-kernel path (`ExecutionPlan.gguf_block_kernels`: CUDA; the interpreter in tests)


def gguf_linear(x2d: Tensor, parts: Sequence[tuple[int, Tensor]], out_features: int) -> Tensor:
    """x2d [M, K] @ Wᵀ, W the parts' (type id, blocks) stacked along the output dim
    in order: a GEMV per part for few rows, the fused dequantize-and-dot kernel per part for
    up to DOT_MAX_ROWS, else the parts dequantized to x's dtype in tiles of at most TILE_BYTES
    and cuBLAS. Output in x's dtype."""
    m, k = x2d.shape
    y = torch.empty(m, out_features, dtype=x2d.dtype, device=x2d.device)
    if m <= DOT_MAX_ROWS:
        product = gguf_gemv_triton if m <= GEMV_MAX_ROWS else gguf_dot_triton
        first = 0
        for type_id, blocks in parts:
            product(x2d, type_id, blocks, y[:, first : first + blocks.shape[0]])
            first += blocks.shape[0]
        return y
    tile = max(1, TILE_BYTES // (k * x2d.element_size()))
    if out_features <= tile:  # every projection of a decoder layer: one scratch, one GEMM
        weights = torch.empty(out_features, k, dtype=x2d.dtype, device=x2d.device)
        first = 0
        for type_id, blocks in parts:
            gguf_dequantize_triton(type_id, blocks, k, out=weights[first : first + len(blocks)])
            first += blocks.shape[0]
        return torch.matmul(x2d, weights.T, out=y)
    first = 0
    for type_id, blocks in parts:
        for start in range(0, blocks.shape[0], tile):
            weights = gguf_dequantize_triton(type_id, blocks[start : start + tile], k, x2d.dtype)
            y[:, first + start : first + start + len(weights)] = x2d @ weights.T
        first += blocks.shape[0]
    return y


def gguf_rows(ids: Tensor, type_id: int, blocks: Tensor, dtype: torch.dtype) -> Tensor:
    """`gguf_rows_reference` in one kernel (ids stay on the device: no sync)."""
    k = planar_values(type_id, blocks.shape[1])
    rows = gguf_dequantize_triton(type_id, blocks, k, dtype, ids=ids.reshape(-1))
    return rows.view(*ids.shape, k)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer

    @triton.jit
    def _half(pointers, mask):
        """The little-endian fp16 at each of `pointers` (uint8), widened to fp32."""
        low = tl.load(pointers, mask=mask, other=0).to(tl.uint16)
        high = tl.load(pointers + 1, mask=mask, other=0).to(tl.uint16)
        return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _code_value(code, bias: tl.constexpr):
        """code - bias in fp32, for integer codes in [0, 2^23): the code ORed into the mantissa
        of 2^23, minus 2^23 + bias. Exact (differences of integers below 2^24), and without
        an integer-to-float conversion per weight, which the GPU issues at a small fraction
        of the FMA rate (it bounded the GEMV in ptxas's SASS)."""
        magic = (code.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True)
        return magic - (8388608.0 + bias)

    @triton.jit
    def _k_scale_bytes(base, ok, s):
        """Q4_K / Q5_K: the 6-bit scale and min of sub-block `s` (0..7) of each block at
        `base` (its 12 packed bytes at offset 4), as fp32."""
        low = s & 3
        first = tl.load(base + 4 + low, mask=ok, other=0)
        second = tl.load(base + 8 + low, mask=ok, other=0)
        shared = tl.load(base + 12 + low, mask=ok, other=0)
        upper = s >= 4
        scale = tl.where(upper, (shared & 15) | ((first >> 6) << 4), first & 63)
        least = tl.where(upper, (shared >> 4) | ((second >> 6) << 4), second & 63)
        return scale.to(tl.float32), least.to(tl.float32)

    @triton.jit
    def _q4_k_step(rows, ok, step):
        """256 values of each row (super-block `step`): [BLOCK_N, 8 sub-blocks, 32]."""
        base = rows + step * 144  # [BLOCK_N, 1, 1]
        s = tl.arange(0, 8)[None, :, None]
        d = _half(base, ok)
        dmin = _half(base + 2, ok)
        scale, least = _k_scale_bytes(base, ok, s)
        # The codes as 32-bit words (blocks and their codes are 16-byte aligned): value
        # 4w + r of sub-block s is nibble 2r + s % 2 of word 8 (s // 2) + w.
        w = tl.arange(0, 8)[None, None, :, None]
        r = tl.arange(0, 4)[None, None, None, :]
        s4 = s[:, :, :, None]
        words = (base[:, :, :, None] + 16 + 32 * (s4 // 2) + 4 * w).to(tl.pointer_type(tl.int32))
        q = (tl.load(words, mask=ok[:, :, :, None], other=0) >> (8 * r + 4 * (s4 % 2))) & 15
        q = tl.reshape(q, [q.shape[0], 8, 32])
        return (d * scale) * _code_value(q, 0) - dmin * least

    @triton.jit
    def _q5_k_step(rows, ok, step):
        """Q4_K's layout (codes at 48, as 32-bit words) and a fifth bit of value 32s + i,
        bit s of qh[i] (qh at 16: bit 8r + s of word w for i = 4w + r)."""
        base = rows + step * 176
        s = tl.arange(0, 8)[None, :, None]
        d = _half(base, ok)
        dmin = _half(base + 2, ok)
        scale, least = _k_scale_bytes(base, ok, s)
        w = tl.arange(0, 8)[None, None, :, None]
        r = tl.arange(0, 4)[None, None, None, :]
        s4 = s[:, :, :, None]
        ok4 = ok[:, :, :, None]
        codes = (base[:, :, :, None] + 48 + 32 * (s4 // 2) + 4 * w).to(tl.pointer_type(tl.int32))
        low = (tl.load(codes, mask=ok4, other=0) >> (8 * r + 4 * (s4 % 2))) & 15
        bits = (base[:, :, :, None] + 16 + 4 * w).to(tl.pointer_type(tl.int32))
        high = (tl.load(bits, mask=ok4, other=0) >> (8 * r + s4)) & 1
        q = tl.reshape(low | (high << 4), [base.shape[0], 8, 32])
        return (d * scale) * _code_value(q, 0) - dmin * least

    @triton.jit
    def _q6_k_step(rows, ok, step):
        """[BLOCK_N, 16 groups, 16]: value 16g + j is, with h = g // 8, c = g // 2 % 4,
        i = 16 (g % 2) + j, the low nibble of ql[64h + 32 (c % 2) + i] (shift 4 (c // 2))
        and two bits of qh[32h + i] (shift 2c), minus 32, times d · scales[g]."""
        base = rows + step * 210
        g = tl.arange(0, 16)[None, :, None]
        j = tl.arange(0, 16)[None, None, :]
        h = g // 8
        c = (g // 2) % 4
        i = 16 * (g % 2) + j
        low = (tl.load(base + 64 * h + 32 * (c % 2) + i, mask=ok, other=0) >> (4 * (c // 2))) & 15
        high = (tl.load(base + 128 + 32 * h + i, mask=ok, other=0) >> (2 * c)) & 3
        scale = tl.load((base + 192 + g).to(tl.pointer_type(tl.int8)), mask=ok, other=0)
        d = _half(base + 208, ok)
        return (d * scale.to(tl.float32)) * _code_value(low | (high << 4), 32)

    @triton.jit
    def _q2_k_step(rows, ok, step):
        """[BLOCK_N, 16 groups, 16]: d · (scales[g] & 15) · q - dmin · (scales[g] >> 4)."""
        base = rows + step * 84
        g = tl.arange(0, 16)[None, :, None]
        j = tl.arange(0, 16)[None, None, :]
        packed = tl.load(base + g, mask=ok, other=0)
        q = (
            tl.load(base + 16 + 32 * (g // 8) + 16 * (g % 2) + j, mask=ok, other=0)
            >> (2 * ((g // 2) % 4))
        ) & 3
        d = _half(base + 80, ok)
        dmin = _half(base + 82, ok)
        step_size = d * (packed & 15).to(tl.float32)
        return step_size * _code_value(q, 0) - dmin * (packed >> 4).to(tl.float32)

    @triton.jit
    def _q3_k_step(rows, ok, step):
        """[BLOCK_N, 16 groups, 16]: d · scale[g] · (low 2 bits - 4 · (1 - hmask bit)), the
        6-bit scale's low nibble from byte g % 8 (shift 4 (g // 8)) and its top two bits from
        byte 8 + g % 4 (shift 2 (g // 4)) of the 12 packed bytes, minus 32; the high bit of
        value 16g + j is bit 4a + c of hmask[i] (a, c, i as in the 2-bit codes)."""
        base = rows + step * 110
        g = tl.arange(0, 16)[None, :, None]
        j = tl.arange(0, 16)[None, None, :]
        i = 16 * (g % 2) + j
        shift = 2 * ((g // 2) % 4)
        low = (tl.load(base + 32 + 32 * (g // 8) + i, mask=ok, other=0) >> shift) & 3
        hmask = (tl.load(base + i, mask=ok, other=0) >> (4 * (g // 8) + (g // 2) % 4)) & 1
        q = low | (hmask << 2)  # the code + 4: high bit set means no 4 is taken off
        nibble = (tl.load(base + 96 + g % 8, mask=ok, other=0) >> (4 * (g // 8))) & 15
        top = (tl.load(base + 104 + g % 4, mask=ok, other=0) >> (2 * (g // 4))) & 3
        scale = (nibble | (top << 4)).to(tl.int32) - 32
        d = _half(base + 108, ok)
        return (d * scale.to(tl.float32)) * _code_value(q, 4)

    @triton.jit
    def _small_step(rows, ok, step, TYPE: tl.constexpr, BLOCKS: tl.constexpr):
        """Eight 32-value blocks of each row (blocks 8·step.., past BLOCKS zero):
        [BLOCK_N, 8, 32]. Value i of a block is the low nibble of byte i % 16 of its codes for
        i < 16, else the high one (Q4/Q5 types), or signed byte i (Q8_0)."""
        b = step * 8 + tl.arange(0, 8)[None, :, None]
        i = tl.arange(0, 32)[None, None, :]
        inside = ok & (b < BLOCKS)
        if TYPE == 8:
            base = rows + b * 34
            # Sign-extending int8 loads convert in one instruction each; the exponent trick
            # measured more instructions in the SASS here (an XOR, a permute per byte).
            q = tl.load((base + 2 + i).to(tl.pointer_type(tl.int8)), mask=inside, other=0)
            return q.to(tl.float32) * _half(base, inside)
        else:
            NBYTES: tl.constexpr = (
                18 if TYPE == 2 else (20 if TYPE == 3 else (22 if TYPE == 6 else 24))
            )
            CODES: tl.constexpr = 2 if TYPE == 2 else (4 if TYPE == 3 else (6 if TYPE == 6 else 8))
            base = rows + b * NBYTES
            d = _half(base, inside)
            q = (tl.load(base + CODES + (i % 16), mask=inside, other=0) >> (4 * (i // 16))) & 15
            if TYPE == 6 or TYPE == 7:
                HIGH: tl.constexpr = 2 if TYPE == 6 else 4
                bit = (tl.load(base + HIGH + i // 8, mask=inside, other=0) >> (i % 8)) & 1
                q = q | (bit << 4)
            if TYPE == 2:
                return d * _code_value(q, 8)
            elif TYPE == 6:
                return d * _code_value(q, 16)
            else:
                return d * _code_value(q, 0) + _half(base + 2, inside)

    # Groups a step's tile has: [BLOCK_N, groups, 256 / groups] (Q2_K, Q3_K, Q6_K: 16 of 16).
    GROUPS = {type_id: 16 if type_id in (10, 11, 14) else 8 for type_id in KERNEL_TYPES}

    @triton.jit
    def _step_columns(step, G: tl.constexpr):
        """The columns of a step's tile, [G groups, 256 / G values] (value g·L + l)."""
        L: tl.constexpr = 256 // G
        return step * 256 + tl.arange(0, G)[:, None] * L + tl.arange(0, L)[None, :]

    @triton.jit
    def _step_values(rows, ok, step, TYPE: tl.constexpr, K: tl.constexpr):
        """Values [step·256, step·256 + 256) of each row as fp32, [BLOCK_N, groups, values]
        (`_step_columns`; zero past K and for masked rows). `rows`: [BLOCK_N, 1, 1] pointers
        to each row's bytes. Kept in the decoder's 3-D shape: a reshape here cost a layout
        conversion through shared memory at every step."""
        if TYPE == 10:
            values = _q2_k_step(rows, ok, step)
        elif TYPE == 11:
            values = _q3_k_step(rows, ok, step)
        elif TYPE == 12:
            values = _q4_k_step(rows, ok, step)
        elif TYPE == 13:
            values = _q5_k_step(rows, ok, step)
        elif TYPE == 14:
            values = _q6_k_step(rows, ok, step)
        else:
            values = _small_step(rows, ok, step, TYPE, K // 32)
        return values

    @triton.jit
    def _gguf_gemv_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        partial_ptr,
        counter_ptr,
        M,
        N,
        stride_xm,
        stride_wn,
        stride_om,
        K: tl.constexpr,
        TYPE: tl.constexpr,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
        SPLIT_K: tl.constexpr = 1,
        LOOP_STAGES: tl.constexpr = 1,
    ):
        """out[m, n] = sum_k x[m, k] w[n, k]; grid (blocks of BLOCK_N weight rows, SPLIT_K
        slices of K's steps). A split's last program to arrive adds the slices' fp32 partials
        in slice order (deterministic, no float atomics) and resets its counter."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rows = (w_ptr + n.to(tl.int64) * stride_wn)[:, None, None]
        wait_for_producer(PDL)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < M
        x_rows = (x_ptr + m.to(tl.int64) * stride_xm)[:, None, None, None]
        x_ok = m_ok[:, None, None, None]
        STEPS: tl.constexpr = (K + 255) // 256
        SLICE: tl.constexpr = (STEPS + SPLIT_K - 1) // SPLIT_K
        acc = tl.zeros([BLOCK_M, BLOCK_N, G, 256 // G], tl.float32)
        for index in tl.range(SLICE, num_stages=LOOP_STAGES):
            step = pid_k * SLICE + index
            ok = n_ok[:, None, None] & (step < STEPS)
            w = _step_values(rows, ok, step, TYPE, K)
            k = _step_columns(step, G)[None, None, :, :]
            xk = tl.load(x_rows + k, mask=x_ok & (k < K), other=0.0)
            acc += w[None, :, :, :] * xk.to(tl.float32)
        result = tl.sum(tl.sum(acc, axis=3), axis=2)
        out_at = out_ptr + m[:, None] * stride_om + n[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(out_at, result.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            own = m[:, None].to(tl.int64) * N + n[None, :]
            tl.store(partial_ptr + pid_k * M * N + own, result, mask=out_ok)
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for split in tl.static_range(SPLIT_K):
                    # .cg reads L2, where the other programs' partials are, not a stale L1.
                    total += tl.load(
                        partial_ptr + split * M * N + own, mask=out_ok, other=0.0,
                        cache_modifier=".cg",
                    )  # fmt: skip
                tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch / replay

    @triton.jit
    def _dot_step(
        acc, values, x_rows, m_ok, step, K: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):  # fmt: skip
        """acc [BLOCK_M, BLOCK_N] + x's rows over one 256-value step . the step's weights
        (`values`, BLOCK_N rows of 256 in any tile shape), on tensor cores in x's dtype."""
        w = tl.reshape(values, [BLOCK_N, 256]).to(x_rows.dtype.element_ty)
        k = step * 256 + tl.arange(0, 256)
        xk = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xk, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xk, tl.trans(w), acc)
        return acc

    @triton.jit
    def _gguf_dot_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        M,
        N,
        stride_xm,
        stride_wn,
        stride_om,
        K: tl.constexpr,
        TYPE: tl.constexpr,
        G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """out[m, n] = sum_k x[m, k] w[n, k], w decoded a step at a time and rounded to x's
        dtype, multiplied by `tl.dot`; grid (blocks of N, blocks of M)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rows = (w_ptr + n.to(tl.int64) * stride_wn)[:, None, None]
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
        STEPS: tl.constexpr = (K + 255) // 256
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step in tl.range(STEPS):
            values = _step_values(rows, n_ok[:, None, None], step, TYPE, K)
            acc = _dot_step(acc, values, x_rows, m_ok, step, K, BLOCK_N, IEEE)
        out_at = out_ptr + m[:, None] * stride_om + n[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _gguf_dequantize_kernel(
        w_ptr,
        ids_ptr,
        out_ptr,
        N,
        stride_wn,
        stride_on,
        K: tl.constexpr,
        TYPE: tl.constexpr,
        G: tl.constexpr,
        BLOCK_N: tl.constexpr,
        INDEXED: tl.constexpr,
    ):
        """out[n, step's 256 columns] = the values of weight row n (row ids[n] if INDEXED);
        grid (blocks of N, steps of K)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        step = tl.program_id(1)
        n_ok = n < N
        source = tl.load(ids_ptr + n, mask=n_ok, other=0).to(tl.int64) if INDEXED else n
        rows = (w_ptr + source.to(tl.int64) * stride_wn)[:, None, None]
        values = _step_values(rows, n_ok[:, None, None], step, TYPE, K)
        k = _step_columns(step, G)[None, :, :]
        out_at = out_ptr + n.to(tl.int64)[:, None, None] * stride_on + k
        ok = n_ok[:, None, None] & (k < K)
        tl.store(out_at, values.to(out_ptr.dtype.element_ty), mask=ok)

    # Types whose codes the kernels read as 32-bit words (Q4_K, Q5_K: 16-byte-aligned blocks).
    WORD_TYPES = (12, 13)
    # Types whose GEMV at 4 activation rows takes 8 weight rows a program, not 16: at 16 it
    # spilled registers (Q8_0, Q3_K, Q6_K) or filled all 255 (Q2_K) in the sm_90 SASS
    # (benchmarks/lab/inspect_gguf_sass.py, results/gguf_gpu_sass-2026-12-07.md). Elsewhere
    # 16: fewer lost the code loads' vectorization (up to 4x the instructions a weight).
    _NARROW_AT_4_ROWS = (8, 10, 11, 14)

    def gemv_block_n(block_m: int, type_id: int) -> int:
        """Weight rows a GEMV program takes at `block_m` activation rows (a power of 2)."""
        return 8 if block_m == 4 and type_id in _NARROW_AT_4_ROWS else 16

    # Triton's CPU interpreter (tests) pays ~10 ms a program: wide tiles, few programs.
    INTERPRETER_BLOCK_N = 128
    DEQUANTIZE_BLOCK_N = 16

    def _check_blocks(type_id: int, blocks: Tensor, k: int) -> None:
        block = BLOCK_FORMATS[type_id]
        if type_id not in KERNEL_TYPES:
            raise ValueError(f"no GPU kernel decodes {block.name} blocks")
        if (
            blocks.dtype != torch.uint8
            or blocks.dim() != 2
            or k % block.values
            or blocks.shape[1] != k // block.values * block.nbytes
            or blocks.stride(1) != 1
        ):
            raise ValueError(
                f"{block.name} rows of {k} values are uint8 [rows, "
                f"{k // block.values * block.nbytes}] with unit column stride, "
                f"got {blocks.dtype} {tuple(blocks.shape)}"
            )
        if type_id in WORD_TYPES and (blocks.data_ptr() % 4 or blocks.stride(0) % 4):
            raise ValueError(f"{block.name} rows must start 4-byte aligned (read as words)")

    # Split-K arrival counters, zero between launches (the last program resets its own).
    _COUNTERS: dict[torch.device, Tensor] = {}

    def _counters(device: torch.device, count: int) -> Tensor:
        counters = _COUNTERS.get(device)
        if counters is None or counters.numel() < count:
            counters = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
            _COUNTERS[device] = counters
        return counters

    @functools.cache
    def _multiprocessors(index: int) -> int:
        return torch.cuda.get_device_properties(index).multi_processor_count

    def gemv_split(n: int, k: int, block_n: int, multiprocessors: int) -> int:
        """K slices for a GEMV: a program keeps one step of its rows' blocks in flight, so a
        weight with few rows (o, down: 3840 of 12B) has too few bytes in flight over the GPU
        unless K is split; split until there are four programs an SM, each slice two steps
        or more, at most 8 slices."""
        programs, steps, split = triton.cdiv(n, block_n), triton.cdiv(k, STEP_VALUES), 1
        while split < 8 and programs * split < 4 * multiprocessors and steps >= 4 * split:
            split *= 2
        return split

    def gguf_gemv_triton(
        x2d: Tensor,
        type_id: int,
        blocks: Tensor,
        out: Tensor,
        block_n: int | None = None,
        num_warps: int = 4,
        split_k: int | None = None,
        loop_stages: int = 1,
        prefetch: bool | None = None,
    ) -> Tensor:
        """out [M, N] = x2d [M, K] @ Wᵀ in one launch (M <= GEMV_MAX_ROWS; out may be a
        column slice of a wider row-major output); `block_n`, `num_warps`, `split_k` and
        `loop_stages` (file rows) or `prefetch` (planar rows) pin the launch (tests,
        benchmarks/lab/gpu_gguf_gemv.py)."""
        m, k = x2d.shape
        if m > GEMV_MAX_ROWS:
            raise ValueError(f"the GGUF GEMV takes at most {GEMV_MAX_ROWS} rows, got {m}")
        n = blocks.shape[0]
        if out.shape != (m, n) or out.stride(1) != 1:
            raise ValueError(f"out must be [{m}, {n}] with unit column stride")
        x2d = x2d if x2d.stride(1) == 1 else x2d.contiguous()
        if is_planar(type_id):
            return _planar_gemv(
                x2d, type_id, blocks, out, block_n, num_warps, split_k, prefetch=prefetch
            )
        _check_blocks(type_id, blocks, k)
        block_m = triton.next_power_of_2(m)
        if block_n is None:
            block_n = gemv_block_n(block_m, type_id) if x2d.is_cuda else INTERPRETER_BLOCK_N
        if split_k is None:
            units = _multiprocessors(x2d.device.index or 0) if x2d.is_cuda else 1
            split_k = gemv_split(n, k, block_n, units) if x2d.is_cuda else 1
        if split_k > 1:
            partial = torch.empty(split_k * m * n, dtype=torch.float32, device=x2d.device)
            counters = _counters(x2d.device, triton.cdiv(n, block_n))
        else:
            partial = counters = out  # unread
        args = (x2d, blocks, out, partial, counters, m, n)
        args += (x2d.stride(0), blocks.stride(0), out.stride(0))
        constants = {"K": k, "TYPE": type_id, "G": GROUPS[type_id]}
        constants |= {"BLOCK_M": block_m, "BLOCK_N": block_n, "SPLIT_K": split_k}
        constants |= {"LOOP_STAGES": loop_stages, "num_warps": num_warps} | pdl_options(x2d)
        grid = (triton.cdiv(n, block_n), split_k)
        launch_kernel(_gguf_gemv_kernel, grid, *args, **constants)
        return out

    DOT_BLOCK_N = 32

    def gguf_dot_triton(
        x2d: Tensor,
        type_id: int,
        blocks: Tensor,
        out: Tensor,
        block_n: int = DOT_BLOCK_N,
        num_warps: int | None = None,
    ) -> Tensor:
        """out [M, N] = x2d [M, K] @ Wᵀ by the fused kernel (any M; the dispatcher gives it
        5..DOT_MAX_ROWS); `block_n` and `num_warps` pin the launch (default: 4 warps for 16
        rows, 8 for 32, where 4 spilled registers in ptxas's report)."""
        m, k = x2d.shape
        n = blocks.shape[0]
        if out.shape != (m, n) or out.stride(1) != 1:
            raise ValueError(f"out must be [{m}, {n}] with unit column stride")
        x2d = x2d if x2d.stride(1) == 1 else x2d.contiguous()
        block_m = min(32, max(16, triton.next_power_of_2(m)))  # tl.dot takes 16 rows or more
        num_warps = num_warps or (4 if block_m == 16 else 8)
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        if is_planar(type_id):
            planes, strides = _planar_operands(type_id, blocks, k)
            args = (x2d, *planes, out, m, n, x2d.stride(0), *strides, out.stride(0))
            constants = {"K": k, "TYPE": stored_type(type_id), "BLOCK_M": block_m}
            constants |= {"BLOCK_N": block_n, "IEEE": x2d.dtype == torch.float32}
            constants |= _planes(stored_type(type_id), k)
            launch_kernel(_planar_dot_kernel, grid, *args, **constants, num_warps=num_warps)
            return out
        _check_blocks(type_id, blocks, k)
        args = (x2d, blocks, out, m, n, x2d.stride(0), blocks.stride(0), out.stride(0))
        constants = {"K": k, "TYPE": type_id, "G": GROUPS[type_id], "BLOCK_M": block_m}
        constants |= {"BLOCK_N": block_n, "IEEE": x2d.dtype == torch.float32}
        launch_kernel(_gguf_dot_kernel, grid, *args, **constants, num_warps=num_warps)
        return out

    def gguf_dequantize_triton(
        type_id: int,
        blocks: Tensor,
        k: int,
        dtype: torch.dtype | None = None,
        ids: Tensor | None = None,
        out: Tensor | None = None,
        block_n: int | None = None,
    ) -> Tensor:
        """The values of `blocks`' rows (rows `ids` if given) as [rows, k] in `dtype`, or
        into `out` (rows of unit column stride, e.g. a slice of a larger scratch); `block_n`
        pins the rows a program (tests)."""
        planar = is_planar(type_id)
        if planar:
            planes, strides = _planar_operands(type_id, blocks, k)
        else:
            _check_blocks(type_id, blocks, k)
        rows = blocks.shape[0] if ids is None else ids.numel()
        if out is None:
            out = torch.empty(rows, k, dtype=dtype, device=blocks.device)
        if out.shape != (rows, k) or out.stride(1) != 1:
            raise ValueError(f"out must be [{rows}, {k}] with unit column stride")
        if rows == 0:
            return out
        if block_n is None:
            block_n = DEQUANTIZE_BLOCK_N if blocks.is_cuda else INTERPRETER_BLOCK_N
        indices = ids if ids is not None else blocks  # unread without INDEXED
        grid = (triton.cdiv(rows, block_n), triton.cdiv(k, STEP_VALUES))
        if planar:
            args = (*planes, indices, out, rows, *strides, out.stride(0))
            constants = {"K": k, "TYPE": stored_type(type_id), "BLOCK_N": block_n}
            constants |= {"INDEXED": ids is not None} | _planes(stored_type(type_id), k)
            launch_kernel(_planar_dequantize_kernel, grid, *args, **constants)
            return out
        args = (blocks, indices, out, rows, blocks.stride(0), out.stride(0))
        constants = {"K": k, "TYPE": type_id, "G": GROUPS[type_id], "BLOCK_N": block_n}
        constants["INDEXED"] = ids is not None
        launch_kernel(_gguf_dequantize_kernel, grid, *args, **constants)
        return out

    # -----------------------------------------------------------------------------------------
    # Planar rows (`hearth.quant.gguf_blocks.to_planar`): Q4_0, Q8_0, Q4_K, Q6_K

    # The float 2**23 as int32 bits, passed at run time (a constant exponent would take a second
    # LOP3: one immediate operand each).
    TWO23_BITS = 150 << 23

    @triton.jit
    def _planar_code(words, upper, two23, J: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr):
        """Code J of each int32 word (bits [BITS·J, BITS·J + BITS)) minus BIAS, as exact fp32,
        in place: ORed with the exponent of 2**(23 - P) at its bit P it is the float
        2**(23 - P) + code (one LOP3), less 2**(23 - P) + BIAS (one FADD; both integers below
        2**24, so exact). Codes reaching past bit 23 are read from `upper`, the words moved
        down 16 (one shift a word, shared by its codes)."""
        UPPER: tl.constexpr = J * BITS + BITS > 23
        P: tl.constexpr = J * BITS - 16 if UPPER else J * BITS
        MASK: tl.constexpr = ((1 << BITS) - 1) << P
        exponent = two23 - (P << 23)
        source = upper if UPPER else words
        value = ((source & MASK) | exponent).to(tl.float32, bitcast=True)
        return value - (exponent.to(tl.float32, bitcast=True) + BIAS)

    @triton.jit
    def _q6_k_code(low, low_up, high_low, high_up, two23, J: tl.constexpr):
        """Q6_K code J of each low word minus 32, as exact fp32: its nibble (bit 4J) and its two
        high bits (bit 4J + 4 of `high_low`, the high word shifted for this low word) as one
        6-bit field under the exponent of 2**(23 - P): two LOP3s and one FADD. Fields past bit
        23 (J >= 5) are read from the words moved down 16 (`low_up`, `high_up`). The high
        bits and exponent are joined first and the nibble XORed in (its bits are disjoint):
        written as one OR chain, LLVM reassociated it into three LOP3s."""
        UPPER: tl.constexpr = 4 * J + 6 > 23
        P: tl.constexpr = 4 * J - 16 if UPPER else 4 * J
        exponent = two23 - (P << 23)
        low_source = low_up if UPPER else low
        high_source = high_up if UPPER else high_low
        HIGH_MASK: tl.constexpr = 3 << (P + 4)
        LOW_MASK: tl.constexpr = 15 << P
        top = (high_source & HIGH_MASK) | exponent
        value = ((low_source & LOW_MASK) ^ top).to(tl.float32, bitcast=True)
        return value - (exponent.to(tl.float32, bitcast=True) + 32.0)

    @triton.jit
    def _load_if(pointers, ok, MASKED: tl.constexpr):
        """A load masked by `ok` (zero outside) only where the kernel's steps can pass K: a
        mask costs a zeroed register per value and a predicate."""
        if MASKED:
            return tl.load(pointers, mask=ok, other=0)
        else:
            return tl.load(pointers)

    @triton.jit
    def _x_values(x_at, offset, ok, MASKED: tl.constexpr, PAIRS: tl.constexpr):
        """x at `x_at` + `offset` values as fp32 [units, 1, 4]. With PAIRS, `x_at` points at
        bf16 pairs read as int32 [units, 1, 2] (offset still in values): each pair's low
        value is the word shifted up 16 and its high one the word's top half, one
        instruction each (the compiler's own bf16 conversion took two for one of them)."""
        if PAIRS:
            pairs = _load_if(x_at + offset // 2, ok, MASKED)
            low = (pairs << 16).to(tl.float32, bitcast=True)
            high = (pairs & -65536).to(tl.float32, bitcast=True)
            both = tl.join(low, high)  # [units, 1, 2, 2]: value 2p + e
            return tl.reshape(both, [both.shape[0], 1, 4])
        else:
            return _load_if(x_at + offset, ok, MASKED).to(tl.float32)

    @triton.jit
    def _rows_fma(
        acc0, acc1, acc2, acc3, value, x_at, offset, stride_xm, ok, M: tl.constexpr,
        MASKED: tl.constexpr, PAIRS: tl.constexpr,
    ):  # fmt: skip
        """acc_m += value · x_m for the M activation rows (`_x_values`: row 0's at `x_at`
        + `offset`, row m's `stride_xm` values on)."""
        acc0 += value * _x_values(x_at, offset, ok, MASKED, PAIRS)
        if M > 1:
            acc1 += value * _x_values(x_at, offset + stride_xm, ok, MASKED, PAIRS)
        if M > 2:
            acc2 += value * _x_values(x_at, offset + 2 * stride_xm, ok, MASKED, PAIRS)
        if M > 3:
            acc3 += value * _x_values(x_at, offset + 3 * stride_xm, ok, MASKED, PAIRS)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _scaled_add(acc0, acc1, acc2, acc3, dots0, dots1, dots2, dots3, scale, M: tl.constexpr):
        acc0 += scale * dots0
        if M > 1:
            acc1 += scale * dots1
        if M > 2:
            acc2 += scale * dots2
        if M > 3:
            acc3 += scale * dots3
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _store_planar_rows(
        out_ptr, partial_ptr, counter_ptr, acc0, acc1, acc2, acc3, n, n_ok, N, stride_om,
        M: tl.constexpr, SPLIT_K: tl.constexpr,
    ):  # fmt: skip
        """Each row's sums over K (acc summed over its group and word axes), rounded once to
        out's dtype; a K split's last program to arrive adds the slices' fp32 partials in
        slice order (deterministic, no float atomics) and resets its counter."""
        r0 = tl.sum(tl.sum(acc0, axis=2), axis=0)
        r1 = tl.sum(tl.sum(acc1, axis=2), axis=0)
        r2 = tl.sum(tl.sum(acc2, axis=2), axis=0)
        r3 = tl.sum(tl.sum(acc3, axis=2), axis=0)
        if SPLIT_K == 1:
            tl.store(out_ptr + n, r0.to(out_ptr.dtype.element_ty), mask=n_ok)
            if M > 1:
                tl.store(out_ptr + stride_om + n, r1.to(out_ptr.dtype.element_ty), mask=n_ok)
            if M > 2:
                tl.store(out_ptr + 2 * stride_om + n, r2.to(out_ptr.dtype.element_ty), mask=n_ok)
            if M > 3:
                tl.store(out_ptr + 3 * stride_om + n, r3.to(out_ptr.dtype.element_ty), mask=n_ok)
        else:
            own = partial_ptr + tl.program_id(1) * M * N + n
            tl.store(own, r0, mask=n_ok)
            if M > 1:
                tl.store(own + N, r1, mask=n_ok)
            if M > 2:
                tl.store(own + 2 * N, r2, mask=n_ok)
            if M > 3:
                tl.store(own + 3 * N, r3, mask=n_ok)
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(counter_ptr + tl.program_id(0), 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                for m in tl.static_range(M):
                    total = tl.zeros(n.shape, tl.float32)
                    for split in tl.static_range(SPLIT_K):
                        # .cg reads L2, where the other programs' partials are, not a stale L1.
                        total += tl.load(
                            partial_ptr + (split * M + m) * N + n, mask=n_ok, other=0.0,
                            cache_modifier=".cg",
                        )  # fmt: skip
                    out_at = out_ptr + m * stride_om + n
                    tl.store(out_at, total.to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(counter_ptr + tl.program_id(0), 0)  # ready for the next launch

    @triton.jit
    def _planar_loads(
        word_rows, byte_rows, half_rows, step, u_in, w, TYPE: tl.constexpr,
        BLOCK_G: tl.constexpr, UPG: tl.constexpr, GROUPS: tl.constexpr, PLANE_A: tl.constexpr,
        PLANE_B: tl.constexpr, PLANE_C: tl.constexpr, PLANE_D: tl.constexpr,
        MASKED: tl.constexpr,
    ):  # fmt: skip
        """What one step of the planar GEMV reads of its rows, as loaded: the words and four
        scale operands (Q4_K: scales, mins, d, dmin; Q6_K: high words, first and second
        scales, d; Q4_0 and Q8_0: d, then d again, unused)."""
        u = step * (BLOCK_G * UPG) + u_in
        g = u // UPG
        g_ok = g < GROUPS
        words = _load_if(word_rows + 4 * u + w, g_ok, MASKED)
        if TYPE == 12:
            a = _load_if(byte_rows + PLANE_A + g, g_ok, MASKED)
            b = _load_if(byte_rows + PLANE_B + g, g_ok, MASKED)
            c = _load_if(half_rows + PLANE_C + g // 8, g_ok, MASKED)
            d = _load_if(half_rows + PLANE_D + g // 8, g_ok, MASKED)
            return words, a, b, c, d
        elif TYPE == 14:
            high = _load_if(word_rows + PLANE_A + 2 * g + w // 2, g_ok, MASKED)
            first = _load_if(byte_rows + PLANE_B + 2 * g, g_ok, MASKED)
            second = _load_if(byte_rows + PLANE_B + 2 * g + 1, g_ok, MASKED)
            d = _load_if(half_rows + PLANE_C + g // 8, g_ok, MASKED)
            return words, high, first, second, d
        else:
            d = _load_if(half_rows + PLANE_A + g, g_ok, MASKED)
            return words, d, d, d, d

    @triton.jit
    def _planar_step(
        acc0, acc1, acc2, acc3, loaded, x_ptr, step, u_in, w, stride_xm, two23,
        TYPE: tl.constexpr, M: tl.constexpr, BLOCK_G: tl.constexpr, UPG: tl.constexpr,
        GROUPS: tl.constexpr, MASKED: tl.constexpr,
    ):  # fmt: skip
        """The M accumulators plus one step's products (`_planar_loads`'s operands)."""
        words, a, b, c, d = loaded
        u = step * (BLOCK_G * UPG) + u_in
        g = u // UPG
        g_ok = g < GROUPS
        upper = words >> 16  # arithmetic: the sign copies land above every mask
        PAIRS: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
        x_first = x_ptr + g * 32 + 4 * (u % UPG)
        if PAIRS:
            x_at = x_first.to(tl.pointer_type(tl.int32)) + tl.arange(0, 2)[None, None, :]
        else:
            x_at = x_first + w
        if TYPE == 12:
            scale = c.to(tl.float32) * a.to(tl.float32)
            offset = d.to(tl.float32) * b.to(tl.float32)
            for j in tl.static_range(8):
                weight = scale * _planar_code(words, upper, two23, j, 4, 0.0) - offset
                acc0, acc1, acc2, acc3 = _rows_fma(
                    acc0, acc1, acc2, acc3, weight, x_at, 4 * j, stride_xm, g_ok, M, MASKED,
                    PAIRS,
                )  # fmt: skip
        else:
            dots0 = tl.zeros(acc0.shape, tl.float32)
            dots1 = tl.zeros(acc0.shape, tl.float32)
            dots2 = tl.zeros(acc0.shape, tl.float32)
            dots3 = tl.zeros(acc0.shape, tl.float32)
            if TYPE == 14:
                e = w % 2  # code j's high bits are at 4j + 2e of the shared high word
                high_low = a << (4 - 2 * e)
                high_up = a >> (12 + 2 * e)
                half = d.to(tl.float32)
                scale_first = half * b.to(tl.int8, bitcast=True).to(tl.float32)
                scale = half * c.to(tl.int8, bitcast=True).to(tl.float32)
                for j in tl.static_range(8):
                    code = _q6_k_code(words, upper, high_low, high_up, two23, j)
                    dots0, dots1, dots2, dots3 = _rows_fma(
                        dots0, dots1, dots2, dots3, code, x_at, 4 * j, stride_xm, g_ok, M,
                        MASKED, PAIRS,
                    )  # fmt: skip
                    if j == 3:  # values 32g + 0..15 end: scale them, start the next 16
                        acc0, acc1, acc2, acc3 = _scaled_add(
                            acc0, acc1, acc2, acc3, dots0, dots1, dots2, dots3, scale_first, M
                        )
                        dots0 = tl.zeros(acc0.shape, tl.float32)
                        dots1 = tl.zeros(acc0.shape, tl.float32)
                        dots2 = tl.zeros(acc0.shape, tl.float32)
                        dots3 = tl.zeros(acc0.shape, tl.float32)
            else:
                WPG: tl.constexpr = 4 * UPG
                BITS: tl.constexpr = 8 if TYPE == 8 else 4
                BIAS: tl.constexpr = 128.0 if TYPE == 8 else 8.0
                scale = a.to(tl.float32)
                for j in tl.static_range(32 // WPG):
                    code = _planar_code(words, upper, two23, j, BITS, BIAS)
                    dots0, dots1, dots2, dots3 = _rows_fma(
                        dots0, dots1, dots2, dots3, code, x_at, WPG * j, stride_xm, g_ok, M,
                        MASKED, PAIRS,
                    )  # fmt: skip
            acc0, acc1, acc2, acc3 = _scaled_add(
                acc0, acc1, acc2, acc3, dots0, dots1, dots2, dots3, scale, M
            )
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _planar_gemv_kernel(
        x_ptr, words_ptr, bytes_ptr, halves_ptr, out_ptr, partial_ptr, counter_ptr,
        N, stride_xm, stride_words, stride_bytes, stride_halves, stride_om, two23,
        K: tl.constexpr, TYPE: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr, PLANE_A: tl.constexpr, PLANE_B: tl.constexpr,
        PLANE_C: tl.constexpr, PLANE_D: tl.constexpr, PDL: tl.constexpr,
        SPLIT_K: tl.constexpr = 1, PREFETCH: tl.constexpr = False,
    ):  # fmt: skip
        """out[m, n] = sum_k x[m, k] w[n, k] for m < M <= 4 over planar rows; grid (blocks of
        BLOCK_N rows, SPLIT_K slices of K's steps of BLOCK_G 32-value groups). A program's
        tiles are [BLOCK_G groups, BLOCK_N, words a group] (in units of 4 words); code j of
        every word pairs with x at 32g + WPG·j + w (adjacent in x: one vector load serves a
        thread's words of all its rows). Q4_K forms each weight, fl(d·sc · q - dmin·m), with
        one FMA (d·sc and dmin·m are exact fp32 products of an fp16 and a 6-bit integer, and
        so is d·sc · q: the FMA rounds exactly where `gguf.quants.dequantize` rounds), then
        adds x times it. The
        symmetric types (w = s · q, s · q exact) add x · q and scale each group's (or Q6_K's
        16 values') sum once. Planes (PLANE_*): Q4_K scales, mins (bytes), d, dmin (halves);
        Q6_K high words (words), scales (bytes), d (halves); Q4_0, Q8_0 d (halves)."""
        WPG: tl.constexpr = 8 if TYPE == 8 else 4
        GROUPS: tl.constexpr = K // 32
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        n_read = tl.minimum(n, N - 1).to(tl.int64)  # rows past N read row N - 1, not stored
        word_rows = (words_ptr + tl.multiple_of(n_read * stride_words, 4))[None, :, None]
        byte_rows = (bytes_ptr + n_read * stride_bytes)[None, :, None]
        half_rows = (halves_ptr + n_read * stride_halves)[None, :, None]
        # Tiles are [units, BLOCK_N, 4]: a unit is 4 adjacent words of a group (Q8_0's
        # groups are two), 16 bytes a thread loads at once; its codes' x are 4 adjacent values.
        UPG: tl.constexpr = WPG // 4  # units a group
        u_in = tl.arange(0, BLOCK_G * UPG)[:, None, None]
        w = tl.arange(0, 4)[None, None, :]
        STEPS: tl.constexpr = (GROUPS + BLOCK_G - 1) // BLOCK_G
        SLICE: tl.constexpr = (STEPS + SPLIT_K - 1) // SPLIT_K
        acc0 = tl.zeros([BLOCK_G * UPG, BLOCK_N, 4], tl.float32)
        acc1 = tl.zeros([BLOCK_G * UPG, BLOCK_N, 4], tl.float32)
        acc2 = tl.zeros([BLOCK_G * UPG, BLOCK_N, 4], tl.float32)
        acc3 = tl.zeros([BLOCK_G * UPG, BLOCK_N, 4], tl.float32)
        # Masks only where a step passes K (32-value types whose K is not whole steps); a K
        # split's slices stop at the last step (`while`: the interpreter loops to run-time
        # bounds only so).
        MASKED: tl.constexpr = GROUPS % BLOCK_G != 0
        step = pid_k * SLICE
        end = tl.minimum(step + SLICE, STEPS)
        if PREFETCH:
            # Register double buffering: the next step's words and scales are requested
            # before this step's arithmetic, two steps of loads in flight a program (a `while`
            # loop is not software-pipelined); the last step requests itself again (an L2 hit).
            # The first step's are requested before the wait for the previous kernel (with
            # PDL): the weights are not its to write.
            loaded = _planar_loads(
                word_rows, byte_rows, half_rows, step, u_in, w, TYPE, BLOCK_G, UPG, GROUPS,
                PLANE_A, PLANE_B, PLANE_C, PLANE_D, MASKED,
            )  # fmt: skip
        wait_for_producer(PDL)
        while step < end:
            if PREFETCH:
                current = loaded
                loaded = _planar_loads(
                    word_rows, byte_rows, half_rows, tl.minimum(step + 1, end - 1), u_in, w,
                    TYPE, BLOCK_G, UPG, GROUPS, PLANE_A, PLANE_B, PLANE_C, PLANE_D, MASKED,
                )  # fmt: skip
            else:
                current = _planar_loads(
                    word_rows, byte_rows, half_rows, step, u_in, w, TYPE, BLOCK_G, UPG, GROUPS,
                    PLANE_A, PLANE_B, PLANE_C, PLANE_D, MASKED,
                )  # fmt: skip
            acc0, acc1, acc2, acc3 = _planar_step(
                acc0, acc1, acc2, acc3, current, x_ptr, step, u_in, w, stride_xm, two23, TYPE,
                M, BLOCK_G, UPG, GROUPS, MASKED,
            )  # fmt: skip
            step += 1
        _store_planar_rows(
            out_ptr, partial_ptr, counter_ptr, acc0, acc1, acc2, acc3, n, n_ok, N, stride_om,
            M, SPLIT_K,
        )  # fmt: skip

    @triton.jit
    def _planar_step_values(
        word_rows, byte_rows, half_rows, ok, step, TYPE: tl.constexpr, K: tl.constexpr,
        PLANE_A: tl.constexpr, PLANE_B: tl.constexpr, PLANE_C: tl.constexpr,
        PLANE_D: tl.constexpr,
    ):  # fmt: skip
        """Values [step·256, step·256 + 256) of each planar row as fp32, [BLOCK_N, 8 groups, 32]
        in K order (zero past K and for masked rows); `*_rows`: [BLOCK_N, 1, 1, 1] pointers."""
        WPG: tl.constexpr = 8 if TYPE == 8 else 4
        BITS: tl.constexpr = 8 if TYPE == 8 else 4
        CODES: tl.constexpr = 32 // WPG
        g = step * 8 + tl.arange(0, 8)[None, :, None, None]
        j = tl.arange(0, CODES)[None, None, :, None]
        w = tl.arange(0, WPG)[None, None, None, :]
        ok = ok & (g < K // 32)
        words = tl.load(word_rows + g * WPG + w, mask=ok, other=0)
        q = (words >> (BITS * j)) & ((1 << BITS) - 1)  # [BLOCK_N, 8, CODES, WPG]
        if TYPE == 12:
            scale = tl.load(half_rows + PLANE_C + g // 8, mask=ok, other=0).to(tl.float32)
            scale *= tl.load(byte_rows + PLANE_A + g, mask=ok, other=0).to(tl.float32)
            offset = tl.load(half_rows + PLANE_D + g // 8, mask=ok, other=0).to(tl.float32)
            offset *= tl.load(byte_rows + PLANE_B + g, mask=ok, other=0).to(tl.float32)
            values = scale * q.to(tl.float32) - offset
        elif TYPE == 14:
            high = tl.load(word_rows + PLANE_A + 2 * g + w // 2, mask=ok, other=0)
            code = q | (((high >> (4 * j + 2 * (w % 2))) & 3) << 4)
            raw = tl.load(byte_rows + PLANE_B + 2 * g + j // 4, mask=ok, other=0)
            scale = tl.load(half_rows + PLANE_C + g // 8, mask=ok, other=0).to(tl.float32)
            scale *= raw.to(tl.int8, bitcast=True).to(tl.float32)
            values = scale * (code - 32).to(tl.float32)
        else:
            scale = tl.load(half_rows + PLANE_A + g, mask=ok, other=0).to(tl.float32)
            values = scale * (q - (128 if TYPE == 8 else 8)).to(tl.float32)
        return tl.reshape(values, [values.shape[0], 8, 32])

    @triton.jit
    def _planar_dot_kernel(
        x_ptr, words_ptr, bytes_ptr, halves_ptr, out_ptr, M, N, stride_xm, stride_words,
        stride_bytes, stride_halves, stride_om, K: tl.constexpr, TYPE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        PLANE_A: tl.constexpr, PLANE_B: tl.constexpr, PLANE_C: tl.constexpr,
        PLANE_D: tl.constexpr,
    ):  # fmt: skip
        """`_gguf_dot_kernel` over planar rows: a step of BLOCK_N rows decoded, rounded to x's
        dtype and multiplied by `tl.dot`; grid (blocks of N, blocks of M)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        n64 = n.to(tl.int64)
        word_rows = (words_ptr + n64 * stride_words)[:, None, None, None]
        byte_rows = (bytes_ptr + n64 * stride_bytes)[:, None, None, None]
        half_rows = (halves_ptr + n64 * stride_halves)[:, None, None, None]
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = m < M
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
        STEPS: tl.constexpr = (K + 255) // 256
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step in tl.range(STEPS):
            values = _planar_step_values(
                word_rows, byte_rows, half_rows, n_ok[:, None, None, None], step, TYPE, K,
                PLANE_A, PLANE_B, PLANE_C, PLANE_D,
            )  # fmt: skip
            acc = _dot_step(acc, values, x_rows, m_ok, step, K, BLOCK_N, IEEE)
        out_at = out_ptr + m[:, None] * stride_om + n[None, :]
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _planar_dequantize_kernel(
        words_ptr, bytes_ptr, halves_ptr, ids_ptr, out_ptr, N, stride_words, stride_bytes,
        stride_halves, stride_on, K: tl.constexpr, TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
        INDEXED: tl.constexpr, PLANE_A: tl.constexpr, PLANE_B: tl.constexpr,
        PLANE_C: tl.constexpr, PLANE_D: tl.constexpr,
    ):  # fmt: skip
        """`_gguf_dequantize_kernel` over planar rows; grid (blocks of N, steps of K)."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        step = tl.program_id(1)
        n_ok = n < N
        source = tl.load(ids_ptr + n, mask=n_ok, other=0) if INDEXED else n
        source = source.to(tl.int64)
        word_rows = (words_ptr + source * stride_words)[:, None, None, None]
        byte_rows = (bytes_ptr + source * stride_bytes)[:, None, None, None]
        half_rows = (halves_ptr + source * stride_halves)[:, None, None, None]
        values = _planar_step_values(
            word_rows, byte_rows, half_rows, n_ok[:, None, None, None], step, TYPE, K,
            PLANE_A, PLANE_B, PLANE_C, PLANE_D,
        )  # fmt: skip
        k = _step_columns(step, 8)[None, :, :]
        out_at = out_ptr + n.to(tl.int64)[:, None, None] * stride_on + k
        tl.store(out_at, values.to(out_ptr.dtype.element_ty), mask=n_ok[:, None, None] & (k < K))

    def _planes(type_id: int, k: int) -> dict[str, int]:
        """PLANE_* of a planar type at k: bytes for byte planes, halves, words as each reads."""
        at = planar_offsets(type_id, k)
        if type_id == 12:
            a, b, c, d = at["scales"], at["mins"], at["d"] // 2, at["dmin"] // 2
        elif type_id == 14:
            a, b, c, d = at["high"] // 4, at["scales"], at["d"] // 2, 0
        else:
            a, b, c, d = at["d"] // 2, 0, 0, 0
        return {"PLANE_A": a, "PLANE_B": b, "PLANE_C": c, "PLANE_D": d}

    def _planar_operands(layout: int, blocks: Tensor, k: int) -> tuple:
        """(words, bytes, halves views of planar rows, their row strides) after checks."""
        type_id = stored_type(layout)
        name = BLOCK_FORMATS[type_id].name
        width = planar_row_bytes(type_id, k)
        if (
            blocks.dtype != torch.uint8
            or blocks.dim() != 2
            or k % 32
            or (type_id in (12, 14) and k % 256)
            or blocks.shape[1] != width
            or blocks.stride(1) != 1
        ):
            raise ValueError(
                f"planar {name} rows of {k} values are uint8 [rows, {width}] with unit column "
                f"stride, got {blocks.dtype} {tuple(blocks.shape)}"
            )
        if blocks.data_ptr() % ROW_ALIGNMENT or blocks.stride(0) % ROW_ALIGNMENT:
            raise ValueError(f"planar {name} rows must start {ROW_ALIGNMENT}-byte aligned")
        words, halves = blocks.view(torch.int32), blocks.view(torch.float16)
        return (words, blocks, halves), (words.stride(0), blocks.stride(0), halves.stride(0))

    # Groups of 32 values a planar GEMV program takes a step (tiles [groups, rows, words]).
    PLANAR_BLOCK_G = 8
    # Whether the planar GEMV requests a step's loads a step ahead (register double
    # buffering; unmeasured: benchmarks/lab/gpu_gguf_gemv.py times both).
    PLANAR_PREFETCH = False

    def planar_block_n(m: int, type_id: int, n: int, multiprocessors: int) -> int:
        """Weight rows a planar GEMV program takes: as many as keep the registers in check
        (sm_90 SASS, 4 warps, no prefetch: at one activation row 64 rows take 96 registers
        for Q4_0 and Q4_K, 168 for Q8_0 and Q6_K; at two 32 take 96-128; at four 32 take 168
        for Q4_K but 234-240 for the others, where 16 take 128-168), each thread then holding
        4, 2 or 1 rows of a group (the x values it loads serve them all); at one row 64 only
        where that still gives every SM a program, else 32 (the K split fills the GPU).
        Q4_K at one row takes 16: more programs keep more loads in flight, and on an H100 that
        ran its 12B q/k/v, o, gate/up, down and head GEMVs 1.5-2.0x faster than 32 or 64
        (`benchmarks/lab/gpu_gguf_gemv.py`); Q6_K measured best as it is."""
        if m == 1:
            if type_id == 12:
                return 16
            return 64 if -(-n // 64) >= multiprocessors else 32
        if m == 2 or type_id == 12:
            return 32
        return 16

    def _planar_gemv(
        x2d: Tensor, layout: int, blocks: Tensor, out: Tensor, block_n: int | None,
        num_warps: int, split_k: int | None, block_g: int | None = None,
        prefetch: bool | None = None,
    ) -> Tensor:  # fmt: skip
        m, k = x2d.shape
        type_id = stored_type(layout)
        planes, strides = _planar_operands(layout, blocks, k)
        if x2d.data_ptr() % 16 or x2d.stride(0) % 8:
            # The kernel reads x in vectors (bf16 as int32 pairs): a fresh, aligned copy of a
            # view that starts or strides off them.
            x2d = torch.empty(m, k, dtype=x2d.dtype, device=x2d.device).copy_(x2d)
        n = blocks.shape[0]
        units = _multiprocessors(x2d.device.index or 0) if x2d.is_cuda else 1
        if block_n is None:
            cuda_rows = planar_block_n(m, type_id, n, units)
            block_n = cuda_rows if x2d.is_cuda else INTERPRETER_BLOCK_N
        block_g = block_g or PLANAR_BLOCK_G
        if split_k is None:
            split_k = gemv_split(n, k, block_n, units) if x2d.is_cuda else 1
        if split_k > 1:
            partial = torch.empty(split_k * m * n, dtype=torch.float32, device=x2d.device)
            counters = _counters(x2d.device, triton.cdiv(n, block_n))
        else:
            partial = counters = out  # unread
        args = (x2d, *planes, out, partial, counters, n, x2d.stride(0), *strides)
        args += (out.stride(0), TWO23_BITS)
        constants = {"K": k, "TYPE": type_id, "M": m, "BLOCK_N": block_n, "BLOCK_G": block_g}
        if prefetch is None:
            prefetch = PLANAR_PREFETCH
        constants |= _planes(type_id, k) | {"SPLIT_K": split_k, "num_warps": num_warps}
        constants["PREFETCH"] = prefetch
        constants |= pdl_options(x2d)
        grid = (triton.cdiv(n, block_n), split_k)
        launch_kernel(_planar_gemv_kernel, grid, *args, **constants)
        return out
