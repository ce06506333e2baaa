"""Triton kernels over GGUF blocks as stored (`hearth.ops.gguf_matmul`), every block type.

They run in Triton's CPU interpreter here and compiled on a GPU machine (the same tests: the
tensors are made on the GPU when there is one). The weights come from the `gguf` package
(quantized by it where it can, random valid blocks for the k-quants: `random_blocks`) and the
oracle is `gguf.quants.dequantize` itself:

* the dequantize kernel's fp32 values equal the oracle's bit for bit (every product in a
  block's decoding is exact in fp32; its one offset add rounds once, as numpy's does);
* a product (GEMV or dequantized tile + GEMM) of fp32 activations equals the fp64 product on
  the oracle's weights within the bound of any order of k fp32 sums of exact products:
  γ_k·Σ|x_i·w_i|, γ_k = k·u / (1 - k·u), u = 2⁻²⁴ (Higham, Accuracy and Stability of
  Numerical Algorithms, 3.1). One wrong code or scale lands far outside it;
* bf16 activations (the GPU's compute dtype): the same bound on the fp32 sums, plus the one
  rounding of the output to bf16 (half an ulp: u = 2⁻⁸ of |y|), on a GPU only: Triton's
  interpreter casts fp32 to bf16 by truncation, a full ulp.

Shapes are small (K <= 512, a few dozen rows) for the interpreter's sake; K = 320 for the
32-value types leaves a partial 256-value step (its blocks past K are masked).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_blocks_data import random_blocks
from hearth.ops import gguf_matmul as gm
from hearth.quant import gguf_blocks as gb
from hearth.quant.gguf_blocks import BLOCK_FORMATS

pytestmark = pytest.mark.skipif(not gm.HAS_TRITON, reason="needs triton (its interpreter)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TYPES = sorted(BLOCK_FORMATS)
ROWS = 24


def _width(type_id: int) -> int:
    return 512 if BLOCK_FORMATS[type_id].values == 256 else 320


def _weights(type_id: int, rows: int = ROWS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks on the test device, the oracle's fp32 values on the CPU)."""
    raw = random_blocks(type_id, rows, _width(type_id), seed=seed + type_id)
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(raw).to(DEVICE), torch.from_numpy(np.ascontiguousarray(values))


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    unit = 2.0**-24
    return k * unit / (1 - k * unit) * (x.double().abs() @ weight.double().abs().T)


def _assert_within_sum_bound(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    exact = x.double() @ weight.double().T
    error = (y.double().cpu() - exact).abs()
    assert bool((error <= _bound(x, weight)).all()), float(error.max())


@pytest.mark.parametrize("type_id", TYPES, ids=[BLOCK_FORMATS[t].name for t in TYPES])
def test_dequantize_kernel_is_the_gguf_package_bit_for_bit(type_id: int) -> None:
    blocks, expected = _weights(type_id)
    values = gm.gguf_dequantize_triton(type_id, blocks, _width(type_id), torch.float32)
    assert torch.equal(values.cpu().view(torch.int32), expected.view(torch.int32))
    # Rows by id (a token table's lookup): ids on the device, repeated and out of order.
    ids = torch.tensor([[5, 0, 23], [5, 17, 2]], device=DEVICE)
    rows = gm.gguf_rows(ids, type_id, blocks, torch.float32)
    assert rows.shape == (2, 3, _width(type_id))
    assert torch.equal(rows.cpu(), expected[ids.cpu()])
    reference = gm.gguf_rows_reference(ids.cpu(), type_id, blocks.cpu(), torch.float32)
    assert torch.equal(rows.cpu(), reference)


@pytest.mark.parametrize("type_id", TYPES, ids=[BLOCK_FORMATS[t].name for t in TYPES])
def test_gemv_and_tiled_product_equal_fp64_on_the_gguf_weights(type_id: int) -> None:
    """1..4 rows take the GEMV, 6 and 20 the fused dot kernel (one and two blocks of 16 rows;
    fp32 activations: an IEEE fp32 dot, exact weights), 40 the dequantized tile and a GEMM;
    each within the bound."""
    blocks, weight = _weights(type_id)
    x = torch.randn(40, _width(type_id), generator=torch.Generator().manual_seed(type_id))
    for rows in (1, 3, 6, 20, 40):
        y = gm.gguf_linear(x[:rows].to(DEVICE), [(type_id, blocks)], ROWS)
        assert y.shape == (rows, ROWS) and y.dtype == torch.float32
        _assert_within_sum_bound(y, x[:rows], weight)
    reference = gm.gguf_matmul_reference(x, type_id, blocks.cpu())
    _assert_within_sum_bound(reference, x, weight)


@pytest.mark.parametrize("type_id", [2, 12, 14], ids=["Q4_0", "Q4_K", "Q6_K"])
def test_a_gemv_split_over_k_adds_its_slices(type_id: int) -> None:
    """K split in 2 and 3 slices (the last one short, 5 steps of 256 values), several row
    blocks: the last program of each row block adds the partials; the same bound. Twice in a
    row, so the arrival counters must have been reset by the first."""
    raw = random_blocks(type_id, ROWS, 1280, seed=9)
    weight = torch.from_numpy(
        np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id)))
    )
    blocks = torch.from_numpy(raw).to(DEVICE)
    x = torch.randn(3, 1280, generator=torch.Generator().manual_seed(3))
    for split in (2, 3, 3):
        y = torch.empty(3, ROWS, device=DEVICE)
        gm.gguf_gemv_triton(x.to(DEVICE), type_id, blocks, y, block_n=8, split_k=split)
        _assert_within_sum_bound(y, x, weight)


@pytest.mark.parametrize("rows", [2, 7, 40])
def test_a_stack_of_parts_of_different_types_is_one_product(rows: int) -> None:
    """A q/k/v-like stack (Q4_K, Q4_K, Q6_K as a Q4_K_M file mixes them) into one output, by
    the GEMV and the dot kernel into column slices and by one dequantized scratch."""
    parts = [_weights(12, 16, seed=1), _weights(12, 8, seed=2), _weights(14, 8, seed=3)]
    weight = torch.cat([values for _, values in parts])
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    stack = [(t, b) for t, (b, _) in zip((12, 12, 14), parts, strict=True)]
    y = gm.gguf_linear(x.to(DEVICE), stack, 32)
    _assert_within_sum_bound(y, x, weight)


def test_a_head_larger_than_a_tile_is_computed_a_tile_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks, weight = _weights(14, rows=40, seed=4)
    monkeypatch.setattr(gm, "TILE_BYTES", 12 * 512 * 4)  # 12 rows of fp32: four tiles
    x = torch.randn(gm.DOT_MAX_ROWS + 1, 512, generator=torch.Generator().manual_seed(5))
    _assert_within_sum_bound(gm.gguf_linear(x.to(DEVICE), [(14, blocks)], 40), x, weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 rounding: the GPU's (see top)")
@pytest.mark.parametrize("type_id", TYPES, ids=[BLOCK_FORMATS[t].name for t in TYPES])
def test_cuda_bf16_activations(type_id: int) -> None:
    """bf16 x: the GEMV's fp32 sums rounded once to bf16; the dot kernel's and the prefill's
    weights are the exact values rounded to bf16 (what HF computes with on a bf16 load), their
    sums fp32 (tensor cores, cuBLAS): the bound on those weights, plus the output rounding."""
    blocks, weight = _weights(type_id)
    x = torch.randn(6, _width(type_id), generator=torch.Generator().manual_seed(1)).bfloat16()
    y = gm.gguf_linear(x[:2].cuda(), [(type_id, blocks)], ROWS).float().cpu()
    exact = x[:2].double() @ weight.double().T
    summed = _bound(x[:2].float(), weight)
    allowed = summed + 2.0**-8 * (exact.abs() + summed)
    assert bool(((y.double() - exact).abs() <= allowed).all())
    values = gm.gguf_dequantize_triton(type_id, blocks, _width(type_id), torch.bfloat16)
    assert torch.equal(values.cpu(), weight.bfloat16())
    rounded = weight.bfloat16().float()
    x = torch.randn(40, _width(type_id), generator=torch.Generator().manual_seed(2)).bfloat16()
    for rows in (6, 20, 40):
        y = gm.gguf_linear(x[:rows].cuda(), [(type_id, blocks)], ROWS).float().cpu()
        exact = x[:rows].double() @ rounded.double().T
        summed = _bound(x[:rows].float(), rounded)
        allowed = summed + 2.0**-8 * (exact.abs() + summed)
        assert bool(((y.double() - exact).abs() <= allowed).all()), rows


def test_bad_operands_are_refused_by_name() -> None:
    blocks, _ = _weights(12)
    with pytest.raises(ValueError, match=r"Q4_K rows of 256 values are uint8 \[rows, 144\]"):
        gm.gguf_dequantize_triton(12, blocks, 256, torch.float32)
    shifted = torch.empty(ROWS * 144 + 1, dtype=torch.uint8, device=DEVICE)[1:].view(ROWS, 144)
    with pytest.raises(ValueError, match="Q4_K rows must start 4-byte aligned"):
        gm.gguf_dequantize_triton(12, shifted, 256, torch.float32)
    with pytest.raises(ValueError, match="at most 4 rows"):
        x = torch.zeros(5, 512, device=DEVICE)
        gm.gguf_gemv_triton(x, 12, blocks, torch.empty(5, ROWS, device=DEVICE))


# ---------------------------------------------------------------------------------------------
# Planar rows (`hearth.quant.gguf_blocks.to_planar`): Q4_0, Q8_0, Q4_K, Q6_K

PLANAR_IDS = [BLOCK_FORMATS[t].name for t in gb.PLANAR_TYPES]


def _planar(type_id: int, rows: int = ROWS, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(planar rows on the test device, the oracle's fp32 values of the file's blocks)."""
    blocks, values = _weights(type_id, rows, seed)
    return gb.to_planar(type_id, blocks.cpu()).to(DEVICE), values


def _planar_bound(x: torch.Tensor, weight: torch.Tensor, type_id: int) -> torch.Tensor:
    """γ_k·Σ|x_i·w_i| as above for Q4_K, whose kernels form each weight and add x times it. The
    symmetric types (w = s·q, exact) add x·q and multiply each group's sum by s: one rounding
    more on each term's path (k + 1 in all: a product, the scale, at most k - 1 additions)."""
    k = x.shape[-1] + (0 if type_id == 12 else 1)
    unit = 2.0**-24
    return k * unit / (1 - k * unit) * (x.double().abs() @ weight.double().abs().T)


def _assert_within_planar_bound(y, x, weight, type_id: int) -> None:
    exact = x.double() @ weight.double().T
    error = (y.double().cpu() - exact).abs()
    assert bool((error <= _planar_bound(x, weight, type_id)).all()), float(error.max())


@pytest.mark.parametrize("type_id", gb.PLANAR_TYPES, ids=PLANAR_IDS)
def test_the_planar_repack_is_lossless(type_id: int) -> None:
    """Planar rows unpack to the file's bytes exactly, take the file's bytes (Q4_K: its 12
    packed scale bytes become 16, +2.8%) padded to 16 a row, and decode (torch reference) to
    `gguf.quants.dequantize`'s values bit for bit."""
    for width in (_width(type_id), 3840):
        raw = torch.from_numpy(random_blocks(type_id, 5, width, seed=type_id))
        planar = gb.to_planar(type_id, raw)
        assert torch.equal(gb.from_planar(type_id, planar), raw)
        grown = 148 / 144 if type_id == 12 else 1.0
        assert raw.shape[1] * grown <= planar.shape[1] < raw.shape[1] * grown + 16
        assert planar.shape[1] % gb.ROW_ALIGNMENT == 0
        expected = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(type_id))
        values = gb.dequantize_layout(gb.planar_layout(type_id), planar)
        assert torch.equal(values, torch.from_numpy(np.ascontiguousarray(expected)))


@pytest.mark.parametrize("type_id", gb.PLANAR_TYPES, ids=PLANAR_IDS)
def test_planar_kernels_see_the_gguf_weights(type_id: int) -> None:
    """The dequantize kernel (and a lookup by ids) on planar rows is the oracle bit for bit;
    1..4 rows take the planar GEMV, 6 and 20 the dot kernel, 40 the dequantized tile and a
    GEMM, each within the bound of `_planar_bound`."""
    planar, weight = _planar(type_id)
    layout = gb.planar_layout(type_id)
    values = gm.gguf_dequantize_triton(layout, planar, _width(type_id), torch.float32)
    assert torch.equal(values.cpu().view(torch.int32), weight.view(torch.int32))
    ids = torch.tensor([[5, 0, 23], [5, 17, 2]], device=DEVICE)
    assert torch.equal(gm.gguf_rows(ids, layout, planar, torch.float32).cpu(), weight[ids.cpu()])
    x = torch.randn(40, _width(type_id), generator=torch.Generator().manual_seed(type_id))
    for rows in (1, 2, 3, 4, 6, 20, 40):
        y = gm.gguf_linear(x[:rows].to(DEVICE), [(layout, planar)], ROWS)
        assert y.shape == (rows, ROWS) and y.dtype == torch.float32
        _assert_within_planar_bound(y, x[:rows], weight, type_id)
    # bf16 activations (the GPU's; the GEMV reads them as pairs) into an fp32 output: the
    # same bound on their values, which fp32 holds exactly.
    # With `prefetch` the loop loads each step a step ahead. Last, x a view one value off
    # its storage's start and with an odd row stride (the GEMV copies it aligned).
    x = x.bfloat16()
    for rows, prefetch in ((1, False), (3, False), (1, True), (4, True)):
        y = torch.empty(rows, ROWS, device=DEVICE)
        gm.gguf_gemv_triton(x[:rows].to(DEVICE), layout, planar, y, prefetch=prefetch)
        _assert_within_planar_bound(y, x[:rows].float(), weight, type_id)
    wide = torch.zeros(2, _width(type_id) + 1, dtype=torch.bfloat16)
    wide[:, 1:] = x[:2]
    y = torch.empty(2, ROWS, device=DEVICE)
    gm.gguf_gemv_triton(wide.to(DEVICE)[:, 1:], layout, planar, y)
    _assert_within_planar_bound(y, x[:2].float(), weight, type_id)


@pytest.mark.parametrize("type_id", [12, 14], ids=["Q4_K", "Q6_K"])
def test_a_planar_gemv_split_over_k_adds_its_slices(type_id: int) -> None:
    """K split in 2 and 3 slices of 8-group steps (5 steps, the last slice short), rows in
    blocks of 8; twice at 3 (the second loading a step ahead), so the first launch must have
    reset the arrival counters."""
    raw = random_blocks(type_id, ROWS, 1280, seed=9)
    weight = torch.from_numpy(
        np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id)))
    )
    planar = gb.to_planar(type_id, torch.from_numpy(raw)).to(DEVICE)
    x = torch.randn(3, 1280, generator=torch.Generator().manual_seed(3))
    for split, prefetch in ((2, False), (3, False), (3, True)):
        y = torch.empty(3, ROWS, device=DEVICE)
        layout = gb.planar_layout(type_id)
        gm.gguf_gemv_triton(
            x.to(DEVICE), layout, planar, y, block_n=8, split_k=split, prefetch=prefetch
        )
        _assert_within_planar_bound(y, x, weight, type_id)


@pytest.mark.parametrize("rows", [1, 4, 7, 40])
def test_a_planar_stack_of_q4_k_and_q6_k_is_one_product(rows: int) -> None:
    """A Q4_K_M-like q/k/v stack (Q4_K, Q4_K, Q6_K) in planar rows, into one output."""
    parts = [_planar(12, 16, seed=1), _planar(12, 8, seed=2), _planar(14, 8, seed=3)]
    weight = torch.cat([values for _, values in parts])
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    stack = [(gb.planar_layout(t), p) for t, (p, _) in zip((12, 12, 14), parts, strict=True)]
    y = gm.gguf_linear(x.to(DEVICE), stack, 32)
    _assert_within_planar_bound(y, x, weight, 14)  # the looser of the two bounds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 rounding: the GPU's (see top)")
@pytest.mark.parametrize("type_id", gb.PLANAR_TYPES, ids=PLANAR_IDS)
def test_cuda_planar_bf16_activations(type_id: int) -> None:
    """bf16 x through the planar GEMV (1..4 rows) at 12B's K: the sum bound plus the output's
    one rounding to bf16 (half an ulp), as `test_cuda_bf16_activations`."""
    raw = random_blocks(type_id, 64, 3840, seed=11)
    weight = torch.from_numpy(
        np.ascontiguousarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id)))
    )
    planar = gb.to_planar(type_id, torch.from_numpy(raw)).cuda()
    x = torch.randn(4, 3840, generator=torch.Generator().manual_seed(1)).bfloat16()
    for rows in (1, 2, 4):
        y = gm.gguf_linear(x[:rows].cuda(), [(gb.planar_layout(type_id), planar)], 64)
        exact = x[:rows].double() @ weight.double().T
        summed = _planar_bound(x[:rows].float(), weight, type_id)
        allowed = summed + 2.0**-8 * (exact.abs() + summed)
        assert bool(((y.float().cpu().double() - exact).abs() <= allowed).all()), rows


def test_bad_planar_operands_are_refused_by_name() -> None:
    planar, _ = _planar(12)
    layout = gb.planar_layout(12)
    with pytest.raises(ValueError, match=r"planar Q4_K rows of 256 values are uint8 \[rows, 160\]"):
        gm.gguf_dequantize_triton(layout, planar, 256, torch.float32)
    width = planar.shape[1]
    shifted = torch.empty(ROWS * width + 4, dtype=torch.uint8, device=DEVICE)[4:]
    with pytest.raises(ValueError, match="planar Q4_K rows must start 16-byte aligned"):
        gm.gguf_dequantize_triton(layout, shifted.view(ROWS, width), 512, torch.float32)
    with pytest.raises(ValueError, match="Q2_K has no planar layout"):
        gb.to_planar(10, torch.zeros(2, 84, dtype=torch.uint8))
