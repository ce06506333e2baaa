"""Decode attention of B sequences at once over a paged K/V pool (`kv.paged`): one query token
per sequence, each reading its own blocks through its row of a block table.

Pool planes are laid out [num_blocks, kv_heads, block_size, width] (width: head_dim for dense
K/V, or an encoded plane's width, as `decode_attention.PlaneFormat` describes). Row b's key at
absolute position p lives in block `block_tables[b, p // block_size]`, slot `p % block_size`.
It is visible to row b's query iff p <= query_positions[b] and, with a window,
query_positions[b] - p < window. Table entries of blocks no visible key lives in (a sliding
layer's freed blocks, the unused tail of a row) may hold any valid block index: they are
never read. A padded row (a CUDA-graph bucket larger than the batch) points at any block and
position 0; its output is ignored.

`paged_decode_attention` dispatches to the Triton kernel on a GPU and to the torch reference
elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hearth.ops.decode_attention import PlaneFormat, decode_attention_reference


def _check_tables(
    q: torch.Tensor, block_tables: torch.Tensor, query_positions: torch.Tensor
) -> None:
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32, got {block_tables.dtype}")
    if query_positions.shape != (batch,) or query_positions.dtype != torch.long:
        raise ValueError(
            f"query_positions must be int64 [{batch}], got {query_positions.dtype} "
            f"{tuple(query_positions.shape)}"
        )


def paged_decode_attention_reference(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Torch reference: gather each row's blocks into one sequence of slots numbered by
    position, then `decode_attention_reference` (fp32 softmax) per row -> [B, Hq, D]."""
    _check_tables(q, block_tables, query_positions)
    block_size = key_planes[0].shape[2]
    outputs = []
    for row in range(q.shape[0]):
        table = block_tables[row].long()
        positions = torch.arange(table.shape[0] * block_size, device=q.device)

        outputs.append(
            decode_attention_reference(
                q[row : row + 1],
                _gathered(key_planes, table),
                _gathered(value_planes, table),
                key_format,
                value_format,
                positions,
                query_positions[row],
                window,
                scale,
            )
        )
    return torch.cat(outputs)


def _gathered(planes: Sequence[torch.Tensor], table: torch.Tensor) -> list[torch.Tensor]:
    """A row's blocks as one sequence: [max_blocks, Hkv, block_size, w] planes ->
    [1, Hkv, max_blocks * block_size, w]."""
    return [p[table].transpose(0, 1).flatten(1, 2).unsqueeze(0) for p in planes]


def paged_decode_attention(
    q: torch.Tensor,
    key_planes: Sequence[torch.Tensor],
    value_planes: Sequence[torch.Tensor],
    key_format: PlaneFormat,
    value_format: PlaneFormat,
    block_tables: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token per sequence) over the pool's blocks -> [B, Hq, D]
    in q's dtype. `block_tables` [B, max_blocks] int32, `query_positions` [B] int64, both on
    q's device. On a GPU: graph-capturable (launch shapes depend on B, max_blocks and the
    window only)."""
    return paged_decode_attention_reference(
        q, key_planes, value_planes, key_format, value_format, block_tables, query_positions,
        window, scale,
    )  # fmt: skip
