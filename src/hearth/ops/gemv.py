"""Float matrix-vector products for batch-1 decode, with the MLP's GeGLU folded into the input.

In a decode profile cuBLAS runs the wide projections (qkv, gate/up, the head) at about copy
bandwidth, but the two with few outputs (o_proj and down,
N = hidden) it splits over K and follows with a memset and a reduce kernel per call, and
down's input first needs its own GeGLU kernel. Here the projection is one kernel (the
models run the GeGLU kernel first: folding it in, below, measured slower):

* each program streams BLOCK_N weight rows over one slice of K (coalesced 16-byte loads),
  and the last program of a row block to finish adds the slices' partial sums in slice
  order (deterministic: no float atomics);
* with `geglu`, the input is `gelu_tanh(gate) * up` computed on the fly from the stacked
  gate/up output (or from a gate and a separate `up`, as Gemma 4's per-layer input gate
  has them), rounded exactly as `activation.gelu_tanh_mul` rounds;
* with an add-norm input (`gemv_add_norm`), the input is the residual sum that
  `norm.add_rms_norm` would have stored, formed by every program from the sublayer output
  and the residual (for narrow weights, where few programs repeat the row's RMS): the
  launch before the GEMV goes.

Accumulation is fp32; the output is rounded once to the activations' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hearth.ops import HAS_TRITON, kernel_enabled, pdl_options, prefetch_lines
from hearth.ops.activation import gelu_tanh_mul, gelu_tanh_mul_reference
from hearth.ops.launch import launch_kernel
from hearth.ops.native.bf16_gemm import linear as cpu_linear
from hearth.ops.norm import add_rms_norm, add_rms_norm_reference

# Rows of activations one launch takes (decode is 1; a few speculative/batched rows fit).
GEMV_MAX_ROWS = 4
# Rows `gemv` sends to the kernel: from 3 rows cuBLAS is faster at every 12B and E4B shape
# (results/gpu_gemv_bf16_rows_h100-2026-12-07.md).
GEMV_ROUTED_ROWS = 2


def _unsplit_launch(block_n: int, block_k: int, loop_stages: int) -> dict[str, int]:
    """An unsplit launch whose K loop keeps `loop_stages` tiles in flight, four warps."""
    return {
        "BLOCK_N": block_n,
        "BLOCK_K": block_k,
        "SPLIT_K": 1,
        "LOOP_STAGES": loop_stages,
        "num_warps": 4,
    }


# Launches pinned by weight shape (N, K) for one row: the fastest of a sweep of pipelined
# launches in CUDA graphs (`benchmarks/gpu_gemv_bf16_sweep.py`), faster than the autotuner's
# pick for these shapes. Other shapes are autotuned.
GEMV_LAUNCHES: dict[tuple[int, int], dict[str, int]] = {
    (3840, 4096): _unsplit_launch(8, 512, 4),  # 12B o
    (3840, 15360): _unsplit_launch(8, 512, 3),  # 12B down
    (2560, 2048): _unsplit_launch(8, 512, 3),  # E4B o (sliding)
    (2560, 10240): _unsplit_launch(8, 512, 4),  # E4B down
    (2816, 4096): _unsplit_launch(8, 512, 4),  # 26B-A4B o (sliding)
    (2816, 2112): _unsplit_launch(8, 512, 3),  # 26B-A4B dense down
    (2560, 4096): _unsplit_launch(8, 512, 4),  # E4B o (global)
    (256, 2560): _unsplit_launch(4, 1024, 4),  # E4B per-layer gate
    (2816, 8192): _unsplit_launch(8, 512, 4),  # 26B-A4B o (global)
    (5376, 8192): _unsplit_launch(8, 512, 1),  # 31B o (sliding)
    (5376, 21504): _unsplit_launch(8, 512, 3),  # 31B down
    # Wide projections, which a pin moves from cuBLAS to this GEMV (`has_pinned_launch`): the
    # shapes where the fastest launch beat cuBLAS by over 3% in CUDA graphs. 12B's and 31B's
    # stay on cuBLAS (within that margin).
    (3072, 2560): _unsplit_launch(8, 512, 3),  # E4B qkv (sliding)
    (6144, 2560): _unsplit_launch(16, 256, 4),  # E4B qkv (global)
    (2048, 2560): _unsplit_launch(8, 512, 4),  # E4B q (KV-sharing, sliding)
    (4096, 2560): _unsplit_launch(8, 512, 3),  # E4B q (KV-sharing, global)
    (20480, 2560): _unsplit_launch(8, 1024, 4),  # E4B gate/up
    (8192, 2816): _unsplit_launch(8, 1024, 4),  # 26B-A4B qkv (sliding)
    (9216, 2816): _unsplit_launch(8, 1024, 4),  # 26B-A4B qkv (global)
    (4224, 2816): _unsplit_launch(8, 1024, 1),  # 26B-A4B dense gate/up
}


def gemv_reference(
    x: Tensor, weight: Tensor, geglu: bool = False, up: Tensor | None = None
) -> Tensor:
    """``x @ weight.T``, with ``x = gelu_tanh(gate) * up`` first: of a stacked [.., 2K] input,
    or of gate x and `up`, both [.., K]."""
    if geglu:
        x = gelu_tanh_mul_reference(x, up)
    return F.linear(x, weight)


def pinned_launch(rows: int, n: int, k: int) -> dict[str, int] | None:
    """The launch pinned for an [n, k] weight, which applies to one row only."""
    return GEMV_LAUNCHES.get((n, k)) if rows == 1 else None


def has_pinned_launch(x: Tensor, weight: Tensor) -> bool:
    """Whether `gemv` takes x against `weight` with a launch pinned for its shape: a
    projection that cuBLAS reads well (qkv, gate/up) takes the GEMV only there, where the
    pinned launch measured faster than cuBLAS."""
    return pinned_launch(x.numel() // x.shape[-1], *weight.shape) is not None


class AddNorm(NamedTuple):
    """A GEMV input formed as `add_rms_norm` forms its residual: ``residual + round(norm(x)
    · weight)``, stored in `out` by the launch that reads it."""

    residual: Tensor
    weight: Tensor
    eps: float
    out: Tensor


def gemv_add_norm_reference(
    x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(h @ weight.T, h) for h = residual + round(rms_norm(x) · norm_weight)."""
    summed = add_rms_norm_reference(residual, x, norm_weight, eps)[0]
    return F.linear(summed, weight), summed


def gemv_add_norm(
    x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """`gemv_add_norm_reference` in one launch on CUDA: the GEMV's programs form the residual
    sum themselves (each takes x's RMS over the whole row, cheap for a narrow weight) in place
    of an `add_rms_norm` launch before the GEMV."""
    rows = x.numel() // x.shape[-1]
    if not (kernel_enabled(x) and rows <= GEMV_ROUTED_ROWS and weight.dtype == x.dtype):
        summed = add_rms_norm(residual, x, norm_weight, eps)[0]
        return F.linear(summed, weight), summed
    summed = torch.empty_like(x, memory_format=torch.contiguous_format)
    add_norm = AddNorm(residual, norm_weight, eps, summed.view(rows, -1))
    return gemv_triton(x, weight, add_norm=add_norm), summed


def gemv(x: Tensor, weight: Tensor, geglu: bool = False, up: Tensor | None = None) -> Tensor:
    """`gemv_reference`, one Triton kernel for few rows on CUDA (cuBLAS for many)."""
    rows = x.numel() // x.shape[-1]
    if kernel_enabled(x) and rows <= GEMV_ROUTED_ROWS and weight.dtype == x.dtype:
        return gemv_triton(x, weight, geglu, up=up)
    return cpu_linear(gelu_tanh_mul(x, up) if geglu else x, weight)  # F.linear off the CPU


if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import prefetch_row_lines, wait_for_producer
    from hearth.ops.activation import geglu

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        up_ptr,
        w_ptr,
        out_ptr,
        partial_ptr,
        counter_ptr,
        M,
        N,
        stride_xm,
        stride_um,
        stride_wn,
        stride_om,
        norm_w_ptr,
        summed_ptr,
        eps,
        K: tl.constexpr,
        GEGLU: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PDL: tl.constexpr,
        LOOP_STAGES: tl.constexpr = 1,
        PREFETCH_LINES: tl.constexpr = 0,
        ADD_NORM: tl.constexpr = False,
        ROW_BLOCK: tl.constexpr = 16,
    ):
        """out[m, n] = sum_k x'[m, k] w[n, k]; grid (blocks of N, slices of K). With GEGLU
        x' is gelu_tanh(x) * up (up_ptr: x_ptr + K for a stacked gate/up). With ADD_NORM x'
        is ``up + round(rms_norm(x) · norm_w)`` (up_ptr: the residual), as `add_rms_norm`
        rounds it: every program takes x's RMS over its whole row (ROW_BLOCK >= K), and the
        first row block stores x' at summed_ptr. LOOP_STAGES > 1 software-pipelines the K
        loop (loads of later steps in flight during this one's FMAs).
        PREFETCH_LINES > 0 asks L2 for that many lines of each weight row's slice before the
        wait for the previous kernel (`hearth.ops.PREFETCH_LINES`)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
        # Whole BLOCK_K steps per slice; the trip count is a constexpr (K is one) because
        # Triton's interpreter cannot loop to runtime bounds.
        STEPS: tl.constexpr = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K
        k_begin = pid_k * (STEPS * BLOCK_K)
        if PREFETCH_LINES > 0:
            rows_read = w_ptr + tl.minimum(n, N - 1).to(tl.int64)[:, None] * stride_wn
            prefetch_row_lines(rows_read, k_begin, K, PREFETCH_LINES)
        wait_for_producer(PDL)
        m = tl.arange(0, BLOCK_M)
        m_ok = m < M
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm
        up_rows = up_ptr + m.to(tl.int64)[:, None] * stride_um
        if ADD_NORM:
            columns = tl.arange(0, ROW_BLOCK)
            row_ok = m_ok[:, None] & (columns < K)[None, :]
            whole = tl.load(x_rows + columns[None, :], mask=row_ok, other=0.0).to(tl.float32)
            inverse_rms = tl.rsqrt(tl.sum(whole * whole, axis=1) / K + eps)
            summed_rows = summed_ptr + m.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
        for step in tl.range(STEPS, num_stages=LOOP_STAGES):
            k = k_begin + step * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x_ok = m_ok[:, None] & k_ok[None, :]
            if GEGLU:
                gate = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
                up = tl.load(up_rows + k[None, :], mask=x_ok, other=0.0)
                xk = geglu(gate, up).to(tl.float32)
            elif ADD_NORM:
                sub = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
                residual = tl.load(up_rows + k[None, :], mask=x_ok, other=0.0)
                norm_w = tl.load(norm_w_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                normed = sub.to(tl.float32) * inverse_rms[:, None] * norm_w[None, :]
                summed = (residual.to(tl.float32) + normed.to(sub.dtype).to(tl.float32)).to(
                    sub.dtype
                )
                tl.store(summed_rows + k[None, :], summed, mask=x_ok & (pid_n == 0))
                xk = summed.to(tl.float32)
            else:
                xk = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0).to(tl.float32)
            acc += w.to(tl.float32)[None, :, :] * xk[:, None, :]
        result = tl.sum(acc, axis=2)

        out_at = m[:, None] * stride_om + n[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + out_at, result.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            # Partials [SPLIT_K, M, N] fp32; the last slice to finish sums them in order.
            own = m[:, None].to(tl.int64) * N + n[None, :]
            tl.store(partial_ptr + pid_k * M * N + own, result, mask=out_ok)
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for split in tl.static_range(SPLIT_K):
                    # .cg reads L2, where the other programs' partials are, not a stale L1.
                    total += tl.load(
                        partial_ptr + split * M * N + own,
                        mask=out_ok,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                tl.store(out_ptr + out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch / replay

    _TILES = ((8, 512, 4), (16, 256, 4), (16, 512, 8), (32, 256, 8), (64, 128, 8))
    _CONFIGS = [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split}, num_warps=warps)
        for n, k, warps in _TILES
        for split in (1, 2, 4, 8)
    ]
    # Used where there is no autotuning: Triton's CPU interpreter (tests).
    DEFAULT_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 1}
    MAX_SPLIT_K = 8
    MIN_BLOCK_N = 4  # the narrowest tile a pinned launch may take (one counter per row block)

    def _prune(configs: list, named_args: dict, **kwargs: object) -> list:
        """Drop splits whose slices would be under two steps, and tiles that spill."""
        args = {**named_args, **kwargs}
        kept = [
            c
            for c in configs
            if args["K"] >= 2 * c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"]
            and args["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 8192
        ]
        return kept or [triton.Config(DEFAULT_CONFIG, num_warps=4)]

    _gemv_tuned = triton.autotune(
        configs=_CONFIGS,
        key=["N", "K", "BLOCK_M", "GEGLU"],
        prune_configs_by={"early_config_prune": _prune},
    )(_gemv_kernel)

    # Split-K arrival counters, zero between launches (the last program resets its own).
    _COUNTERS: dict[torch.device, Tensor] = {}

    def _counters(device: torch.device, count: int) -> Tensor:
        counters = _COUNTERS.get(device)
        if counters is None or counters.numel() < count:
            counters = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
            _COUNTERS[device] = counters
        return counters

    def gemv_triton(
        x: Tensor,
        weight: Tensor,
        geglu: bool = False,
        config: dict | None = None,
        up: Tensor | None = None,
        add_norm: AddNorm | None = None,
    ) -> Tensor:
        """``gemv_reference`` in one launch; `config` pins the tiles (tests, the interpreter).
        With `add_norm` x is first `add_norm.summed(x)` (see `gemv_add_norm`), which this
        launch also stores in `add_norm.out`."""
        k = weight.shape[-1]
        width = 2 * k if geglu and up is None else k
        if x.shape[-1] != width:
            raise ValueError(f"x has {x.shape[-1]} inputs; the weight takes {width}")
        if up is not None and (not geglu or up.shape != x.shape):
            raise ValueError(f"up {tuple(up.shape)} is GeGLU's second input, shaped as x")
        if add_norm is not None:
            if geglu or up is not None:
                raise ValueError("a GEMV takes GeGLU or an add-norm input, not both")
            up = add_norm.residual
            if up.shape != x.shape or add_norm.weight.shape != (k,):
                raise ValueError(f"the add-norm residual and weight must match x {x.shape}")
        rows = x.reshape(-1, width)
        if rows.shape[0] > GEMV_MAX_ROWS:
            raise ValueError(f"the GEMV kernel takes at most {GEMV_MAX_ROWS} rows")
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        if up is None:
            up_rows = rows[:, k:] if geglu else rows  # unread without GEGLU
        else:
            up_rows = up.reshape(-1, k)
            up_rows = up_rows if up_rows.stride(-1) == 1 else up_rows.contiguous()
        weight = weight if weight.stride(-1) == 1 else weight.contiguous()
        m, n = rows.shape[0], weight.shape[0]
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        interpreted = not x.is_cuda
        if config is None and not interpreted:
            config = pinned_launch(m, n, k)
        split_possible = (config is None and not interpreted) or (config or {}).get(
            "SPLIT_K", 1
        ) > 1
        partial = torch.empty(
            MAX_SPLIT_K * m * n if split_possible else 1, dtype=torch.float32, device=x.device
        )
        counters = _counters(x.device, triton.cdiv(n, MIN_BLOCK_N)) if split_possible else partial
        args = (rows, up_rows, weight, out, partial, counters, m, n)
        args += (rows.stride(0), up_rows.stride(0), weight.stride(0), out.stride(0))
        if add_norm is not None:
            summed = add_norm.out
            if summed.shape != (m, k) or not summed.is_contiguous():
                raise ValueError(f"the add-norm output must be a contiguous [{m}, {k}]")
            args += (add_norm.weight, summed, add_norm.eps)
        else:
            args += (weight, out, 0.0)  # unread
        pdl = pdl_options(x)
        constants = {"K": k, "GEGLU": geglu, "BLOCK_M": triton.next_power_of_2(m)}
        constants |= pdl | {"PREFETCH_LINES": prefetch_lines(pdl)}
        if add_norm is not None:
            constants |= {"ADD_NORM": True, "ROW_BLOCK": triton.next_power_of_2(k)}

        def grid(meta: dict) -> tuple[int, int]:
            return (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

        if config is None and not interpreted:
            launch_kernel(_gemv_tuned, grid, *args, **constants)
        else:
            chosen = config or DEFAULT_CONFIG
            launch_kernel(_gemv_kernel, grid(chosen), *args, **constants, **chosen)
        return out.view(*x.shape[:-1], n)
