"""A lookup-only table left in its GGUF file, read row by row at each lookup.

Gemma 4's per-layer table (262144 x 8960 on E2B) is the largest tensor of the small models,
yet a decode step reads one row of it. Kept as the file stores it (GGML blocks in the memory
map, as llama.cpp keeps it), it costs no load time and no resident memory beyond the page
cache, and each looked-up row is decoded exactly as the file means it. The file must stay in
place while the model runs.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from hearth.ops import native


class MappedBlockTable(nn.Module):
    """Rows of GGML blocks (`rows`: [vocab, bytes per row], a view of the file's mapping) of a
    type `hearth.ops.native` decodes; `embed` returns the looked-up rows in the requested dtype,
    each value bf16 as the dequantized table rounded to bf16 holds it."""

    def __init__(self, rows: np.ndarray, type_id: int, width: int) -> None:
        super().__init__()
        if type_id not in native.BLOCK_TYPES:
            raise ValueError(f"GGML type {type_id} is not one that hearth.ops.native decodes")
        self.rows = rows
        self.type_id = type_id
        self.width = width

    def embed(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        kernels = native.kernels()
        if kernels is None:
            raise RuntimeError("a mapped GGUF table needs hearth's native kernels")
        picked = np.ascontiguousarray(self.rows[ids.reshape(-1).cpu().numpy()])
        out = torch.empty(picked.shape[0], self.width, dtype=torch.bfloat16)
        kernels.blocks_to_bf16(self.type_id, picked.reshape(-1), out)
        return out.reshape(*ids.shape, self.width).to(dtype)

    @property
    def nbytes(self) -> int:
        return 0  # in the file's page cache, not in this process's memory

    def extra_repr(self) -> str:
        return f"rows={self.rows.shape[0]}, width={self.width}, type={self.type_id} (mapped)"
