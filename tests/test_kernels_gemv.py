"""The float GEMV kernel (kernels/gemv.py) in Triton's CPU interpreter.

Oracle: fp64 matmul of the same inputs; with `geglu`, the input is first made by the eager
torch ops (`gelu_tanh_mul_reference`, whose roundings the kernel reproduces exactly), so the
kernel differs from the oracle only by fp32 accumulation in another order (about
sqrt(K) eps32 of sum |x w|, a factor 4 of slack) and the output's final rounding (half an
ulp of its dtype). fp16/fp32 stand in for bf16: the interpreter's bf16 is not the GPU's.
"""

from __future__ import annotations

import math

import pytest
import torch

from hearth.kernels import gemv as gemv_module
from hearth.kernels.activation import gelu_tanh_mul_reference

pytestmark = [
    pytest.mark.skipif(not gemv_module.HAS_TRITON, reason="needs triton (its interpreter)"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; GPU script checks"),
]
EPS32 = torch.finfo(torch.float32).eps


def _check(x: torch.Tensor, weight: torch.Tensor, geglu: bool, config: dict) -> None:
    got = gemv_module.gemv_triton(x, weight, geglu, config)
    inputs = gelu_tanh_mul_reference(x) if geglu else x
    oracle = inputs.double() @ weight.double().T
    magnitude = inputs.double().abs() @ weight.double().abs().T
    k = weight.shape[1]
    bound = torch.finfo(x.dtype).eps * oracle.abs() + 4 * math.sqrt(k) * EPS32 * magnitude
    assert got.shape == (*x.shape[:-1], weight.shape[0]) and got.dtype == x.dtype
    assert ((got.double() - oracle).abs() <= bound).all()
    reference = gemv_module.gemv_reference(x, weight, geglu)
    assert ((reference.double() - oracle).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("geglu", [False, True])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_against_fp64(dtype: torch.dtype, geglu: bool, split: int) -> None:
    # N=40 is not a multiple of BLOCK_N=16; K=200 leaves ragged last steps in every slice.
    generator = torch.Generator().manual_seed(split + 2 * geglu)
    n, k = 40, 200
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    x = torch.randn(3, 2 * k if geglu else k, generator=generator).to(dtype)
    _check(x, weight, geglu, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split})


def test_gemv_keeps_leading_dims_and_runs_again_after_a_split() -> None:
    # The split-K counters must be back at zero after a launch, or the next one sums early.
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(24, 96, generator=generator)
    x = torch.randn(1, 1, 96, generator=generator)
    for _ in range(2):
        _check(x, weight, False, {"BLOCK_N": 8, "BLOCK_K": 16, "SPLIT_K": 2})


def test_gemv_rejects_a_wrong_width_and_too_many_rows() -> None:
    weight = torch.randn(8, 32)
    with pytest.raises(ValueError, match="inputs"):
        gemv_module.gemv_triton(torch.randn(1, 32), weight, geglu=True)
    with pytest.raises(ValueError, match="at most"):
        gemv_module.gemv_triton(torch.randn(5, 32), weight)


def _gelu_tanh64(g: torch.Tensor) -> torch.Tensor:
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_geglu_against_fp64(dtype: torch.dtype, rows: int) -> None:
    """The gate/up GEMV that stores gelu_tanh(gate) * up, against an fp64 oracle. Its
    roundings (gate, up, the GELU, the product: one ulp of the dtype each; the fp32 tanh from
    exp: a few eps32, so 8 eps of the GELU) and the fp32 accumulation of gate and up (4
    sqrt(K) eps32 of sum |x w|, carried through |gelu'| <= 1.13 and |up|) bound the error."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 40, 200  # 40 outputs: not a multiple of BLOCK_N=16; K ragged in BLOCK_K=32
    stacked = (torch.randn(2 * n, k, generator=generator) * 0.1).to(dtype)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    got = gemv_module.gemv_geglu_triton(x, stacked, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1})
    projected = x.double() @ stacked.double().T
    magnitude = x.double().abs() @ stacked.double().abs().T
    gate, up = projected[:, :n], projected[:, n:]
    oracle = _gelu_tanh64(gate) * up
    eps = torch.finfo(dtype).eps
    accumulated = 4 * math.sqrt(k) * EPS32
    gelu = _gelu_tanh64(gate).abs()
    bound = (
        max(eps, 8 * EPS32) * gelu * up.abs()
        + (eps * gate.abs() + accumulated * magnitude[:, :n]) * 1.13 * up.abs()
        + (eps * up.abs() + accumulated * magnitude[:, n:]) * gelu
        + eps * oracle.abs()
    )
    reference = gemv_module.gemv_geglu_reference(x, stacked)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert ((got.double() - oracle).abs() <= bound).all()
    assert ((reference.double() - oracle).abs() <= bound).all()


def test_gemv_geglu_rejects_an_odd_stack_and_a_split() -> None:
    with pytest.raises(ValueError, match="even"):
        gemv_module.gemv_geglu_triton(torch.randn(1, 8), torch.randn(7, 8))
    with pytest.raises(ValueError, match="split"):
        gemv_module.gemv_geglu_triton(
            torch.randn(1, 8), torch.randn(8, 8), {"BLOCK_N": 8, "BLOCK_K": 8, "SPLIT_K": 2}
        )
