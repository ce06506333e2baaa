"""The tensor-core affine kernel compiled for a GPU (skipped without CUDA): bf16 x, scales and
biases as a model runs it, against an fp64 product of the unrounded weights; CUDA graphs
replay it bit for bit; `affine_linear` takes it at 5..64 rows.

Tolerance (as tests/ops/test_affine_matmul.py's): the output's rounding to bf16 (eps_bf16 |y|,
twice the GPU's half ulp) plus fp32 accumulation, 4 sqrt(K) eps32 of sum |x w|. 4-bit codes
of a bf16 x enter the mma as ``128 + code`` (the 128 taken off with the bias): the mma then
sums terms up to ~35x |x w| on average, and the tensor cores' fp32 accumulation (products
exact, sums truncated) costs a few ulps of those per group, about a fifth of the bound at
K = 1536 (`benchmarks/lab/gpu_affine_rows.py` prints the ratio at 12B's shapes).
"""

from __future__ import annotations

import math

import pytest
import torch

from hearth.ops import affine_matmul as am
from hearth.quant.mlx import quantize_affine, unpack_codes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EPS32 = torch.finfo(torch.float32).eps
EPS_BF16 = torch.finfo(torch.bfloat16).eps
N, K = 200, 1536  # a partial block of 64 or 128 rows; 48, 24 or 12 groups


def _operands(bits: int, group: int, rows: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=generator)
    packed, scales, biases = (t.cuda() for t in quantize_affine(weight, bits, group))
    scales, biases = scales.bfloat16(), biases.bfloat16()
    x = torch.randn(rows, K, generator=generator).bfloat16().cuda()
    codes = unpack_codes(packed.cpu(), bits).double().unflatten(-1, (-1, group))
    w = codes * scales.cpu().double()[..., None] + biases.cpu().double()[..., None]
    w = w.flatten(-2)
    oracle = x.cpu().double() @ w.T
    magnitude = x.cpu().double().abs() @ w.abs().T
    return (x, packed, scales, biases), oracle, magnitude


def _assert_within(got: torch.Tensor, oracle: torch.Tensor, magnitude: torch.Tensor) -> None:
    error = (got.cpu().double() - oracle).abs()
    bound = EPS_BF16 * oracle.abs() + 4 * math.sqrt(K) * EPS32 * magnitude + 1e-30
    assert (error <= bound).all(), f"max error/bound {(error / bound).max().item():.3f}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [5, 16, 33, 64])
def test_mma_kernel_on_the_gpu_matches_the_oracle(bits: int, group: int, rows: int) -> None:
    """The heuristic's launch and a 4-way K split, each within the module's bound."""
    operands, oracle, magnitude = _operands(bits, group, rows, seed=bits * group + rows)
    tile = max(16, 1 << (rows - 1).bit_length())
    for config in (None, am.MmaConfig(tile, 64, split_k=4)):
        got = am.affine_mma_triton(*operands, bits, group, config)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
        _assert_within(got, oracle, magnitude)


@pytest.mark.parametrize("bits", [4, 8])
def test_mma_kernel_replays_from_a_cuda_graph_bit_for_bit(bits: int) -> None:
    """Captured (a K split and its sum launch, fixed launches: nothing to autotune or sync),
    replayed on new x, it gives the eager call's bits; `affine_linear` at 5..64 rows is it."""
    operands, _, _ = _operands(bits, 64, 16, seed=bits)
    x, weight = operands[0], operands[1:]
    split = am.MmaConfig(16, 64, split_k=4)
    am.affine_mma_triton(x, *weight, bits, 64, split)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = am.affine_mma_triton(x, *weight, bits, 64, split)
    fresh = torch.randn_like(x)
    x.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, am.affine_mma_triton(fresh, *weight, bits, 64, split))
    for rows in (am.MMA_MIN_ROWS, 16, am.MMA_MAX_ROWS):
        rows_x = torch.randn(rows, K, device="cuda").bfloat16()
        assert torch.equal(
            am.affine_linear(rows_x, *weight, bits, 64),
            am.affine_mma_triton(rows_x, *weight, bits, 64),
        )
