"""Projections and token tables over GGUF weights kept as the file stores them.

A GGUF file's quantized blocks are loaded once, byte for byte, and never rounded again: every
product sees the weight `gguf.quants.dequantize` gives, in fp32 (`hearth.quant.gguf_blocks`).
A decode step (up to 16 input rows) runs the native block GEMV on the blocks themselves; a
prefill dequantizes a tile of rows at a time into an fp32 buffer and runs a real GEMM on it.
Activations are fp32 in the products whatever the model's compute dtype, but for the block
types the plan names in `gguf_bf16_gemv_types`: their decode GEMV rounds the activations to
bf16 and sums exact products of them and the integer codes (the weights stay exact). The
types in the plan's `gguf_amx_prefill_types` run their prefill on AMX bf16 tiles instead of the
tiled fp32 GEMM: exact integer codes times the activations split into two bf16 halves (or one,
`gguf_amx_bf16_inputs`), each group's sums scaled by its step in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from hearth.ops import gguf_matmul, native
from hearth.quant.gguf_blocks import (
    BLOCK_FORMATS,
    PLANAR_TYPES,
    dequantize_blocks,
    dequantize_layout,
    is_planar,
    planar_layout,
    planar_row_bytes,
    to_planar,
)

# A prefill dequantizes this many fp32 bytes of weight rows at a time: a tile that stays in the
# L2 cache while the GEMM reads it, and bounds the memory of a large table's head.
TILE_BYTES = 2 << 20
# Rows repacked at a time into a planar layout at load (a 262144-row head in 16 chunks).
REPACK_ROWS = 16384


def dequantize_rows(type_id: int, blocks: Tensor) -> Tensor:
    """fp32 values of stored rows (uint8 [rows, bytes per row]): the native decoder where it
    runs, else torch's (the same bits)."""
    if is_planar(type_id):
        return dequantize_layout(type_id, blocks)
    block = BLOCK_FORMATS[type_id]
    kernels = native.kernels()
    if kernels is None or blocks.device.type != "cpu":
        return dequantize_blocks(type_id, blocks)
    out = torch.empty(blocks.shape[0], blocks.shape[1] // block.nbytes * block.values)
    kernels.blocks_to_f32(type_id, blocks.contiguous(), out)
    return out


class GGUFLinear(nn.Module):
    """y = x @ Wᵀ with W [out, in] the exact fp32 values of GGML blocks held as stored.

    W may be several parts stacked along the output dim (a q/k/v or gate/up stack), each of its
    own type: `parts` is (GGML type id, uint8 blocks [rows, bytes per row]) in output order.
    Adjacent parts of one type are held as one segment (`type_ids`, `part_rows`). The types in
    `bf16_gemv_types` run the decode GEMV with activations rounded to bf16 (where the native
    kernels have it for the type; `ExecutionPlan.gguf_bf16_gemv_types`). The types in
    `amx_prefill_types` run a prefill on the AMX kernel where it runs here
    (`ExecutionPlan.gguf_amx_prefill_types`), with the inputs as two bf16 halves, or one where
    `amx_bf16_inputs`. A decode step of at least `amx_decode_rows` rows (0: none) runs on the
    AMX kernel too, its inputs rounded to one bf16 (`ExecutionPlan.gguf_amx_head_rows`).
    """

    def __init__(
        self,
        parts: Sequence[tuple[int, Tensor]],
        in_features: int,
        bf16_gemv_types: Sequence[int] = (),
        amx_prefill_types: Sequence[int] = (),
        amx_bf16_inputs: bool = False,
        amx_decode_rows: int = 0,
    ) -> None:
        super().__init__()
        if not parts:
            raise ValueError("GGUFLinear needs at least one part")
        self.in_features = in_features
        self.bf16_gemv_types = frozenset(bf16_gemv_types)
        self.amx_prefill_types = frozenset(amx_prefill_types)
        self.amx_bf16_inputs = amx_bf16_inputs
        self.amx_decode_rows = amx_decode_rows
        for index, (type_id, blocks) in enumerate(parts):
            block = BLOCK_FORMATS[type_id]
            if (
                blocks.dtype != torch.uint8
                or blocks.dim() != 2
                or in_features % block.values
                or blocks.shape[1] != in_features // block.values * block.nbytes
            ):
                raise ValueError(
                    f"part {index}: {block.name} rows of {in_features} values are "
                    f"{in_features // block.values * block.nbytes} bytes, got {tuple(blocks.shape)}"
                )
        # Adjacent parts of one type become one segment: one kernel call at a decode step.
        segments: list[tuple[int, list[Tensor]]] = []
        for type_id, blocks in parts:
            if segments and segments[-1][0] == type_id:
                segments[-1][1].append(blocks)
            else:
                segments.append((type_id, [blocks]))
        self.type_ids: list[int] = []
        self.part_rows: list[int] = []
        for index, (type_id, pieces) in enumerate(segments):
            joined = pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces)
            self.type_ids.append(type_id)
            self.part_rows.append(joined.shape[0])
            self.register_buffer(f"blocks_{index}", joined)
        self.out_features = sum(self.part_rows)

    def parts(self) -> list[tuple[int, Tensor]]:
        """(type id, blocks) of each segment, in output order."""
        return [(t, getattr(self, f"blocks_{i}")) for i, t in enumerate(self.type_ids)]

    def dequantize(self) -> Tensor:
        """The whole weight [out, in] in fp32 (for tests and references; a large table's is big)."""
        return torch.cat([dequantize_rows(t, blocks) for t, blocks in self.parts()])

    def forward(self, x: Tensor) -> Tensor:
        x2d = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        y = torch.empty(x2d.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        kernels = native.kernels() if x.device.type == "cpu" else None
        decode = kernels is not None and x2d.shape[0] <= native.MAX_INPUT_ROWS
        amx_decode = decode and 0 < self.amx_decode_rows <= x2d.shape[0]
        first = 0
        for (type_id, blocks), rows in zip(self.parts(), self.part_rows, strict=True):
            out = y[:, first : first + rows]
            amx = (
                kernels is not None
                and type_id in self.amx_prefill_types
                and type_id in kernels.amx_gemm_types
            )
            if amx and amx_decode:
                assert kernels is not None
                kernels.blocks_gemm_amx(type_id, x2d, blocks, out, False)  # one bf16
            elif decode:
                assert kernels is not None
                bf16 = type_id in self.bf16_gemv_types and type_id in kernels.bf16_gemv_types
                kernels.blocks_gemv(type_id, x2d, blocks, out, bf16=bf16)
            elif amx:
                assert kernels is not None
                kernels.blocks_gemm_amx(type_id, x2d, blocks, out, not self.amx_bf16_inputs)
            else:
                self._tiled_matmul(type_id, x2d, blocks, out)
            first += rows
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _tiled_matmul(self, type_id: int, x2d: Tensor, blocks: Tensor, out: Tensor) -> None:
        """out = x2d @ Wᵀ for many input rows: W dequantized a tile of rows at a time."""
        tile = max(1, TILE_BYTES // (4 * self.in_features))
        for start in range(0, blocks.shape[0], tile):
            weights = dequantize_rows(type_id, blocks[start : start + tile])
            out[:, start : start + len(weights)] = x2d @ weights.T

    @property
    def nbytes(self) -> int:
        return sum(blocks.nbytes for _, blocks in self.parts())

    def extra_repr(self) -> str:
        types = ", ".join(BLOCK_FORMATS[t].name for t in self.type_ids)
        return f"in_features={self.in_features}, out_features={self.out_features}, types={types}"


class GGUFEmbeddingHead(nn.Module):
    """The tied token table and output head as one GGUFLinear [vocab, hidden] held once: `embed`
    decodes only the looked-up rows, `head` is the block GEMV (or tiled GEMM) over all rows."""

    def __init__(self, table: GGUFLinear) -> None:
        super().__init__()
        if len(table.type_ids) != 1:
            raise ValueError("a token table is one part of one type")
        self.table = table

    def embed(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        ((type_id, blocks),) = self.table.parts()
        rows = dequantize_rows(type_id, blocks[ids.reshape(-1)])
        return rows.reshape(*ids.shape, self.table.in_features).to(dtype)

    def head(self, x: Tensor) -> Tensor:
        return self.table(x)

    def dequantize(self) -> Tensor:
        return self.table.dequantize()

    @property
    def nbytes(self) -> int:
        return self.table.nbytes


class GGUFLookupTable(nn.Module):
    """A lookup-only table (Gemma 4's per-layer inputs) left in the file's memory map: each
    lookup decodes the picked rows' blocks to their exact fp32 values. The file must stay in
    place while the model runs; the table costs page cache, not process memory."""

    def __init__(self, rows: np.ndarray, type_id: int, width: int) -> None:
        super().__init__()
        block = BLOCK_FORMATS[type_id]
        if rows.shape[1] != width // block.values * block.nbytes or width % block.values:
            raise ValueError(f"{block.name} rows of {width} values do not fit {rows.shape}")
        self.rows = rows
        self.type_id = type_id
        self.width = width

    def embed(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        picked = torch.from_numpy(np.ascontiguousarray(self.rows[ids.reshape(-1).cpu().numpy()]))
        values = dequantize_rows(self.type_id, picked)
        return values.reshape(*ids.shape, self.width).to(device=ids.device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        return 0  # in the file's page cache, not in this process's memory

    def extra_repr(self) -> str:
        name = BLOCK_FORMATS[self.type_id].name
        return f"rows={self.rows.shape[0]}, width={self.width}, type={name} (mapped)"


class GGUFKernelLinear(GGUFLinear):
    """A `GGUFLinear` computed by the Triton block kernels (`hearth.ops.gguf_matmul`), which the
    plan picks on CUDA (`ExecutionPlan.gguf_block_kernels`): the block GEMV at a decode step,
    tiles dequantized to the activations' dtype and cuBLAS at a prefill. Activations keep their
    dtype (bf16 on a GPU); sums are fp32.

    Segments of a type with a planar layout (Q4_0, Q8_0, Q4_K, Q6_K) are repacked once, where
    they lie, into it (`hearth.quant.gguf_blocks.to_planar`: lossless, the file's bytes but for
    Q4_K's unpacked scales, +2.8%, and rows padded to 16 bytes), which the GEMV reads in fewer
    instructions a weight; `parts()` then names them by their layout id (PLANAR + type id)."""

    def __init__(self, parts: Sequence[tuple[int, Tensor]], in_features: int) -> None:
        super().__init__(parts, in_features)
        self.layouts = list(self.type_ids)
        for index, type_id in enumerate(self.type_ids):
            if type_id not in PLANAR_TYPES or in_features % BLOCK_FORMATS[type_id].values:
                continue
            name = f"blocks_{index}"
            stored = getattr(self, name)
            if stored.device.type == "meta":  # a fit's sizing: the shape only
                width = planar_row_bytes(type_id, in_features)
                planar = torch.empty(stored.shape[0], width, dtype=torch.uint8, device="meta")
            else:  # a chunk of rows at a time: the repack's temporaries stay small
                width = planar_row_bytes(type_id, in_features)
                planar = torch.empty(
                    stored.shape[0], width, dtype=torch.uint8, device=stored.device
                )
                for first in range(0, stored.shape[0], REPACK_ROWS):
                    chunk = stored[first : first + REPACK_ROWS]
                    planar[first : first + len(chunk)] = to_planar(type_id, chunk)
            setattr(self, name, planar)
            del stored
            self.layouts[index] = planar_layout(type_id)

    def parts(self) -> list[tuple[int, Tensor]]:
        """(layout id, rows) of each segment, in output order."""
        return [(t, getattr(self, f"blocks_{i}")) for i, t in enumerate(self.layouts)]

    def dequantize(self) -> Tensor:
        return torch.cat([dequantize_layout(t, blocks) for t, blocks in self.parts()])

    def forward(self, x: Tensor) -> Tensor:
        x2d = x.reshape(-1, self.in_features)
        y = gguf_matmul.gguf_linear(x2d, self.parts(), self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)


class GGUFKernelTable(GGUFEmbeddingHead):
    """A token table on blocks (`GGUFKernelLinear`): lookups decode the picked rows in one
    kernel that reads the ids on the device (no host sync, so CUDA graphs capture it); the
    head, if tied, is the table's block GEMV. Gemma 4's per-layer table takes it on a GPU too
    (lookups only)."""

    def embed(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        ((type_id, blocks),) = self.table.parts()
        return gguf_matmul.gguf_rows(ids, type_id, blocks, dtype)
