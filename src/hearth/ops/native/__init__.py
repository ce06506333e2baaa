"""Hearth's native CPU kernels (``kernels.c``): built on first use, loaded with ctypes.

CPU decode at batch 1 is a stream of weights plus a few hundred tiny ops per token. The kernels
here replace torch where it is slow (`benchmarks/cpu_decode.py` measures them):

* the int8 and bf16 matrix-vector products, where torch's kernels (``aten._weight_int8pack_mm``,
  the bf16 GEMM) stream short weight rows at about half the memory bandwidth;
* the bf16 glue of a decode step (add + RMSNorm, q/k RMSNorm + RoPE, one-query attention),
  one call each instead of a dozen dispatched torch ops, with the same roundings;
* a whole Gemma 3 or Gemma 4 (dense) decoder layer at one token, made of the two above
  (``gemma3_decode_layer``, ``gemma4_decode_layer``, run by ``hearth.runtime.native_step``):
  no Python between a layer's ops;
* at load, GGUF blocks (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K) -> bf16 and bf16 -> int8 rows, which
  torch and numpy run at a small fraction of the memory bandwidth; for a CPU prefill, int8 ->
  bf16.

They need a C compiler with OpenMP and an x86-64 CPU with AVX-512, or AVX2 with FMA and F16C
(``vec16.h`` serves both); without them, ``kernels()`` is None and every caller keeps its torch
path. ``HEARTH_NATIVE=0`` turns them off.

The library is compiled once per source, compiler and CPU into ``$HEARTH_CACHE/native`` (default
``~/.cache/hearth/native``), written to a temporary name and renamed, so concurrent processes
never load a half-written file. torch is imported first: its libgomp is then the one the library
binds to, and both share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

log = logging.getLogger("hearth.ops.native")

SOURCE = Path(__file__).with_name("kernels.c")
# What SOURCE includes: part of the library's identity (a change rebuilds it).
HEADERS = (Path(__file__).with_name("vec16.h"),)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LIBRARIES = ("-lm",)
# Input rows the int8 kernel takes (MAX_INPUT_ROWS in the source).
MAX_INPUT_ROWS = 16
DISABLE_VARIABLE = "HEARTH_NATIVE"
COMPILE_TIMEOUT_S = 120
BUILD_NOTE = "hearth: compiling native CPU kernels (once for this CPU and compiler)..."

_POINTER, _INT64, _FLOAT, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
# Entry points and their C argument types (pointers are data_ptr()s, None for NULL).
_SIGNATURES = {
    "hearth_int8_rows_matmul": [
        _POINTER, _INT64, _INT64, _POINTER, _POINTER, _INT64, _POINTER, _INT,
    ],
    "hearth_bf16_rows_matmul": [_POINTER, _INT64, _INT64, _POINTER, _INT64, _POINTER, _INT],
    "hearth_add_rms_norm": [
        _POINTER, _POINTER, _INT64, _INT64, _POINTER, _POINTER, _FLOAT, _POINTER, _POINTER,
    ],
    "hearth_norm_rope": [
        _POINTER, _INT64, _INT64, _INT64, _INT64, _INT64, _POINTER, _POINTER, _POINTER, _POINTER,
        _FLOAT, _POINTER, _POINTER, _POINTER,
    ],
    "hearth_decode_attention": [
        _POINTER, _POINTER, _POINTER, _INT64, _INT64, _INT64, _INT64, _INT64, _FLOAT, _POINTER,
        _INT,
    ],
    "hearth_gemma3_decode_layer": [
        _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT64, _INT64,
        _INT64, _POINTER, _INT,
    ],
    "hearth_gemma4_decode_layer": [
        _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT64, _INT64,
        _INT64, _POINTER, _POINTER, _INT,
    ],
    "hearth_decode_attention_f32": [
        _POINTER, _POINTER, _POINTER, _INT64, _INT64, _INT64, _INT64, _INT64, _FLOAT, _POINTER,
        _INT,
    ],
    "hearth_geglu_f32": [_POINTER, _INT64, _INT64, _POINTER],
    "hearth_gemma3_blocks_layer": [
        _POINTER, _INT64, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT,
    ],
    "hearth_blocks_to_bf16": [_INT, _POINTER, _INT64, _POINTER, _INT],
    "hearth_blocks_to_f32": [_INT, _POINTER, _INT64, _POINTER, _INT],
    "hearth_add_rms_norm_f32": [
        _POINTER, _POINTER, _INT64, _INT64, _POINTER, _POINTER, _FLOAT, _POINTER, _POINTER,
    ],
    "hearth_norm_rope_f32": [
        _POINTER, _INT64, _INT64, _INT64, _INT64, _INT64, _POINTER, _POINTER, _POINTER, _POINTER,
        _FLOAT, _POINTER, _POINTER, _POINTER,
    ],
    "hearth_blocks_gemv": [
        _INT, _POINTER, _INT64, _INT64, _POINTER, _INT64, _POINTER, _INT64, _INT,
    ],
    "hearth_blocks_gemv_bf16": [
        _INT, _POINTER, _INT64, _INT64, _POINTER, _INT64, _POINTER, _INT64, _INT,
    ],
    "hearth_blocks_gemv_bf16_takes": [_INT],
    "hearth_blocks_gemm_amx": [
        _INT, _POINTER, _INT64, _INT64, _POINTER, _INT64, _POINTER, _INT64, _INT, _INT,
    ],
    "hearth_blocks_gemm_amx_takes": [_INT],
    "hearth_quantize_int8_rows": [_POINTER, _INT64, _INT64, _FLOAT, _POINTER, _POINTER, _INT],
    "hearth_int8_rows_to_bf16": [_POINTER, _POINTER, _INT64, _INT64, _POINTER, _INT],
    "hearth_argmax_rows": [_POINTER, _INT64, _INT64, _POINTER],
    "hearth_gemma4_blocks_layer": [
        _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _POINTER, _INT64, _INT64,
        _INT64, _POINTER, _INT,
    ],
}  # fmt: skip
# GGML block types ``blocks_to_bf16`` decodes: type id -> (values, bytes) per block.
BLOCK_TYPES = {8: (32, 34), 2: (32, 18), 6: (32, 22), 12: (256, 144), 14: (256, 210)}
# GGML block types ``blocks_to_f32`` and ``blocks_gemv`` compute on: type id -> (values, bytes)
# per block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).
STORED_BLOCK_TYPES = {
    2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
}  # fmt: skip


class DecodeLayerOperands(ctypes.Structure):
    """A Gemma 3 layer's fixed operands for ``gemma3_decode_layer`` (``hearth_decode_layer`` in
    the source): sizes, weight pointers (int8 with bf16 row scales, or bf16 where the scales
    are NULL), fp32 norm weights, eps and the attention scale."""

    _fields_ = [
        *((name, _INT64) for name in ("hidden", "q_heads", "kv_heads", "head_dim", "intermediate")),
        *((name, _POINTER) for name in ("qkv", "o", "gate_up", "down")),
        *((f"{name}_scales", _POINTER) for name in ("qkv", "o", "gate_up", "down")),
        *(
            (f"{name}_norm", _POINTER)
            for name in ("q", "k", "post_attention", "pre_feedforward", "post_feedforward", "next")
        ),
        ("eps", _FLOAT),
        ("scale", _FLOAT),
    ]


# Segments a projection over GGUF blocks may be stored in (BLOCKS_MAX_SEGMENTS in the source).
MAX_BLOCK_SEGMENTS = 4


class BlocksWeight(ctypes.Structure):
    """A projection over GGML blocks for ``gemma3_blocks_layer``: its output rows in
    ``segments`` runs, each of one type (``type``), ``rows`` rows stored at ``blocks``; ``bf16``
    1: the segment runs the bf16 GEMV (where its type is in ``NativeKernels.bf16_gemv_types``)."""

    _fields_ = [
        ("segments", _INT64),
        ("type", _INT64 * MAX_BLOCK_SEGMENTS),
        ("rows", _INT64 * MAX_BLOCK_SEGMENTS),
        ("blocks", _POINTER * MAX_BLOCK_SEGMENTS),
        ("bf16", _INT64 * MAX_BLOCK_SEGMENTS),
    ]


class BlocksLayerOperands(ctypes.Structure):
    """A Gemma 3 layer's fixed operands over GGUF blocks for ``gemma3_blocks_layer``
    (``hearth_blocks_layer`` in the source): sizes, the four projections, fp32 norm weights,
    eps and the attention scale."""

    _fields_ = [
        *((name, _INT64) for name in ("hidden", "q_heads", "kv_heads", "head_dim", "intermediate")),
        *((name, BlocksWeight) for name in ("qkv", "o", "gate_up", "down")),
        *(
            (f"{name}_norm", _POINTER)
            for name in ("q", "k", "post_attention", "pre_feedforward", "post_feedforward", "next")
        ),
        ("eps", _FLOAT),
        ("scale", _FLOAT),
    ]


class Gemma4LayerOperands(ctypes.Structure):
    """A Gemma 4 dense layer's fixed operands for ``gemma4_decode_layer`` (``hearth_gemma4_layer``
    in the source): ``base`` as for Gemma 3 (norm weights w; no k norm on a KV-sharing layer),
    plus how V is made (a ``ValueMode``: 0 for a KV-sharing layer), the per-layer input's gate
    and projection (``per_layer`` 0: none) with the norm after them, and the bf16 layer
    scalar."""

    _fields_ = [
        ("base", DecodeLayerOperands),
        ("per_layer", _INT64),
        ("value_mode", _INT64),
        *(
            (name, _POINTER)
            for name in (
                "per_layer_gate", "per_layer_projection", "per_layer_gate_scales",
                "per_layer_projection_scales", "post_per_layer_norm", "layer_scalar",
            )
        ),
    ]  # fmt: skip


class Gemma4BlocksLayerOperands(ctypes.Structure):
    """A Gemma 4 dense layer's fixed operands over GGUF blocks for ``gemma4_blocks_layer``
    (``hearth_gemma4_blocks_operands`` in the source): ``base`` as for Gemma 3 over blocks
    (norm weights w; no k norm on a KV-sharing layer; scale 1), how V is made (a
    ``ValueMode``: 0 for a KV-sharing layer), the per-layer input's gate and projection over
    blocks (``per_layer`` 0: none) with the norm after them, and the fp32 layer scalar."""

    _fields_ = [
        ("base", BlocksLayerOperands),
        ("per_layer", _INT64),
        ("value_mode", _INT64),
        ("per_layer_gate", BlocksWeight),
        ("per_layer_projection", BlocksWeight),
        ("post_per_layer_norm", _POINTER),
        ("layer_scalar", _POINTER),
    ]


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(f"native kernel: {what}")


def _dense(tensor: Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and tensor.is_contiguous() and tensor.device.type == "cpu"


def _layer_inputs_fit(
    operands: DecodeLayerOperands | BlocksLayerOperands,
    x: Tensor,
    normed: Tensor,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    length: int,
    dtype: torch.dtype = torch.bfloat16,
) -> bool:
    """What a native decoder layer reads: x and normed [hidden], cos/sin [D], and K/V planes
    [1, Hk, slots, D] holding at least `length` slots, all in `dtype`."""
    dim = operands.head_dim
    return (
        _dense(x, dtype)
        and _dense(normed, dtype)
        and x.numel() == normed.numel() == operands.hidden
        and _dense(cos, dtype)
        and _dense(sin, dtype)
        and cos.numel() == sin.numel() == dim
        and keys.dtype == values.dtype == dtype
        and keys.shape == values.shape
        and keys.shape[:2] == (1, operands.kv_heads)
        and keys.shape[3] == dim
        and attention_layout(keys, values)
        and 0 < length <= keys.shape[2]
    )


def _gemma4_inputs_fit(
    operands: Gemma4LayerOperands | Gemma4BlocksLayerOperands,
    x: Tensor,
    normed: Tensor,
    cos: Tensor,
    sin: Tensor,
    keys: Tensor,
    values: Tensor,
    slot: int | None,
    length: int,
    per_layer_input: Tensor | None,
    dtype: torch.dtype,
) -> bool:
    """What a native Gemma 4 layer reads (`_layer_inputs_fit`'s, in `dtype`), a slot unless the
    layer shares K/V, and its per-layer input [per_layer] where it has one."""
    shares = operands.value_mode == 0
    return (
        _layer_inputs_fit(operands.base, x, normed, cos, sin, keys, values, length, dtype)
        and (slot is None) == shares
        and (shares or 0 <= slot < length)
        and (per_layer_input is None) == (operands.per_layer == 0)
        and (
            per_layer_input is None
            or (_dense(per_layer_input, dtype) and per_layer_input.numel() == operands.per_layer)
        )
    )


def attention_layout(keys: Tensor, values: Tensor) -> bool:
    """Whether K/V [B, Hk, slots, D] share strides that step whole rows of D: what
    ``decode_attention`` reads (a cache buffer, or its first slots)."""
    batch_stride, head_stride, slot_stride, element_stride = keys.stride()
    return (
        keys.stride() == values.stride()
        and element_stride == 1
        and slot_stride == keys.shape[3]
        and batch_stride == keys.shape[1] * head_stride
    )


class ContiguousKV(NamedTuple):
    """A sequence's fp32 K/V as one buffer each, [1, Hk, slots, D]: the new token goes into
    slot `slot`, and attention reads slots 0..length-1."""

    keys: Tensor
    values: Tensor
    slot: int
    length: int


class BlockTable:
    """A sequence's block table as the native kernels read it: a block id per logical block
    (int64; -1 where the block is not held), checked once against the pool's `num_blocks`:
    every entry from `held_from` on is a block of the pool (a sliding layer's table holds a
    suffix, a full layer's all of it). Not to be modified once made."""

    __slots__ = ("held_from", "ids", "length", "num_blocks")

    def __init__(self, blocks: Sequence[int | None], num_blocks: int) -> None:
        values = [-1 if block is None else block for block in blocks]
        held_from = len(values)
        while held_from and 0 <= values[held_from - 1] < num_blocks:
            held_from -= 1
        self.ids = torch.tensor(values, dtype=torch.int64)
        self.held_from = held_from
        self.length = len(values)
        self.num_blocks = num_blocks


class PagedKV(NamedTuple):
    """A sequence's fp32 K/V in a paged pool's planes [num_blocks, Hk, block_size, D]: logical
    block i of the sequence is block i of `table`. The new token goes into position
    `position`'s block, and attention reads the positions of `runs` ([start, end) each, one or
    two) in that order."""

    keys: Tensor
    values: Tensor
    table: BlockTable
    position: int
    runs: tuple[tuple[int, int], ...]


def _planes_fit(keys: Tensor, values: Tensor, kv_heads: int, dim: int) -> bool:
    """fp32 K/V planes [*, Hk, slots, D] on the CPU: a contiguous buffer's (`ContiguousKV`,
    whose layout its rows check) or a pool's, which must be contiguous."""
    return (
        keys.dtype == values.dtype == torch.float32
        and keys.shape == values.shape
        and keys.device.type == values.device.type == "cpu"
        and keys.dim() == 4
        and keys.shape[1] == kv_heads
        and keys.shape[3] == dim
    )


def _contiguous_fields(cache: ContiguousKV) -> list[int]:
    """A `ContiguousKV`'s row of ``hearth_gemma3_blocks_layer``'s `caches` (CACHE_FIELDS in
    the source), after checking that its slots lie in its planes."""
    keys, values = cache.keys, cache.values
    _require(
        keys.shape[0] == 1
        and attention_layout(keys, values)
        and 0 <= cache.slot < cache.length <= keys.shape[2],
        "gemma3_blocks_layer takes contiguous K/V [1, Hk, slots, D] with a slot below the "
        "length read",
    )
    return [
        keys.data_ptr(), values.data_ptr(), 0, keys.stride(1), cache.slot, cache.length, 0,
        cache.length, 0, 0,
    ]  # fmt: skip


def _paged_fields(cache: PagedKV, pointers: tuple[int, int], size: int, blocks: int) -> list[int]:
    """A `PagedKV`'s row of ``hearth_gemma3_blocks_layer``'s `caches`, its planes (at
    `pointers`, of `blocks` blocks of `size` slots) already checked: after checking that every
    position it reads or writes lies in a block of the pool its table holds."""
    runs, table, position = cache.runs, cache.table, cache.position
    if len(runs) == 1:
        (first0, end0), first1, end1 = runs[0], 0, 0
        low, high = first0, end0 - 1
    else:
        _require(len(runs) == 2, "gemma3_blocks_layer reads one or two runs of positions")
        (first0, end0), (first1, end1) = runs
        _require(first1 < end1, "gemma3_blocks_layer: an empty run of positions")
        low, high = min(first0, first1), max(end0, end1) - 1
    # The runs and the position lie in one span of positions (a window's, or 0..position):
    # every block of the span must be held.
    _require(
        type(table) is BlockTable
        and table.num_blocks == blocks
        and 0 <= first0 < end0
        and first1 >= 0
        and low <= position <= high
        and table.held_from <= low // size
        and high // size < table.length,
        "gemma3_blocks_layer: a position read or written lies in no block of the pool",
    )
    return [
        *pointers, table.ids.data_ptr(), size, position, end0 - first0 + end1 - first1, first0,
        end0 - first0, first1, end1 - first1,
    ]  # fmt: skip


class NativeKernels:
    """The loaded library, with typed entry points that check what they are given."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._functions = {}
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.restype, function.argtypes = ctypes.c_int, argtypes
            self._functions[name] = function

    def _call(self, name: str, *args: object) -> None:
        if self._functions[name](*args) != 0:
            raise MemoryError(f"{name} could not allocate its buffers")

    def int8_rows_matmul(self, x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
        """``x [m, k] @ (qweight [n, k] * scales [n])ᵀ`` in bf16, for 1 <= m <= 16."""
        rows, in_features = x.shape
        out_features = qweight.shape[0]
        _require(
            _dense(x, torch.bfloat16)
            and _dense(qweight, torch.int8)
            and _dense(scales, torch.bfloat16)
            and qweight.shape[1] == in_features
            and scales.shape == (out_features,)
            and 1 <= rows <= MAX_INPUT_ROWS,
            "int8_rows_matmul takes bf16 x [1..16, k], int8 q [n, k], bf16 scales [n]",
        )
        y = torch.empty(rows, out_features, dtype=torch.bfloat16)
        self._call(
            "hearth_int8_rows_matmul", x.data_ptr(), rows, in_features, qweight.data_ptr(),
            scales.data_ptr(), out_features, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y

    def argmax_rows(self, rows: Tensor) -> Tensor:
        """``rows.max(dim=-1).indices`` of fp32 rows [m, n] (the first index of each row's
        largest value, or of its first NaN), without torch's scalar scan: a vector maximum,
        then the first 16-value block holding it."""
        _require(
            _dense(rows, torch.float32) and rows.dim() == 2 and rows.shape[1] >= 1,
            "argmax_rows takes contiguous fp32 rows [m, n >= 1]",
        )
        out = torch.empty(rows.shape[0], dtype=torch.int64)
        self._call("hearth_argmax_rows", rows.data_ptr(), *rows.shape, out.data_ptr())
        return out

    def blocks_to_bf16(self, type_id: int, blocks: np.ndarray, out: Tensor) -> None:
        """GGML blocks of a type in ``BLOCK_TYPES`` (Q8_0, Q4_0, Q5_0, Q4_K, Q6_K; uint8,
        C-contiguous, whole blocks) -> ``out`` (bf16, one value per code): each value as the
        `gguf` package computes it in fp32, rounded to bf16 once."""
        values, nbytes = BLOCK_TYPES[type_id]
        n_blocks = blocks.size // nbytes
        _require(
            blocks.dtype == np.uint8
            and blocks.flags.c_contiguous
            and blocks.size == n_blocks * nbytes
            and _dense(out, torch.bfloat16)
            and out.numel() == n_blocks * values,
            "blocks_to_bf16 takes whole uint8 blocks and a bf16 output of their size",
        )
        self._call(
            "hearth_blocks_to_bf16", type_id, blocks.ctypes.data, n_blocks, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip

    def blocks_to_f32(self, type_id: int, blocks: Tensor, out: Tensor) -> None:
        """GGML blocks of a type in ``STORED_BLOCK_TYPES`` (uint8, contiguous, whole blocks)
        -> ``out`` (fp32, contiguous, one value per code), bit for bit as the `gguf` package
        dequantizes them."""
        values, nbytes = STORED_BLOCK_TYPES[type_id]
        n_blocks = blocks.numel() // nbytes
        _require(
            _dense(blocks, torch.uint8)
            and blocks.numel() == n_blocks * nbytes
            and _dense(out, torch.float32)
            and out.numel() == n_blocks * values,
            "blocks_to_f32 takes whole uint8 blocks and an fp32 output of their size",
        )
        self._call(
            "hearth_blocks_to_f32", type_id, blocks.data_ptr(), n_blocks, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip

    @functools.cached_property
    def bf16_gemv_types(self) -> frozenset[int]:
        """The GGML types ``blocks_gemv(..., bf16=True)`` takes in this build: Q4_0, Q5_0,
        Q8_0, Q4_K and Q6_K where the CPU has AVX512-BF16 (the library is built for it), none
        elsewhere."""
        takes = self._functions["hearth_blocks_gemv_bf16_takes"]
        return frozenset(t for t in STORED_BLOCK_TYPES if takes(t) == 1)

    def blocks_gemv(
        self, type_id: int, x: Tensor, blocks: Tensor, out: Tensor, bf16: bool = False
    ) -> None:
        """``out [m, n] = x [m, k] @ Wᵀ`` for fp32 x (1 <= m <= 16) and W [n, k] the exact fp32
        values of GGML blocks ``blocks`` [n, k / values · bytes] (uint8, contiguous); fp32
        sums. ``out`` may be a column slice of a wider fp32 matrix (rows at any stride).
        ``bf16`` (a type in ``bf16_gemv_types``): x rounded to bf16 and the products summed by
        the bf16 dot-product instructions, the weights still exact."""
        rows, in_features = x.shape
        out_features = blocks.shape[0]
        _require(
            rows <= MAX_INPUT_ROWS and _block_operands_fit(type_id, x, blocks, out),
            "blocks_gemv takes fp32 x [1..16, k], uint8 blocks [n, row bytes], fp32 out [m, n]",
        )
        _require(not bf16 or type_id in self.bf16_gemv_types, "no bf16 block GEMV for this type")
        self._call(
            "hearth_blocks_gemv_bf16" if bf16 else "hearth_blocks_gemv", type_id, x.data_ptr(),
            rows, in_features, blocks.data_ptr(), out_features, out.data_ptr(), out.stride(0),
            torch.get_num_threads(),
        )  # fmt: skip

    @functools.cached_property
    def amx_gemm_types(self) -> frozenset[int]:
        """The GGML types ``blocks_gemm_amx`` takes here: every type of ``STORED_BLOCK_TYPES``
        where the library is built for AMX-BF16 and Linux grants this process the tile state,
        none elsewhere (AVX2 or AVX-512 without AMX)."""
        takes = self._functions["hearth_blocks_gemm_amx_takes"]
        return frozenset(t for t in STORED_BLOCK_TYPES if takes(t) == 1)

    def blocks_gemm_amx(
        self, type_id: int, x: Tensor, blocks: Tensor, out: Tensor, split: bool = True
    ) -> None:
        """``out [m, n] = x [m, k] @ Wᵀ`` for fp32 x (any m >= 1) and W the exact fp32 values of
        GGML blocks ``blocks`` [n, row bytes], on AMX bf16 tiles: x rounded to bf16, or with
        ``split`` to two bf16 halves hi + lo (~16 significant bits); codes times x summed in
        fp32 per group, scaled by the group's step in fp32. ``out`` may be a column slice of a
        wider fp32 matrix."""
        _require(type_id in self.amx_gemm_types, "blocks_gemm_amx takes no such type here")
        rows, in_features = x.shape
        out_features = blocks.shape[0]
        _require(
            _block_operands_fit(type_id, x, blocks, out),
            "blocks_gemm_amx takes fp32 x [m, k], uint8 blocks, fp32 out [m, n]",
        )
        self._call(
            "hearth_blocks_gemm_amx", type_id, x.data_ptr(), rows, in_features,
            blocks.data_ptr(), out_features, out.data_ptr(), out.stride(0), int(split),
            torch.get_num_threads(),
        )  # fmt: skip

    def quantize_int8_rows(self, weight: Tensor, scale_floor: float) -> tuple[Tensor, Tensor]:
        """Symmetric int8 per row of a finite bf16 ``weight`` [rows, cols]: (codes int8, bf16
        scales), as ``hearth.quant.cpu.quantize_int8_rows`` computes them."""
        _require(
            _dense(weight, torch.bfloat16) and weight.dim() == 2,
            "quantize_int8_rows takes a contiguous bf16 matrix",
        )
        rows, cols = weight.shape
        codes = torch.empty(rows, cols, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.bfloat16)
        self._call(
            "hearth_quantize_int8_rows", weight.data_ptr(), rows, cols, scale_floor,
            codes.data_ptr(), scales.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return codes, scales

    def int8_rows_to_bf16(self, codes: Tensor, scales: Tensor) -> Tensor:
        """``bf16(codes [rows, cols] * scales [rows])``, as ``(codes.float() * scales.float()
        [:, None]).bfloat16()`` computes it (the fp32 product is exact)."""
        rows, cols = codes.shape
        _require(
            _dense(codes, torch.int8) and _dense(scales, torch.bfloat16) and scales.numel() == rows,
            "int8_rows_to_bf16 takes int8 codes [rows, cols] and bf16 scales [rows]",
        )
        out = torch.empty(rows, cols, dtype=torch.bfloat16)
        self._call(
            "hearth_int8_rows_to_bf16", codes.data_ptr(), scales.data_ptr(), rows, cols,
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def bf16_rows_matmul(self, x: Tensor, weight: Tensor) -> Tensor:
        """``x [m, k] @ weight [n, k]ᵀ`` in bf16 (fp32 sums), for 1 <= m <= 16."""
        rows, in_features = x.shape
        out_features = weight.shape[0]
        _require(
            _dense(x, torch.bfloat16)
            and _dense(weight, torch.bfloat16)
            and weight.shape[1] == in_features
            and 1 <= rows <= MAX_INPUT_ROWS,
            "bf16_rows_matmul takes bf16 x [1..16, k] and bf16 weight [n, k]",
        )
        y = torch.empty(rows, out_features, dtype=torch.bfloat16)
        self._call(
            "hearth_bf16_rows_matmul", x.data_ptr(), rows, in_features, weight.data_ptr(),
            out_features, y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return y

    def add_rms_norm(
        self,
        residual: Tensor,
        x: Tensor,
        weight: Tensor,
        eps: float,
        next_weight: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """``residual + norm(x)·w`` and, given ``next_weight``, its norm by that: residual and x
        both bf16 or both fp32 (the results in their dtype), the weights fp32."""
        width, dtype = x.shape[-1], x.dtype
        _require(
            dtype in (torch.bfloat16, torch.float32)
            and _dense(residual, dtype)
            and _dense(x, dtype)
            and residual.shape == x.shape
            and _dense(weight, torch.float32)
            and weight.shape == (width,)
            and (next_weight is None or (_dense(next_weight, torch.float32)
                                         and next_weight.shape == (width,))),
            "add_rms_norm takes bf16 or fp32 residual and x of one shape, fp32 weights [width]",
        )  # fmt: skip
        entry = "hearth_add_rms_norm" if dtype == torch.bfloat16 else "hearth_add_rms_norm_f32"
        summed = torch.empty_like(x)
        normed = None if next_weight is None else torch.empty_like(x)
        self._call(
            entry, residual.data_ptr(), x.data_ptr(), x.numel() // width, width,
            weight.data_ptr(), None if next_weight is None else next_weight.data_ptr(), eps,
            summed.data_ptr(), None if normed is None else normed.data_ptr(),
        )  # fmt: skip
        return summed, normed

    def norm_rope(
        self,
        qkv: Tensor,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        q_weight: Tensor,
        k_weight: Tensor,
        cos: Tensor,
        sin: Tensor,
        eps: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """q, k RMSNorm + RoPE and the v split of ``qkv [T, (Hq + 2·Hk)·D]`` (qkv, cos/sin
        [T, D] all bf16 or all fp32; norm weights fp32): ``(q [T, Hq, D], k [T, Hk, D],
        v [T, Hk, D])`` in qkv's dtype."""
        tokens, width = qkv.shape
        dtype = qkv.dtype
        _require(
            dtype in (torch.bfloat16, torch.float32)
            and _dense(qkv, dtype)
            and width == (q_heads + 2 * kv_heads) * head_dim
            and head_dim % 2 == 0
            and _dense(q_weight, torch.float32)
            and _dense(k_weight, torch.float32)
            and q_weight.shape == k_weight.shape == (head_dim,)
            and _dense(cos, dtype)
            and _dense(sin, dtype)
            and cos.shape == sin.shape == (tokens, head_dim),
            "norm_rope takes bf16 or fp32 qkv [T, (Hq + 2 Hk) D] and cos/sin [T, D] of that "
            "dtype, fp32 norm weights [D]",
        )
        entry = "hearth_norm_rope" if dtype == torch.bfloat16 else "hearth_norm_rope_f32"
        q = torch.empty(tokens, q_heads, head_dim, dtype=dtype)
        k = torch.empty(tokens, kv_heads, head_dim, dtype=dtype)
        v = torch.empty(tokens, kv_heads, head_dim, dtype=dtype)
        self._call(
            entry, qkv.data_ptr(), tokens, width, q_heads, kv_heads, head_dim,
            q_weight.data_ptr(), k_weight.data_ptr(), cos.data_ptr(), sin.data_ptr(), eps,
            q.data_ptr(), k.data_ptr(), v.data_ptr(),
        )  # fmt: skip
        return q, k, v

    def decode_attention(
        self, q: Tensor, keys: Tensor, values: Tensor, scale: float, length: int
    ) -> Tensor:
        """One query per head, ``q [B, H, 1, D]``, over the first ``length`` keys of
        ``keys``/``values [B, Hk, slots, D]`` (bf16): ``[B, H, 1, D]``, softmax in fp32."""
        batch, heads, queries, dim = q.shape
        kv_heads, slots = keys.shape[1], keys.shape[2]
        group_stride = keys.stride(1)
        _require(
            _dense(q, torch.bfloat16)
            and queries == 1
            and keys.dtype == values.dtype == torch.bfloat16
            and keys.shape == values.shape
            and keys.shape[0] == batch
            and keys.shape[3] == dim
            and heads % kv_heads == 0
            and attention_layout(keys, values)
            and 1 <= length <= slots,
            "decode_attention takes bf16 q [B, H, 1, D] and K/V [B, Hk, slots, D] with rows of D",
        )
        out = torch.empty_like(q)
        self._call(
            "hearth_decode_attention", q.data_ptr(), keys.data_ptr(), values.data_ptr(),
            batch * kv_heads, heads // kv_heads, dim, length, group_stride, scale, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def decode_attention_f32(
        self, q: Tensor, keys: Tensor, values: Tensor, scale: float, length: int
    ) -> Tensor:
        """As ``decode_attention`` in fp32: q [1, H, 1, D], K/V [1, Hk, slots, D] fp32, the
        result fp32 (no rounding)."""
        heads, dim = q.shape[1], q.shape[3]
        kv_heads, slots = keys.shape[1], keys.shape[2]
        _require(
            _dense(q, torch.float32)
            and q.shape[0] == 1
            and q.shape[2] == 1
            and keys.dtype == values.dtype == torch.float32
            and keys.shape == values.shape
            and keys.shape[0] == 1
            and keys.shape[3] == dim
            and heads % kv_heads == 0
            and attention_layout(keys, values)
            and 1 <= length <= slots,
            "decode_attention_f32 takes fp32 q [1, H, 1, D] and K/V [1, Hk, slots, D]",
        )
        out = torch.empty_like(q)
        self._call(
            "hearth_decode_attention_f32", q.data_ptr(), keys.data_ptr(), values.data_ptr(),
            kv_heads, heads // kv_heads, dim, length, keys.stride(1), scale, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def geglu_f32(self, gate_up: Tensor) -> Tensor:
        """gelu_tanh(gate) · up of fp32 rows ``gate_up [rows, 2n]`` (gate, then up), as the
        native GGUF layer forms it (``x / (1 + e^(-2u))``: torch's tanh form rewritten)."""
        _require(
            _dense(gate_up, torch.float32) and gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0,
            "geglu_f32 takes contiguous fp32 gate_up [rows, 2n]",
        )
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2)
        self._call("hearth_geglu_f32", gate_up.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def gemma3_blocks_layer(
        self,
        operands: BlocksLayerOperands,
        x: Tensor,
        normed: Tensor,
        cos: Tensor,
        sin: Tensor,
        caches: Sequence[ContiguousKV | PagedKV],
    ) -> None:
        """One Gemma 3 layer over GGUF blocks at one token of each of B sequences, in place:
        ``x`` (the residual streams, fp32 [B, hidden]) becomes the layer's output and
        ``normed`` (their input norms) that output's next norm; cos/sin fp32 [B, D] at each
        sequence's position. ``caches``: per sequence, where its K/V lie (`ContiguousKV` or
        `PagedKV`). ``operands`` must point at live tensors."""
        batch = len(caches)
        dim = operands.head_dim
        _require(
            1 <= batch <= MAX_INPUT_ROWS
            and _dense(x, torch.float32)
            and _dense(normed, torch.float32)
            and x.shape == normed.shape == (batch, operands.hidden)
            and _dense(cos, torch.float32)
            and _dense(sin, torch.float32)
            and cos.shape == sin.shape == (batch, dim),
            "gemma3_blocks_layer takes fp32 x, normed [B, hidden] and cos/sin [B, D]",
        )
        # Rows of one pool share its planes: each pair checked once.
        pools: dict[tuple[int, int], tuple[tuple[int, int], int, int]] = {}
        rows = []
        for cache in caches:
            if type(cache) is not PagedKV:
                _require(
                    _planes_fit(cache.keys, cache.values, operands.kv_heads, dim),
                    "gemma3_blocks_layer takes fp32 K/V planes [1, Hk, slots, D]",
                )
                rows.append(_contiguous_fields(cache))
                continue
            pool = pools.get((id(cache.keys), id(cache.values)))
            if pool is None:
                keys, values = cache.keys, cache.values
                _require(
                    _planes_fit(keys, values, operands.kv_heads, dim)
                    and keys.is_contiguous()
                    and values.is_contiguous(),
                    "gemma3_blocks_layer takes contiguous fp32 pool planes [blocks, Hk, "
                    "block_size, D]",
                )
                pool = ((keys.data_ptr(), values.data_ptr()), keys.shape[2], keys.shape[0])
                pools[(id(keys), id(values))] = pool
            rows.append(_paged_fields(cache, *pool))
        fields = torch.tensor(rows, dtype=torch.int64)
        self._call(
            "hearth_gemma3_blocks_layer", ctypes.byref(operands), batch, x.data_ptr(),
            normed.data_ptr(), cos.data_ptr(), sin.data_ptr(), fields.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip

    def gemma3_decode_layer(
        self,
        operands: DecodeLayerOperands,
        x: Tensor,
        normed: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: Tensor,
        values: Tensor,
        slot: int,
        length: int,
    ) -> None:
        """One Gemma 3 layer at one token, in place: ``x`` (the residual stream, bf16 [hidden])
        becomes the layer's output and ``normed`` (its input norm) that output's next norm.
        The new K/V go into ``slot`` of ``keys``/``values`` [1, Hk, slots, D] (bf16), and
        attention reads slots ``0..length-1``. ``operands`` must point at live tensors."""
        _require(
            _layer_inputs_fit(operands, x, normed, cos, sin, keys, values, length)
            and 0 <= slot < length,
            "gemma3_decode_layer takes bf16 x, normed [hidden], cos/sin [D], K/V [1, Hk, slots, D]",
        )
        self._call(
            "hearth_gemma3_decode_layer", ctypes.byref(operands), x.data_ptr(), normed.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.stride(1),
            slot, length, gelu_tanh_table().data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def gemma4_decode_layer(
        self,
        operands: Gemma4LayerOperands,
        x: Tensor,
        normed: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: Tensor,
        values: Tensor,
        slot: int | None,
        length: int,
        per_layer_input: Tensor | None,
    ) -> None:
        """One Gemma 4 dense layer at one token, in place, as ``gemma3_decode_layer``. A layer
        that owns K/V writes them into ``slot``; a KV-sharing one (``slot`` None) attends over
        its donor's ``keys``/``values``. ``per_layer_input``: bf16 [per_layer] or None."""
        _require(
            _gemma4_inputs_fit(
                operands, x, normed, cos, sin, keys, values, slot, length, per_layer_input,
                torch.bfloat16,
            ),
            "gemma4_decode_layer takes bf16 x, normed [hidden], cos/sin [D], K/V "
            "[1, Hk, slots, D], a slot unless the layer shares K/V, its per-layer input",
        )  # fmt: skip
        self._call(
            "hearth_gemma4_decode_layer", ctypes.byref(operands), x.data_ptr(),
            normed.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
            values.data_ptr(), keys.stride(1), -1 if slot is None else slot, length,
            None if per_layer_input is None else per_layer_input.data_ptr(),
            gelu_tanh_table().data_ptr(), torch.get_num_threads(),
        )  # fmt: skip

    def gemma4_blocks_layer(
        self,
        operands: Gemma4BlocksLayerOperands,
        x: Tensor,
        normed: Tensor,
        cos: Tensor,
        sin: Tensor,
        keys: Tensor,
        values: Tensor,
        slot: int | None,
        length: int,
        per_layer_input: Tensor | None,
    ) -> None:
        """One Gemma 4 dense layer over GGUF blocks at one token, in place: ``x`` (the residual
        stream, fp32 [hidden]) becomes the layer's output and ``normed`` (its input norm) that
        output's next norm; cos/sin fp32 [D]. A layer that owns K/V writes them into ``slot``
        of its fp32 ``keys``/``values`` [1, Hk, slots, D]; a KV-sharing one (``slot`` None)
        attends over its donor's. Attention reads slots ``0..length-1``. ``per_layer_input``:
        fp32 [per_layer] or None. ``operands`` must point at live tensors."""
        _require(
            _gemma4_inputs_fit(
                operands, x, normed, cos, sin, keys, values, slot, length, per_layer_input,
                torch.float32,
            ),
            "gemma4_blocks_layer takes fp32 x, normed [hidden], cos/sin [D], K/V "
            "[1, Hk, slots, D], a slot unless the layer shares K/V, its per-layer input",
        )  # fmt: skip
        self._call(
            "hearth_gemma4_blocks_layer", ctypes.byref(operands), x.data_ptr(),
            normed.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
            values.data_ptr(), keys.stride(1), -1 if slot is None else slot, length,
            None if per_layer_input is None else per_layer_input.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip


@functools.cache
def gelu_tanh_table() -> Tensor:
    """bf16 gelu_tanh of every bf16 number, indexed by its 16-bit pattern: made by torch's own
    ``F.gelu``, so a native GeGLU looking it up rounds exactly as torch does."""
    patterns = torch.cat([torch.arange(0, 1 << 15), torch.arange(-(1 << 15), 0)])
    numbers = patterns.to(torch.int16).view(torch.bfloat16)
    return torch.nn.functional.gelu(numbers, approximate="tanh").contiguous()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def library_path(cache_dir: Path, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Where the library for this source, compiler, flags and CPU lives (built or not)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False, timeout=30
    ).stdout
    key = hashlib.sha256()
    sources = [path.read_bytes() for path in (SOURCE, *HEADERS)]
    for part in (*sources, " ".join(flags + LIBRARIES).encode(), version.encode()):
        key.update(part)
    key.update(f"{platform.machine()}\n{_cpu_identity()}".encode())
    return cache_dir / f"kernels-{key.hexdigest()[:16]}.so"


def build(cache_dir: Path, compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile the library into ``cache_dir`` unless it is there; raises on a compiler error.
    ``flags``: another target than this CPU (tests build the AVX2 library with
    ``-march=haswell`` on an AVX-512 machine)."""
    target = library_path(cache_dir, compiler, flags)
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Seconds of silence would look like a hang: one line on stderr, ended when done.
    print(BUILD_NOTE, end="", file=sys.stderr, flush=True)
    started = time.perf_counter()
    outcome = "failed"
    try:
        with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
            partial = Path(scratch) / target.name
            subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(partial), *LIBRARIES],
                capture_output=True,
                text=True,
                check=True,
                timeout=COMPILE_TIMEOUT_S,
            )
            os.replace(partial, target)
        outcome = f"done in {time.perf_counter() - started:.1f} s"
    finally:
        print(f" {outcome}", file=sys.stderr, flush=True)
    return target


def default_cache_dir() -> Path:
    return Path(os.environ.get("HEARTH_CACHE") or Path.home() / ".cache" / "hearth") / "native"


@functools.cache
def kernels() -> NativeKernels | None:
    """The native kernels, built on first call; None where they cannot run here."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler: CPU decode keeps torch's kernels")
        return None
    try:
        path = build(default_cache_dir(), compiler)
        return NativeKernels(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as error:
        # CalledProcessError carries the compiler's message (e.g. neither AVX-512 nor AVX2).
        detail = getattr(error, "stderr", "") or error
        log.info("native kernels unavailable, CPU decode keeps torch's kernels: %s", detail)
        return None


def row_matmul(x: Tensor, weight: Tensor) -> Tensor | None:
    """``x @ weightᵀ`` through the native bf16 kernel when ``x`` is one CPU bf16 row (a decode
    step) and the kernels run here; None otherwise (the caller's torch path then)."""
    if x.numel() != x.shape[-1] or not weight.is_contiguous():
        return None
    kernels = for_cpu_bf16(x, weight)
    if kernels is None:
        return None
    y = kernels.bf16_rows_matmul(x.reshape(1, -1).contiguous(), weight)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _block_operands_fit(type_id: int, x: Tensor, blocks: Tensor, out: Tensor) -> bool:
    """Whether x [m >= 1, k] (fp32, dense), blocks [n, k / values · bytes] (uint8, dense) and
    out [m, n] (fp32 CPU rows of unit column stride) fit a product over `type_id` blocks."""
    values, nbytes = STORED_BLOCK_TYPES[type_id]
    rows, in_features = x.shape
    out_features = blocks.shape[0]
    return (
        _dense(x, torch.float32)
        and rows >= 1
        and in_features % values == 0
        and _dense(blocks, torch.uint8)
        and blocks.shape == (out_features, in_features // values * nbytes)
        and out.dtype == torch.float32
        and out.device.type == "cpu"
        and out.shape == (rows, out_features)
        and out.stride(1) == 1
    )


def for_cpu_fp32_row(*tensors: Tensor) -> NativeKernels | None:
    """The kernels when every tensor is an fp32 CPU tensor, the first one row (a decode step's
    token), and they run here; else None (also under autograd). Prefills keep torch's ops."""
    first = tensors[0]
    if first.numel() != first.shape[-1]:
        return None
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return kernels()


def for_cpu_bf16(*tensors: Tensor) -> NativeKernels | None:
    """The kernels when every tensor is a bf16 CPU tensor and they run here, else None; also
    None when autograd would track any of them (the kernels have no backward)."""
    if not all(t.device.type == "cpu" and t.dtype == torch.bfloat16 for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return kernels()
