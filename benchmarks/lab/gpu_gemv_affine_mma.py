"""Prototype: the 4-bit affine GEMV on tensor cores, against the v1 GEMV (library kernel).

v1 spends ~5-7 instructions per 4-bit code (extract, exact int->float, FMA, x loads, a
shared-memory reduction per group) and is instruction bound at ~24% of bandwidth. Here the
dot products run as `tl.dot` (mma), so a code costs only its conversion to bf16:

* a word's codes j and j + 4 (bits 4j and 16 + 4j) become one bf16 pair with one shift and
  one LOP3: ``(word >> 4j) & 0x000F000F | 0x43004300`` is the pair ``(128 + q_j, 128 + q_j+4)``,
  exact in bf16. K is permuted so such a pair is what the mma reads as two adjacent k: dot j
  of a step takes pair j of every word, and x is gathered in the same order;
* scales act after the dot: B has one column per group of the step (x where k is in that
  group, else 0), so the mma returns every (row, group) dot at once, and
  ``sum_k (s q_k + b) x_k = s * D + (b - 128 s) * X`` with D the mma's (128 + q) dot and X the
  group's sum of x, in fp32.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_gemv_affine_mma.py
    PYTHONPATH=$PWD/src TRITON_INTERPRET=1 python benchmarks/lab/gpu_gemv_affine_mma.py --cpu

Measured on the H200 (results/gpu_gemv_affine_mma_*-2026-12-03.md): correct, but never
faster than v1. At best it ties (12B gate/up 52.5 µs both; qkv 17.0 vs 16.6); down and the
head run at 0.6-0.9x. sm_90 SASS has ~2.9 instructions a code against v1's 5-7, so issue
slots were not what bound v1 either; a software-pipelined loop (cp.async, 2-4 stages) made
it slower still. Not adopted; kept as the record of the design and its numbers.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton
import triton.language as tl

WORDS = 32  # words a row contributes per step: 4 groups of 64 4-bit codes
GROUPS_PER_STEP = 4
COLUMNS = 16  # B's width: one column per group of the step (mma needs >= 16)
MAGIC = 0x43004300  # the bf16 pair (128, 128)


@triton.jit
def _substep(
    acc, x_sums, packed_ptr, word_rows, x_ptr, g, g_end, w, p_k, p, col, ones, magic,
    SUB: tl.constexpr, BLOCK_N: tl.constexpr, BITCAST: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Four groups from group g into columns 4 SUB .. 4 SUB + 3 of the accumulators; MASKED:
    groups from g_end on count as zero (codes 0 and x 0)."""
    STEP_WORDS: tl.constexpr = 32
    if MASKED:
        words = tl.load(
            packed_ptr + word_rows[:, None] + g * 8 + w[None, :],
            mask=(g + w // 8 < g_end)[None, :],
            other=0,
        )
    else:
        words = tl.load(packed_ptr + word_rows[:, None] + g * 8 + w[None, :])
    x_step = x_ptr + g * 64
    in_column = (p // 16 + 4 * SUB)[:, None] == col[None, :]
    for j in tl.static_range(4):
        # magic = 0x43004300 at run time: one LOP3 (AND and OR) with a register operand.
        pairs = ((words >> (4 * j)) & 0x000F000F) | magic
        if BITCAST:  # the halves are bf16 bit patterns: no conversion instruction
            low = (pairs & 0xFFFF).to(tl.int16)
            high = (pairs >> 16).to(tl.int16)
            a = tl.reshape(tl.join(low, high), [BLOCK_N, 2 * STEP_WORDS])
            a = a.to(tl.bfloat16, bitcast=True)
        else:  # the interpreter mishandles these bf16 tiles: the same values in fp32
            low = ((pairs & 0xFF) + 128).to(tl.float32)
            high = (((pairs >> 16) & 0xFF) + 128).to(tl.float32)
            a = tl.reshape(tl.join(low, high), [BLOCK_N, 2 * STEP_WORDS])
        if MASKED:
            xk = tl.load(x_step + p_k + j, mask=g + p // 16 < g_end, other=0.0)
        else:
            xk = tl.load(x_step + p_k + j)
        b = tl.where(in_column, xk[:, None], 0.0).to(tl.bfloat16)
        if BITCAST:
            acc = tl.dot(a, b, acc)
            # Column sums of B by the mma too, already in the accumulator's layout.
            x_sums = tl.dot(ones.to(tl.bfloat16), b, x_sums)
        else:
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
            x_sums = tl.dot(ones, b.to(tl.float32), x_sums, input_precision="ieee")
    return acc, x_sums


@triton.jit
def _mma_gemv_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    biases_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    N,
    row_words,
    groups,
    magic,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BITCAST: tl.constexpr,
    SUBSTEPS: tl.constexpr,
    SPLIT_GROUPS: tl.constexpr,
    STAGES: tl.constexpr,
):
    """out[n] = sum_k x[k] w[n, k], 4-bit group-64 MLX weights; grid (row blocks, K splits).
    Split s owns groups [s * split_groups, ...), a multiple of GROUPS_PER_STEP."""
    STEP_WORDS: tl.constexpr = 32
    COLS: tl.constexpr = 16
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    n_read = tl.minimum(n, N - 1)
    word_rows = n_read * row_words
    group_rows = n_read * groups
    w = tl.arange(0, STEP_WORDS)
    col = tl.arange(0, COLS)
    # B row p holds k = 8 * (p // 2) + j + 4 * (p % 2) of dot j; its group is p // 16.
    p = tl.arange(0, 2 * STEP_WORDS)
    p_k = 8 * (p // 2) + 4 * (p % 2)
    ones = tl.full([BLOCK_N, 2 * STEP_WORDS], 1.0, tl.float32)
    total = tl.zeros([BLOCK_N, COLS], tl.float32)
    g0 = pid_k * SPLIT_GROUPS
    g_end = tl.minimum(g0 + SPLIT_GROUPS, groups)
    if STAGES > 0:
        # A constexpr trip count, so Triton software-pipelines the loads STAGES deep (a
        # `while` loop keeps one step of loads in flight: latency, not bandwidth, bound).
        for step in tl.range(0, SPLIT_GROUPS // 4, num_stages=STAGES):
            g = g0 + 4 * step
            acc = tl.zeros([BLOCK_N, COLS], tl.float32)
            x_sums = tl.zeros([BLOCK_N, COLS], tl.float32)
            acc, x_sums = _substep(
                acc, x_sums, packed_ptr, word_rows, x_ptr, g, g_end, w, p_k, p, col, ones,
                magic, 0, BLOCK_N, BITCAST, True,
            )  # fmt: skip
            at = group_rows[:, None] + g + col[None, :]
            ok = ((col < 4) & (g + col < g_end))[None, :]
            scale = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
            bias = tl.load(biases_ptr + at, mask=ok, other=0.0).to(tl.float32)
            total += acc * scale + (bias - 128.0 * scale) * x_sums
        g0 = g_end  # skips the loop below
    while g0 < g_end:
        acc = tl.zeros([BLOCK_N, COLS], tl.float32)
        x_sums = tl.zeros([BLOCK_N, COLS], tl.float32)  # every row: the groups' sums of x
        for sub in tl.static_range(SUBSTEPS):
            # Sub-step `sub` fills columns 4 sub .. 4 sub + 3; one fold per SUBSTEPS.
            if SUBSTEPS == 1:
                acc, x_sums = _substep(
                    acc, x_sums, packed_ptr, word_rows, x_ptr, g0, g_end, w, p_k, p, col, ones,
                    magic, 0, BLOCK_N, BITCAST, False,
                )  # fmt: skip
            elif g0 + 4 * sub < g_end:
                acc, x_sums = _substep(
                    acc, x_sums, packed_ptr, word_rows, x_ptr, g0 + 4 * sub, g_end, w, p_k, p,
                    col, ones, magic, sub, BLOCK_N, BITCAST, False,
                )  # fmt: skip
        at = group_rows[:, None] + g0 + col[None, :]
        ok = ((col < 4 * SUBSTEPS) & (g0 + col < g_end))[None, :]
        scale = tl.load(scales_ptr + at, mask=ok, other=0.0).to(tl.float32)
        bias = tl.load(biases_ptr + at, mask=ok, other=0.0).to(tl.float32)
        total += acc * scale + (bias - 128.0 * scale) * x_sums
        g0 += 4 * SUBSTEPS
    result = tl.sum(total, axis=1)
    if SPLIT_K == 1:
        tl.store(out_ptr + n, result.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(partial_ptr + pid_k * N + n, result, mask=n_ok)
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc_n = tl.zeros([BLOCK_N], tl.float32)
            for split in tl.static_range(SPLIT_K):
                acc_n += tl.load(
                    partial_ptr + split * N + n, mask=n_ok, other=0.0, cache_modifier=".cg"
                )
            tl.store(out_ptr + n, acc_n.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(counter_ptr + pid_n, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def mma_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    block_n: int = 64,
    split_k: int = 1,
    num_warps: int = 4,
    substeps: int = 4,
    stages: int = 0,
) -> torch.Tensor:
    """x [K] (bf16) @ W.T for 4-bit group-64 packed W [N, K/8]; K a multiple of 256."""
    n, row_words = packed.shape
    groups = scales.shape[1]
    if groups % GROUPS_PER_STEP or x.numel() != groups * 64:
        raise ValueError("K must be a multiple of 256 and match the packing")
    steps = groups // GROUPS_PER_STEP
    split_k = max(1, min(split_k, steps))
    split_groups = -(-steps // split_k) * GROUPS_PER_STEP
    split_k = -(-groups // split_groups)
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    partial = torch.empty(split_k * n, dtype=torch.float32, device=x.device)
    counters = _COUNTERS.get(x.device)
    if counters is None:
        counters = _COUNTERS[x.device] = torch.zeros(65536, dtype=torch.int32, device=x.device)
    grid = (triton.cdiv(n, block_n), split_k)
    _mma_gemv_kernel[grid](
        x, packed.view(torch.int32), scales, biases, out, partial, counters,
        n, row_words, groups, MAGIC, BLOCK_N=block_n, SPLIT_K=split_k,
        BITCAST=x.is_cuda, SUBSTEPS=substeps, SPLIT_GROUPS=split_groups, STAGES=stages,
        num_warps=num_warps,
    )  # fmt: skip
    return out


def _operands(n: int, k: int, device: torch.device, seed: int = 0):
    from hearth.quant.mlx import pack_codes

    generator = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=device, generator=generator)
    scales = (torch.rand(n, k // 64, device=device, generator=generator) * 0.02 + 0.001).to(
        torch.bfloat16
    )
    noise = torch.randn(n, k // 64, device=device, generator=generator)
    biases = (-scales.float() * 8 + 0.001 * noise).to(torch.bfloat16)
    x = torch.randn(k, device=device, generator=generator).to(torch.bfloat16)
    return x, pack_codes(codes, 4), scales, biases, codes


def _exact(x, scales, biases, codes) -> torch.Tensor:
    """fp64 sum of x * (s q + b) with unrounded weights."""
    s = scales.double().repeat_interleave(64, dim=1)
    b = biases.double().repeat_interleave(64, dim=1)
    return (codes.double() * s + b) @ x.double()


def check(device: torch.device, shapes, splits) -> list[str]:
    lines = []
    for n, k in shapes:
        x, packed, scales, biases, codes = _operands(n, k, device)
        want = _exact(x, scales, biases, codes)
        # The mma sums (128 + q) s x: terms up to 143 s |x|, before the 128 offset cancels.
        terms = (143 * scales.double().repeat_interleave(64, 1)) @ x.double().abs()
        variants = [(split, sub, 0) for split in splits for sub in (1, 4)]
        variants += [(split, 1, 3) for split in splits]
        for split, substeps, stages in variants:
            got = mma_gemv(
                x, packed, scales, biases, split_k=split, substeps=substeps, stages=stages
            ).double()
            # bf16 output rounding (one ulp, 2^-8 |y|) plus fp32 accumulation: rounding errors
            # of K terms grow ~sqrt(K) ulps of their magnitude; 2^-16 = 256 ulps covers K=64k.
            error = ((got - want).abs() / (want.abs() * 2**-8 + terms * 2**-16)).max()
            lines.append(
                f"| {n}x{k} | split {split} sub {substeps} stages {stages} | "
                f"max error / bound {error:.3f} | "
                f"{'ok' if error <= 1 else 'FAIL'} |"
            )
    return lines


# Rows and warps per program (64+ rows: Hopper's warpgroup MMA), and (fold every SUBSTEPS x 4
# groups, pipeline stages).
# (mma.sync tiles of 16-32 rows compile to ~3x the instructions: B is rebuilt per warp.)
LAUNCH_TILES = ((64, 4), (128, 8))
LAUNCH_LOOPS = ((4, 0), (1, 2), (1, 3), (1, 4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true", help="interpreter check on small shapes")
    args = parser.parse_args()
    if args.cpu:
        print("\n".join(check(torch.device("cpu"), [(96, 512), (64, 1280)], [1, 2, 4])))
        return
    from hearth.ops import affine_matmul as am

    device = torch.device("cuda")
    lines = ["| shape | launch | check | verdict |", "|---|---|---|---|"]
    lines += check(device, [(8192, 3840), (3840, 15360)], [1, 4])
    lines += ["", "| shape | v1 µs | mma launch | µs | GB/s | vs v1 |", "|---|---|---|---|---|---|"]
    shapes = [
        (15360, 3840, "gate/up half"), (30720, 3840, "gate/up"), (3840, 15360, "down"),
        (8192, 3840, "qkv"), (3840, 4096, "o_proj"), (262144, 3840, "head"),
    ]  # fmt: skip
    launches = [
        (block_n, split, warps, sub, stages)
        for block_n, warps in LAUNCH_TILES
        for split in (1, 2, 4)
        for sub, stages in LAUNCH_LOOPS
    ]
    for n, k, name in shapes:
        x, packed, scales, biases, _ = _operands(n, k, device)
        moved = packed.numel() * 4 + scales.numel() * 4
        # Enough copies that one replay reads >= 256 MB: L2 (60 MB) holds none of them.
        copies = [(packed, scales, biases)] + [
            (packed.clone(), scales.clone(), biases.clone())
            for _ in range(-(-(2**28) // moved) - 1)
        ]

        def v1_calls(ops=copies, x=x):
            return [partial(am.affine_gemv_triton, x[None], *o, 4, 64) for o in ops]

        v1 = _graph_time(v1_calls())
        for block_n, split, warps, sub, stages in launches:
            calls = [partial(mma_gemv, x, *o, block_n, split, warps, sub, stages) for o in copies]
            t = _graph_time(calls)
            lines.append(
                f"| {name} {n}x{k} | {v1 * 1e6:.1f} | N{block_n} split{split} w{warps} sub{sub} "
                f"stages{stages} "
                f"| {t * 1e6:.1f} | {moved / t / 1e9:.0f} | {v1 / t:.2f}x |"
            )
        print("\n".join(lines[-len(launches) :]), flush=True)
        del copies
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gemv_affine_mma.md").write_text(table)


def _graph_time(calls: list, replays: int = 10) -> float:
    """Seconds per call, from a CUDA graph of the calls back to back (at least 20), replayed."""
    calls = calls * -(-20 // len(calls))
    for fn in calls[:3]:
        fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e-3 / (len(calls) * replays)


if __name__ == "__main__":
    main()
