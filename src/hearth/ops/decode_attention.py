"""Split-K ("flash-decoding") attention of one query token over a KV cache in any layout.

One Triton kernel reads K and V straight from a cache's planes: dense tensors, MLX affine
codes (packed/scales/biases, groups along head_dim) or TurboQuant codebook codes (packed
codes + fp16 σ per 32-group, in the rotated space). The storage format of K and of V are
compile-time switches, so every cache kind is served by the same code.

Work split: one program per (batch, KV head, split of the slots); it holds all query heads
of its KV head (GQA), so each K/V byte is read once. Each split writes (max, sum, acc) in
fp32 and a second small kernel merges them in split order (deterministic), one program per
query head and slice of head_dim: a split merging its KV head's partials itself, once the
last of them arrived, would read every split alone and was slower than the extra launch.
A single split normalises and writes the output itself. The number of splits depends only
on shapes and the device, never on data, and the query position is read on the device, so a
call can be captured in a CUDA graph and replayed as the cache fills.

Masking uses each slot's absolute position (`positions`, EMPTY_POSITION for empty slots):
slot n is visible iff pos[n] <= qpos and (window is None or qpos - pos[n] < window). Every
block is masked so; with `skip_masked_blocks` a block with no visible slot is also branched
over (empty tails of a static cache). Masked loads fetch nothing either way.

Rotation: codebook keys are dot-products in the rotated space, so the wrapper rotates the
query once; codebook values are averaged in the rotated space and the wrapper un-rotates
the output once (deferred V), instead of un-rotating every stored value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from hearth.ops import pdl_options
from hearth.ops.hadamard import rotate_rows, unrotate_rows
from hearth.ops.launch import launch_kernel
from hearth.quant.kv_codecs import EMPTY_POSITION, AffineCodec
from hearth.quant.turbo import CODEBOOKS, GROUP, TurboCodec, decode_rotated

DENSE, AFFINE, CODEBOOK = 0, 1, 2
_KIND_CODES = {"dense": DENSE, "affine": AFFINE, "codebook": CODEBOOK}
_PLANES = {"dense": 1, "affine": 3, "codebook": 2}
_LOG2E = 1.4426950408889634
# Finite start for the running max: a split whose slots are all masked keeps m = this and
# sum = 0, and exp2(m - m_new) stays 1 instead of NaN (-inf - -inf).
_NO_SCORE = -1.0e30
# How a split program finishes: one split normalises and writes the output; else it writes
# its partials for the merge launch.
_WRITE_OUTPUT, _WRITE_PARTIALS = 0, 1


@dataclass(frozen=True)
class PlaneFormat:
    """How one of K or V is stored, and so which planes (tensors) describe it.

    dense:    (data [B, Hkv, S, D],)
    affine:   (packed uint32 [B, Hkv, S, D*bits/32], scales [.., D/g], biases [.., D/g])
    codebook: (packed uint32 [B, Hkv, S, D*bits/32], sigma fp16 [.., D/32]), rotated space
    """

    kind: str
    bits: int = 16
    group_size: int = GROUP

    def __post_init__(self) -> None:
        if self.kind not in _KIND_CODES:
            raise ValueError(f"plane format kind must be one of {tuple(_KIND_CODES)}")
        if self.kind == "affine" and self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"affine KV bits must be 2..6 or 8, got {self.bits}")
        if self.kind == "codebook" and (self.bits not in (1, 2, 3, 4) or self.group_size != GROUP):
            raise ValueError(f"codebook KV is 1..4 bits in groups of {GROUP}")

    @classmethod
    def dense(cls) -> PlaneFormat:
        return cls("dense")

    @classmethod
    def affine(cls, bits: int, group_size: int) -> PlaneFormat:
        return cls("affine", bits, group_size)

    @classmethod
    def codebook(cls, bits: int) -> PlaneFormat:
        return cls("codebook", bits, GROUP)

    @property
    def planes(self) -> int:
        return _PLANES[self.kind]

    @property
    def rotated(self) -> bool:
        return self.kind == "codebook"


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of the split kernel; None fields take the shape-based defaults."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    splits: int | None = None  # a target: slots per split are rounded to 2^k blocks
    skip_masked_blocks: bool | None = None  # branch over blocks with no visible slot
    programs_per_sm: int | None = None  # split target when `splits` is None


# ---------------------------------------------------------------------------------------------
# Rotation helpers (device-cached: no host-to-device copy on the hot path, nor in a graph)


def rotate_query(q: torch.Tensor) -> torch.Tensor:
    """`turbo.rotate(q)` in fp32: one kernel on the GPU (kernels/hadamard.py)."""
    return rotate_rows(q)


def unrotate_output(y: torch.Tensor) -> torch.Tensor:
    """`turbo.unrotate(y)` in fp32: one kernel on the GPU (kernels/hadamard.py)."""
    return unrotate_rows(y)


@cache
def _centroids(bits: int, device: torch.device) -> torch.Tensor:
    return CODEBOOKS[bits][0].to(device=device, dtype=torch.float32)


@cache
def _multiprocessors(device: torch.device) -> int:
    """SM count; a fixed 8 off the GPU (the interpreter), so CPU tests see several splits."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------
# Triton kernels (defined only when Triton imports)

try:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # Jitted code reads module globals only as constexprs.
    NO_SCORE = tl.constexpr(_NO_SCORE)
    EMPTY = tl.constexpr(EMPTY_POSITION)
    WRITE_OUTPUT = tl.constexpr(_WRITE_OUTPUT)

    @triton.jit
    def _centroid(codes, centroids, BITS: tl.constexpr):
        """Codebook values of codes, with no per-code loads: the codebook is symmetric
        (c[2^b-1-i] = -c[i]), so the top bit is the sign and a select tree over the other
        bits picks one of the 2^(b-1) positive centroids (scalars loaded once)."""
        HALF: tl.constexpr = 1 << (BITS - 1)
        positive = (codes >> (BITS - 1)) != 0
        # Magnitude rank: positive codes count up from the middle, negative ones down.
        # (top bit - 1) is 0 for positive codes and all ones for negative ones.
        rank = (codes ^ ((codes >> (BITS - 1)) - 1)) & (HALF - 1)
        magnitude = tl.load(centroids + HALF) + tl.zeros(codes.shape, tl.float32)
        if BITS >= 2:
            bit0 = (rank & 1) != 0
            pair0 = tl.where(bit0, tl.load(centroids + HALF + 1), tl.load(centroids + HALF))
            magnitude = pair0
            if BITS >= 3:
                bit1 = (rank & 2) != 0
                pair1 = tl.where(bit0, tl.load(centroids + HALF + 3), tl.load(centroids + HALF + 2))
                magnitude = tl.where(bit1, pair1, pair0)
                if BITS >= 4:
                    bit2 = (rank & 4) != 0
                    pair2 = tl.where(
                        bit0, tl.load(centroids + HALF + 5), tl.load(centroids + HALF + 4)
                    )
                    pair3 = tl.where(
                        bit0, tl.load(centroids + HALF + 7), tl.load(centroids + HALF + 6)
                    )
                    upper = tl.where(bit1, pair3, pair2)
                    magnitude = tl.where(bit2, upper, magnitude)
        return tl.where(positive, magnitude, -magnitude)

    @triton.jit
    def _group_lanes(BITS: tl.constexpr, GROUP_SIZE: tl.constexpr):
        """(unit, code index in the unit) of each lane of a group's columns.

        A unit is the fewest whole words holding whole codes (1 word of 32/BITS codes, or 3
        words of 32 3-bit codes). Lane c holds code c // UNITS of unit c % UNITS: adjacent
        lanes read adjacent words (vector loads, each word once per shift) and no reshape
        or layout change is needed; the query and the output are permuted to match.
        """
        UNIT_WORDS: tl.constexpr = BITS // (BITS & -BITS)
        PER_UNIT: tl.constexpr = 32 * UNIT_WORDS // BITS
        UNITS: tl.constexpr = GROUP_SIZE // PER_UNIT
        lane = tl.arange(0, GROUP_SIZE)[None, None, :]
        return lane % UNITS, lane // UNITS

    @triton.jit
    def _group_dims(BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Head dim [GROUPS, 1, GROUP_SIZE] of each (group, lane) of a grouped tile."""
        UNIT_WORDS: tl.constexpr = BITS // (BITS & -BITS)
        PER_UNIT: tl.constexpr = 32 * UNIT_WORDS // BITS
        unit, index = _group_lanes(BITS, GROUP_SIZE)
        group = tl.arange(0, HEAD_DIM // GROUP_SIZE)[:, None, None]
        return group * GROUP_SIZE + unit * PER_UNIT + index

    @triton.jit
    def _grouped_levels(
        data,
        aux,
        aux2,
        centroids,
        data_rows,
        aux_rows,
        row_mask,
        FORMAT: tl.constexpr,
        BITS: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        """Rows of one KV head as (levels [GROUPS, BLOCK_N, GROUP_SIZE], scale and bias
        [GROUPS, BLOCK_N]), fp32, lanes in the order of `_group_lanes`. `data_rows` and
        `aux_rows` [BLOCK_N] are each row's element offset in the packed plane and in the
        scale/bias planes (a contiguous cache: slot x stride; a paged pool: its block's
        base plus the slot in the block). An element is
        level * scale + bias (codebook planes: level = centroid, no bias). Affine levels
        are small integers, exact in any float type, so the dots take them unscaled."""
        UNIT_WORDS: tl.constexpr = BITS // (BITS & -BITS)
        PER_UNIT: tl.constexpr = 32 * UNIT_WORDS // BITS
        UNITS: tl.constexpr = GROUP_SIZE // PER_UNIT
        group = tl.arange(0, HEAD_DIM // GROUP_SIZE)[:, None, None]
        row = data_rows[None, :, None]
        mask = row_mask[None, :, None]
        unit, index = _group_lanes(BITS, GROUP_SIZE)
        bit = index * BITS
        shift = (bit % 32).to(tl.uint32)
        base = data + row + group * (UNITS * UNIT_WORDS)
        if UNIT_WORDS == 1:
            packed = tl.load(base + unit, mask=mask, other=0).to(tl.uint32, bitcast=True)
            codes = packed >> shift
        else:
            # Codes straddle words (3-bit): take each code's low bits from its word and,
            # where it spills over, the next word's low bits.
            word_of_code = bit // 32
            spills = (bit % 32) + BITS > 32
            low = tl.zeros([1, 1, GROUP_SIZE], tl.uint32)
            high = tl.zeros([1, 1, GROUP_SIZE], tl.uint32)
            for k in tl.static_range(UNIT_WORDS):
                if UNITS == 1:
                    word = tl.load(base + k, mask=mask, other=0)  # one per (group, row)
                else:
                    word = tl.load(base + unit * UNIT_WORDS + k, mask=mask, other=0)
                word = word.to(tl.uint32, bitcast=True)
                low = tl.where(word_of_code == k, word, low)
                high = tl.where(spills & (word_of_code + 1 == k), word, high)
            codes = (low >> shift) | (high << ((32 - shift) % 32))
        codes = codes & ((1 << BITS) - 1)
        aux_offsets = aux_rows[None, :] + tl.arange(0, HEAD_DIM // GROUP_SIZE)[:, None]
        aux_mask = row_mask[None, :]
        scale = tl.load(aux + aux_offsets, mask=aux_mask, other=0.0).to(tl.float32)
        if FORMAT == 1:
            bias = tl.load(aux2 + aux_offsets, mask=aux_mask, other=0.0).to(tl.float32)
            # Exact int -> float without the slow conversion: 2^23 + code, minus 2^23.
            levels = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            bias = tl.zeros(scale.shape, tl.float32)
            levels = _centroid(codes, centroids, BITS)
        return levels, scale, bias

    @triton.jit
    def _dense_tile(data, data_rows, row_mask, HEAD_DIM: tl.constexpr, OUT_DTYPE: tl.constexpr):
        """Rows of one KV head's dense plane as a [BLOCK_N, HEAD_DIM] tile in OUT_DTYPE
        (`data_rows`: each row's element offset, as in `_grouped_levels`)."""
        offsets = data_rows[:, None] + tl.arange(0, HEAD_DIM)[None, :]
        return tl.load(data + offsets, mask=row_mask[:, None], other=0.0).to(OUT_DTYPE)

    @triton.jit
    def _attend_block(
        query,
        query_sums,
        running_max,
        running_sum,
        acc,
        k_rows,
        k_aux_rows,
        v_rows,
        v_aux_rows,
        visible,
        scale_log2,
        k0,
        k1,
        k2,
        k_centroids,
        v0,
        v1,
        v2,
        v_centroids,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        K_FORMAT: tl.constexpr,
        K_BITS: tl.constexpr,
        K_GROUP: tl.constexpr,
        V_FORMAT: tl.constexpr,
        V_BITS: tl.constexpr,
        V_GROUP: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One online-softmax step (base 2) of the query heads over a block of slots, whose
        rows sit at element offsets `k_rows`/`v_rows` of the K/V data planes and
        `k_aux_rows`/`v_aux_rows` of their scale (and bias) planes.

        Quantized planes are decoded per scale group into [GROUPS, BLOCK_N, GROUP] tiles of
        levels and multiplied by batched dots (query and accumulator held per group in the
        same lane order), so no tile is reshaped: reshapes cost layout shuffles through
        shared memory. Scales and biases act on the dots' small outputs, not on every
        element: q.k = sum_g s_g (q_g . levels_g) + b_g sum(q_g), and
        sum_n p_n v_n = sum_n (p_n s_n) levels_n + sum_n p_n b_n per group.
        `query_sums` holds sum(q_g) [GROUPS, BLOCK_G] for affine keys.
        """
        dtype = query.dtype
        if K_FORMAT == 0:
            keys = _dense_tile(k0, k_rows, visible, HEAD_DIM, dtype)
            scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION)
        else:
            levels, k_scale, k_bias = _grouped_levels(
                k0, k1, k2, k_centroids, k_rows, k_aux_rows, visible,
                K_FORMAT, K_BITS, K_GROUP, HEAD_DIM,
            )  # fmt: skip
            per_group = tl.dot(
                query, tl.permute(levels.to(dtype), (0, 2, 1)), input_precision=PRECISION
            )
            per_group = per_group * k_scale[:, None, :]
            if K_FORMAT == 1:
                per_group += query_sums[:, :, None] * k_bias[:, None, :]
            scores = tl.sum(per_group, axis=0)
        scores = tl.where(visible[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        if V_FORMAT == 0:
            values = _dense_tile(v0, v_rows, visible, HEAD_DIM, dtype)
            acc = acc * correction[:, None] + tl.dot(
                weights.to(dtype), values, input_precision=PRECISION
            )
        else:
            levels, v_scale, v_bias = _grouped_levels(
                v0, v1, v2, v_centroids, v_rows, v_aux_rows, visible,
                V_FORMAT, V_BITS, V_GROUP, HEAD_DIM,
            )  # fmt: skip
            scaled = (weights[None, :, :] * v_scale[:, None, :]).to(dtype)
            acc = acc * correction[None, :, None] + tl.dot(
                scaled, levels.to(dtype), input_precision=PRECISION
            )
            if V_FORMAT == 1:
                acc += tl.sum(weights[None, :, :] * v_bias[:, None, :], axis=2)[:, :, None]
        return new_max, running_sum, acc

    @triton.jit
    def _query_tile(
        q,
        batch,
        kv_head,
        stride_qb,
        stride_qh,
        GROUPS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        K_FORMAT: tl.constexpr,
        K_BITS: tl.constexpr,
        K_GROUP: tl.constexpr,
    ):
        """(query, query_sums, heads, group_mask) of one KV head's query heads: the query
        [BLOCK_G, HEAD_DIM], or [GROUPS, BLOCK_G, GROUP] in the key tiles' lane order for
        grouped keys; sum(q_g) [GROUPS, BLOCK_G] for affine keys (else unread)."""
        group = tl.arange(0, BLOCK_G)
        group_mask = group < GROUPS
        heads = kv_head * GROUPS + group
        query_rows = q + batch * stride_qb + heads * stride_qh
        if K_FORMAT == 0:
            dims = tl.arange(0, HEAD_DIM)
            query = tl.load(
                query_rows[:, None] + dims[None, :], mask=group_mask[:, None], other=0.0
            )
        else:
            key_dims = _group_dims(K_BITS, K_GROUP, HEAD_DIM)
            query = tl.load(
                query_rows[None, :, None] + key_dims, mask=group_mask[None, :, None], other=0.0
            )
        if K_FORMAT == 1:
            query_sums = tl.sum(query.to(tl.float32), axis=2)
        else:
            query_sums = tl.zeros([1], tl.float32)
        return query, query_sums, heads, group_mask

    @triton.jit
    def _empty_accumulator(
        heads,
        group_mask,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        V_FORMAT: tl.constexpr,
        V_BITS: tl.constexpr,
        V_GROUP: tl.constexpr,
    ):
        """(acc, acc_dims, acc_heads, acc_mask): the zero output accumulator and where its
        lanes go, [BLOCK_G, HEAD_DIM] or [GROUPS, BLOCK_G, GROUP] in the value tiles' order."""
        if V_FORMAT == 0:
            acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
            acc_dims = tl.arange(0, HEAD_DIM)[None, :]
            acc_heads = heads[:, None]
            acc_mask = group_mask[:, None]
        else:
            acc = tl.zeros([HEAD_DIM // V_GROUP, BLOCK_G, V_GROUP], tl.float32)
            acc_dims = _group_dims(V_BITS, V_GROUP, HEAD_DIM)
            acc_heads = heads[None, :, None]
            acc_mask = group_mask[None, :, None]
        return acc, acc_dims, acc_heads, acc_mask

    @triton.jit
    def _finish_split(
        running_max,
        running_sum,
        acc,
        heads,
        group_mask,
        acc_dims,
        acc_heads,
        acc_mask,
        first_head,
        split,
        splits,
        out,
        part_max,
        part_sum,
        part_acc,
        HEAD_DIM: tl.constexpr,
        V_FORMAT: tl.constexpr,
        FINISH: tl.constexpr,
    ):
        """Store a split's result: the normalised output when one split sees every visible
        slot, else its (max, sum, acc) for the merge. An empty split stores max NO_SCORE,
        sum 0, acc 0: weight 0 in the merge."""
        if FINISH == WRITE_OUTPUT:
            total = tl.maximum(running_sum, 1.0e-30)
            if V_FORMAT == 0:  # noqa: SIM108 (a jitted constexpr branch)
                result = acc / total[:, None]
            else:
                result = acc / total[None, :, None]
            tl.store(
                out + (first_head + acc_heads) * HEAD_DIM + acc_dims,
                result.to(out.dtype.element_ty),
                mask=acc_mask,
            )
        else:
            rows_out = (first_head + heads) * splits + split
            tl.store(part_max + rows_out, running_max, mask=group_mask)
            tl.store(part_sum + rows_out, running_sum, mask=group_mask)
            acc_rows = (first_head + acc_heads) * splits + split
            tl.store(part_acc + acc_rows * HEAD_DIM + acc_dims, acc, mask=acc_mask)

    @triton.jit
    def _split_kernel(
        q,
        stride_qb,
        stride_qh,
        k0,
        k1,
        k2,
        stride_k0b,
        stride_k0h,
        stride_k0s,
        stride_k1b,
        stride_k1h,
        stride_k1s,
        v0,
        v1,
        v2,
        stride_v0b,
        stride_v0h,
        stride_v0s,
        stride_v1b,
        stride_v1h,
        stride_v1s,
        k_centroids,
        v_centroids,
        positions,
        query_position,
        window,
        part_acc,
        part_max,
        part_sum,
        out,
        slots,
        splits,
        scale_log2,
        KV_HEADS: tl.constexpr,
        GROUPS: tl.constexpr,
        BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK: tl.constexpr,
        K_FORMAT: tl.constexpr,
        K_BITS: tl.constexpr,
        K_GROUP: tl.constexpr,
        V_FORMAT: tl.constexpr,
        V_BITS: tl.constexpr,
        V_GROUP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        SKIP_MASKED: tl.constexpr,
        PRECISION: tl.constexpr,
        FINISH: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """(max, sum, acc) of one split of one KV head's slots for its query heads; see
        FINISH for what happens to them."""
        batch_head = tl.program_id(0)
        split = tl.program_id(1)
        batch = batch_head // KV_HEADS
        kv_head = batch_head % KV_HEADS
        wait_for_producer(PDL)

        query, query_sums, heads, group_mask = _query_tile(
            q, batch, kv_head, stride_qb, stride_qh,
            GROUPS, BLOCK_G, HEAD_DIM, K_FORMAT, K_BITS, K_GROUP,
        )  # fmt: skip
        qpos = tl.load(query_position)

        k0 += batch * stride_k0b + kv_head * stride_k0h
        k1 += batch * stride_k1b + kv_head * stride_k1h
        k2 += batch * stride_k1b + kv_head * stride_k1h
        v0 += batch * stride_v0b + kv_head * stride_v0h
        v1 += batch * stride_v1b + kv_head * stride_v1h
        v2 += batch * stride_v1b + kv_head * stride_v1h

        running_max = tl.full([BLOCK_G], NO_SCORE, tl.float32)
        running_sum = tl.zeros([BLOCK_G], tl.float32)
        acc, acc_dims, acc_heads, acc_mask = _empty_accumulator(
            heads, group_mask, BLOCK_G, HEAD_DIM, V_FORMAT, V_BITS, V_GROUP
        )
        start = split * CHUNK
        for block in range(0, CHUNK, BLOCK_N):
            rows = start + block + tl.arange(0, BLOCK_N)
            row_mask = rows < slots
            pos = tl.load(positions + rows, mask=row_mask, other=EMPTY)
            visible = row_mask & (pos <= qpos)
            if HAS_WINDOW:
                visible = visible & (qpos - pos < window)
            if SKIP_MASKED:
                # Empty or out-of-window blocks cost only their positions.
                if tl.max(visible.to(tl.int32), axis=0) > 0:
                    running_max, running_sum, acc = _attend_block(
                        query, query_sums, running_max, running_sum, acc,
                        rows * stride_k0s, rows * stride_k1s, rows * stride_v0s,
                        rows * stride_v1s, visible, scale_log2,
                        k0, k1, k2, k_centroids, v0, v1, v2, v_centroids,
                        HEAD_DIM, BLOCK_N, K_FORMAT, K_BITS, K_GROUP,
                        V_FORMAT, V_BITS, V_GROUP, PRECISION,
                    )  # fmt: skip
            else:
                running_max, running_sum, acc = _attend_block(
                    query, query_sums, running_max, running_sum, acc,
                    rows * stride_k0s, rows * stride_k1s, rows * stride_v0s,
                    rows * stride_v1s, visible, scale_log2,
                    k0, k1, k2, k_centroids, v0, v1, v2, v_centroids,
                    HEAD_DIM, BLOCK_N, K_FORMAT, K_BITS, K_GROUP,
                    V_FORMAT, V_BITS, V_GROUP, PRECISION,
                )  # fmt: skip

        _finish_split(
            running_max, running_sum, acc, heads, group_mask, acc_dims, acc_heads, acc_mask,
            batch * KV_HEADS * GROUPS, split, splits, out, part_max, part_sum, part_acc,
            HEAD_DIM, V_FORMAT, FINISH,
        )  # fmt: skip

    @triton.jit
    def _split_tile(part_max, part_sum, rows, row_ok, splits, chunk, BLOCK_S: tl.constexpr):
        """(maxima, sums, partial row, mask), each [BLOCK_S, rows], of one chunk of splits.
        `.cg` loads read L2, where other programs' partials are, not a stale L1 line."""
        index = chunk * BLOCK_S + tl.arange(0, BLOCK_S)
        at = rows[None, :] * splits + index[:, None]
        inside = (index < splits)[:, None] & row_ok[None, :]
        maxima = tl.load(part_max + at, mask=inside, other=NO_SCORE, cache_modifier=".cg")
        sums = tl.load(part_sum + at, mask=inside, other=0.0, cache_modifier=".cg")
        return maxima, sums, at, inside

    @triton.jit
    def _merge_splits(
        part_acc,
        part_max,
        part_sum,
        out,
        first_row,
        splits,
        dim_start,
        ROWS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        SPAN: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_S: tl.constexpr,
        CHUNKS: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """out[r, dims] = Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) sum_s, M = max_s m_s, for
        ROWS rows from first_row and SPAN dims from dim_start, in tiles of BLOCK_S splits x
        BLOCK_R rows x BLOCK_D dims. CHUNKS tiles cover the splits, always summed in the
        same order: the result does not depend on which program merges."""
        rows = first_row + tl.arange(0, BLOCK_R)
        row_ok = tl.arange(0, BLOCK_R) < ROWS
        top = tl.full([BLOCK_R], NO_SCORE, tl.float32)
        for chunk in tl.static_range(CHUNKS):
            maxima, sums, at, inside = _split_tile(
                part_max, part_sum, rows, row_ok, splits, chunk, BLOCK_S
            )
            top = tl.maximum(top, tl.max(maxima, axis=0))
        denominator = tl.zeros([BLOCK_R], tl.float32)
        for chunk in tl.static_range(CHUNKS):
            maxima, sums, at, inside = _split_tile(
                part_max, part_sum, rows, row_ok, splits, chunk, BLOCK_S
            )
            denominator += tl.sum(tl.exp2(maxima - top[None, :]) * sums, axis=0)
        # No visible slot at all (never the case for a real query: it sees itself) gives 0.
        denominator = tl.maximum(denominator, 1.0e-30)
        for start in tl.static_range(0, SPAN, BLOCK_D):
            dims = dim_start + start + tl.arange(0, BLOCK_D)
            total = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
            for chunk in tl.static_range(CHUNKS):
                maxima, sums, at, inside = _split_tile(
                    part_max, part_sum, rows, row_ok, splits, chunk, BLOCK_S
                )
                weight = tl.exp2(maxima - top[None, :])
                partial = tl.load(
                    part_acc + at[:, :, None] * HEAD_DIM + dims[None, None, :],
                    mask=inside[:, :, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                total += tl.sum(weight[:, :, None] * partial, axis=0)
            tl.store(
                out + rows[:, None] * HEAD_DIM + dims[None, :],
                (total / denominator[:, None]).to(out.dtype.element_ty),
                mask=row_ok[:, None],
            )

    @triton.jit
    def _merge_kernel(
        part_acc,
        part_max,
        part_sum,
        out,
        splits,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_S: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """The merge as its own launch: one program per (query head row, BLOCK_D dims)."""
        wait_for_producer(PDL)
        _merge_splits(
            part_acc, part_max, part_sum, out, tl.program_id(0), splits,
            tl.program_id(1) * BLOCK_D, 1, HEAD_DIM, BLOCK_D, 1, BLOCK_S, 1, BLOCK_D,
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Host side


def _check_planes(
    name: str, planes: Sequence[torch.Tensor], fmt: PlaneFormat, shape: tuple[int, ...]
) -> None:
    if len(planes) != fmt.planes:
        raise ValueError(f"{name}: {fmt.kind} needs {fmt.planes} planes, got {len(planes)}")
    batch, kv_heads, slots, dim = shape
    widths = {
        "dense": [dim],
        "affine": [dim * fmt.bits // 32, dim // fmt.group_size, dim // fmt.group_size],
        "codebook": [dim * fmt.bits // 32, dim // GROUP],
    }[fmt.kind]
    for plane, width in zip(planes, widths, strict=True):
        if tuple(plane.shape) != (batch, kv_heads, slots, width) or plane.stride(-1) != 1:
            raise ValueError(
                f"{name}: plane {tuple(plane.shape)} (stride {plane.stride()}) is not "
                f"[{batch}, {kv_heads}, {slots}, {width}] with a contiguous last dim"
            )
    if fmt.kind == "affine" and planes[1].stride() != planes[2].stride():
        raise ValueError(f"{name}: scales and biases must share strides")


def _split_plan(
    slots: int, programs: int, block_n: int, device: torch.device, config: LaunchConfig
) -> tuple[int, int]:
    """(slots per split, splits): enough programs to fill the GPU, at least a block each.

    Slots per split is a power-of-two number of blocks and a compile-time constant, so a
    kernel is compiled for a handful of values however the cache length varies.
    """
    per_sm = config.programs_per_sm or PROGRAMS_PER_SM
    wanted = config.splits or max(1, -(-per_sm * _multiprocessors(device) // programs))
    blocks = -(-slots // block_n)
    per_split = -(-blocks // min(wanted, blocks))
    chunk = block_n * triton.next_power_of_2(per_split)
    return chunk, -(-slots // chunk)


# Programs per SM the splits aim for where a call pins none, as the launch sweeps of
# `benchmarks/gpu_kernels_attention.py` chose.
PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class _Launch:
    """A LaunchConfig with every field resolved for one call."""

    block_n: int
    num_warps: int
    num_stages: int
    skip_masked_blocks: bool


# Dense K/V read by at most this many (batch, KV head) rows of programs take 16-slot blocks
# and 4 warps: with so few rows, smaller blocks let a short context split over more programs.
# With more rows (12B's 8 KV heads) the same tiles were slower.
FEW_KV_ROWS = 2


def _default_tiles(
    head_dim: int, key_format: PlaneFormat, value_format: PlaneFormat, kv_rows: int = 0
) -> _Launch:
    """Tile sizes, warps, stages and block skipping for a head size and formats, and for
    `kv_rows` (batch x KV heads) rows of programs (0: unknown)."""
    kinds = (key_format.kind, value_format.kind)
    if kinds == ("affine", "affine") and key_format.bits in (4, 8) and head_dim <= 256:
        # 64-slot blocks beat 32 up to D=256; at D=512 they spill.
        return _Launch(64, 4, 2, True)
    if kinds != ("dense", "dense"):
        # Decoded tiles live in registers: 32 slots x 4 warps never spill (64 slots spill
        # for 4-bit codebook keys with 3-bit values, and at D=512).
        return _Launch(32, 4, 2, True)
    if 0 < kv_rows <= FEW_KV_ROWS:
        return _Launch(16, 4, 3, False)
    # Dense: 32..64 slots per block; 8 warps at D=256, 4 at D=512 (fewer, fuller warps won).
    block_n = max(16, min(64, 16384 // head_dim))
    warps = 8 if head_dim == 256 else 4
    # No branch and 3 stages (K/V prefetched) beat skipping masked blocks: unskipped masked
    # blocks cost no K/V traffic (the loads are masked).
    return _Launch(block_n, warps, 3, False)


def _resolve(
    config: LaunchConfig,
    head_dim: int,
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    kv_rows: int = 0,
) -> _Launch:
    """The config's fields, the defaults where they are None."""
    default = _default_tiles(head_dim, key_format, value_format, kv_rows)
    return _Launch(
        config.block_n or default.block_n,
        config.num_warps or default.num_warps,
        config.num_stages or default.num_stages,
        default.skip_masked_blocks
        if config.skip_masked_blocks is None
        else config.skip_masked_blocks,
    )


def _finish_mode(splits: int) -> int:
    """How the split programs finish (see _WRITE_OUTPUT): the output, or partials to merge."""
    return _WRITE_OUTPUT if splits == 1 else _WRITE_PARTIALS


def decode_attention_rotated(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    positions: torch.Tensor,
    query_position: torch.Tensor,
    window: int | None,
    scale: float,
    config: LaunchConfig = LaunchConfig(),
) -> torch.Tensor:
    """The raw kernel(s): q must already be rotated for codebook keys, and the output
    [B, Hq, D] is in the rotated space (fp32) for codebook values, else in q's dtype."""
    batch, query_heads, head_dim = q.shape
    kv_heads, slots = key_planes[0].shape[1:3]
    shape = (batch, kv_heads, slots, head_dim)
    _check_planes("keys", key_planes, key_format, shape)
    _check_planes("values", value_planes, value_format, shape)
    if query_heads % kv_heads or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"unsupported heads/head_dim: {query_heads}/{kv_heads}, {head_dim}")
    if positions.shape != (slots,) or positions.dtype != torch.long:
        raise ValueError(
            f"positions must be int64 [{slots}], got {positions.dtype} {positions.shape}"
        )
    if query_position.dim() != 0 or query_position.dtype != torch.long:
        raise ValueError("query_position must be a 0-dim int64 tensor (device-side)")
    if q.stride(-1) != 1:
        q = q.contiguous()
    groups = query_heads // kv_heads
    launch = _resolve(config, head_dim, key_format, value_format, batch * kv_heads)
    chunk, splits = _split_plan(slots, batch * kv_heads, launch.block_n, q.device, config)
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
    # fp32 operands would default to TF32 on the GPU; half types take no precision option.
    precision = "ieee" if q.dtype == torch.float32 else None
    launch_kernel(_split_kernel, (batch * kv_heads, splits),
        q, q.stride(0), q.stride(1),
        _as_words(k0), k1, k2, *k0.stride()[:3], *k1.stride()[:3],
        _as_words(v0), v1, v2, *v0.stride()[:3], *v1.stride()[:3],
        k_centroids, v_centroids,
        positions, query_position, 0 if window is None else window,
        part_acc, part_max, part_sum, out,
        slots, splits, scale * _LOG2E,
        KV_HEADS=kv_heads, GROUPS=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)),
        HEAD_DIM=head_dim, BLOCK_N=launch.block_n, CHUNK=chunk,
        K_FORMAT=_KIND_CODES[key_format.kind], K_BITS=key_format.bits,
        K_GROUP=key_format.group_size,
        V_FORMAT=_KIND_CODES[value_format.kind], V_BITS=value_format.bits,
        V_GROUP=value_format.group_size,
        HAS_WINDOW=window is not None,
        SKIP_MASKED=launch.skip_masked_blocks, PRECISION=precision, FINISH=finish,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_options(q),
    )  # fmt: skip
    if finish == _WRITE_OUTPUT:
        return out
    # The merge holds every split of a BLOCK_D slice of one head at once; slices of 64
    # give enough programs to merge in one wave.
    block_s = max(16, triton.next_power_of_2(splits))
    block_d = min(head_dim, 64, max(16, 8192 // block_s))
    launch_kernel(_merge_kernel, (batch * query_heads, head_dim // block_d),
        part_acc, part_max, part_sum, out, splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4, **pdl_options(q),
    )  # fmt: skip
    return out


def _padded(planes: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three plane slots for the kernel; unused ones repeat the first (never read)."""
    first = planes[0]
    second = planes[1] if len(planes) > 1 else first
    third = planes[2] if len(planes) > 2 else second
    return first, second, third


def _as_words(plane: torch.Tensor) -> torch.Tensor:
    """Packed uint32 codes as int32 (a pointer type every Triton build takes); the kernel
    bitcasts them back so shifts are logical."""
    return plane.view(torch.int32) if plane.dtype == torch.uint32 else plane


def decode_attention(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    positions: torch.Tensor,
    query_position: torch.Tensor,
    window: int | None,
    scale: float,
    config: LaunchConfig = LaunchConfig(),
) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token per sequence) over a cache's planes -> [B, Hq, D].

    `positions` [S] int64 gives each slot's absolute position (EMPTY_POSITION when empty),
    `query_position` is the query's absolute position as a 0-dim int64 tensor on q's device.
    Rotates q for codebook keys and un-rotates the output for codebook values. Output in
    q's dtype. Graph-capturable once warmed up (the first call caches small device tables).
    """
    query = rotate_query(q).to(q.dtype) if key_format.rotated else q
    out = decode_attention_rotated(
        query, key_planes, value_planes, key_format, value_format,
        positions, query_position, window, scale, config,
    )  # fmt: skip
    return unrotate_output(out).to(q.dtype) if value_format.rotated else out


def decode_planes(
    planes: Sequence[torch.Tensor], fmt: PlaneFormat, dtype: torch.dtype
) -> torch.Tensor:
    """Planes -> K or V [B, Hkv, S, D] in the un-rotated space, through the kv codecs."""
    if fmt.kind == "dense":
        return planes[0].to(dtype)
    if fmt.kind == "affine":
        return AffineCodec(fmt.bits, fmt.group_size).dequantize(planes).to(dtype)
    return decode_rotated(planes[0], planes[1], fmt.bits, dtype)


def decode_attention_reference(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    positions: torch.Tensor,
    query_position: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Torch reference of `decode_attention`: decode K/V to fp32, mask, softmax in fp32."""
    keys = decode_planes(key_planes, key_format, torch.float32)
    values = decode_planes(value_planes, value_format, torch.float32)
    batch, query_heads, head_dim = q.shape
    groups = query_heads // keys.shape[1]
    distance = query_position - positions
    visible = distance >= 0
    if window is not None:
        visible &= distance < window
    grouped = q.float().reshape(batch, keys.shape[1], groups, head_dim)
    scores = torch.einsum("bhgd,bhsd->bhgs", grouped, keys) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhgs,bhsd->bhgd", scores.softmax(dim=-1), values)
    return out.reshape(batch, query_heads, head_dim).to(q.dtype)


def formats_of(codec: object) -> tuple[PlaneFormat, PlaneFormat, int]:
    """(key format, value format, number of key planes) of a kv codec's planes."""
    if isinstance(codec, AffineCodec):
        fmt = PlaneFormat.affine(codec.bits, codec.group_size)
        return fmt, fmt, fmt.planes
    if isinstance(codec, TurboCodec):
        value = PlaneFormat.codebook(codec.value_bits)
        if codec.key_kind == "k":
            key = PlaneFormat.affine(codec.key_bits, GROUP)
        else:
            key = PlaneFormat.codebook(codec.key_bits)
        return key, value, key.planes
    if getattr(codec, "signature", lambda: "")() == "dense":
        return PlaneFormat.dense(), PlaneFormat.dense(), 1
    raise ValueError(f"no decode-attention format for codec {codec!r}")
