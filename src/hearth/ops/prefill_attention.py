"""Flash attention forward for prefill: many queries over K/V, masked by absolute positions.

Key n is visible to query m iff 0 <= kpos[n] < EMPTY_POSITION, kpos[n] <= qpos[m] and
(window is None or qpos[m] - kpos[n] < window). Rows with no visible key output 0.

One program per (query head, BLOCK_M queries, batch) streams K/V blocks with an online
softmax in fp32 (exp2). Work is bounded without assuming any order of positions:
* the wrapper summarises each key block's positions (min/max over valid slots, and the max
  counting empty slots as EMPTY_POSITION);
* a program scans those summaries once and loops only over the span of blocks that may hold
  a visible key for its queries, so causal prefill costs about half and a sliding window
  bounds the work when positions increase (the common case);
* inside the span, a block whose every key is visible to every query of the program skips
  the per-element mask; other blocks (diagonal, window edge, a ring buffer's rotated or
  empty slots) are masked element by element, which alone makes the result correct.

The torch reference (`prefill_attention_reference`) computes the same thing with a boolean
mask and an fp32 softmax; `prefill_attention` dispatches between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hearth.ops import kernel_enabled
from hearth.ops.launch import launch_kernel
from hearth.quant.kv_codecs import EMPTY_POSITION

_LOG2E = 1.4426950408889634
# Finite start for the running max: a row that has seen only masked keys keeps m = this and
# sum = 0, and exp2(m - m_new) stays finite instead of NaN (-inf - -inf).
_NO_SCORE = -1.0e30
# Positions inside the kernel's mask are int32 offsets from the program's lowest query
# position, clamped to ±_FAR: int32 compares are half the instructions of int64 ones. A
# window at least this wide is treated as no window (no sequence is that long).
_FAR = 2**30
_BOUNDS_CHUNK = 256  # key-block summaries scanned per step of a program's prologue
HEAD_DIMS = (16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of the kernel; None fields take `default_config`'s value for the shape."""

    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # Programs that share a query block, each producing 1/value_splits of the output's
    # columns: smaller accumulators (D=512 fills half the register file) for recomputing
    # Q·Kᵀ value_splits times.
    value_splits: int | None = None


def default_config(head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """Tiles that fit Hopper's 227 KB of shared memory and 64K registers per SM.

    The fp32 accumulator [BLOCK_M, D] lives in registers, and Q, K and V tiles (times the
    pipeline stages for K/V) in shared memory, so tiles shrink as D grows.
    """
    wide = dtype == torch.float32  # fp32 operands take twice the shared memory
    if head_dim <= 64:
        return LaunchConfig(128, 64, 4, 3, 1)
    if head_dim <= 128:
        return LaunchConfig(128, 32 if wide else 64, 8, 3 if not wide else 2, 1)
    if head_dim <= 256:
        return LaunchConfig(64 if wide else 128, 32 if wide else 64, 8, 2, 1)
    # D=512, bf16: 128x32 with two value splits (each program recomputes Q·Kᵀ for half the
    # output columns, halving the fp32 accumulator): faster than the unsplit 64x32, in the
    # kernel sweep and in long prefills from prefill graphs.
    if wide:
        return LaunchConfig(32, 32, 8, 1, 1)
    return LaunchConfig(128, 32, 8, 2, 2)


def _resolve(config: LaunchConfig | None, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    default = default_config(head_dim, dtype)
    if config is None:
        return default
    return LaunchConfig(
        config.block_m or default.block_m,
        config.block_n or default.block_n,
        config.num_warps or default.num_warps,
        config.num_stages or default.num_stages,
        config.value_splits or default.value_splits,
    )


# ---------------------------------------------------------------------------------------------
# Torch reference


def visible_keys(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Boolean [M, S]: which keys each query sees (empty and negative slots never)."""
    valid = (key_positions >= 0) & (key_positions < EMPTY_POSITION)
    distance = query_positions[:, None] - key_positions[None, :]
    visible = valid[None, :] & (distance >= 0)
    if window is not None:
        visible &= distance < window
    return visible


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q [B, Hq, M, D] over k/v [B, Hkv, S, D] in fp32 (GQA by grouping) -> q's dtype."""
    batch, heads, queries, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    visible = visible_keys(query_positions, key_positions, window)
    # Query head h reads KV head h // groups: the group's queries stack along the rows.
    grouped = q.float().reshape(batch, kv_heads, groups * queries, dim)
    scores = (grouped @ k.float().transpose(-1, -2)) * scale
    scores = scores.view(batch, kv_heads, groups, queries, keys).masked_fill(~visible, -math.inf)
    probs = torch.where(visible.any(-1, keepdim=True), scores.softmax(dim=-1), 0.0)
    out = probs.view(batch, kv_heads, groups * queries, keys) @ v.float()
    return out.reshape(batch, heads, queries, dim).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernel (defined only when Triton imports)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # Jitted code reads module globals only as constexprs.
    NO_SCORE = tl.constexpr(_NO_SCORE)
    EMPTY = tl.constexpr(EMPTY_POSITION)
    FAR = tl.constexpr(_FAR)

    @triton.jit
    def _key_block_span(
        BOUNDS, key_blocks, q_low, q_high, window,
        HAS_WINDOW: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        """[first, last) key blocks that may hold a key visible to a query in [q_low, q_high]."""
        # Scalar tensors, not Python ints, as they are loop-carried.
        first = tl.zeros([], tl.int32) + key_blocks
        last = tl.zeros([], tl.int32)
        for start in range(0, key_blocks, CHUNK):
            index = start + tl.arange(0, CHUNK)
            inside = index < key_blocks
            lowest = tl.load(BOUNDS + index, mask=inside, other=EMPTY)
            highest = tl.load(BOUNDS + key_blocks + index, mask=inside, other=-1)
            maybe = lowest <= q_high
            if HAS_WINDOW:
                maybe = maybe & (highest > q_low - window)
            first = tl.minimum(first, tl.min(tl.where(maybe, index, key_blocks), axis=0))
            last = tl.maximum(last, tl.max(tl.where(maybe, index + 1, 0), axis=0))
        return first, last

    @triton.jit
    def _prefill_attention_kernel(
        Q, K, V, OUT, QPOS, KPOS, BOUNDS,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        queries, keys, key_blocks, group, qk_scale, window,
        HAS_WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDS_CHUNK: tl.constexpr,
        VALUE_SPLITS: tl.constexpr, IEEE_DOTS: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0) // VALUE_SPLITS
        VALUE_DIM: tl.constexpr = HEAD_DIM // VALUE_SPLITS
        value_dims = (tl.program_id(0) % VALUE_SPLITS) * VALUE_DIM + tl.arange(0, VALUE_DIM)
        # Query blocks in reverse: with increasing positions the last ones see the most keys,
        # and starting the longest programs first balances the tail of the grid.
        m_block = tl.num_programs(1) - 1 - tl.program_id(1)
        batch = tl.program_id(2).to(tl.int64)
        kv_head = head // group

        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < queries
        dims = tl.arange(0, HEAD_DIM)
        qpos = tl.load(QPOS + rows, mask=row_ok, other=0)
        q_low = tl.min(tl.where(row_ok, qpos, EMPTY), axis=0)
        q_high = tl.max(tl.where(row_ok, qpos, -EMPTY), axis=0)
        rel_q = tl.where(row_ok, tl.minimum(qpos - q_low, FAR), 0).to(tl.int32)
        first, last = _key_block_span(
            BOUNDS, key_blocks, q_low, q_high, window, HAS_WINDOW, BOUNDS_CHUNK
        )

        q_base = Q + batch * stride_qb + head.to(tl.int64) * stride_qh
        q = tl.load(
            q_base + rows[:, None] * stride_qm + dims[None, :], mask=row_ok[:, None], other=0.0
        )
        k_base = K + batch * stride_kb + kv_head.to(tl.int64) * stride_kh
        v_base = V + batch * stride_vb + kv_head.to(tl.int64) * stride_vh

        m_i = tl.full([BLOCK_M], NO_SCORE, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, VALUE_DIM], tl.float32)
        for block in range(first, last):
            cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < keys
            k = tl.load(
                k_base + cols[:, None] * stride_kn + dims[None, :], mask=col_ok[:, None], other=0.0
            )
            if IEEE_DOTS:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
            # Every key valid, at or before the lowest query, and inside the highest query's
            # window: the whole tile is visible and needs no mask.
            lowest = tl.load(BOUNDS + block)
            highest_any = tl.load(BOUNDS + 2 * key_blocks + block)
            partial = highest_any > q_low
            if HAS_WINDOW:
                partial = partial | (q_high - lowest >= window)
            if partial:
                kpos = tl.load(KPOS + cols, mask=col_ok, other=EMPTY)
                valid = (kpos >= 0) & (kpos < EMPTY)
                rel_k = tl.minimum(tl.maximum(kpos - q_low, -FAR), FAR)
                rel_k = tl.where(valid, rel_k, FAR).to(tl.int32)
                visible = rel_k[None, :] <= rel_q[:, None]
                if HAS_WINDOW:
                    visible = visible & (rel_q[:, None] - rel_k[None, :] < window)
                s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_base + cols[:, None] * stride_vn + value_dims[None, :],
                mask=col_ok[:, None],
                other=0.0,
            )
            # Rescale, then accumulate into acc as the dot's own accumulator: no second
            # [BLOCK_M, D] fp32 tile in registers.
            acc = acc * alpha[:, None]
            if IEEE_DOTS:
                acc = tl.dot(p, v, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new

        # Rows that saw no visible key have l = 0 and acc = 0: they output 0.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_base = OUT + batch * stride_ob + head.to(tl.int64) * stride_oh
        tl.store(
            o_base + rows[:, None] * stride_om + value_dims[None, :],
            out.to(OUT.dtype.element_ty),
            mask=row_ok[:, None],
        )


def key_block_bounds(key_positions: torch.Tensor, block_n: int) -> torch.Tensor:
    """int64 [3, blocks]: per block of `block_n` keys, the lowest and highest valid position
    (EMPTY_POSITION and -1 when none is valid) and the highest counting any invalid slot
    (padding past the end included) as EMPTY_POSITION."""
    blocks = -(-key_positions.shape[0] // block_n)
    padding = blocks * block_n - key_positions.shape[0]
    grid = F.pad(key_positions, (0, padding), value=EMPTY_POSITION).view(blocks, block_n)
    valid = (grid >= 0) & (grid < EMPTY_POSITION)
    lowest = torch.where(valid, grid, EMPTY_POSITION).amin(dim=1)
    highest = torch.where(valid, grid, -1).amax(dim=1)
    highest_any = torch.where(valid, grid, EMPTY_POSITION).amax(dim=1)
    return torch.stack((lowest, highest, highest_any)).contiguous()


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B, Hq, M, D], k/v [B, Hkv, S, D]; got {q.shape}, {k.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)} (GQA)")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {q.shape[3]}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    scale: float,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The Triton kernel: q [B, Hq, M, D], k/v [B, Hkv, S, D] -> [B, Hq, M, D] in q's dtype.

    Any strides but the last dimension's; positions are int64 [M] and [S] absolute
    positions (within one query block they must lie less than 2^30 apart).
    """
    _check_shapes(q, k, v)
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    batch, heads, queries, dim = q.shape
    keys = k.shape[2]
    tiles = _resolve(config, dim, q.dtype)
    # Stored token-major ([B, M, H, D], returned as its [B, H, M, D] view), the layout the
    # output projection reads: the caller's transpose and reshape are then views, not a copy.
    out = torch.empty(batch, queries, heads, dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    if queries == 0:
        return out
    query_positions = query_positions.to(torch.int64).contiguous()
    key_positions = key_positions.to(torch.int64).contiguous()
    bounds = key_block_bounds(key_positions, tiles.block_n)
    has_window = window is not None and window < _FAR
    grid = (heads * tiles.value_splits, triton.cdiv(queries, tiles.block_m), batch)
    launch_kernel(_prefill_attention_kernel, grid,
        q, k, v, out, query_positions, key_positions, bounds,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        queries, keys, bounds.shape[1], heads // k.shape[1],
        scale * _LOG2E, window if has_window else 0,
        HAS_WINDOW=has_window, HEAD_DIM=dim,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BOUNDS_CHUNK=_BOUNDS_CHUNK,
        VALUE_SPLITS=tiles.value_splits, IEEE_DOTS=q.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    return out


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Masked attention of q [B, Hq, M, D] over k/v [B, Hkv, S, D]: Triton on CUDA, else
    the torch reference. See the module docstring for the visibility rule."""
    if kernel_enabled(q):
        return prefill_attention_triton(q, k, v, query_positions, key_positions, window, scale)
    return prefill_attention_reference(q, k, v, query_positions, key_positions, window, scale)
