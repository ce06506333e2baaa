"""Matmuls that read MLX affine-quantized weights (``w = scale * q + bias``) where they lie.

Layout (hearth.quant.mlx): packed uint32 ``[..., N, K * bits / 32]``, codes LSB first; scales
and biases ``[..., N, K / group]``. Triton paths, each beside its torch reference:

* **GEMV** (M <= 4 rows: decode, a few speculative rows): each program owns ``BLOCK_N``
  output rows and walks its share of K a step of ``BLOCK_G`` groups at a time. A step is a
  ``[BLOCK_N, BLOCK_G * words per group]`` tile of packed words, read where they lie; a thread
  holds contiguous words of several rows, so each x value it loads serves all of them. The M
  rows of x are unrolled (one accumulator each, never a tensor dimension) and share the
  unpacked codes. A code becomes an exact float with one AND|OR and one subtraction (the
  exponent trick): the code at bits ``[p, p + bits)`` of a word, ``p + bits <= 23``, ORed
  with the exponent of ``2**(23 - p)`` is the float ``2**(23 - p) + code``; codes above bit 23
  are moved down 16 first. Per group it forms ``sum(x * q)`` and applies
  ``scale * that + bias * sum(x)``, so the scale and bias cost nothing per element. Where N
  gives too few programs, K is split: each program stores fp32 partials and a small launch
  of its own (PDL) adds them in split order (deterministic, CUDA-graph safe); were the last
  program of a row block to arrive to add them, its serial tail after the loop (a release, an
  arrival count, the partials' loads) would outlast the launch gap PDL hides. The launch
  config comes from `gemv_config`, a small heuristic fitted to launch sweeps. With
  `prefetch` the loop requests the next
  step's words, scales and biases before this step's arithmetic (Triton does not
  software-pipeline a `while` loop), keeping two steps of loads in flight per program. With
  `codes_major_x` the launcher first copies x into `codes_major` order (a PDL Triton kernel),
  so that the x values a thread needs for one code position are one vector load (the 4-bit
  kernel was bound by L1 requests for x). 4-bit codes are taken as ``offset + code`` floats
  (one LOP3 per code after one shift per pair), their offsets taken off per group from the x
  sums: fp32 sums of ``x * (offset + code)`` with offsets 16 and 256 lose a few bits against
  sums of ``x * code``, ~2^-16 of sum |x * w|, far below the output's rounding.
* **Gathered GEMV** (MoE decode): the unrolled GEMV with a third grid axis over the (token,
  slot) pairs, each reading only the rows of the expert that pair chose; the ids stay on the
  device (no sync, so CUDA graphs can capture it). A float kernel serves bf16 experts.
* **Tensor cores** (MMA_MIN_ROWS..MMA_MAX_ROWS = 5..64 rows: batched decode): the codes are
  read once and each group's dot runs as ``tl.dot`` (mma) of the codes ``[BLOCK_N, group]``
  by x transposed, M padded to a tile of 16, 32 or 64; a second dot by ones gives the
  group's sums of x in the same layout, and ``scale * dot + bias * sum(x)`` applies in fp32
  per group, as in the GEMVs. Codes are exact in x's dtype (< 256); 4-bit codes of a bf16 x
  are made as bf16 ``128 + code`` pairs (one shift and one LOP3 per two codes), the 128
  taken off with the bias. Launches from `mma_config` (fixed per shape class: CUDA graphs
  capture it); a K split's partials are added in split order by the GEMV's sum launch.
* **Tile GEMV** (gathered experts too large for the unrolled GEMV's int32 offsets; 5..16
  rows where called directly): the rows are a tensor dimension of one
  ``[M, BLOCK_N, groups, words]`` tile, with the same per-group scale and bias; autotuned. A
  K split's last program to arrive (an acq_rel counter) adds the partials in split order and
  resets the counter.
* **Prefill** (M > MMA_MAX_ROWS): dequantize once with a Triton kernel that rounds exactly as
  ``dequantize_affine`` does, then cuBLAS. Dequantizing costs ~N*K*2 bytes, small beside the
  2*M*N*K FLOPs of a long prompt.

Accumulation is fp32 everywhere. Bits 4 and 8 have kernels; other widths use the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from hearth.ops import HAS_TRITON, kernel_enabled, pdl_options
from hearth.ops.activation import gelu_tanh_mul_reference
from hearth.ops.launch import launch_kernel
from hearth.quant import mlx as mlx_affine

KERNEL_BITS = (4, 8)
# Above this many rows the weight is dequantized once and cuBLAS runs the matmul.
GEMV_MAX_ROWS = 16
# Rows the GEMV kernel unrolls; 5..GEMV_MAX_ROWS rows take the tile kernel.
UNROLLED_ROWS = 4
WORD_BITS = 32
MAX_SPLIT_K = 8
# Widths whose `gemv_config` launches the register-prefetching loop (GemvConfig.prefetch):
# the 4-bit loop has too few bytes in flight without it; 8-bit measured slower with it.
GEMV_PREFETCH_BITS = (4,)
# Where `gemv_config` says so, the GEMV reads x codes-major (`codes_major`, in blocks of
# X_BLOCK_WORDS words): per code position j, the x values of a thread's words are adjacent,
# one vector load instead of one 2-byte load per word and j (the 4-bit GEMV was bound by L1
# requests, most of them x loads). A PDL Triton kernel reorders x before the GEMV, unless
# x's producer stored it so (`CodesMajor`).
X_BLOCK_WORDS = 32
# Outputs a program of the K split's sum launch adds (`_sum_splits_kernel`): 12B's 3840 rows
# in 15 programs.
SPLIT_SUM_BLOCK = 256


# ---------------------------------------------------------------------------------------------
# Torch references


def codes_major(x: Tensor, bits: int, block_words: int = X_BLOCK_WORDS) -> Tensor:
    """x ``[M, K]`` reordered per block of `block_words` packed words so that, within a block,
    the inputs of code position j of every word are adjacent: ``[M, blocks, codes, words]``,
    element ``[m, b, j, w] = x[m, (b * block_words + w) * codes + j]`` (codes = 32 / bits)."""
    m, k = x.shape
    codes = WORD_BITS // bits
    blocks = k // (codes * block_words)
    return x.view(m, blocks, block_words, codes).transpose(2, 3).contiguous()


def codes_major_fits(k: int, bits: int, block_words: int = X_BLOCK_WORDS) -> bool:
    return k % (WORD_BITS // bits * block_words) == 0


class CodesMajor(NamedTuple):
    """x ``[..., K]`` already in `codes_major` order (`values`, ``[M, blocks, codes, words]``
    contiguous), as a norm kernel stores it for the 4-bit GEMV after it (`reads_codes_major`):
    the GEMV then reads it without its own reorder launch. `shape` is x's."""

    values: Tensor
    shape: torch.Size

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def input_order(self) -> Tensor:
        """x in input order (the reference's operand)."""
        return self.values.transpose(2, 3).reshape(self.shape)


class Gather(NamedTuple):
    """The (token, slot) pairs of a gathered GEMV over MoE experts: each pair's expert id
    (`ids`, ``[pairs]``) and x row ``pair // x_rows_per_id`` (top_k where a token's slots share
    its row, 1 where each slot has its own)."""

    ids: Tensor
    x_rows_per_id: int


def affine_matmul_reference(
    x: Tensor, packed: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int
) -> Tensor:
    """``x @ W.T`` with W dequantized exactly as mlx does, then cast to the activations' dtype."""
    return F.linear(
        x, mlx_affine.dequantize_affine(packed, scales, biases, bits, group_size).to(x.dtype)
    )


def affine_embed_reference(
    ids: Tensor, packed: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int
) -> Tensor:
    """Rows `ids` of an MLX-packed token table ``[*ids.shape, K]`` in the scales' dtype,
    dequantizing only those rows."""
    rows = packed.view(torch.int32)[ids].view(torch.uint32)  # CUDA has no uint32 gather
    return mlx_affine.dequantize_affine(rows, scales[ids], biases[ids], bits, group_size)


def affine_embed(
    ids: Tensor,
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
    bits: int,
    group_size: int,
    dtype: torch.dtype,
) -> Tensor:
    """`affine_embed_reference` cast to `dtype`; on CUDA at 4 and 8 bits one kernel, bit for
    bit (eagerly the gathers, unpacking and roundings are ~23 launches a table a step)."""
    if kernel_enabled(packed) and bits in KERNEL_BITS:
        return affine_dequantize_triton(packed, scales, biases, bits, group_size, dtype, ids)
    return affine_embed_reference(ids, packed, scales, biases, bits, group_size).to(dtype)


def _slot_rows(x: Tensor, expert_ids: Tensor) -> Tensor:
    """One input row per (token, slot) pair, ``[T * top_k, K]``: x is ``[T, K]`` (shared by a
    token's slots, as the gate/up projection is) or ``[T, top_k, K]`` (one row per slot)."""
    if x.dim() == 2:
        x = x[:, None, :].expand(-1, expert_ids.shape[1], -1)
    return x.reshape(-1, x.shape[-1])


def _check_expert_shapes(x: Tensor, expert_ids: Tensor) -> None:
    if expert_ids.dim() != 2 or x.shape[0] != expert_ids.shape[0]:
        raise ValueError(f"expert_ids {tuple(expert_ids.shape)} must be [tokens, top_k] of x")
    if x.dim() == 3 and x.shape[1] != expert_ids.shape[1]:
        raise ValueError(
            f"x {tuple(x.shape)} has a row per slot, but top_k is {expert_ids.shape[1]}"
        )


def affine_expert_matmul_reference(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
    expert_ids: Tensor,
    bits: int,
    group_size: int,
    geglu_out: bool = False,
) -> Tensor:
    """``[T, top_k, N]``: each pair's input times its expert's dequantized weight ``[N, K]``;
    with `geglu_out`, ``gelu_tanh_mul`` of it, ``[T, top_k, N / 2]``."""
    _check_expert_shapes(x, expert_ids)
    ids = expert_ids.reshape(-1)
    words = packed.view(torch.int32)[ids].view(torch.uint32)  # CUDA cannot index uint32
    weights = mlx_affine.dequantize_affine(words, scales[ids], biases[ids], bits, group_size)
    rows = _slot_rows(x, expert_ids)
    out = torch.bmm(weights.to(x.dtype), rows[:, :, None])[..., 0].view(*expert_ids.shape, -1)
    return gelu_tanh_mul_reference(out) if geglu_out else out


def float_expert_matmul_reference(
    x: Tensor, weight: Tensor, expert_ids: Tensor, geglu_out: bool = False
) -> Tensor:
    """``[T, top_k, N]`` of float experts ``weight [E, N, K]``, as the quantized one above.
    With `geglu_out` the experts are a stacked gate/up and the output ``gelu_tanh_mul`` of
    the product, ``[T, top_k, N / 2]``."""
    _check_expert_shapes(x, expert_ids)
    rows = _slot_rows(x, expert_ids)
    chosen = weight[expert_ids.reshape(-1)].to(x.dtype)
    out = torch.bmm(chosen, rows[:, :, None])[..., 0].view(*expert_ids.shape, -1)
    return gelu_tanh_mul_reference(out) if geglu_out else out


# ---------------------------------------------------------------------------------------------
# Dispatchers: the Triton kernel on CUDA for the widths it covers, the reference otherwise


def affine_gemv_partials(
    x: Tensor, packed: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int
) -> Tensor | None:
    """``x @ W.T``'s fp32 partial sums [splits, ..., N], not yet added, where the GPU's GEMV
    splits K for this shape: a consumer adds them in split order, as the GEMV's own sum launch
    would (`norm.Partials`). None where it would not split or off the GPU: use `affine_linear`."""
    if not (kernel_enabled(x) and bits in KERNEL_BITS):
        return None
    return affine_gemv_partials_triton(x, packed, scales, biases, bits, group_size)


def affine_linear(
    x: Tensor | CodesMajor,
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
    bits: int,
    group_size: int,
) -> Tensor:
    """``x @ W.T`` of an MLX-packed W; the CPU path is the reference, bit for bit. x may be
    `CodesMajor` where `codes_major_input` said so."""
    if isinstance(x, CodesMajor):
        if not kernel_enabled(x.values):
            x = x.input_order()
        else:
            return affine_gemv_triton(x, packed, scales, biases, bits, group_size)
    if kernel_enabled(x) and bits in KERNEL_BITS:
        return affine_matmul_triton(x, packed, scales, biases, bits, group_size)
    return affine_matmul_reference(x, packed, scales, biases, bits, group_size)


def codes_major_input(
    x: Tensor, packed: Tensor, bits: int, group_size: int
) -> tuple[int, int] | None:
    """(codes per word, words per block) where the GPU GEMV of x ``[..., K]`` by this packed
    weight reads x `codes_major` (and so would reorder it first), for a producer to store x so
    (`CodesMajor`) instead; None where it reads x in input order, or off the GPU."""
    if not (kernel_enabled(x) and bits in KERNEL_BITS) or x.numel() == 0:
        return None
    rows = x.reshape(-1, x.shape[-1])  # only its shape is read
    config = _unrolled_config(rows, packed, bits, group_size, None)
    if config is None or not _reads_codes_major(config, x.shape[-1], bits):
        return None
    return WORD_BITS // bits, X_BLOCK_WORDS


def _reads_codes_major(config: GemvConfig, k: int, bits: int) -> bool:
    """Whether an unrolled launch of `config` reads x `codes_major` (else in input order)."""
    return config.codes_major_x and codes_major_fits(k, bits, X_BLOCK_WORDS)


def affine_gemv_geglu_out(
    x: Tensor | CodesMajor,
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
    bits: int,
    group_size: int,
) -> Tensor | None:
    """``gelu_tanh(gate) · up`` of x times a stacked gate/up weight ``[2 * I, K]``, stored by
    the GPU GEMV itself (one GeGLU launch fewer, the same bits), where that GEMV runs without
    a K split; None elsewhere (then project and `gelu_tanh_mul`)."""
    if not (kernel_enabled(x.values if isinstance(x, CodesMajor) else x) and bits in KERNEL_BITS):
        return None
    return affine_gemv_geglu_out_triton(x, packed, scales, biases, bits, group_size)


def affine_expert_matmul(
    x: Tensor,
    packed: Tensor,
    scales: Tensor,
    biases: Tensor,
    expert_ids: Tensor,
    bits: int,
    group_size: int,
    geglu_out: bool = False,
) -> Tensor:
    """``[T, top_k, N]``: x ``[T, K]`` or ``[T, top_k, K]`` times the chosen experts' weights;
    with `geglu_out`, ``gelu_tanh_mul`` of that product of stacked gate/up experts, stored by
    the GPU's GEMV (one GeGLU launch fewer)."""
    args = (x, packed, scales, biases, expert_ids, bits, group_size)
    if kernel_enabled(x) and bits in KERNEL_BITS:
        return affine_expert_matmul_triton(*args, geglu_out=geglu_out)
    return affine_expert_matmul_reference(*args, geglu_out=geglu_out)


def float_expert_matmul(
    x: Tensor, weight: Tensor, expert_ids: Tensor, geglu_out: bool = False
) -> Tensor:
    """``[T, top_k, N]`` of float experts ``[E, N, K]``, without a host sync on CUDA; with
    `geglu_out`, ``gelu_tanh_mul`` of the product of stacked gate/up experts ``[E, 2N, K]``,
    stored by the kernel (the GeGLU launch goes)."""
    if kernel_enabled(x):
        return float_expert_matmul_triton(x, weight, expert_ids, geglu_out=geglu_out)
    return float_expert_matmul_reference(x, weight, expert_ids, geglu_out)


# ---------------------------------------------------------------------------------------------
# GEMV launch configuration


@dataclass(frozen=True)
class GemvConfig:
    """A GEMV launch: output rows per program, groups per step, warps and K splits."""

    block_n: int
    block_g: int
    warps: int = 4
    split_k: int = 1
    prefetch: bool = False  # load step s + 1 before step s's arithmetic
    codes_major_x: bool = False  # read x reordered by `codes_major` where it fits

    def __str__(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        prefetch = " prefetch" if self.prefetch else ""
        ordered = " x-codes-major" if self.codes_major_x else ""
        return f"N{self.block_n} G{self.block_g} w{self.warps}{split}{prefetch}{ordered}"


H200_MULTIPROCESSORS = 132
# Rows from which a weight counts as a vocabulary head (Gemma's tied heads are 262144 rows).
HEAD_ROWS = 1 << 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@lru_cache(maxsize=256)
def gemv_config(
    n: int, k: int, bits: int, group: int, multiprocessors: int = H200_MULTIPROCESSORS
) -> GemvConfig:
    """The GEMV launch for an ``[N, K]`` weight, fitted to launch sweeps of group-64 weights at
    M=1 in CUDA graphs of back-to-back calls past L2, as decode runs them
    (`benchmarks/gpu_gemv_affine_sweep.py`):

    ==== ============================================== =================================
    bits shape class (examples, N x K)                   launch
    ==== ============================================== =================================
    4    N/32 row blocks > 2 per SM (30720 x 3840; head)  N64 G4, x codes-major
    4    fewer; rows of 129-511 words, N/16 blocks >= 1   N16 G16 unsplit, x in input order,
         per SM (8192 x 2816; 8192 x 3840)                no prefetching loop
    4    fewer; rows of >= 512 words (3840 x 15360)       N32 G16, splits to 1 program a SM
    4    fewer, other rows (2560 x 256)                   N64 G4, splits to 2 programs a SM
    8    N/32 row blocks > 2 per SM (30720 x 3840)        N32 G8
    8    N/16 row blocks > 2 per SM (8192 x 3840)         N16 G16
    8    fewer (3840 x 15360; 3840 x 4096)                N32 G8, splits to 2 programs a SM
    ==== ============================================== =================================

    A launch with few row blocks is latency bound and gains from anything that puts more
    bytes in flight per program: at 4 bits, 16 groups per step (a thread then holds 8 rows,
    so each x value it loads serves 8 codes) where every split still gets two whole steps,
    else 64 rows and more splits. Splits double until the row blocks give the programs
    marked, each keeping at least one whole step. 4-bit rows too short for two such steps a
    split, in enough row blocks of 16 to give every SM one, run unsplit: a split's partials
    and sum launch would cost more than it gains. Other group sizes keep the packed words
    per step, so G scales with 64 / group; they, and M > 1, are not measured. Widths in
    GEMV_PREFETCH_BITS take the prefetching loop (all but the unsplit short rows, as the
    gathered experts). Only 4-bit launches whose row blocks fill the GPU read x codes-major
    (their loop was bound by L1 requests for x); the others read x in input order, saving
    the reorder launch before them.
    """
    few = 2 * multiprocessors  # more row blocks than this fill the GPU without a K split
    many_rows = _cdiv(n, 32) > few
    row_words = k * bits // WORD_BITS
    long_rows = row_words >= 4 * 128  # two 128-word steps in each of two splits
    words_per_group = group * bits // WORD_BITS
    short_rows = row_words > 128 and not long_rows and _cdiv(n, 16) >= multiprocessors
    if bits == 4 and not many_rows and short_rows:
        return GemvConfig(16, max(1, 128 // words_per_group))
    # (rows per program, packed words per step, first split, programs the splits aim for)
    if bits == 4:
        if many_rows:
            launch = (64, 32, 1, 0)
        elif long_rows:
            launch = (32, 128, 2, multiprocessors)
        else:
            launch = (64, 32, 2, few)
    elif many_rows:
        launch = (32, 128, 1, 0)
    elif _cdiv(n, 16) > few:
        launch = (16, 256, 1, 0)
    else:
        launch = (32, 128, 2, few)
    block_n, step_words, split, programs = launch
    block_g = max(1, step_words // words_per_group)
    blocks = _cdiv(n, block_n)
    if split > 1:
        while blocks * split < programs and split < MAX_SPLIT_K:
            split *= 2
        # Each split gets at least one whole step of groups.
        split = max(1, min(split, k // group // block_g))
    return GemvConfig(
        block_n,
        block_g,
        split_k=split,
        prefetch=bits in GEMV_PREFETCH_BITS,
        codes_major_x=bits == 4 and many_rows,
    )


@lru_cache(maxsize=64)
def gathered_gemv_config(k: int, bits: int, group: int) -> GemvConfig:
    """The unrolled GEMV's launch over gathered experts of ``[N, K]``, fitted to a sweep of
    26B-A4B's at one token (8 experts a launch, in CUDA graphs past L2:
    `benchmarks/gpu_gathered_gemv_sweep.py`): steps of 128 packed words at 4 bits, 128 or 256
    at 8, x in input order (a codes-major x was slower at 4 bits), no K split (8 pairs fill
    the GPU), no prefetching loop:

    ==== ================================== ============
    bits shape (N x K)                       launch
    ==== ================================== ============
    4    gate/up 1408 x 2816 (352 words)     N32 G16 w4
    4    down 2816 x 704 (88 words: 1 step)  N16 G16 w4
    8    gate/up (704 words)                 N16 G8 w4
    8    down (176 words: 1 step)            N32 G16 w4
    ==== ================================== ============
    """
    words_per_group = group * bits // WORD_BITS
    row_words = k * bits // WORD_BITS
    step_words = 128 if bits == 4 or row_words > 256 else 256
    one_step = row_words <= step_words
    rows_one_step, rows_more = (16, 32) if bits == 4 else (32, 16)  # rows a program
    block_n = rows_one_step if one_step else rows_more
    return GemvConfig(block_n, max(1, step_words // words_per_group))


# Rows from which the tensor-core kernel takes a matmul (fewer: the unrolled GEMV) and up to
# which it does (more: dequantize once, then cuBLAS). One place for both thresholds.
MMA_MIN_ROWS = UNROLLED_ROWS + 1
MMA_MAX_ROWS = 64
# Programs per SM the K split of the tensor-core kernel aims for at most (fitted on an H100:
# benchmarks/results/affine_mma_sweep_h100-2026-12-07.md).
MMA_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class MmaConfig:
    """A launch of the tensor-core kernel (`_affine_mma_kernel`): x rows per tile (M padded to
    it), output columns per program, K splits, warps, and software-pipeline stages."""

    block_m: int
    block_n: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3

    def __str__(self) -> str:
        split = f" split{self.split_k}" if self.split_k > 1 else ""
        return f"M{self.block_m} N{self.block_n} w{self.warps} s{self.stages}{split}"


@lru_cache(maxsize=256)
def mma_config(
    m: int, n: int, k: int, bits: int, group: int, multiprocessors: int = H200_MULTIPROCESSORS
) -> MmaConfig:
    """The tensor-core kernel's launch for M rows of x by an ``[N, K]`` weight: one tile of
    16, 32 or 64 rows (mma's smallest M is 16); 128 output rows a program, or 64 where 128
    would leave SMs idle (12B's o_proj and down: 30 blocks of 128); 8 warps where the fp32
    ``[BLOCK_N, BLOCK_M]`` accumulators would pass 64 registers a thread at 4. K is split
    while that keeps at most two programs an SM, each split keeping at least 4 groups, and
    while the splits' fp32 partials (written and read: 8 bytes an output a split) stay under
    the weight's bytes. Fitted to `benchmarks/lab/gpu_affine_rows.py --sweep` on an H100
    (12B q/k/v split 2 and down split 4, at 16 and 64 rows: 1.3-1.7x unsplit)."""
    block_m = max(16, 1 << (m - 1).bit_length())
    block_n = 128 if _cdiv(n, 128) >= multiprocessors else 64
    warps = 4 if block_m * block_n <= 64 * 64 else 8
    blocks = _cdiv(n, block_n)
    groups = k // group
    # 8 * split * M * N partial bytes <= N * K * bits / 8
    most_splits = max(1, k * bits // (64 * m))
    split = 1
    while (
        blocks * split * 2 <= MMA_PROGRAMS_PER_SM * multiprocessors
        and split * 2 <= min(MAX_SPLIT_K, most_splits)
        and groups // (split * 2) >= 4
    ):
        split *= 2
    return MmaConfig(block_m, block_n, split, warps)


# ---------------------------------------------------------------------------------------------
# Triton kernels

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer
    from hearth.ops.activation import geglu

    # Globals a kernel reads must be constexpr objects (the interpreter does not enforce it).
    _KERNEL_WORD_BITS = tl.constexpr(WORD_BITS)
    # The float 2**23 as int32 bits, passed to the GEMV at run time: were the exponent a
    # constant, ptxas would need two LOP3s (one immediate operand each) for the AND and the OR.
    TWO23_BITS = 150 << 23

    @triton.jit
    def _store_geglu_pairs(out_row, values, first, N, BLOCK_N: tl.constexpr):
        """Store gelu_tanh(gate) * up [BLOCK_N / 2] at columns ``first + c`` of `out_row`,
        from the dots `values` [BLOCK_N] of gate and up rows in turn: each dot rounded as
        stored, then as `activation.gelu_tanh_mul` rounds, so the result equals the plain
        GEMV then the GeGLU kernel bit for bit."""
        gate, up = tl.split(tl.reshape(values.to(out_row.dtype.element_ty), [BLOCK_N // 2, 2]))
        c = first + tl.arange(0, BLOCK_N // 2)
        tl.store(out_row + c, geglu(gate, up), mask=c < N)

    @triton.jit
    def _codes_as_float(words, shift: tl.constexpr, mask: tl.constexpr):
        """Codes at bit `shift` of int32 words, as exact fp32: ``2**23 + code`` minus ``2**23``."""
        code = (words >> shift) & mask
        return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _exact_codes(words, two23, J: tl.constexpr, BITS: tl.constexpr):
        """Code J of each int32 word as exact fp32, without shifting it to bit 0: at bit P it
        is ORed with the exponent of ``2**(23 - P)`` (one LOP3 with the AND), giving the float
        ``2**(23 - P) + code``, and that power of two is subtracted. Codes reaching past bit 23
        would leave the mantissa, so those are moved down 16 first (one shift per word)."""
        MASK: tl.constexpr = (1 << BITS) - 1
        LOWER: tl.constexpr = 16 if J * BITS + BITS > 23 else 0
        P: tl.constexpr = J * BITS - LOWER
        exponent = two23 - (P << 23)
        if LOWER > 0:
            words = words >> LOWER  # arithmetic: the sign copies land above the mask
        values = ((words & (MASK << P)) | exponent).to(tl.float32, bitcast=True)
        return values - exponent.to(tl.float32, bitcast=True)

    @triton.jit
    def _offset_codes(words, two23, J: tl.constexpr):
        """4-bit code J of each int32 word as the exact fp32 ``OFFSET_J + code``, with no
        subtraction (the caller takes ``OFFSET_J * sum(x)`` off per group instead): one shift
        per pair of codes moves code 2p to bit 15 and code 2p + 1 to bit 19, where the
        exponent of ``2**(23 - P)`` makes them ``256 + code`` and ``16 + code``. Small offsets
        keep fp32 sums of ``x * (offset + code)`` within a few bits of sums of ``x * code``."""
        P: tl.constexpr = 15 if J % 2 == 0 else 19
        SHIFT: tl.constexpr = 15 - 8 * (J // 2)  # left; negative is right
        if SHIFT > 0:
            words = words << SHIFT
        elif SHIFT < 0:
            words = words >> -SHIFT  # arithmetic: the sign copies land above the mask
        exponent = two23 - (P << 23)
        return ((words & (15 << P)) | exponent).to(tl.float32, bitcast=True)

    @triton.jit
    def _add_row(
        acc,
        words,
        scale,
        bias,
        two23,
        x_row,
        k_word,
        k_ok,
        BITS: tl.constexpr,
        CODES: tl.constexpr,
        WPG: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr,
        MASKED: tl.constexpr,
        X_BLOCK: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        """acc ``[BLOCK_N, BLOCK_G]`` plus one x row's ``scale * sum(x q) + bias * sum(x)``
        per (output row, group) of the step; words is ``[BLOCK_N, BLOCK_G * WPG]``. x is in
        input order (X_BLOCK 0) or `codes_major` in blocks of X_BLOCK words."""
        dots = tl.zeros(words.shape, tl.float32)
        x_sums = tl.zeros(k_word.shape, tl.float32)
        x_odd_sums = tl.zeros(k_word.shape, tl.float32)  # FOLD: x of the odd codes
        for j in tl.static_range(CODES):
            # Code j of every word pairs with x at k = word * CODES + j: one x slice serves
            # every row a thread holds, and the code values every x row (the compiler CSEs them
            # across the unrolled rows).
            q = _offset_codes(words, two23, j) if FOLD else _exact_codes(words, two23, j, BITS)
            if X_BLOCK == 0:
                x_at = x_row + k_word * CODES + j
            else:
                x_at = x_row + (k_word // X_BLOCK) * (X_BLOCK * CODES) + j * X_BLOCK
                x_at += k_word % X_BLOCK
            xj = tl.load(x_at, mask=k_ok, other=0) if MASKED else tl.load(x_at)
            xj = xj.to(tl.float32)
            dots += q * xj[None, :]
            if FOLD and j % 2 == 1:
                x_odd_sums += xj
            else:
                x_sums += xj
        group_dots = tl.sum(tl.reshape(dots, [BLOCK_N, BLOCK_G, WPG]), axis=2)
        group_x = tl.sum(tl.reshape(x_sums, [BLOCK_G, WPG]), axis=1)
        if FOLD:  # x_sums holds the even codes' x: take off 256 * those + 16 * the odd ones
            group_odd = tl.sum(tl.reshape(x_odd_sums, [BLOCK_G, WPG]), axis=1)
            group_dots -= (256.0 * group_x + 16.0 * group_odd)[None, :]
            group_x += group_odd
        return acc + (group_dots * scale + bias * group_x[None, :])

    @triton.jit
    def _load_step(
        packed_ptr,
        scales_ptr,
        biases_ptr,
        word_rows,
        group_rows,
        g0,
        g_end,
        WPG: tl.constexpr,
        BLOCK_G: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """The packed words ``[BLOCK_N, BLOCK_G * WPG]`` and fp32 scales and biases
        ``[BLOCK_N, BLOCK_G]`` of groups ``[g0, g0 + BLOCK_G)``. MASKED only for a split's tail:
        a mask costs a compare per element, so whole steps go without."""
        k_word = g0 * WPG + tl.arange(0, BLOCK_G * WPG)
        g = g0 + tl.arange(0, BLOCK_G)
        word_at = packed_ptr + word_rows[:, None] + k_word[None, :]
        group_at = group_rows[:, None] + g[None, :]
        if MASKED:
            words = tl.load(word_at, mask=(k_word < g_end * WPG)[None, :], other=0)
            g_ok = (g < g_end)[None, :]
            scale = tl.load(scales_ptr + group_at, mask=g_ok, other=0).to(tl.float32)
            bias = tl.load(biases_ptr + group_at, mask=g_ok, other=0).to(tl.float32)
        else:
            words = tl.load(word_at)
            scale = tl.load(scales_ptr + group_at).to(tl.float32)
            bias = tl.load(biases_ptr + group_at).to(tl.float32)
        return words, scale, bias

    @triton.jit
    def _gemv_step(
        acc0,
        acc1,
        acc2,
        acc3,
        words,
        scale,
        bias,
        x_ptr,
        g0,
        g_end,
        stride_xm,
        two23,
        M: tl.constexpr,
        BITS: tl.constexpr,
        CODES: tl.constexpr,
        WPG: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr,
        MASKED: tl.constexpr,
        X_BLOCK: tl.constexpr,
        FOLD: tl.constexpr,
    ):
        """Add the loaded groups ``[g0, g0 + BLOCK_G)`` to the M accumulators."""
        k_word = g0 * WPG + tl.arange(0, BLOCK_G * WPG)
        k_ok = k_word < g_end * WPG
        acc0 = _add_row(
            acc0, words, scale, bias, two23, x_ptr, k_word, k_ok,
            BITS, CODES, WPG, BLOCK_N, BLOCK_G, MASKED, X_BLOCK, FOLD,
        )  # fmt: skip
        if M > 1:
            acc1 = _add_row(
                acc1, words, scale, bias, two23, x_ptr + stride_xm, k_word, k_ok,
                BITS, CODES, WPG, BLOCK_N, BLOCK_G, MASKED, X_BLOCK, FOLD,
            )  # fmt: skip
        if M > 2:
            acc2 = _add_row(
                acc2, words, scale, bias, two23, x_ptr + 2 * stride_xm, k_word, k_ok,
                BITS, CODES, WPG, BLOCK_N, BLOCK_G, MASKED, X_BLOCK, FOLD,
            )  # fmt: skip
        if M > 3:
            acc3 = _add_row(
                acc3, words, scale, bias, two23, x_ptr + 3 * stride_xm, k_word, k_ok,
                BITS, CODES, WPG, BLOCK_N, BLOCK_G, MASKED, X_BLOCK, FOLD,
            )  # fmt: skip
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _load_and_add_step(
        acc0, acc1, acc2, acc3, packed_ptr, scales_ptr, biases_ptr, word_rows, group_rows,
        x_ptr, g0, g_end, stride_xm, two23, M: tl.constexpr, BITS: tl.constexpr,
        CODES: tl.constexpr, WPG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
        MASKED: tl.constexpr, X_BLOCK: tl.constexpr, FOLD: tl.constexpr,
    ):  # fmt: skip
        """`_load_step` of groups ``[g0, g0 + BLOCK_G)``, then `_gemv_step` of them."""
        words, scale, bias = _load_step(
            packed_ptr, scales_ptr, biases_ptr, word_rows, group_rows, g0, g_end,
            WPG, BLOCK_G, MASKED,
        )  # fmt: skip
        return _gemv_step(
            acc0, acc1, acc2, acc3, words, scale, bias, x_ptr, g0, g_end, stride_xm,
            two23, M, BITS, CODES, WPG, BLOCK_N, BLOCK_G, MASKED, X_BLOCK, FOLD,
        )  # fmt: skip

    @triton.jit
    def _store_row(out_ptr, acc, n, n_ok):
        tl.store(out_ptr + n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _affine_gemv_kernel(
        x_ptr,
        packed_ptr,
        scales_ptr,
        biases_ptr,
        out_ptr,
        partial_ptr,
        N,
        row_words,
        groups,
        split_groups,
        stride_xm,
        stride_om,
        two23,
        ids_ptr,
        x_rows_per_id,
        M: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PREFETCH: tl.constexpr,
        X_BLOCK: tl.constexpr,
        FOLD: tl.constexpr,
        PDL: tl.constexpr,
        GEGLU_OUT: tl.constexpr = False,
        GATHER: tl.constexpr = False,
    ):
        """out[m, n] = sum_k x[m, k] * w[n, k] for m < M <= 4; grid (blocks of N, splits of K).
        A K split only stores its fp32 partials (`_sum_splits_kernel` adds them). With
        GEGLU_OUT (no K split) the weight is a stacked gate/up ``[2 * I, K]``: a program's rows
        are gate and up rows in turn, ``pid_n * BLOCK_N / 2 + r // 2`` of gate (r even) or of
        up (r odd), and it stores ``geglu(gate, up)`` into out ``[M, I]``
        (`_store_geglu_pairs`).

        `row_words` and `groups` (K / codes per word, K / GROUP) are passed, not derived, so
        Triton sees the row strides' divisibility and loads 16 bytes at a time. Split s owns
        groups ``[s * split_groups, (s + 1) * split_groups)``, whole steps but for the last.
        The loops are `while` loops: Triton's interpreter cannot run `range` to a run-time
        bound. two23: see TWO23_BITS.

        With GATHER (M = 1, no K split) grid axis 2 is a (token, slot)
        pair r of MoE experts stacked ``[E, N, ...]``: the weight is expert ``ids[r]``
        (``N * row_words`` words and ``N * groups`` scales apart), x row ``r // x_rows_per_id``
        and out row r."""
        CODES: tl.constexpr = _KERNEL_WORD_BITS // BITS
        WPG: tl.constexpr = GROUP // CODES  # words per group
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        if GATHER:
            wait_for_producer(PDL)  # the router wrote the ids
            slot_pair = tl.program_id(2)
            expert_rows = tl.load(ids_ptr + slot_pair).to(tl.int64) * N
            packed_ptr += expert_rows * row_words
            scales_ptr += expert_rows * groups
            biases_ptr += expert_rows * groups
            x_ptr += (slot_pair // x_rows_per_id).to(tl.int64) * stride_xm
            out_ptr += slot_pair.to(tl.int64) * stride_om
        if GEGLU_OUT:
            r = tl.arange(0, BLOCK_N)
            pair = pid_n * (BLOCK_N // 2) + r // 2
            n = pair + (r % 2) * (N // 2)
            n_ok = pair < N // 2
        else:
            n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_ok = n < N
        # Rows past N read row N - 1 (no load masks) and are not stored. int32 offsets: the
        # launcher takes this kernel only for N * row_words < 2**31.
        n_read = tl.minimum(n, N - 1)
        word_rows = n_read * row_words
        group_rows = n_read * groups
        g0 = pid_k * split_groups
        if not GATHER:
            wait_for_producer(PDL)
        g_end = tl.minimum(g0 + split_groups, groups)
        acc0 = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_G], tl.float32)
        whole = (g_end - g0) // BLOCK_G  # steps without masks
        if PREFETCH and whole > 0:
            # Register double buffering: the next step's words are requested before this
            # step's arithmetic, so one program keeps two steps of loads in flight (a `while`
            # loop is not software-pipelined by Triton).
            words, scale, bias = _load_step(
                packed_ptr, scales_ptr, biases_ptr, word_rows, group_rows, g0, g_end,
                WPG, BLOCK_G, False,
            )  # fmt: skip
            last = g0 + (whole - 1) * BLOCK_G
            while g0 < last:
                next_words, next_scale, next_bias = _load_step(
                    packed_ptr, scales_ptr, biases_ptr, word_rows, group_rows, g0 + BLOCK_G,
                    g_end, WPG, BLOCK_G, False,
                )  # fmt: skip
                acc0, acc1, acc2, acc3 = _gemv_step(
                    acc0, acc1, acc2, acc3, words, scale, bias, x_ptr, g0, g_end,
                    stride_xm, two23, M, BITS, CODES, WPG, BLOCK_N, BLOCK_G, False, X_BLOCK,
                    FOLD,
                )  # fmt: skip
                words, scale, bias = next_words, next_scale, next_bias
                g0 += BLOCK_G
            acc0, acc1, acc2, acc3 = _gemv_step(
                acc0, acc1, acc2, acc3, words, scale, bias, x_ptr, g0, g_end, stride_xm,
                two23, M, BITS, CODES, WPG, BLOCK_N, BLOCK_G, False, X_BLOCK, FOLD,
            )  # fmt: skip
            g0 += BLOCK_G
        while g0 + BLOCK_G <= g_end:  # without PREFETCH
            acc0, acc1, acc2, acc3 = _load_and_add_step(
                acc0, acc1, acc2, acc3, packed_ptr, scales_ptr, biases_ptr, word_rows,
                group_rows, x_ptr, g0, g_end, stride_xm, two23, M, BITS, CODES, WPG,
                BLOCK_N, BLOCK_G, False, X_BLOCK, FOLD,
            )  # fmt: skip
            g0 += BLOCK_G
        if g0 < g_end:
            acc0, acc1, acc2, acc3 = _load_and_add_step(
                acc0, acc1, acc2, acc3, packed_ptr, scales_ptr, biases_ptr, word_rows,
                group_rows, x_ptr, g0, g_end, stride_xm, two23, M, BITS, CODES, WPG,
                BLOCK_N, BLOCK_G, True, X_BLOCK, FOLD,
            )  # fmt: skip

        if GEGLU_OUT:
            first = pid_n * (BLOCK_N // 2)
            _store_geglu_pairs(out_ptr, tl.sum(acc0, axis=1), first, N // 2, BLOCK_N)
            if M > 1:
                _store_geglu_pairs(
                    out_ptr + stride_om, tl.sum(acc1, axis=1), first, N // 2, BLOCK_N
                )
            if M > 2:
                _store_geglu_pairs(
                    out_ptr + 2 * stride_om, tl.sum(acc2, axis=1), first, N // 2, BLOCK_N
                )
            if M > 3:
                _store_geglu_pairs(
                    out_ptr + 3 * stride_om, tl.sum(acc3, axis=1), first, N // 2, BLOCK_N
                )
        elif SPLIT_K == 1:
            _store_row(out_ptr, acc0, n, n_ok)
            if M > 1:
                _store_row(out_ptr + stride_om, acc1, n, n_ok)
            if M > 2:
                _store_row(out_ptr + 2 * stride_om, acc2, n, n_ok)
            if M > 3:
                _store_row(out_ptr + 3 * stride_om, acc3, n, n_ok)
        else:
            # Partials [SPLIT_K, M, N] fp32, for `_sum_splits_kernel`.
            own = partial_ptr + pid_k * M * N
            tl.store(own + n, tl.sum(acc0, axis=1), mask=n_ok)
            if M > 1:
                tl.store(own + N + n, tl.sum(acc1, axis=1), mask=n_ok)
            if M > 2:
                tl.store(own + 2 * N + n, tl.sum(acc2, axis=1), mask=n_ok)
            if M > 3:
                tl.store(own + 3 * N + n, tl.sum(acc3, axis=1), mask=n_ok)

    @triton.jit
    def _sum_splits(partial_ptr, out_ptr, n, n_ok, N, stride_om, M: tl.constexpr, SPLITS):
        """out[m, n] = the SPLITS partials [SPLITS, M, N] added in split order, from fp32
        zeros. `.cg` reads L2, where other programs' partials are, not a stale L1 line."""
        for m in tl.static_range(M):
            total = tl.zeros(n.shape, tl.float32)
            for split in tl.static_range(SPLITS):
                at = partial_ptr + (split * M + m) * N + n
                total += tl.load(at, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + m * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _sum_splits_kernel(
        partial_ptr, out_ptr, N, stride_om, M: tl.constexpr, SPLIT_K: tl.constexpr,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """`_sum_splits` of BLOCK outputs a program: a K-split GEMV's finish, in a launch of
        its own."""
        wait_for_producer(PDL)
        n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        _sum_splits(partial_ptr, out_ptr, n, n < N, N, stride_om, M, SPLIT_K)

    @triton.jit
    def _codes_major_kernel(
        x_ptr, out_ptr, stride_xm, K, CODES: tl.constexpr, BLOCK_WORDS: tl.constexpr,
        BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """`codes_major` of one x row (program_id 1) in blocks of BLOCK outputs: output i of
        the row is ``[block, j, w]`` and reads ``x[(block * BLOCK_WORDS + w) * CODES + j]``."""
        wait_for_producer(PDL)
        row = tl.program_id(1)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        per_block: tl.constexpr = CODES * BLOCK_WORDS
        j = (i % per_block) // BLOCK_WORDS
        w = i % BLOCK_WORDS
        at = (i // per_block * BLOCK_WORDS + w) * CODES + j
        ok = i < K
        x = tl.load(x_ptr + row * stride_xm + at, mask=ok)
        tl.store(out_ptr + row * K + i, x.to(out_ptr.dtype.element_ty), mask=ok)

    def codes_major_triton(x: Tensor, bits: int, block_words: int = X_BLOCK_WORDS) -> Tensor:
        """`codes_major` in one Triton launch (with PDL where the GPU has it)."""
        m, k = x.shape
        codes = WORD_BITS // bits
        blocks = k // (codes * block_words)
        out = torch.empty(m, blocks, codes, block_words, dtype=x.dtype, device=x.device)
        block = 1024
        launch_kernel(
            _codes_major_kernel,
            (triton.cdiv(k, block), m),
            x,
            out,
            x.stride(0),
            k,
            codes,
            block_words,
            block,
            **pdl_options(x),
        )
        return out

    @triton.jit
    def _affine_tile_gemv_kernel(
        x_ptr,
        packed_ptr,
        scales_ptr,
        biases_ptr,
        ids_ptr,
        out_ptr,
        partial_ptr,
        counter_ptr,
        M,
        N,
        stride_xm,
        stride_om,
        X_ROWS_PER_ID,
        ROWS,
        K: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        GATHER: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_KW: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        """out[r, m, n] = sum_k x[row(r) + m, k] * W_r[n, k]; W_r is expert ids[r] or the weight.

        Grid: (ROWS, blocks of weight rows, splits of K). Without GATHER there is one r and
        BLOCK_M rows of x; with it each r is a (token, slot) pair with one row, x row
        r // X_ROWS_PER_ID.
        """
        wait_for_producer(PDL)
        CODES: tl.constexpr = _KERNEL_WORD_BITS // BITS
        WORDS_PER_GROUP: tl.constexpr = GROUP // CODES
        BLOCK_G: tl.constexpr = (BLOCK_KW + WORDS_PER_GROUP - 1) // WORDS_PER_GROUP
        MASK: tl.constexpr = (1 << BITS) - 1
        pid_r = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        row_words = K // CODES
        groups = K // GROUP
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        if GATHER:
            expert = tl.load(ids_ptr + pid_r).to(tl.int64)
            packed_ptr += expert * N * row_words
            scales_ptr += expert * N * groups
            biases_ptr += expert * N * groups
            x_ptr += (pid_r // X_ROWS_PER_ID).to(tl.int64) * stride_xm
            out_ptr += pid_r.to(tl.int64) * stride_om

        m = tl.arange(0, BLOCK_M)
        m_ok = m < M
        word_rows = n.to(tl.int64) * row_words
        group_rows = n.to(tl.int64) * groups
        x_rows = m.to(tl.int64) * stride_xm
        # This split's groups, in whole steps of BLOCK_G so that loads stay aligned. The trip
        # count is a constexpr (K is one): Triton's interpreter cannot loop to runtime bounds.
        STEPS: tl.constexpr = ((K // GROUP + SPLIT_K - 1) // SPLIT_K + BLOCK_G - 1) // BLOCK_G
        g_begin = pid_k * (STEPS * BLOCK_G)

        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_G], tl.float32)
        for step in range(STEPS):
            g = g_begin + step * BLOCK_G + tl.arange(0, BLOCK_G)
            g_ok = g < groups
            word = g[:, None] * WORDS_PER_GROUP + tl.arange(0, WORDS_PER_GROUP)[None, :]
            words = tl.load(
                packed_ptr + word_rows[:, None, None] + word[None, :, :],
                mask=n_ok[:, None, None] & g_ok[None, :, None],
                other=0,
            )
            group_ok = n_ok[:, None] & g_ok[None, :]
            group_at = group_rows[:, None] + g[None, :]
            scale = tl.load(scales_ptr + group_at, mask=group_ok, other=0).to(tl.float32)
            bias = tl.load(biases_ptr + group_at, mask=group_ok, other=0).to(tl.float32)
            x_ok = m_ok[:, None, None] & g_ok[None, :, None]
            products = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_G, WORDS_PER_GROUP], tl.float32)
            x_sums = tl.zeros([BLOCK_M, BLOCK_G, WORDS_PER_GROUP], tl.float32)
            # Code j of every word pairs with x at k = word * CODES + j.
            for j in tl.static_range(CODES):
                q = _codes_as_float(words, j * BITS, MASK)
                xj = tl.load(
                    x_ptr + x_rows[:, None, None] + (word * CODES + j)[None, :, :],
                    mask=x_ok,
                    other=0,
                ).to(tl.float32)
                products += q[None, :, :, :] * xj[:, None, :, :]
                x_sums += xj
            dots = tl.sum(products, axis=3)
            acc += dots * scale[None, :, :] + bias[None, :, :] * tl.sum(x_sums, axis=2)[:, None, :]
        result = tl.sum(acc, axis=2)

        out_at = m[:, None] * stride_om + n[None, :]
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptr + out_at, result.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            # Partials [SPLIT_K, R, M, N] fp32; the last split to finish sums them in order.
            split_stride = tl.cast(ROWS, tl.int64) * M * N
            own = (pid_r * M + m[:, None]).to(tl.int64) * N + n[None, :]
            tl.store(partial_ptr + pid_k * split_stride + own, result, mask=out_ok)
            tl.debug_barrier()  # every thread's partial is written before the release below
            counter = counter_ptr + pid_r * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for split in tl.static_range(SPLIT_K):
                    # .cg reads L2, where the other programs' partials are, not a stale L1.
                    total += tl.load(
                        partial_ptr + split * split_stride + own,
                        mask=out_ok,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                tl.store(out_ptr + out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)
                tl.atomic_xchg(counter, 0)  # ready for the next launch (and CUDA-graph replays)

    @triton.jit
    def _code(words, J: tl.constexpr, BITS: tl.constexpr):
        """Code J of each int32 word."""
        return (words >> (J * BITS)) & ((1 << BITS) - 1)

    @triton.jit
    def _codes_in_order(words, BITS: tl.constexpr):
        """The codes of int32 words ``[R, W]`` as ``[R, W, 2, 2(, 2)]`` whose flattened last
        dims count codes 0, 1, 2... of each word: `tl.join` stacks its operands along a new
        last dim, so the outermost join takes even and odd codes, the next their halves."""
        if BITS == 4:
            even = tl.join(
                tl.join(_code(words, 0, 4), _code(words, 4, 4)),
                tl.join(_code(words, 2, 4), _code(words, 6, 4)),
            )
            odd = tl.join(
                tl.join(_code(words, 1, 4), _code(words, 5, 4)),
                tl.join(_code(words, 3, 4), _code(words, 7, 4)),
            )
        else:
            even = tl.join(_code(words, 0, 8), _code(words, 2, 8))
            odd = tl.join(_code(words, 1, 8), _code(words, 3, 8))
        return tl.join(even, odd)

    @triton.jit
    def _bf16_pairs(words, J: tl.constexpr, magic):
        """4-bit codes J and J + 4 of each int32 word as the bf16 pair ``(128 + q_J,
        128 + q_J+4)``, ``[R, W, 2]``: one shift and one AND|OR put each code under the
        exponent of 128 (`magic` is 0x43004300, a run-time operand so that ptxas makes one
        LOP3 of it); bf16's 7 mantissa bits hold a 4-bit code exactly."""
        pairs = ((words >> (4 * J)) & 0x000F000F) | magic
        low = (pairs & 0xFFFF).to(tl.int16)
        high = (pairs >> 16).to(tl.int16)
        return tl.join(low, high).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _offset_bf16_codes(words, magic):
        """The 4-bit codes of int32 words ``[R, W]`` as bf16 ``128 + code``,
        ``[R, W, 2, 2, 2]``, in order when flattened: pair J holds codes J and J + 4 (last
        dim h), and joining pairs (0, 2) and (1, 3), then those, puts code ``J + 4 h`` at
        ``4 h + J``."""
        return tl.join(
            tl.join(_bf16_pairs(words, 0, magic), _bf16_pairs(words, 2, magic)),
            tl.join(_bf16_pairs(words, 1, magic), _bf16_pairs(words, 3, magic)),
        )

    @triton.jit
    def _affine_mma_kernel(
        x_ptr,
        packed_ptr,
        scales_ptr,
        biases_ptr,
        out_ptr,
        partial_ptr,
        M,
        N,
        stride_xm,
        stride_om,
        K: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT_K: tl.constexpr,
        STAGES: tl.constexpr,
        DOT_FP32: tl.constexpr,
        OFFSET_CODES: tl.constexpr,
        PDL: tl.constexpr,
        magic=0x43004300,
    ):
        """out[m, n] = sum_g ( s[n, g] * D[n, m, g] + b[n, g] * X[m, g] ) for m < M <= BLOCK_M,
        D the dot of group g's codes with x and X the group's sum of x; grid (blocks of N,
        splits of K). Per group, two ``tl.dot`` into fp32 ``[BLOCK_N, BLOCK_M]``: its codes
        ``[BLOCK_N, GROUP]`` (exact in x's dtype: codes < 256) by x transposed, giving D, and
        ones by x, giving X already broadcast over the columns (no reduction across threads);
        the scale and the bias then act in fp32, as in the GEMVs. The weight is the dot's
        left operand: its rows fill the mma's M (64 a warpgroup), x's few rows its N.

        DOT_FP32: the dots in fp32 (ieee), for fp32 x (never tf32) and in Triton's
        interpreter, whose dot multiplies bf16 tiles' bit patterns as integers (bf16 to fp32
        is exact, so the sums are the same). A K split stores fp32 partials
        ``[SPLIT_K, M, N]`` (`_sum_splits_kernel` adds them). The trip count is a constexpr
        (K is one): the interpreter cannot loop to a run-time bound, and a constant count
        lets Triton pipeline the loads STAGES deep."""
        CODES: tl.constexpr = _KERNEL_WORD_BITS // BITS
        WPG: tl.constexpr = GROUP // CODES  # words per group
        GROUPS: tl.constexpr = K // GROUP
        ROW_WORDS: tl.constexpr = K // CODES
        SPLIT_GROUPS: tl.constexpr = (GROUPS + SPLIT_K - 1) // SPLIT_K
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        # Rows past N read row N - 1 (no weight masks) and are not stored.
        n_read = tl.minimum(n, N - 1).to(tl.int64)
        word_rows = n_read * ROW_WORDS
        group_rows = n_read * GROUPS
        m = tl.arange(0, BLOCK_M)
        m_ok = m < M
        x_rows = m.to(tl.int64) * stride_xm
        in_group = tl.arange(0, GROUP)
        word_in_group = tl.arange(0, WPG)
        g_begin = pid_k * SPLIT_GROUPS
        wait_for_producer(PDL)
        total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        ones = tl.full([BLOCK_N, GROUP], 1.0, tl.float32)
        for step in tl.range(0, SPLIT_GROUPS, num_stages=STAGES):
            g = g_begin + step
            g_ok = g < GROUPS  # the last split's tail steps add zeros
            xs = tl.load(  # [GROUP, BLOCK_M]
                x_ptr + x_rows[None, :] + g * GROUP + in_group[:, None],
                mask=m_ok[None, :] & g_ok,
                other=0,
            )
            words = tl.load(
                packed_ptr + word_rows[:, None] + g * WPG + word_in_group[None, :],
                mask=g_ok,
                other=0,
            )
            scale = tl.load(scales_ptr + group_rows + g, mask=g_ok, other=0).to(tl.float32)
            bias = tl.load(biases_ptr + group_rows + g, mask=g_ok, other=0).to(tl.float32)
            if OFFSET_CODES:
                q = tl.reshape(_offset_bf16_codes(words, magic), [BLOCK_N, GROUP])
                bias -= 128.0 * scale  # the dot sums (128 + q) x
            else:
                codes = tl.reshape(_codes_in_order(words, BITS), [BLOCK_N, GROUP])
                q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # exact
            if DOT_FP32:
                xs = xs.to(tl.float32)
                dots = tl.dot(q.to(tl.float32), xs, input_precision="ieee")
                x_sums = tl.dot(ones, xs, input_precision="ieee")
            else:
                dots = tl.dot(q.to(xs.dtype), xs)
                x_sums = tl.dot(ones.to(xs.dtype), xs)
            total += dots * scale[:, None]  # two FMAs an output
            total += bias[:, None] * x_sums

        out_at = m[None, :] * stride_om + n[:, None]
        out_ok = m_ok[None, :] & n_ok[:, None]
        if SPLIT_K == 1:
            tl.store(out_ptr + out_at, total.to(out_ptr.dtype.element_ty), mask=out_ok)
        else:
            own = pid_k * M * N + m[None, :] * N + n[:, None]
            tl.store(partial_ptr + own, total, mask=out_ok)

    @triton.jit
    def _affine_dequantize_kernel(
        packed_ptr,
        scales_ptr,
        biases_ptr,
        out_ptr,
        N,
        K,
        rows_ptr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr,
        GATHER_ROWS: tl.constexpr = False,
        PDL: tl.constexpr = False,
    ):
        """W [N, K] in out's dtype, rounded as ``dequantize_affine``: ``q * scale`` and then
        ``+ bias``, each rounded to the scales' dtype, then cast. With GATHER_ROWS out row n
        is W's row ``rows[n]`` (a token table's rows, `affine_embed`)."""
        CODES: tl.constexpr = _KERNEL_WORD_BITS // BITS
        WORDS_PER_GROUP: tl.constexpr = GROUP // CODES
        MASK: tl.constexpr = (1 << BITS) - 1
        wait_for_producer(PDL)  # the ids, when a decode step's sampling wrote them
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        groups = K // GROUP
        ok = (n < N)[:, None] & (g < groups)[None, :]
        if GATHER_ROWS:
            source = tl.load(rows_ptr + n, mask=n < N, other=0).to(tl.int64)
        else:
            source = n.to(tl.int64)
        word = g[:, None] * WORDS_PER_GROUP + tl.arange(0, WORDS_PER_GROUP)[None, :]
        words = tl.load(
            packed_ptr + source[:, None, None] * (K // CODES) + word[None, :, :],
            mask=ok[:, :, None],
            other=0,
        )
        group_at = source[:, None] * groups + g[None, :]
        scale = tl.load(scales_ptr + group_at, mask=ok, other=0)
        bias = tl.load(biases_ptr + group_at, mask=ok, other=0)
        shifts = tl.arange(0, CODES) * BITS
        codes = (words[:, :, :, None] >> shifts[None, None, None, :]) & MASK
        q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        # The product of a code (<= 8 bits) and a scale is exact in fp32: one rounding each.
        weight = (q * scale.to(tl.float32)[:, :, None, None]).to(scale.dtype)
        weight = (weight.to(tl.float32) + bias.to(tl.float32)[:, :, None, None]).to(scale.dtype)
        column = word[:, :, None] * CODES + tl.arange(0, CODES)[None, None, :]
        tl.store(
            out_ptr + n.to(tl.int64)[:, None, None, None] * K + column[None, :, :, :],
            weight.to(out_ptr.dtype.element_ty),
            mask=ok[:, :, None, None],
        )

    @triton.jit
    def _float_gather_gemv_kernel(
        x_ptr,
        weight_ptr,
        ids_ptr,
        out_ptr,
        N,
        stride_xm,
        stride_om,
        X_ROWS_PER_ID,
        K: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
        GEGLU_OUT: tl.constexpr = False,
    ):
        """out[r, n] = x[r // X_ROWS_PER_ID] . weight[ids[r], n]; grid (pairs r, blocks of N).
        With GEGLU_OUT the experts are stacked gate/up [E, 2N, K] and out[r] is
        gelu_tanh(gate) * up [N]: a program's rows alternate gate row c and up row c
        (`_store_geglu_pairs`)."""
        pid_r = tl.program_id(0)
        lane = tl.arange(0, BLOCK_N)
        if GEGLU_OUT:  # gate row c and up row N + c in turn, for outputs c of block pid_n
            column = tl.program_id(1) * (BLOCK_N // 2) + lane // 2
            n = column + (lane % 2) * N
            n_ok = column < N
            ROWS = 2 * N
        else:
            n = tl.program_id(1) * BLOCK_N + lane
            n_ok = n < N
            ROWS = N
        wait_for_producer(PDL)
        expert = tl.load(ids_ptr + pid_r).to(tl.int64)
        rows = weight_ptr + expert * ROWS * K + n.to(tl.int64)[:, None] * K
        x_row = x_ptr + (pid_r // X_ROWS_PER_ID).to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for step in range((K + BLOCK_K - 1) // BLOCK_K):
            k = step * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w = tl.load(rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            xk = tl.load(x_row + k, mask=k_ok, other=0).to(tl.float32)
            acc += w.to(tl.float32) * xk[None, :]
        out = tl.sum(acc, axis=1)
        out_row = out_ptr + pid_r.to(tl.int64) * stride_om
        if GEGLU_OUT:
            _store_geglu_pairs(out_row, out, tl.program_id(1) * (BLOCK_N // 2), N, BLOCK_N)
        else:
            tl.store(out_row + n, out.to(out_ptr.dtype.element_ty), mask=n_ok)

    # -----------------------------------------------------------------------------------------
    # Tile GEMV configurations (autotuned)

    # Word tiles BLOCK_M * BLOCK_N * BLOCK_KW above this spill registers (fp32 products).
    _MAX_TILE_WORDS = 4096
    _TILE_SHAPES = ((8, 32, 4), (16, 64, 4), (32, 32, 4), (64, 32, 4), (64, 64, 8))
    _TILE_CONFIGS = [
        triton.Config({"BLOCK_N": n, "BLOCK_KW": kw, "SPLIT_K": split}, num_warps=warps)
        for n, kw, warps in _TILE_SHAPES
        for split in (1, 2, 4, MAX_SPLIT_K)
    ]
    # Used where there is no autotuning: Triton's CPU interpreter (tests).
    DEFAULT_TILE_CONFIG = {"BLOCK_N": 16, "BLOCK_KW": 32, "SPLIT_K": 1}

    def _multiprocessors() -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def _split_allowed(rows: int, n: int) -> bool:
        """Split K only where N gives fewer than two programs per SM at the smallest block."""
        return rows * triton.cdiv(n, _TILE_SHAPES[0][0]) < 2 * _multiprocessors()

    def _prune_tile_configs(configs: list, named_args: dict, **kwargs: object) -> list:
        args = {**named_args, **kwargs}
        rows, n, block_m = args["ROWS"], args["N"], args["BLOCK_M"]
        groups = args["K"] // args["GROUP"]
        allowed = _split_allowed(rows, n)
        kept = []
        for config in configs:
            block_n, block_kw, split = (
                config.kwargs[k] for k in ("BLOCK_N", "BLOCK_KW", "SPLIT_K")
            )
            programs = rows * triton.cdiv(n, block_n)
            if block_m * block_n * block_kw > _MAX_TILE_WORDS:
                continue
            if split > 1 and (not allowed or programs * split > 8 * _multiprocessors()):
                continue
            if split > 1 and groups < 2 * split:
                continue
            kept.append(config)
        return kept or [triton.Config(DEFAULT_TILE_CONFIG, num_warps=4)]

    _affine_tile_gemv_tuned = triton.autotune(
        configs=_TILE_CONFIGS,
        key=["N", "K", "BITS", "GROUP", "BLOCK_M", "GATHER"],
        prune_configs_by={"early_config_prune": _prune_tile_configs},
    )(_affine_tile_gemv_kernel)

    _float_gather_tuned = triton.autotune(
        configs=[
            triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=warps)
            for n, k, warps in ((8, 256, 4), (16, 256, 4), (32, 128, 4), (16, 512, 8))
        ],
        key=["N", "K", "GEGLU_OUT"],
    )(_float_gather_gemv_kernel)
    DEFAULT_FLOAT_GATHER_CONFIG = {"BLOCK_N": 8, "BLOCK_K": 64}

    # The tile GEMV's split-K arrival counters, zero between launches (the last program resets
    # its own). Sized so that model shapes never regrow it: a CUDA graph keeps the buffer it
    # captured.
    _COUNTERS: dict[torch.device, Tensor] = {}

    def _counters(device: torch.device, count: int) -> Tensor:
        counters = _COUNTERS.get(device)
        if counters is None or counters.numel() < count:
            counters = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
            _COUNTERS[device] = counters
        return counters

    # -----------------------------------------------------------------------------------------
    # Launchers

    def _check_operands(
        x: Tensor | CodesMajor, packed: Tensor, scales: Tensor, bits: int, group: int
    ) -> int:
        if bits not in KERNEL_BITS:
            raise ValueError(f"the affine kernels cover bits {KERNEL_BITS}, not {bits}")
        k = packed.shape[-1] * WORD_BITS // bits
        if x.shape[-1] != k or scales.shape[-1] * group != k:
            raise ValueError(
                f"x has {x.shape[-1]} inputs; the weight packs {k} in groups of {group}"
            )
        return k

    def _launch_gemv(
        x: Tensor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        out: Tensor,
        bits: int,
        group: int,
        config: GemvConfig,
        x_codes_major: bool = False,
        add_splits: bool = True,
        *,
        geglu_out: bool = False,
        gather: Gather | None = None,
    ) -> Tensor | None:
        """The unrolled GEMV: x ``[M <= 4, K]`` (unit stride along K) into out ``[M, N]``; with
        `x_codes_major` x is ``codes_major(x)``, contiguous. A K-split launch returns its fp32
        partials ``[splits * M * N]``; without `add_splits` only those, out left unwritten.
        With `geglu_out` (no K split) it stores ``geglu(gate, up)`` of a stacked gate/up
        weight into out ``[M, N / 2]``. With `gather` (no K split) the weight is experts
        ``[E, N, ...]`` and out ``[pairs, N]``: one x row a pair (`Gather`)."""
        if geglu_out and (config.split_k > 1 or packed.shape[-2] % 2):
            raise ValueError("the GeGLU store needs an unsplit launch over stacked gate/up rows")
        if gather is not None and config.split_k > 1:
            raise ValueError("a gathered GEMV runs without a K split")
        m, k = (1 if gather else x.shape[0]), x[0].numel()
        n, row_words = packed.shape[-2:]
        groups = k // group
        # Whole steps per split, so that only a split's last step can need masks.
        split_groups = triton.cdiv(triton.cdiv(groups, config.split_k), config.block_g)
        split_groups *= config.block_g
        blocks = triton.cdiv(n, config.block_n)
        pdl = pdl_options(x)
        if config.split_k > 1:
            partial = torch.empty(config.split_k * m * n, dtype=torch.float32, device=x.device)
        else:
            partial = out  # unread
        launch_kernel(
            _affine_gemv_kernel,
            (blocks, config.split_k, gather.ids.numel() if gather else 1),
            x,
            packed.view(torch.int32),  # same bits; Triton shifts int32 everywhere
            scales,
            biases,
            out,
            partial,
            n,
            row_words,
            groups,
            split_groups,
            x.stride(0),
            out.stride(0),
            TWO23_BITS,
            gather.ids if gather else out,  # unread without GATHER
            gather.x_rows_per_id if gather else 1,
            M=m,
            BITS=bits,
            GROUP=group,
            BLOCK_N=config.block_n,
            BLOCK_G=config.block_g,
            SPLIT_K=config.split_k,
            PREFETCH=config.prefetch,
            X_BLOCK=X_BLOCK_WORDS if x_codes_major else 0,
            FOLD=bits == 4,  # `_offset_codes`: one subtraction fewer a 4-bit code
            num_warps=config.warps,
            **pdl,
            GEGLU_OUT=geglu_out,
            GATHER=gather is not None,
        )
        if config.split_k > 1 and add_splits:
            launch_kernel(
                _sum_splits_kernel, (triton.cdiv(n, SPLIT_SUM_BLOCK),), partial, out, n,
                out.stride(0), M=m, SPLIT_K=config.split_k, BLOCK=SPLIT_SUM_BLOCK, **pdl,
            )  # fmt: skip
        return partial if config.split_k > 1 else None

    def _launch_tile_gemv(
        x: Tensor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        out: Tensor,
        bits: int,
        group: int,
        *,
        ids: Tensor | None,
        rows: int,
        block_m: int,
        x_rows_per_id: int,
        config: dict | None,
        num_warps: int = 4,
    ) -> None:
        """One tile-GEMV launch over `rows` grid rows (1, or the expert pairs) into `out`."""
        m = 1 if ids is not None else x.shape[0]
        k = x.shape[-1]
        n = packed.shape[-2]  # weight rows: the grid's blocks, the partials' width
        words = packed.view(torch.int32)  # same bits; Triton shifts int32 everywhere
        interpreted = not x.is_cuda
        split_possible = (
            config["SPLIT_K"] > 1
            if config is not None
            else (not interpreted and _split_allowed(rows, n))
        )
        partial = torch.empty(
            (MAX_SPLIT_K * rows * m * n) if split_possible else 1,
            dtype=torch.float32,
            device=x.device,
        )
        counters = _counters(x.device, rows * n) if split_possible else partial
        ids_arg = ids if ids is not None else words  # unread without GATHER
        args = (
            x,
            words,
            scales,
            biases,
            ids_arg,
            out,
            partial,
            counters,
            m,
            n,
            x.stride(-2),
            out.stride(-2),
            x_rows_per_id,
            rows,
            k,
        )
        constants = {"BITS": bits, "GROUP": group, "BLOCK_M": block_m, "GATHER": ids is not None}
        constants |= pdl_options(x)

        def grid(meta: dict) -> tuple[int, int, int]:
            return (rows, triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])

        if config is None and not interpreted:
            launch_kernel(_affine_tile_gemv_tuned, grid, *args, **constants)
        else:
            chosen = config or DEFAULT_TILE_CONFIG
            launch_kernel(
                _affine_tile_gemv_kernel,
                grid(chosen),
                *args,
                **constants,
                **chosen,
                num_warps=num_warps,
            )

    def affine_gemv_triton(
        x: Tensor | CodesMajor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        bits: int,
        group_size: int,
        config: GemvConfig | None = None,
    ) -> Tensor:
        """``x [..., K] @ W.T`` for at most GEMV_MAX_ROWS rows: the unrolled GEMV up to
        UNROLLED_ROWS rows (launched as `gemv_config` says), the tile GEMV above (autotuned).
        `config` pins the launch (tests); for the tile GEMV it means the same tile shape.
        An x stored `CodesMajor` (`codes_major_input`) is read as it is, by the unrolled GEMV."""
        rows, unrolled = _unrolled_operands(x, packed, scales, bits, group_size, config)
        m, n = rows.shape[0], packed.shape[-2]
        if m > GEMV_MAX_ROWS:
            raise ValueError(f"the GEMV kernels take at most {GEMV_MAX_ROWS} rows")
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out.view(*x.shape[:-1], -1)
        operand = x if isinstance(x, CodesMajor) else rows
        if unrolled is not None:
            _launch_unrolled(operand, packed, scales, biases, out, bits, group_size, unrolled)
            return out.view(*x.shape[:-1], -1)
        if isinstance(x, CodesMajor):
            raise ValueError("only the unrolled GEMV (at most 4 rows) reads x codes-major")
        tile = None
        if config is not None:
            words_per_group = group_size * bits // WORD_BITS
            tile = {
                "BLOCK_N": config.block_n,
                "BLOCK_KW": config.block_g * words_per_group,
                "SPLIT_K": config.split_k,
            }
        _launch_tile_gemv(
            rows,
            packed,
            scales,
            biases,
            out,
            bits,
            group_size,
            ids=None,
            rows=1,
            block_m=triton.next_power_of_2(m),
            x_rows_per_id=1,
            config=tile,
            num_warps=config.warps if config is not None else 4,
        )
        return out.view(*x.shape[:-1], -1)

    def affine_gemv_partials_triton(
        x: Tensor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        bits: int,
        group_size: int,
        config: GemvConfig | None = None,
    ) -> Tensor | None:
        """`affine_gemv_partials` in Triton (and its interpreter); `config` pins the launch."""
        rows, config = _unrolled_operands(x, packed, scales, bits, group_size, config)
        if config is None or config.split_k == 1:
            return None
        n = packed.shape[-2]
        unwritten = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
        partial = _launch_unrolled(
            rows, packed, scales, biases, unwritten, bits, group_size, config, add_splits=False
        )
        assert partial is not None
        return partial.view(config.split_k, *x.shape[:-1], n)

    def _unrolled_config(
        rows: Tensor, packed: Tensor, bits: int, group_size: int, config: GemvConfig | None
    ) -> GemvConfig | None:
        """The unrolled GEMV's launch for x's `rows` [M, K] (`gemv_config`'s, unless `config`
        pins one); None where the tile GEMV takes them: more rows, or weights whose words pass
        the unrolled kernel's int32 offsets."""
        (m, k), n = rows.shape, packed.shape[-2]
        if m > UNROLLED_ROWS or n * packed.shape[-1] >= 2**31:
            return None
        if config is None:
            sms = _multiprocessors() if rows.is_cuda else H200_MULTIPROCESSORS
            config = gemv_config(n, k, bits, group_size, sms)
        return config

    def _launch_unrolled(
        rows: Tensor | CodesMajor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        out: Tensor,
        bits: int,
        group_size: int,
        config: GemvConfig,
        add_splits: bool = True,
        geglu_out: bool = False,
        gather: Gather | None = None,
    ) -> Tensor | None:
        """`_launch_gemv`, x first reordered codes-major where `config` asks for it (unless
        it comes so: `CodesMajor`, then read as it is)."""
        if isinstance(rows, CodesMajor):
            if not _reads_codes_major(config, rows.shape[-1], bits):
                raise ValueError("this GEMV launch reads x in input order, not codes-major")
            x, ordered = rows.values, True
        else:
            x, ordered = rows, _reads_codes_major(config, rows.shape[-1], bits)
            if ordered:
                x = codes_major_triton(x, bits, X_BLOCK_WORDS)
        return _launch_gemv(
            x, packed, scales, biases, out, bits, group_size, config, ordered, add_splits,
            geglu_out=geglu_out, gather=gather,
        )  # fmt: skip

    def _unrolled_operands(
        x: Tensor | CodesMajor,
        packed: Tensor,
        scales: Tensor,
        bits: int,
        group_size: int,
        config: GemvConfig | None,
    ) -> tuple[Tensor, GemvConfig | None]:
        """x's checked rows (`_flat_rows`) and the unrolled GEMV's launch for them, or None
        where the tile GEMV takes them (`_unrolled_config`)."""
        _check_operands(x, packed, scales, bits, group_size)
        rows = _flat_rows(x)
        return rows, _unrolled_config(rows, packed, bits, group_size, config)

    def _flat_rows(x: Tensor | CodesMajor) -> Tensor:
        """x as ``[M, K]`` (its values' rows for `CodesMajor`: only their count is read)."""
        if isinstance(x, CodesMajor):
            return x.values.view(x.values.shape[0], -1)
        rows = x.reshape(-1, x.shape[-1])
        return rows if rows.stride(-1) == 1 else rows.contiguous()

    def affine_gemv_geglu_out_triton(
        x: Tensor | CodesMajor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        bits: int,
        group_size: int,
        config: GemvConfig | None = None,
    ) -> Tensor | None:
        """`affine_gemv_geglu_out` in Triton (and its interpreter); `config` pins the launch.
        None where the launch would split K or the tile GEMV takes the rows."""
        shape = x.shape
        rows, config = _unrolled_operands(x, packed, scales, bits, group_size, config)
        n = packed.shape[-2]
        if config is None or config.split_k > 1 or n % 2:
            return None
        out = torch.empty(rows.shape[0], n // 2, dtype=x.dtype, device=x.device)
        operand = x if isinstance(x, CodesMajor) else rows
        _launch_unrolled(
            operand, packed, scales, biases, out, bits, group_size, config, geglu_out=True
        )  # fmt: skip
        return out.view(*shape[:-1], n // 2)

    def affine_dequantize_triton(
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        bits: int,
        group_size: int,
        dtype: torch.dtype,
        rows: Tensor | None = None,
    ) -> Tensor:
        """``dequantize_affine(...).to(dtype)`` for a 2-D weight, in one kernel; with `rows`
        (int ids, any shape) only those rows, shaped ``[*rows.shape, K]``."""
        k = packed.shape[1] * WORD_BITS // bits
        ids = None if rows is None else rows.reshape(-1)
        n = packed.shape[0] if ids is None else ids.numel()
        out = torch.empty(n, k, dtype=dtype, device=packed.device)
        block_n, block_g = 16, max(1, 128 // group_size)
        if ids is not None:  # a token or a few: programs along the row, not across rows
            block_n = min(block_n, triton.next_power_of_2(n))
        grid = (triton.cdiv(n, block_n), triton.cdiv(k // group_size, block_g))
        pdl = pdl_options(out) if ids is not None else {}
        launch_kernel(
            _affine_dequantize_kernel,
            grid,
            packed.view(torch.int32),
            scales,
            biases,
            out,
            n,
            k,
            packed if ids is None else ids,  # unread without GATHER_ROWS
            BITS=bits,
            GROUP=group_size,
            BLOCK_N=block_n,
            BLOCK_G=block_g,
            GATHER_ROWS=ids is not None,
            num_warps=4,
            **pdl,
        )
        return out if rows is None else out.view(*rows.shape, k)

    def affine_mma_triton(
        x: Tensor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        bits: int,
        group_size: int,
        config: MmaConfig | None = None,
    ) -> Tensor:
        """``x [..., K] @ W.T`` for at most MMA_MAX_ROWS rows on tensor cores: the codes read
        once, each group's dot by ``tl.dot`` (`_affine_mma_kernel`), launched as `mma_config`
        says unless `config` pins it; a K split's partials added by a launch of their own in
        split order (deterministic, no counters: CUDA graphs capture it as it is)."""
        _check_operands(x, packed, scales, bits, group_size)
        rows = _flat_rows(x)
        (m, k), n = rows.shape, packed.shape[-2]
        if m > MMA_MAX_ROWS:
            raise ValueError(f"the tensor-core kernel takes at most {MMA_MAX_ROWS} rows")
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out.view(*x.shape[:-1], n)
        if config is None:
            sms = _multiprocessors() if rows.is_cuda else H200_MULTIPROCESSORS
            config = mma_config(m, n, k, bits, group_size, sms)
        if config.block_m < m:
            raise ValueError(f"a tile of {config.block_m} rows cannot hold {m}")
        split = config.split_k
        partial = (
            torch.empty(split * m * n, dtype=torch.float32, device=x.device) if split > 1 else out
        )  # unread without a split
        pdl = pdl_options(x)
        launch_kernel(
            _affine_mma_kernel,
            (triton.cdiv(n, config.block_n), split),
            rows,
            packed.view(torch.int32),  # same bits; Triton shifts int32 everywhere
            scales,
            biases,
            out,
            partial,
            m,
            n,
            rows.stride(0),
            out.stride(0),
            K=k,
            BITS=bits,
            GROUP=group_size,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            SPLIT_K=split,
            STAGES=config.stages,
            DOT_FP32=x.dtype == torch.float32 or not x.is_cuda,
            OFFSET_CODES=bits == 4 and x.dtype == torch.bfloat16,
            num_warps=config.warps,
            **pdl,
        )
        if split > 1:  # the partials [split, M * N] as one row of M * N outputs
            launch_kernel(
                _sum_splits_kernel, (triton.cdiv(m * n, SPLIT_SUM_BLOCK),), partial, out,
                m * n, 0, M=1, SPLIT_K=split, BLOCK=SPLIT_SUM_BLOCK, **pdl,
            )  # fmt: skip
        return out.view(*x.shape[:-1], n)

    def affine_matmul_triton(
        x: Tensor, packed: Tensor, scales: Tensor, biases: Tensor, bits: int, group_size: int
    ) -> Tensor:
        """The unrolled GEMV for up to UNROLLED_ROWS rows (decode), the tensor-core kernel
        for MMA_MIN_ROWS..MMA_MAX_ROWS (batched decode), dequantize-once plus cuBLAS for more
        (prefill)."""
        rows = x.numel() // max(x.shape[-1], 1)
        if rows < MMA_MIN_ROWS:
            return affine_gemv_triton(x, packed, scales, biases, bits, group_size)
        if rows <= MMA_MAX_ROWS:
            return affine_mma_triton(x, packed, scales, biases, bits, group_size)
        _check_operands(x, packed, scales, bits, group_size)
        weight = affine_dequantize_triton(packed, scales, biases, bits, group_size, x.dtype)
        return F.linear(x, weight)

    def affine_expert_matmul_triton(
        x: Tensor,
        packed: Tensor,
        scales: Tensor,
        biases: Tensor,
        expert_ids: Tensor,
        bits: int,
        group_size: int,
        config: dict | None = None,
        geglu_out: bool = False,
        gemv: GemvConfig | None = None,
    ) -> Tensor:
        """Gathered GEMV: ``[T, top_k, N]``, reading only the chosen experts' packed rows: the
        unrolled GEMV over the pairs (`gemv` pins its launch, else `gathered_gemv_config`),
        whose loop reads the experts far faster than the tile GEMV's generic one; the tile
        GEMV where `config` pins its tile or an expert's words pass the unrolled GEMV's int32
        offsets. With `geglu_out` (unrolled only) the experts are a stacked gate/up and the
        output ``gelu_tanh_mul`` of the product, ``[T, top_k, N / 2]``."""
        _check_expert_shapes(x, expert_ids)
        k = _check_operands(x, packed, scales, bits, group_size)
        n = packed.shape[-2]
        pairs, top_k = expert_ids.numel(), expert_ids.shape[1]
        rows = _flat_rows(x)
        ids = expert_ids.reshape(-1).contiguous()
        x_rows_per_id = top_k if x.dim() == 2 else 1
        unrolled_fits = n * packed.shape[-1] < 2**31  # an expert's words: int32 offsets
        if config is None and unrolled_fits:
            gemv = gemv or gathered_gemv_config(k, bits, group_size)
            if geglu_out and n % 2:
                raise ValueError("a GeGLU output needs stacked gate/up experts (an even N)")
            out = torch.empty(pairs, n // 2 if geglu_out else n, dtype=x.dtype, device=x.device)
            if pairs:
                gather = Gather(ids, x_rows_per_id)
                _launch_unrolled(
                    rows, packed, scales, biases, out, bits, group_size, gemv,
                    geglu_out=geglu_out, gather=gather,
                )  # fmt: skip
            return out.view(*expert_ids.shape, -1)
        if geglu_out:
            raise ValueError("only the unrolled gathered GEMV stores a GeGLU")
        out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
        _launch_tile_gemv(
            rows,
            packed,
            scales,
            biases,
            out,
            bits,
            group_size,
            ids=ids,
            rows=pairs,
            block_m=1,
            x_rows_per_id=x_rows_per_id,
            config=config,
        )
        return out.view(*expert_ids.shape, -1)

    def float_expert_matmul_triton(
        x: Tensor,
        weight: Tensor,
        expert_ids: Tensor,
        config: dict | None = None,
        geglu_out: bool = False,
    ) -> Tensor:
        """Gathered GEMV over float experts ``[E, N, K]``: ``[T, top_k, N]``; with
        `geglu_out`, gelu_tanh_mul of the product of stacked gate/up experts, ``[.., N / 2]``."""
        _check_expert_shapes(x, expert_ids)
        pairs, top_k = expert_ids.numel(), expert_ids.shape[1]
        n, k = weight.shape[-2:]
        if geglu_out and n % 2:
            raise ValueError("a GeGLU output needs stacked gate/up experts (an even N)")
        rows = x.reshape(-1, k)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        weight = weight if weight.is_contiguous() else weight.contiguous()
        width_out = n // 2 if geglu_out else n
        out = torch.empty(pairs, width_out, dtype=x.dtype, device=x.device)
        args = (
            rows,
            weight,
            expert_ids.reshape(-1).contiguous(),
            out,
            width_out,
            rows.stride(0),
            out.stride(0),
            top_k if x.dim() == 2 else 1,
            k,
        )

        def grid(meta: dict) -> tuple[int, int]:
            return (pairs, triton.cdiv(n, meta["BLOCK_N"]))

        constants = {**pdl_options(x), "GEGLU_OUT": geglu_out}
        if config is None and x.is_cuda:
            launch_kernel(_float_gather_tuned, grid, *args, **constants)
        else:
            chosen = config or DEFAULT_FLOAT_GATHER_CONFIG
            launch_kernel(_float_gather_gemv_kernel, grid(chosen), *args, **chosen, **constants)
        return out.view(*expert_ids.shape, -1)
