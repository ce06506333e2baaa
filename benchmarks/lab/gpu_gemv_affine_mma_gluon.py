"""The MLX 4-bit GEMV (M = 1) on mma.sync tensor cores, written in Gluon: a design under test.

Why: the library's 4-bit GEMV (`affine_matmul._affine_gemv_kernel`) spends about 3.6-4.0
instructions a code (a LOP3 and an FFMA each, x conversions, sums). On the H200 its 12B
gate/up launch takes 32.4 µs, as on the H100 (30 µs), though the H200 has 40% more bandwidth:
the H200 runs it at 46% of its copy bandwidth. Here the multiply-adds go to the tensor cores,
so a code costs under one instruction of unpacking:

* A (weights) is built in registers from the packed words where they lie. One LOP3 (AND,
  then OR with the bf16 exponent of 128) turns a word's nibbles j and j + 4 into the bf16
  pair ``(128 + code_j, 128 + code_j+4)``; three shifts and four LOP3s unpack a word's eight
  codes. The 128s come off per group as ``128 * scale * sum(x)``.
* The k order inside an MMA is free, so the words are loaded in the layout the MMA's A
  fragment wants (`layouts`: a Gluon `DistributedLinearLayout`; every conversion to the dot
  operand layouts is asserted trivial at compile time, so nothing moves between lanes).
* B is x, permuted once per GEMV by a small Triton kernel (`_prep_kernel`) into the order
  of the B fragment, with fp32 sums per group. Column n of B holds group n of the step (the
  other groups' rows are zero), so one MMA chain per step of G groups yields every group's
  ``sum(x * (128 + code))`` in its own column, and the scales apply per column:
  ``scale * c - 128 * scale * sum(x) + bias * sum(x)``.
* The next two steps' words, scales and biases are in flight during a step's arithmetic
  (`_mma_gemv_kernel`), or the words come by TMA through a ring of shared-memory steps
  (`_mma_gemv_tma_kernel`, launch `stages` > 0). K splits finish as the library's GEMV does
  (the last program adds the partials in order).

Every launch is checked against dequantize-then-matmul (`gpu_kernels_affine.within_bound`)
before it is timed; the timings are CUDA graphs of back-to-back calls past L2, as
`gpu_gemv_affine_sweep.py` times the library's GEMV, which is timed beside it.

    OUT=/tmp/out PYTHONPATH=src python benchmarks/lab/gpu_gemv_affine_mma_gluon.py [--shapes e4b]

Status (2026-12-05, H100 only; no H200 could be started): every launch correct, none faster
than the library's GEMV, in registers or by TMA (`results/
gpu_gemv_affine_mma_gluon_h100-2026-12-05.md`): the H100 does not issue-bind the library's
GEMV, which runs at 79% of the load-only floor of its access pattern
(`gpu_gemv_load_patterns.py`). Whether the fewer instructions pay on the H200 is the open
question this script answers in one call (`gpu_suite.sh mma-gluon`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from gpu_gemv_affine_sweep import E4B_SHAPES, L2_BYTES, SHAPES, time_graph
from gpu_kernels_affine import COPY_BANDWIDTH, packed_weight, within_bound
from hearth.ops import affine_matmul as am
from hearth.quant.mlx import dequantize_affine

GROUP = 64
# bf16 128.0 in both halves of a word, passed at run time: ptxas then fuses the AND and the
# OR into one LOP3 (two immediates would need two).
BF16_128_PAIR = 0x43004300
# Words in registers (0), or by TMA through this many shared-memory steps.
STAGES = (0, 4)


def _log2(value: int) -> int:
    return value.bit_length() - 1


def layouts(warps: int, reps: int, group: int, steps_groups: int):
    """(rows per program, the packed words' layout, x's layout) for the MMA's fragments.

    Words ``[rows, G * words per group]``: lane ``4 r + q`` holds rows r and r + 8 (+16 a
    warp, + 16 * warps a repetition) and, in each group, words ``[q * LW, (q + 1) * LW)``.
    x ``[n, q, regs]``: lane ``4 n + q`` holds the B fragment values of quarter q of every
    group (only group n's are loaded; the rest are zero)."""
    words_per_group = group // 8
    lane_words = words_per_group // 4
    rows = 16 * warps * reps
    word_regs = (
        [[0, 1 << i] for i in range(_log2(lane_words))]
        + [[8, 0]]
        + [[0, words_per_group << i] for i in range(_log2(steps_groups))]
        + [[16 * warps << i, 0] for i in range(_log2(reps))]
    )
    word = gl.DistributedLinearLayout(
        reg_bases=word_regs,
        lane_bases=[[0, lane_words], [0, 2 * lane_words], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 << i, 0] for i in range(_log2(warps))],
        block_bases=[],
        shape=[rows, steps_groups * words_per_group],
    )
    regs = steps_groups * group // 4
    x = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(_log2(regs))],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[0, 0, 0]] * _log2(warps),
        block_bases=[],
        shape=[8, 4, regs],
    )
    return rows, word, x


@gluon.jit
def _unpack_pairs(words, bf16_128_pair):
    """``[..., j0, j1, h]`` bf16: ``128 + code (j + 4 h)`` of each int32 word, j = j0 + 2 j1."""
    p0 = (words & 0x000F000F) | bf16_128_pair
    p1 = ((words >> 4) & 0x000F000F) | bf16_128_pair
    p2 = ((words >> 8) & 0x000F000F) | bf16_128_pair
    p3 = ((words >> 12) & 0x000F000F) | bf16_128_pair
    pairs = gl.join(gl.join(p0, p1), gl.join(p2, p3))
    pairs = gl.join(pairs, pairs)  # each word twice: pack=2 reads the first as the bf16 pair
    return gl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r,r", [pairs], dtype=gl.bfloat16, is_pure=True, pack=2
    )


@gluon.jit
def _operands(
    xperm_ptr, xsum_ptr, scales_ptr, biases_ptr, pid, g_begin, N, groups,
    ROWS: gl.constexpr, GROUP: gl.constexpr, G: gl.constexpr, X_LAYOUT: gl.constexpr,
    mma: gl.constexpr,
):  # fmt: skip
    """At the split's first step: the B fragments' pointers and mask (lane ``4 n + q`` loads
    quarter q of group n), the scales', biases' and x sums' pointers per output column
    (column n = the step's group n), the columns' mask, and the program's output rows."""
    QUARTER: gl.constexpr = GROUP // 4  # B values a lane holds per group
    xn = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, X_LAYOUT)))[:, None, None]
    xq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, X_LAYOUT)))[None, :, None]
    xr = gl.arange(0, G * QUARTER, layout=gl.SliceLayout(0, gl.SliceLayout(1, X_LAYOUT)))
    xr = xr[None, None, :]
    x_at = xperm_ptr + g_begin * GROUP + (xr // QUARTER) * GROUP + xq * QUARTER + xr % QUARTER
    x_ok = (xr // QUARTER) == xn
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, mma))
    n = pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    group_at = gl.minimum(n, N - 1)[:, None] * groups + g_begin + cols[None, :]
    xs_at = xsum_ptr + g_begin + cols
    return x_at, x_ok, scales_ptr + group_at, biases_ptr + group_at, xs_at, cols, n


@gluon.jit
def _step(
    acc_c, acc_s, acc_b, words, scale, bias, xv, xs, zero, bf16_128_pair,
    ROWS: gl.constexpr, GROUP: gl.constexpr, G: gl.constexpr, mma: gl.constexpr,
):  # fmt: skip
    """One step's MMA chain over G groups and its per-column scale, bias and offset terms."""
    a_layout: gl.constexpr = gl.DotOperandLayout(0, mma, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(1, mma, k_width=2)
    LANE_WORDS: gl.constexpr = GROUP // 32
    QUARTER: gl.constexpr = GROUP // 4
    KS: gl.constexpr = G * GROUP
    pairs = _unpack_pairs(gl.reshape(words, [ROWS, G, 4, LANE_WORDS]), bf16_128_pair)
    # [rows, g, q, lw, j0, j1, h] -> k = 16 (2 lw + j1) + 8 j0 + 2 q + h within group g
    a = gl.reshape(gl.permute(pairs, (0, 1, 3, 5, 4, 2, 6)), [ROWS, KS])
    a = gl.convert_layout(a, a_layout, assert_trivial=True)
    xv = gl.reshape(xv, [8, 4, G, QUARTER // 4, 2, 2])  # [n, q, g, i, b, e]
    b = gl.reshape(gl.permute(xv, (2, 3, 4, 1, 5, 0)), [KS, 8])
    b = gl.convert_layout(b, b_layout, assert_trivial=True)
    c = mma_v2(a, b, zero)
    scale_f = scale.to(gl.float32)
    acc_c = gl.fma(scale_f, c, acc_c)
    acc_s = gl.fma(scale_f, xs[None, :], acc_s)
    acc_b = gl.fma(bias.to(gl.float32), xs[None, :], acc_b)
    return acc_c, acc_s, acc_b


@gluon.jit
def _finish(
    acc_c, acc_s, acc_b, out_ptr, partial_ptr, counter_ptr, n, N, pid, pid_k,
    ROWS: gl.constexpr, SPLIT: gl.constexpr, row_layout: gl.constexpr,
):  # fmt: skip
    """Store the rows, or this split's partials; the last split to arrive adds them in order."""
    n_ok = n < N
    result = gl.sum((acc_c - 128.0 * acc_s) + acc_b, axis=1)
    if SPLIT == 1:
        gl.store(out_ptr + n, result.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        gl.store(partial_ptr + pid_k * N + n, result, mask=n_ok)
        gl.thread_barrier()  # every thread's partials are written before the release below
        arrived = gl.atomic_add(counter_ptr + pid, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = gl.zeros([ROWS], gl.float32, row_layout)
            for split in gl.static_range(SPLIT):
                total += gl.load(
                    partial_ptr + split * N + n, mask=n_ok, other=0.0, cache_modifier=".cg"
                )
            gl.store(out_ptr + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            gl.atomic_xchg(counter_ptr + pid, 0)  # ready for the next launch (and replays)


@gluon.jit
def _wait_for_producer(PDL: gl.constexpr):
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@gluon.jit
def _mma_gemv_kernel(
    xperm_ptr, xsum_ptr, packed_ptr, scales_ptr, biases_ptr, out_ptr, partial_ptr, counter_ptr,
    N, row_words, groups, split_groups, bf16_128_pair,
    WARPS: gl.constexpr, ROWS: gl.constexpr, GROUP: gl.constexpr, G: gl.constexpr,
    WORD_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr, SPLIT: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """out[n] = sum_k x[k] w[n, k]; grid (row blocks, K splits). A step is G groups; the
    words, scales and biases of the next two steps are in registers during a step."""
    WPG: gl.constexpr = GROUP // 8
    KS: gl.constexpr = G * GROUP
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    g_begin = pid_k * split_groups
    word_rows = pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, WORD_LAYOUT))
    word_rows = gl.minimum(word_rows, N - 1)  # rows past N read row N - 1, never stored
    word_cols = g_begin * WPG + gl.arange(0, G * WPG, layout=gl.SliceLayout(0, WORD_LAYOUT))
    word_at = packed_ptr + word_rows[:, None] * row_words + word_cols[None, :]
    x_at, x_ok, s_at, b_at, xs_at, cols, n = _operands(
        xperm_ptr, xsum_ptr, scales_ptr, biases_ptr, pid, g_begin, N, groups, ROWS, GROUP, G,
        X_LAYOUT, mma,
    )  # fmt: skip
    col_ok = (cols < G)[None, :]
    _wait_for_producer(PDL)
    acc_c = gl.zeros([ROWS, 8], gl.float32, mma)  # scale * sum(x (128 + code)) per group
    acc_s = gl.zeros([ROWS, 8], gl.float32, mma)  # scale * sum(x)
    acc_b = gl.zeros([ROWS, 8], gl.float32, mma)  # bias * sum(x)
    zero = gl.zeros([ROWS, 8], gl.float32, mma)
    words = gl.load(word_at)
    scale = gl.load(s_at, mask=col_ok, other=0.0)
    bias = gl.load(b_at, mask=col_ok, other=0.0)
    second = split_groups > G
    words2 = gl.load(word_at + G * WPG, mask=second, other=0)
    scale2 = gl.load(s_at + G, mask=col_ok & second, other=0.0)
    bias2 = gl.load(b_at + G, mask=col_ok & second, other=0.0)
    for step in range(0, split_groups, G):
        more = step + 2 * G < split_groups
        xv = gl.load(x_at, mask=x_ok, other=0.0)
        xs = gl.load(xs_at, mask=cols < G, other=0.0)
        # The loads two steps ahead go out before this step's arithmetic.
        next_words = gl.load(word_at + 2 * G * WPG, mask=more, other=0)
        next_scale = gl.load(s_at + 2 * G, mask=col_ok & more, other=0.0)
        next_bias = gl.load(b_at + 2 * G, mask=col_ok & more, other=0.0)
        word_at += G * WPG
        x_at += KS
        s_at += G
        b_at += G
        xs_at += G
        acc_c, acc_s, acc_b = _step(
            acc_c, acc_s, acc_b, words, scale, bias, xv, xs, zero, bf16_128_pair,
            ROWS, GROUP, G, mma,
        )  # fmt: skip
        words, scale, bias = words2, scale2, bias2
        words2, scale2, bias2 = next_words, next_scale, next_bias
    _finish(
        acc_c, acc_s, acc_b, out_ptr, partial_ptr, counter_ptr, n, N, pid, pid_k, ROWS, SPLIT,
        gl.SliceLayout(1, mma),
    )  # fmt: skip


@gluon.jit
def _mma_gemv_tma_kernel(
    xperm_ptr, xsum_ptr, w_desc, scales_ptr, biases_ptr, out_ptr, partial_ptr, counter_ptr,
    N, groups, split_groups, bf16_128_pair,
    WARPS: gl.constexpr, ROWS: gl.constexpr, GROUP: gl.constexpr, G: gl.constexpr,
    WORD_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr, SPLIT: gl.constexpr, PDL: gl.constexpr,
    STAGES: gl.constexpr,
):  # fmt: skip
    """`_mma_gemv_kernel` with the words brought by TMA into a ring of STAGES steps in shared
    memory: the copies are asynchronous, so the bytes in flight cost no registers, and the
    first ones go out before the PDL wait (nothing writes a weight)."""
    WPG: gl.constexpr = GROUP // 8
    KS: gl.constexpr = G * GROUP
    STEP_BYTES: gl.constexpr = ROWS * G * WPG * 4
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]
    )
    pid = gl.program_id(0)
    pid_k = gl.program_id(1)
    g_begin = pid_k * split_groups
    steps = split_groups // G
    ring = gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, G * WPG], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
    row0 = pid * ROWS
    col0 = g_begin * WPG
    for slot in gl.static_range(STAGES - 1):
        mbarrier.expect(ready.index(slot), STEP_BYTES, pred=slot < steps)
        tma.async_copy_global_to_shared(
            w_desc, [row0, col0 + slot * G * WPG], ready.index(slot), ring.index(slot),
            pred=slot < steps,
        )  # fmt: skip
    x_at, x_ok, s_at, b_at, xs_at, cols, n = _operands(
        xperm_ptr, xsum_ptr, scales_ptr, biases_ptr, pid, g_begin, N, groups, ROWS, GROUP, G,
        X_LAYOUT, mma,
    )  # fmt: skip
    col_ok = (cols < G)[None, :]
    _wait_for_producer(PDL)
    acc_c = gl.zeros([ROWS, 8], gl.float32, mma)
    acc_s = gl.zeros([ROWS, 8], gl.float32, mma)
    acc_b = gl.zeros([ROWS, 8], gl.float32, mma)
    zero = gl.zeros([ROWS, 8], gl.float32, mma)
    scale = gl.load(s_at, mask=col_ok, other=0.0)
    bias = gl.load(b_at, mask=col_ok, other=0.0)
    for step in range(steps):
        current = step % STAGES
        mbarrier.wait(ready.index(current), (step // STAGES) & 1)
        words = ring.index(current).load(WORD_LAYOUT)
        # Every warp has read the slot of the step before (read before this barrier): refill it.
        gl.thread_barrier()
        ahead = step + STAGES - 1
        refill = (current + STAGES - 1) % STAGES
        mbarrier.expect(ready.index(refill), STEP_BYTES, pred=ahead < steps)
        tma.async_copy_global_to_shared(
            w_desc, [row0, col0 + ahead * G * WPG], ready.index(refill), ring.index(refill),
            pred=ahead < steps,
        )  # fmt: skip
        more = step + 1 < steps
        xv = gl.load(x_at, mask=x_ok, other=0.0)
        xs = gl.load(xs_at, mask=cols < G, other=0.0)
        next_scale = gl.load(s_at + G, mask=col_ok & more, other=0.0)
        next_bias = gl.load(b_at + G, mask=col_ok & more, other=0.0)
        x_at += KS
        s_at += G
        b_at += G
        xs_at += G
        acc_c, acc_s, acc_b = _step(
            acc_c, acc_s, acc_b, words, scale, bias, xv, xs, zero, bf16_128_pair,
            ROWS, GROUP, G, mma,
        )  # fmt: skip
        scale, bias = next_scale, next_bias
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(slot))
    _finish(
        acc_c, acc_s, acc_b, out_ptr, partial_ptr, counter_ptr, n, N, pid, pid_k, ROWS, SPLIT,
        gl.SliceLayout(1, mma),
    )  # fmt: skip


@triton.jit
def _prep_kernel(
    x_ptr, xperm_ptr, xsum_ptr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """x per group in B-fragment order (quarter q, then register i, b, e) and its fp32 sum."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    LANE_WORDS: tl.constexpr = GROUP // 32
    g = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    o = tl.arange(0, GROUP)
    q = o // (GROUP // 4)
    r = o % (GROUP // 4)
    e, b, i = r & 1, (r >> 1) & 1, r >> 2
    code = (q * LANE_WORDS + (i >> 1)) * 8 + b + 2 * (i & 1) + 4 * e
    x = tl.load(x_ptr + g[:, None] * GROUP + code[None, :])
    tl.store(xperm_ptr + g[:, None] * GROUP + o[None, :], x)
    tl.store(xsum_ptr + g, tl.sum(x.to(tl.float32), axis=1))


_SPLIT_BUFFERS: dict = {}


def mma_gemv(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    launch: tuple[int, int, int, int, int],
    prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``x [K] @ W.T`` for a 4-bit g64 weight; launch = (warps, reps, G, split, stages):
    stages 0 loads the words into registers, more brings them by TMA through that many
    shared-memory steps."""
    warps, reps, steps_groups, split, stages = launch
    n, row_words = packed.shape
    groups = row_words * 8 // GROUP
    rows, word_layout, x_layout = layouts(warps, reps, GROUP, steps_groups)
    if prepared is None:
        xperm = torch.empty_like(x)
        xsum = torch.empty(groups, dtype=torch.float32, device=x.device)
        block = 4 if groups % 4 == 0 else 1
        _prep_kernel[(groups // block,)](x, xperm, xsum, GROUP, block, True, launch_pdl=True)
    else:
        xperm, xsum = prepared
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n, rows)
    partial = counter = out
    if split > 1:
        key = (n, split, blocks)
        if key not in _SPLIT_BUFFERS:
            _SPLIT_BUFFERS[key] = (
                torch.empty(split, n, dtype=torch.float32, device=x.device),
                torch.zeros(blocks, dtype=torch.int32, device=x.device),
            )
        partial, counter = _SPLIT_BUFFERS[key]
    common = (scales, biases, out, partial, counter)
    if stages:
        step_words = steps_groups * GROUP // 8
        swizzled = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        words = TensorDescriptor.from_tensor(packed.view(torch.int32), [rows, step_words], swizzled)
        _mma_gemv_tma_kernel[(blocks, split)](
            xperm, xsum, words, *common, n, groups, groups // split, BF16_128_PAIR,
            warps, rows, GROUP, steps_groups, word_layout, x_layout, split, True, stages,
            num_warps=warps, launch_pdl=True,
        )  # fmt: skip
    else:
        _mma_gemv_kernel[(blocks, split)](
            xperm, xsum, packed.view(torch.int32), *common, n, row_words, groups,
            groups // split, BF16_128_PAIR,
            warps, rows, GROUP, steps_groups, word_layout, x_layout, split, True,
            num_warps=warps, launch_pdl=True,
        )  # fmt: skip
    return out


def time_weight(n: int, k: int, label: str, sms: int) -> list[str]:
    """Table rows for one weight shape: the library's GEMV, then every mma launch that fits."""
    weights = [packed_weight(n, k, 4, GROUP)]
    moved = sum(t.numel() * t.element_size() for t in weights[0])
    while len(weights) * moved < 4 * L2_BYTES and len(weights) < 16:
        weights.append(packed_weight(n, k, 4, GROUP))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    dense = dequantize_affine(*weights[0], 4, GROUP).to(torch.bfloat16)
    want = torch.nn.functional.linear(x, dense)
    magnitude = x.double().abs() @ dense.double().abs().T
    del dense
    lines = []

    def row(kernel: str, micros: float, verdict: str, alone: float | None = None) -> None:
        shown = f"{micros:.1f}" + (f" ({alone:.1f})" if alone is not None else "")
        share = moved / (micros * 1e-6) / COPY_BANDWIDTH
        lines.append(f"| {label} {n}x{k} | {kernel} | {shown} | {share:.0%} | {verdict} |")
        print(lines[-1], flush=True)

    got = am.affine_gemv_triton(x, *weights[0], 4, GROUP)
    calls = [(lambda w=w: am.affine_gemv_triton(x, *w, 4, GROUP)) for w in weights]
    config = am.gemv_config(n, k, 4, GROUP, sms)
    row(f"library {config}", time_graph(calls), within_bound(got, want, magnitude, k))
    groups = k // GROUP
    xperm = torch.empty_like(x[0])
    xsum = torch.empty(groups, dtype=torch.float32, device=x.device)
    _prep_kernel[(groups // 4,)](x[0], xperm, xsum, GROUP, 4, False)
    for launch in itertools.product((4, 8), (1, 2), (4,), (1, 2, 4, 8), STAGES):
        warps, reps, steps_groups, split, stages = launch
        programs = triton.cdiv(n, 16 * warps * reps) * split
        if groups % (split * steps_groups) or not sms <= programs <= 8 * sms:
            continue
        got = mma_gemv(x[0], *weights[0], launch)[None]
        verdict = within_bound(got, want, magnitude, k)
        calls = [(lambda w=w, c=launch: mma_gemv(x[0], *w, c)) for w in weights]
        micros = time_graph(calls)
        prepared = (xperm, xsum)
        alone = [(lambda w=w, c=launch, p=prepared: mma_gemv(x[0], *w, c, p)) for w in weights]
        tma_stages = f" tma{stages}" if stages else ""
        kernel = f"mma w{warps} r{reps} G{steps_groups} s{split}{tma_stages}"
        row(kernel, micros, verdict, time_graph(alone))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", choices=("12b", "e4b", "both"), default="both")
    args = parser.parse_args()
    shapes = {"12b": SHAPES[:-1], "e4b": E4B_SHAPES[:4], "both": SHAPES[:-1] + E4B_SHAPES[:4]}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    lines = [
        f"# 4-bit GEMV on mma.sync (Gluon) vs the library's ({time.strftime('%Y-%m-%d')}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})",
        "",
        "MLX 4-bit g64, M = 1. µs per call (with x's permutation launch; the GEMV alone in "
        "brackets): CUDA graphs of back-to-back calls on distinct weights past L2. % of "
        f"{COPY_BANDWIDTH / 1e12:.1f} TB/s over words, scales and biases. Launch: warps, "
        "repetitions (16 rows a warp each), groups a step, K splits.",
        "",
        "| shape | kernel, launch | µs | % | check |",
        "|---|---|---|---|---|",
    ]
    for n, k, label in shapes[args.shapes]:
        lines += time_weight(n, k, label, sms)
    out = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gemv_affine_mma_gluon.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
