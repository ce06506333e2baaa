"""GGUF blocks kept as stored (`hearth.layers.gguf`, the native block kernels): the weight every
product sees is `gguf.quants.dequantize`'s, bit for bit, and the products are fp32 sums of it.

Accumulation bound: any order of summing k fp32 products of exact values is within
γ_k·Σ|x_i·w_i| of the exact sum, γ_k = k·u / (1 - k·u), u = 2⁻²⁴ (Higham, Accuracy and
Stability of Numerical Algorithms, 3.1). The fp64 reference on the dequantized weights is
exact to far below that, so a wrong weight value (one code, one scale) lands outside it.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_blocks_data import random_blocks
from hearth.layers import gguf as gguf_layers
from hearth.layers.gguf import GGUFEmbeddingHead, GGUFLinear
from hearth.ops import native
from hearth.quant.gguf_blocks import BLOCK_FORMATS
from native_builds import kernels_build  # noqa: F401 (a fixture)

IN_FEATURES = 512  # two K-type blocks a row
needs_kernels = pytest.mark.skipif(
    native.kernels() is None, reason="no C compiler with OpenMP, or neither AVX-512 nor AVX2"
)


def _expected(type_id: int, raw: np.ndarray) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(np.ascontiguousarray(values))


def _within_accumulation_bound(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> bool:
    k = x.shape[-1]
    unit = 2.0**-24
    gamma = k * unit / (1 - k * unit)
    exact = x.double() @ weight.double().T
    bound = gamma * (x.double().abs() @ weight.double().abs().T)
    return bool(((y.double() - exact).abs() <= bound).all())


@needs_kernels
@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS))
def test_native_blocks_to_f32_and_gemv_per_type(type_id: int) -> None:
    """Dequantization bit for bit; the GEMV at 1 and 5 input rows within the bound."""
    kernels = native.kernels()
    assert kernels is not None
    raw = random_blocks(type_id, rows=40, cols=IN_FEATURES, seed=type_id)
    expected = _expected(type_id, raw)
    values = torch.empty(40, IN_FEATURES)
    kernels.blocks_to_f32(type_id, torch.from_numpy(raw), values)
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))
    x = torch.randn(5, IN_FEATURES, generator=torch.Generator().manual_seed(type_id))
    for rows in (1, 5):
        y = torch.empty(rows, 40)
        kernels.blocks_gemv(type_id, x[:rows].contiguous(), torch.from_numpy(raw), y)
        assert _within_accumulation_bound(y, x[:rows], expected)


@pytest.mark.usefixtures("kernels_build")
@pytest.mark.parametrize("type_id", sorted(BLOCK_FORMATS))
def test_gemv_rows_beside_others_equal_each_alone(type_id: int) -> None:
    """Up to 16 input rows at once (several register blocks of rows, and a partial one): each
    row's sums bit for bit as that row alone, all within the bound; on this CPU's library and
    the AVX2 one (8 rows a block on both)."""
    kernels = native.kernels()
    assert kernels is not None
    raw = random_blocks(type_id, rows=37, cols=IN_FEATURES, seed=type_id + 1)
    blocks = torch.from_numpy(raw)
    x = torch.randn(16, IN_FEATURES, generator=torch.Generator().manual_seed(type_id))
    alone = torch.empty(16, 37)
    for row in range(16):
        kernels.blocks_gemv(type_id, x[row : row + 1].contiguous(), blocks, alone[row : row + 1])
    assert _within_accumulation_bound(alone, x, _expected(type_id, raw))
    for rows in (2, 3, 8, 9, 16):
        together = torch.empty(rows, 37)
        kernels.blocks_gemv(type_id, x[:rows].contiguous(), blocks, together)
        assert torch.equal(together.view(torch.int32), alone[:rows].view(torch.int32)), rows


def _stacked_layer() -> tuple[GGUFLinear, torch.Tensor]:
    """A q/k/v-like stack of parts of four types, two adjacent ones alike (rows not a multiple
    of the kernel's)."""
    parts, weights = [], []
    for type_id, rows in ((6, 37), (8, 16), (8, 5), (12, 21), (14, 8)):
        raw = random_blocks(type_id, rows=rows, cols=IN_FEATURES, seed=rows)
        parts.append((type_id, torch.from_numpy(raw)))
        weights.append(_expected(type_id, raw))
    return GGUFLinear(parts, IN_FEATURES), torch.cat(weights)


@pytest.mark.parametrize("native_kernels", [True, False], ids=["native", "torch"])
def test_stacked_linear_decode_and_prefill_within_the_bound(
    native_kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode (1 and 3 rows: the block GEMV) and a prefill of 40 rows (tiles of 8 rows
    dequantized, then a GEMM), with the native kernels and with torch's reference path."""
    if native_kernels and native.kernels() is None:
        pytest.skip("no native kernels here")
    if not native_kernels:
        monkeypatch.setattr(native, "kernels", lambda: None)
    monkeypatch.setattr(gguf_layers, "TILE_BYTES", 8 * 4 * IN_FEATURES)
    layer, weight = _stacked_layer()
    assert (layer.type_ids, layer.part_rows) == ([6, 8, 12, 14], [37, 21, 21, 8])
    assert torch.equal(layer.dequantize().view(torch.int32), weight.view(torch.int32))
    generator = torch.Generator().manual_seed(1)
    for rows in (1, 3, 40):
        x = torch.randn(1, rows, IN_FEATURES, generator=generator)
        y = layer(x)
        assert y.shape == (1, rows, 87) and y.dtype == torch.float32
        assert _within_accumulation_bound(y[0], x[0], weight)
    assert layer(x.bfloat16()).dtype == torch.bfloat16  # computes in fp32, returns x's dtype


def test_embedding_head_rows_are_the_files_values() -> None:
    raw = random_blocks(8, rows=300, cols=64, seed=3)
    table = GGUFEmbeddingHead(GGUFLinear([(8, torch.from_numpy(raw))], 64))
    ids = torch.tensor([[0, 299, 7], [7, 7, 150]])
    expected = _expected(8, raw)
    assert torch.equal(table.embed(ids), expected[ids])
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    assert _within_accumulation_bound(table.head(x), x, expected)
    assert table.nbytes == raw.nbytes


def test_a_part_of_the_wrong_size_is_refused() -> None:
    blocks = torch.zeros(4, 33, dtype=torch.uint8)
    with pytest.raises(ValueError, match="part 0: Q8_0 rows of 64 values are 68 bytes"):
        GGUFLinear([(8, blocks)], 64)
