"""Split-K ("flash-decoding") attention of one query token over a KV cache in any layout.

One Triton kernel reads K and V straight from a cache's planes: dense tensors, MLX affine
codes (packed/scales/biases, groups along head_dim) or TurboQuant codebook codes (packed
codes + fp16 σ per 32-group, in the rotated space). The storage format of K and of V are
compile-time switches, so every cache kind is served by the same code.

Work split: one program per (batch, KV head, split of the slots); it holds all query heads
of its KV head (GQA), so each K/V byte is read once. Each split writes (max, sum, acc) in
fp32; a second small kernel merges the splits. The number of splits depends only on shapes
and the device, never on data, and the query position is read on the device, so a call can
be captured in a CUDA graph and replayed as the cache fills.

Masking uses each slot's absolute position (`positions`, EMPTY_POSITION for empty slots):
slot n is visible iff pos[n] <= qpos and (window is None or qpos - pos[n] < window). Blocks
with no visible slot are skipped without reading K/V (empty tails of a static cache).

Rotation: codebook keys are dot-products in the rotated space, so the wrapper rotates the
query once; codebook values are averaged in the rotated space and the wrapper un-rotates
the output once (deferred V), instead of un-rotating every stored value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from hearth.kv.cache import EMPTY_POSITION
from hearth.kv.quantized import AffineCodec
from hearth.kv.turbo import CODEBOOKS, GROUP, TurboCodec, decode_rotated, hadamard, random_signs

DENSE, AFFINE, CODEBOOK = 0, 1, 2
_KIND_CODES = {"dense": DENSE, "affine": AFFINE, "codebook": CODEBOOK}
_PLANES = {"dense": 1, "affine": 3, "codebook": 2}
_LOG2E = 1.4426950408889634
# Finite start for the running max: a split whose slots are all masked keeps m = this and
# sum = 0, and exp2(m - m_new) stays 1 instead of NaN (-inf - -inf).
_NO_SCORE = -1.0e30


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
    skip_masked_blocks: bool = True  # branch over blocks with no visible slot


# ---------------------------------------------------------------------------------------------
# Rotation helpers (device-cached: no host-to-device copy on the hot path, nor in a graph)


@cache
def _signs(dim: int, device: torch.device) -> torch.Tensor:
    return random_signs(dim).to(device)


def rotate_query(q: torch.Tensor) -> torch.Tensor:
    """`turbo.rotate(q)` in fp32, with the sign diagonal kept on q's device."""
    return hadamard(q.float() * _signs(q.shape[-1], q.device))


def unrotate_output(y: torch.Tensor) -> torch.Tensor:
    """`turbo.unrotate(y)` in fp32, with the sign diagonal kept on y's device."""
    return hadamard(y) * _signs(y.shape[-1], y.device)


@cache
def _centroids(bits: int, device: torch.device) -> torch.Tensor:
    return CODEBOOKS[bits][0].to(device=device, dtype=torch.float32)


@cache
def _programs_wanted(device: torch.device) -> int:
    """About two programs per SM keep every SM streaming; a fixed count off the GPU."""
    if device.type != "cuda":
        return 16
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


# ---------------------------------------------------------------------------------------------
# Triton kernels (defined only when Triton imports)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # Jitted code reads module globals only as constexprs.
    NO_SCORE = tl.constexpr(_NO_SCORE)
    EMPTY = tl.constexpr(EMPTY_POSITION)

    @triton.jit
    def _unpack_codes(
        words,
        rows,
        row_mask,
        stride_slot,
        BITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Codes [BLOCK_N, HEAD_DIM] (uint32) of the rows' LSB-first bit streams."""
        if 32 % BITS == 0:
            # Whole codes per word: load each word once and fan it out with shifts.
            PER_WORD: tl.constexpr = 32 // BITS
            WORDS: tl.constexpr = HEAD_DIM // PER_WORD
            offsets = rows[:, None] * stride_slot + tl.arange(0, WORDS)[None, :]
            packed = tl.load(words + offsets, mask=row_mask[:, None], other=0)
            packed = packed.to(tl.uint32, bitcast=True)
            shifts = (tl.arange(0, PER_WORD) * BITS).to(tl.uint32)
            codes = (packed[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
            codes = tl.reshape(codes, (BLOCK_N, HEAD_DIM))
        else:
            # Codes straddle words (3-bit): read the word holding each code's low bits and,
            # where it spills over, the next word's low bits.
            bit = tl.arange(0, HEAD_DIM) * BITS
            word = bit // 32
            shift = (bit % 32).to(tl.uint32)
            spills = (bit % 32) + BITS > 32
            base = words + rows[:, None] * stride_slot + word[None, :]
            low = tl.load(base, mask=row_mask[:, None], other=0).to(tl.uint32, bitcast=True)
            high = tl.load(base + 1, mask=row_mask[:, None] & spills[None, :], other=0)
            high = high.to(tl.uint32, bitcast=True)
            codes = (low >> shift[None, :]) | (high << ((32 - shift) % 32)[None, :])
            codes = codes & ((1 << BITS) - 1)
        return codes

    @triton.jit
    def _decode_tile(
        data,
        aux,
        aux2,
        centroids,
        rows,
        row_mask,
        stride_data,
        stride_aux,
        FORMAT: tl.constexpr,
        BITS: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
    ):
        """Rows of one KV head's planes as a [BLOCK_N, HEAD_DIM] tile in OUT_DTYPE."""
        if FORMAT == 0:
            offsets = rows[:, None] * stride_data + tl.arange(0, HEAD_DIM)[None, :]
            tile = tl.load(data + offsets, mask=row_mask[:, None], other=0.0).to(OUT_DTYPE)
        else:
            GROUPS: tl.constexpr = HEAD_DIM // GROUP_SIZE
            codes = _unpack_codes(data, rows, row_mask, stride_data, BITS, HEAD_DIM, BLOCK_N)
            group_offsets = rows[:, None] * stride_aux + tl.arange(0, GROUPS)[None, :]
            scale = tl.load(aux + group_offsets, mask=row_mask[:, None], other=0.0)
            scale = scale.to(tl.float32)[:, :, None]
            if FORMAT == 1:
                bias = tl.load(aux2 + group_offsets, mask=row_mask[:, None], other=0.0)
                levels = tl.reshape(codes.to(tl.float32), (BLOCK_N, GROUPS, GROUP_SIZE))
                grouped = levels * scale + bias.to(tl.float32)[:, :, None]
            else:
                # The codebook has at most 16 entries: the gather stays in L1.
                levels = tl.load(centroids + codes.to(tl.int32))
                grouped = tl.reshape(levels, (BLOCK_N, GROUPS, GROUP_SIZE)) * scale
            tile = tl.reshape(grouped, (BLOCK_N, HEAD_DIM)).to(OUT_DTYPE)
        return tile

    @triton.jit
    def _attend_block(
        query,
        running_max,
        running_sum,
        acc,
        rows,
        visible,
        scale_log2,
        k0,
        k1,
        k2,
        k_centroids,
        stride_k0s,
        stride_k1s,
        v0,
        v1,
        v2,
        v_centroids,
        stride_v0s,
        stride_v1s,
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
        """One online-softmax step (base 2) of the query heads over a block of slots."""
        dtype = query.dtype
        keys = _decode_tile(
            k0, k1, k2, k_centroids, rows, visible, stride_k0s, stride_k1s,
            K_FORMAT, K_BITS, K_GROUP, HEAD_DIM, BLOCK_N, dtype,
        )  # fmt: skip
        scores = tl.dot(query, tl.trans(keys), input_precision=PRECISION) * scale_log2
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp2(running_max - new_max)
        weights = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, axis=1)
        values = _decode_tile(
            v0, v1, v2, v_centroids, rows, visible, stride_v0s, stride_v1s,
            V_FORMAT, V_BITS, V_GROUP, HEAD_DIM, BLOCK_N, dtype,
        )  # fmt: skip
        acc = acc * correction[:, None] + tl.dot(
            weights.to(dtype), values, input_precision=PRECISION
        )
        return new_max, running_sum, acc

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
    ):
        batch_head = tl.program_id(0)
        split = tl.program_id(1)
        batch = batch_head // KV_HEADS
        kv_head = batch_head % KV_HEADS

        group = tl.arange(0, BLOCK_G)
        group_mask = group < GROUPS
        heads = kv_head * GROUPS + group
        dims = tl.arange(0, HEAD_DIM)
        query = tl.load(
            q + batch * stride_qb + heads[:, None] * stride_qh + dims[None, :],
            mask=group_mask[:, None],
            other=0.0,
        )
        qpos = tl.load(query_position)

        k0 += batch * stride_k0b + kv_head * stride_k0h
        k1 += batch * stride_k1b + kv_head * stride_k1h
        k2 += batch * stride_k1b + kv_head * stride_k1h
        v0 += batch * stride_v0b + kv_head * stride_v0h
        v1 += batch * stride_v1b + kv_head * stride_v1h
        v2 += batch * stride_v1b + kv_head * stride_v1h

        running_max = tl.full([BLOCK_G], NO_SCORE, tl.float32)
        running_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
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
                        query, running_max, running_sum, acc, rows, visible, scale_log2,
                        k0, k1, k2, k_centroids, stride_k0s, stride_k1s,
                        v0, v1, v2, v_centroids, stride_v0s, stride_v1s,
                        HEAD_DIM, BLOCK_N, K_FORMAT, K_BITS, K_GROUP,
                        V_FORMAT, V_BITS, V_GROUP, PRECISION,
                    )  # fmt: skip
            else:
                running_max, running_sum, acc = _attend_block(
                    query, running_max, running_sum, acc, rows, visible, scale_log2,
                    k0, k1, k2, k_centroids, stride_k0s, stride_k1s,
                    v0, v1, v2, v_centroids, stride_v0s, stride_v1s,
                    HEAD_DIM, BLOCK_N, K_FORMAT, K_BITS, K_GROUP,
                    V_FORMAT, V_BITS, V_GROUP, PRECISION,
                )  # fmt: skip

        rows_out = (batch * KV_HEADS * GROUPS + heads) * splits + split
        tl.store(part_max + rows_out, running_max, mask=group_mask)
        tl.store(part_sum + rows_out, running_sum, mask=group_mask)
        tl.store(
            part_acc + rows_out[:, None] * HEAD_DIM + dims[None, :], acc, mask=group_mask[:, None]
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
    ):
        """out[row, dblock] = Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) sum_s over the splits."""
        row = tl.program_id(0)
        dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        index = tl.arange(0, BLOCK_S)
        inside = index < splits
        maxima = tl.load(part_max + row * splits + index, mask=inside, other=NO_SCORE)
        sums = tl.load(part_sum + row * splits + index, mask=inside, other=0.0)
        weight = tl.exp2(maxima - tl.max(maxima, axis=0))
        partial = tl.load(
            part_acc + (row * splits + index)[:, None] * HEAD_DIM + dims[None, :],
            mask=inside[:, None],
            other=0.0,
        )
        # No visible slot at all (never the case for a real query: it sees itself) gives 0.
        denominator = tl.maximum(tl.sum(weight * sums, axis=0), 1.0e-30)
        result = tl.sum(weight[:, None] * partial, axis=0) / denominator
        tl.store(out + row * HEAD_DIM + dims, result.to(out.dtype.element_ty))


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
    slots: int, programs: int, block_n: int, device: torch.device, splits: int | None
) -> tuple[int, int]:
    """(slots per split, splits): enough programs to fill the GPU, at least a block each.

    Slots per split is a power-of-two number of blocks and a compile-time constant, so a
    kernel is compiled for a handful of values however the cache length varies.
    """
    wanted = splits or max(1, -(-_programs_wanted(device) // programs))
    blocks = -(-slots // block_n)
    per_split = -(-blocks // min(wanted, blocks))
    chunk = block_n * triton.next_power_of_2(per_split)
    return chunk, -(-slots // chunk)


def _default_block_n(head_dim: int) -> int:
    return max(16, min(64, 16384 // head_dim))


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
    """The raw kernel pair: q must already be rotated for codebook keys, and the output
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
    block_n = config.block_n or _default_block_n(head_dim)
    chunk, splits = _split_plan(slots, batch * kv_heads, block_n, q.device, config.splits)

    device = q.device
    part_acc = torch.empty(batch * query_heads * splits, head_dim, device=device)
    part_max = torch.empty(batch * query_heads * splits, device=device)
    part_sum = torch.empty_like(part_max)
    k0, k1, k2 = _padded(key_planes)
    v0, v1, v2 = _padded(value_planes)
    k_centroids = _centroids(key_format.bits if key_format.rotated else 1, device)
    v_centroids = _centroids(value_format.bits if value_format.rotated else 1, device)
    # fp32 operands would default to TF32 on the GPU; half types take no precision option.
    precision = "ieee" if q.dtype == torch.float32 else None
    _split_kernel[(batch * kv_heads, splits)](
        q, q.stride(0), q.stride(1),
        _as_words(k0), k1, k2, *k0.stride()[:3], *k1.stride()[:3],
        _as_words(v0), v1, v2, *v0.stride()[:3], *v1.stride()[:3],
        k_centroids, v_centroids,
        positions, query_position, 0 if window is None else window,
        part_acc, part_max, part_sum,
        slots, splits, scale * _LOG2E,
        KV_HEADS=kv_heads, GROUPS=groups, BLOCK_G=max(16, triton.next_power_of_2(groups)),
        HEAD_DIM=head_dim, BLOCK_N=block_n, CHUNK=chunk,
        K_FORMAT=_KIND_CODES[key_format.kind], K_BITS=key_format.bits,
        K_GROUP=key_format.group_size,
        V_FORMAT=_KIND_CODES[value_format.kind], V_BITS=value_format.bits,
        V_GROUP=value_format.group_size,
        HAS_WINDOW=window is not None,
        SKIP_MASKED=config.skip_masked_blocks, PRECISION=precision,
        num_warps=config.num_warps or (4 if head_dim <= 128 else 8),
        num_stages=config.num_stages or 2,
    )  # fmt: skip
    out_dtype = torch.float32 if value_format.rotated else q.dtype
    out = torch.empty(batch, query_heads, head_dim, dtype=out_dtype, device=device)
    # The merge holds every split of a BLOCK_D slice of one head at once.
    block_s = max(16, triton.next_power_of_2(splits))
    block_d = min(head_dim, max(16, 8192 // block_s))
    _merge_kernel[(batch * query_heads, head_dim // block_d)](
        part_acc, part_max, part_sum, out, splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=block_s, num_warps=4,
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
