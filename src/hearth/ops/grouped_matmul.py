"""Grouped ("MoE") expert matmul for many tokens: each expert's rows as tiles of tensor-core dots.

The gathered GEMV (affine_matmul.py) runs one dot product per (token, slot) pair and reads the
chosen expert's weight once per pair: right for decode, but at prefill it rereads every expert's
weight hundreds of times and never uses the tensor cores. Here the pairs are sorted by expert on
the device (`plan_experts`: a counting sort by expert, no host sync) and laid out in tiles of
BLOCK_M rows, each expert's segment padded to whole tiles, so every tile belongs to one expert.
One program multiplies a tile by a BLOCK_N slice of its expert's weight ``[N, K]`` with
``tl.dot`` (fp32 accumulation), optionally scales each row (the routing weight) and stores the
rows back in (token, slot) order. The grid is sized by an upper bound on the tile count
(``ceil(pairs / BLOCK_M) + experts``); tiles past the last expert's segment exit at once.

MLX affine-packed experts (bits 4 and 8) are read as packed words: each B tile is unpacked in
registers and dequantized with the same two roundings as ``dequantize_affine`` (``q * scale``
then ``+ bias``, each in the scales' dtype) before the dot, so the kernel multiplies exactly the
reference's weights. Only the float path is needed by bf16 checkpoints; the packed path reads
four (4-bit) or two (8-bit) times fewer weight bytes.

With ``geglu=True`` the experts are a stacked gate/up and a program keeps two accumulators,
gate rows n and up rows N + n, and stores ``gelu_tanh(gate) * up`` rounded as the product
then `activation.gelu_tanh_mul` would round it: the [pairs, 2N] product is never written.

Each entry point has a torch reference that loops over experts (one ``F.linear`` per expert).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from hearth.ops import HAS_TRITON, expert_plan, kernel_enabled
from hearth.ops.activation import gelu_tanh_mul_reference
from hearth.ops.launch import launch_kernel
from hearth.quant import mlx as mlx_affine

KERNEL_BITS = (4, 8)
WORD_BITS = 32
# Rows per tile. Small tiles waste less padding when experts get few rows (short prompts,
# where the weights' bytes, not the FLOPs, bound the time); 64 rows fill a Hopper warpgroup's
# MMA. Each expert's segment wastes half a tile on average.
SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
# Two warpgroups' MMA: each weight tile is read (and, packed, dequantized) once for twice
# the rows, which pays where experts get many rows (TALL_BLOCK_MIN_ROWS); 256-row tiles were
# slower.
TALL_BLOCK_M = 128
# Mean rows per expert from which LARGE_BLOCK_M (TALL_BLOCK_M) tiles pay for their padding.
LARGE_BLOCK_MIN_ROWS = 32
TALL_BLOCK_MIN_ROWS = 128
TALL_BLOCK_MIN_ROWS_PACKED = 64


@dataclass(frozen=True)
class ExpertPlan:
    """Where each (token, slot) pair goes in the expert-sorted, tile-padded row order.

    `rows[i]` is the flat pair index (``token * top_k + slot``) at sorted row i, or `pairs`
    on padding; `tile_experts[t]` is the expert of tile t, or the expert count on tiles past
    the last segment (the grid's upper bound). Both stay on the device.
    """

    rows: Tensor
    tile_experts: Tensor
    block_m: int
    num_experts: int
    tokens: int
    top_k: int

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k

    @property
    def tiles(self) -> int:
        return self.tile_experts.numel()


def default_block_m(pairs: int, num_experts: int, packed: bool = False) -> int:
    """Tile height from the mean rows per expert (host ints only: no sync); `packed`: MLX
    affine weights, whose dequantized tiles pay for taller tiles sooner."""
    tall_from = TALL_BLOCK_MIN_ROWS_PACKED if packed else TALL_BLOCK_MIN_ROWS
    if pairs >= tall_from * num_experts:
        return TALL_BLOCK_M
    return LARGE_BLOCK_M if pairs >= LARGE_BLOCK_MIN_ROWS * num_experts else SMALL_BLOCK_M


def _tile_bound(pairs: int, num_experts: int, block_m: int) -> int:
    """Tiles the grid allots: each expert that has rows adds at most one partial tile."""
    return -(-pairs // block_m) + min(num_experts, pairs)


def _plan_shape(
    expert_ids: Tensor, num_experts: int, block_m: int | None
) -> tuple[int, int, int, int]:
    """(tokens, top_k, block_m, tiles) of a plan for ``expert_ids [T, top_k]``."""
    if expert_ids.dim() != 2:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} must be [tokens, top_k]")
    tokens, top_k = expert_ids.shape
    pairs = tokens * top_k
    block_m = block_m or default_block_m(pairs, num_experts)
    return tokens, top_k, block_m, _tile_bound(pairs, num_experts, block_m)


def plan_experts(expert_ids: Tensor, num_experts: int, block_m: int | None = None) -> ExpertPlan:
    """Sort the pairs of ``expert_ids [T, top_k]`` by expert into tiles of `block_m` rows: a
    counting sort in three Triton kernels on CUDA (`expert_plan`; ~20 torch ops otherwise),
    torch ops elsewhere."""
    if not kernel_enabled(expert_ids) or expert_ids.numel() == 0:
        return plan_experts_reference(expert_ids, num_experts, block_m)
    tokens, top_k, block_m, tiles = _plan_shape(expert_ids, num_experts, block_m)
    flat = expert_ids.reshape(-1)
    rows, tile_experts = expert_plan.sort_pairs_triton(flat, num_experts, block_m, tiles)
    return ExpertPlan(rows, tile_experts, block_m, num_experts, tokens, top_k)


def plan_experts_reference(
    expert_ids: Tensor, num_experts: int, block_m: int | None = None
) -> ExpertPlan:
    """`plan_experts` from torch ops: a stable argsort and a count per expert (no host sync)."""
    tokens, top_k, block_m, tiles = _plan_shape(expert_ids, num_experts, block_m)
    pairs = tokens * top_k
    device = expert_ids.device
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    # scatter_add_, not bincount: CUDA's bincount reads the max on the host (a sync).
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    sorted_experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    rank = torch.arange(pairs, device=device) - first_of_expert[sorted_experts]
    destination = (padded_end - padded)[sorted_experts] + rank
    rows = torch.full((tiles * block_m,), pairs, dtype=torch.int32, device=device)
    rows[destination] = order.int()
    tile_starts = torch.arange(tiles, device=device) * block_m
    tile_experts = torch.searchsorted(padded_end, tile_starts, right=True).int()
    return ExpertPlan(rows, tile_experts, block_m, num_experts, tokens, top_k)


# ---------------------------------------------------------------------------------------------
# Torch references: one F.linear per expert over the rows that chose it


def _pair_rows(x: Tensor, tokens: int, top_k: int) -> Tensor:
    """``[T * top_k, K]``: x ``[T, K]`` shared by a token's slots, or ``[T, top_k, K]``."""
    if x.dim() == 2:
        x = x[:, None, :].expand(tokens, top_k, x.shape[-1])
    if x.shape[:2] != (tokens, top_k):
        raise ValueError(f"x {tuple(x.shape)} does not match expert_ids [{tokens}, {top_k}]")
    return x.reshape(tokens * top_k, x.shape[-1])


def _output_width(weight_rows: int, row_scale: Tensor | None, geglu: bool) -> int:
    """Output columns of experts with `weight_rows` rows: half of a stacked gate/up's with
    `geglu`, whose outputs no row scale multiplies (it would scale gate and up apart)."""
    if not geglu:
        return weight_rows
    if weight_rows % 2:
        raise ValueError(f"a stacked gate/up has an even number of rows, not {weight_rows}")
    if row_scale is not None:
        raise ValueError("a GeGLU output takes no row scale")
    return weight_rows // 2


def _expert_loop(
    x: Tensor, expert_ids: Tensor, row_scale: Tensor | None, geglu: bool, weight_of
) -> Tensor:
    tokens, top_k = expert_ids.shape
    rows = _pair_rows(x, tokens, top_k)
    flat = expert_ids.reshape(-1)
    out: Tensor | None = None
    for expert in flat.unique().tolist():
        chosen = (flat == expert).nonzero()[:, 0]
        y = F.linear(rows[chosen], weight_of(expert).to(x.dtype))
        if row_scale is not None:
            y = (y.float() * row_scale.reshape(-1)[chosen, None]).to(x.dtype)
        if out is None:
            out = y.new_zeros(tokens * top_k, y.shape[-1])
        out[chosen] = y
    assert out is not None, "no pairs"
    out = out.view(tokens, top_k, -1)
    return gelu_tanh_mul_reference(out) if geglu else out


def grouped_expert_matmul_reference(
    x: Tensor,
    weight: Tensor,
    expert_ids: Tensor,
    row_scale: Tensor | None = None,
    geglu: bool = False,
) -> Tensor:
    """``[T, top_k, N]``: each pair's row of x times its expert of ``weight [E, N, K]``,
    times ``row_scale [T, top_k]`` (fp32) when given. With `geglu` the experts are a stacked
    gate/up ``[E, 2N, K]`` and the output ``gelu_tanh_mul`` of that product."""
    _output_width(weight.shape[1], row_scale, geglu)
    return _expert_loop(x, expert_ids, row_scale, geglu, lambda expert: weight[expert])


def grouped_affine_expert_matmul_reference(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
    expert_ids: Tensor,
    bits: int,
    group_size: int,
    row_scale: Tensor | None = None,
    geglu: bool = False,
) -> Tensor:
    """As `grouped_expert_matmul_reference`, each expert dequantized exactly as mlx does."""
    _output_width(packed.shape[1], row_scale, geglu)

    def weight_of(expert: int) -> Tensor:
        return mlx_affine.dequantize_affine(
            packed[expert], scales[expert], biases[expert], bits, group_size
        )

    return _expert_loop(x, expert_ids, row_scale, geglu, weight_of)


# ---------------------------------------------------------------------------------------------
# Dispatchers: the kernel on CUDA, the reference otherwise


def grouped_expert_matmul(
    x: Tensor,
    weight: Tensor,
    expert_ids: Tensor,
    row_scale: Tensor | None = None,
    plan: ExpertPlan | None = None,
    geglu: bool = False,
) -> Tensor:
    """``[T, top_k, N]`` of float experts ``[E, N, K]`` (`geglu`: see the reference); `plan`
    may be shared between calls with the same ids (gate/up, then down)."""
    if kernel_enabled(x):
        return grouped_expert_matmul_triton(x, weight, expert_ids, row_scale, plan, geglu=geglu)
    return grouped_expert_matmul_reference(x, weight, expert_ids, row_scale, geglu)


def grouped_affine_expert_matmul(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
    expert_ids: Tensor,
    bits: int,
    group_size: int,
    row_scale: Tensor | None = None,
    plan: ExpertPlan | None = None,
    geglu: bool = False,
) -> Tensor:
    """``[T, top_k, N]`` of MLX-packed experts, read packed on CUDA for bits 4 and 8."""
    if kernel_enabled(x) and bits in KERNEL_BITS:
        return grouped_affine_expert_matmul_triton(
            x, packed, scales, biases, expert_ids, bits, group_size, row_scale, plan, geglu=geglu
        )
    return grouped_affine_expert_matmul_reference(
        x, packed, scales, biases, expert_ids, bits, group_size, row_scale, geglu
    )


# ---------------------------------------------------------------------------------------------
# Triton kernel

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops.activation import geglu

    _KERNEL_WORD_BITS = tl.constexpr(WORD_BITS)

    @triton.jit
    def _dequantized_tile(
        packed_ptr,
        scales_ptr,
        biases_ptr,
        n,
        n_ok,
        k_start,
        K: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """W[n, k_start : k_start + BLOCK_K] in the scales' dtype, rounded as mlx rounds it."""
        CODES: tl.constexpr = _KERNEL_WORD_BITS // BITS
        BLOCK_KW: tl.constexpr = BLOCK_K // CODES
        TILE_GROUPS: tl.constexpr = (BLOCK_K + GROUP - 1) // GROUP
        GROUP_IN_TILE: tl.constexpr = BLOCK_K // TILE_GROUPS
        MASK: tl.constexpr = (1 << BITS) - 1
        word = k_start // CODES + tl.arange(0, BLOCK_KW)
        words = tl.load(
            packed_ptr + n.to(tl.int64)[:, None] * (K // CODES) + word[None, :],
            mask=n_ok[:, None] & (word < K // CODES)[None, :],
            other=0,
        )
        shifts = tl.arange(0, CODES) * BITS
        codes = (words[:, :, None] >> shifts[None, None, :]) & MASK
        # code | 0x4B000000 is the float 2**23 + code: exact, and cheaper than a conversion.
        q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        q = tl.reshape(q, [BLOCK_N, TILE_GROUPS, GROUP_IN_TILE])
        g = k_start // GROUP + tl.arange(0, TILE_GROUPS)
        group_ok = n_ok[:, None] & (g < K // GROUP)[None, :]
        group_at = n.to(tl.int64)[:, None] * (K // GROUP) + g[None, :]
        scale = tl.load(scales_ptr + group_at, mask=group_ok, other=0)
        bias = tl.load(biases_ptr + group_at, mask=group_ok, other=0)
        # A code times a scale is exact in fp32, so each line rounds once, as mlx does.
        weight = (q * scale.to(tl.float32)[:, :, None]).to(scale.dtype)
        weight = (weight.to(tl.float32) + bias.to(tl.float32)[:, :, None]).to(scale.dtype)
        return tl.reshape(weight, [BLOCK_N, BLOCK_K])

    @triton.jit
    def _weight_tile(
        weight_ptr,
        scales_ptr,
        biases_ptr,
        n,
        n_ok,
        step,
        K: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Rows `n` of one expert's weight at K step `step`: float (BITS = 0) or dequantized."""
        k_start = step * BLOCK_K
        if BITS == 0:
            k = k_start + tl.arange(0, BLOCK_K)
            rows = weight_ptr + n.to(tl.int64)[:, None] * K
            tile = tl.load(rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0)
        else:
            tile = _dequantized_tile(
                weight_ptr,
                scales_ptr,
                biases_ptr,
                n,
                n_ok,
                k_start,
                K,
                BITS,
                GROUP,
                BLOCK_N,
                BLOCK_K,
            )
        return tile

    @triton.jit
    def _dot(a, b, acc, FP32_DOT: tl.constexpr):
        """acc + a @ b^T, b in a's dtype (fp32 activations: exact products, not TF32)."""
        precision: tl.constexpr = "ieee" if FP32_DOT else None
        return tl.dot(a, tl.trans(b.to(a.dtype)), acc, input_precision=precision)

    @triton.jit
    def _grouped_matmul_kernel(
        x_ptr,
        weight_ptr,
        scales_ptr,
        biases_ptr,
        rows_ptr,
        tile_experts_ptr,
        row_scale_ptr,
        out_ptr,
        PAIRS,
        N,
        TILES,
        stride_xm,
        stride_om,
        X_ROWS_PER_PAIR,
        NUM_EXPERTS,
        K: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        HAS_ROW_SCALE: tl.constexpr,
        GEGLU: tl.constexpr,
        FP32_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """out[p, n] = x[p // X_ROWS_PER_PAIR] . W_e[n] (* row_scale[p]) for each pair p of a
        tile of expert e; W is float ``[E, N, K]`` (BITS = 0) or packed. With GEGLU, W_e is a
        stacked gate/up ``[2N, K]`` and out[p, n] = gelu_tanh(x . W_e[n]) * (x . W_e[N + n]),
        each dot rounded as stored, then as `activation.gelu_tanh_mul` rounds. 1-D grid,
        swizzled so that GROUP_M tiles (mostly of one expert) share each weight slice while it
        is in L2."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(TILES - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_rows
        pid_n = (pid % in_group) // group_rows
        expert = tl.load(tile_experts_ptr + pid_m)
        if expert >= NUM_EXPERTS:
            return
        expert = expert.to(tl.int64)

        pair = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_ok = pair < PAIRS
        x_rows = x_ptr + (pair // X_ROWS_PER_PAIR).to(tl.int64)[:, None] * stride_xm
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        weight_rows = 2 * N if GEGLU else N  # an expert's rows: gate then up with GEGLU
        if BITS == 0:
            weight_ptr += expert * weight_rows * K
        else:
            CODES: tl.constexpr = _KERNEL_WORD_BITS // BITS
            weight_ptr += expert * weight_rows * (K // CODES)
            scales_ptr += expert * weight_rows * (K // GROUP)
            biases_ptr += expert * weight_rows * (K // GROUP)

        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # GEGLU only
        for step in range((K + BLOCK_K - 1) // BLOCK_K):
            k = step * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < K
            a = tl.load(x_rows + k[None, :], mask=pair_ok[:, None] & k_ok[None, :], other=0)
            b = _weight_tile(
                weight_ptr,
                scales_ptr,
                biases_ptr,
                n,
                n_ok,
                step,
                K,
                BITS,
                GROUP,
                BLOCK_N,
                BLOCK_K,
            )
            acc = _dot(a, b, acc, FP32_DOT)
            if GEGLU:
                b = _weight_tile(
                    weight_ptr,
                    scales_ptr,
                    biases_ptr,
                    n + N,
                    n_ok,
                    step,
                    K,
                    BITS,
                    GROUP,
                    BLOCK_N,
                    BLOCK_K,
                )
                up_acc = _dot(a, b, up_acc, FP32_DOT)

        if GEGLU:
            dtype = out_ptr.dtype.element_ty
            acc = geglu(acc.to(dtype), up_acc.to(dtype)).to(tl.float32)
        if HAS_ROW_SCALE:
            acc *= tl.load(row_scale_ptr + pair, mask=pair_ok, other=0)[:, None]
        out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & n_ok[None, :])

    # -----------------------------------------------------------------------------------------
    # Launch configurations

    GROUP_M = 8
    # (BLOCK_N, BLOCK_K, warps, stages) per tile height, timed by
    # benchmarks/gpu_kernels_grouped.py. Short tiles (mma.sync) want long K steps; tiles of 64+
    # rows run on Hopper's warpgroup MMA. 256 x 64 on 8 warps with 4 stages beat the others on
    # 26B-A4B's long prefills in a sweep of 36 launches (`benchmarks/gpu_grouped_sweep.py`).
    _SHORT_TILES = ((64, 128, 4, 3), (128, 64, 4, 3))
    _TALL_TILES = ((128, 64, 4, 4), (128, 64, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4))
    # With GEGLU a program holds two accumulators (gate and up) and reads two weight tiles a
    # step: tall tiles of half the width, at most 128 fp32 accumulator registers a thread.
    _GEGLU_TALL_TILES = ((64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4))
    _CONFIGS = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps, num_stages=stages)
        for n, k, warps, stages in dict.fromkeys(_SHORT_TILES + _TALL_TILES + _GEGLU_TALL_TILES)
    ]
    # Used where there is no autotuning: Triton's CPU interpreter (tests).
    DEFAULT_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 32}

    def _prune_configs(configs: list, named_args: dict, **kwargs: object) -> list:
        """The tiles of this tile height (and output: GEGLU); packed weights need whole groups
        per K step or whole K steps per group."""
        args = {**named_args, **kwargs}
        tall = _GEGLU_TALL_TILES if args["GEGLU"] else _TALL_TILES
        tiles, group = tall if args["BLOCK_M"] >= 64 else _SHORT_TILES, args["GROUP"]
        kept = []
        for c in configs:
            n, k = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
            if (n, k, c.num_warps, c.num_stages) in tiles and (k % group == 0 or group % k == 0):
                kept.append(c)
        return kept or configs[:1]

    _grouped_matmul_tuned = triton.autotune(
        configs=_CONFIGS,
        key=["N", "K", "BITS", "GROUP", "BLOCK_M", "GEGLU", "FP32_DOT"],
        prune_configs_by={"early_config_prune": _prune_configs},
    )(_grouped_matmul_kernel)

    # -----------------------------------------------------------------------------------------
    # Launchers

    def _launch(
        x: Tensor,
        weight: Tensor,
        scales: Tensor | None,
        biases: Tensor | None,
        weight_rows: int,
        expert_ids: Tensor,
        row_scale: Tensor | None,
        plan: ExpertPlan | None,
        bits: int,
        group: int,
        config: dict | None,
        geglu: bool,
    ) -> Tensor:
        tokens, top_k = expert_ids.shape
        k = x.shape[-1]
        n = _output_width(weight_rows, row_scale, geglu)
        if x.shape[0] != tokens or (x.dim() == 3 and x.shape[1] != top_k):
            raise ValueError(f"x {tuple(x.shape)} does not match expert_ids {(tokens, top_k)}")
        num_experts = weight.shape[0]
        if plan is None:
            plan = plan_experts(expert_ids, num_experts)
        elif (plan.tokens, plan.top_k, plan.num_experts) != (tokens, top_k, num_experts):
            raise ValueError("the plan was made for other expert ids")
        rows = x.reshape(-1, k)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        out = torch.empty(tokens * top_k, n, dtype=x.dtype, device=x.device)
        scale = None if row_scale is None else row_scale.reshape(-1).float().contiguous()
        args = (
            rows,
            weight,
            scales if scales is not None else weight,  # unread for float weights
            biases if biases is not None else weight,
            plan.rows,
            plan.tile_experts,
            scale if scale is not None else out,  # unread without HAS_ROW_SCALE
            out,
            plan.pairs,
            n,
            plan.tiles,
            rows.stride(0),
            out.stride(0),
            top_k if x.dim() == 2 else 1,
            num_experts,
            k,
        )
        constants = {
            "BITS": bits,
            "GROUP": group,
            "HAS_ROW_SCALE": scale is not None,
            "GEGLU": geglu,
            "FP32_DOT": x.dtype == torch.float32,
            "BLOCK_M": plan.block_m,
            "GROUP_M": GROUP_M,
        }

        def grid(meta: dict) -> tuple[int]:
            return (plan.tiles * triton.cdiv(n, meta["BLOCK_N"]),)

        if config is None and x.is_cuda:
            launch_kernel(_grouped_matmul_tuned, grid, *args, **constants)
        else:
            chosen = dict(config or DEFAULT_CONFIG)
            options = {key: chosen.pop(key) for key in ("num_warps", "num_stages") if key in chosen}
            launch_kernel(
                _grouped_matmul_kernel, grid(chosen), *args, **constants, **chosen, **options
            )
        return out.view(tokens, top_k, n)

    def grouped_expert_matmul_triton(
        x: Tensor,
        weight: Tensor,
        expert_ids: Tensor,
        row_scale: Tensor | None = None,
        plan: ExpertPlan | None = None,
        config: dict | None = None,
        geglu: bool = False,
    ) -> Tensor:
        """Float experts ``[E, N, K]``; `config` pins BLOCK_N/BLOCK_K (and num_warps,
        num_stages) instead of autotuning (tests, benchmarks)."""
        weight = weight if weight.is_contiguous() else weight.contiguous()
        if weight.shape[-1] != x.shape[-1]:
            raise ValueError(f"x has {x.shape[-1]} inputs, the experts {weight.shape[-1]}")
        rows = weight.shape[1]
        return _launch(
            x, weight, None, None, rows, expert_ids, row_scale, plan, 0, 1, config, geglu
        )

    def grouped_affine_expert_matmul_triton(
        x: Tensor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        expert_ids: Tensor,
        bits: int,
        group_size: int,
        row_scale: Tensor | None = None,
        plan: ExpertPlan | None = None,
        config: dict | None = None,
        geglu: bool = False,
    ) -> Tensor:
        """MLX-packed experts (uint32 ``[E, N, K * bits / 32]``), dequantized tile by tile."""
        if bits not in KERNEL_BITS:
            raise ValueError(f"the grouped kernel covers bits {KERNEL_BITS}, not {bits}")
        k = packed.shape[-1] * WORD_BITS // bits
        if x.shape[-1] != k or scales.shape[-1] * group_size != k:
            raise ValueError(f"x has {x.shape[-1]} inputs; the experts pack {k}")
        words = packed.contiguous().view(torch.int32)  # same bits; Triton shifts int32
        return _launch(
            x,
            words,
            scales.contiguous(),
            biases.contiguous(),
            packed.shape[1],
            expert_ids,
            row_scale,
            plan,
            bits,
            group_size,
            config,
            geglu,
        )
