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

from hearth.ops import gemv as gemv_module
from hearth.ops.activation import gelu_tanh_mul_reference

pytestmark = [
    pytest.mark.skipif(not gemv_module.HAS_TRITON, reason="needs triton (its interpreter)"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; GPU script checks"),
]
EPS32 = torch.finfo(torch.float32).eps


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    geglu: bool,
    config: dict,
    up: torch.Tensor | None = None,
) -> None:
    got = gemv_module.gemv_triton(x, weight, geglu, config, up=up)
    inputs = gelu_tanh_mul_reference(x, up) if geglu else x
    oracle = inputs.double() @ weight.double().T
    magnitude = inputs.double().abs() @ weight.double().abs().T
    k = weight.shape[1]
    bound = torch.finfo(x.dtype).eps * oracle.abs() + 4 * math.sqrt(k) * EPS32 * magnitude
    assert got.shape == (*x.shape[:-1], weight.shape[0]) and got.dtype == x.dtype
    assert ((got.double() - oracle).abs() <= bound).all()
    reference = gemv_module.gemv_reference(x, weight, geglu, up)
    assert ((reference.double() - oracle).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("geglu", [False, True])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("stages", [1, 3])
def test_gemv_against_fp64(dtype: torch.dtype, geglu: bool, split: int, stages: int) -> None:
    # N=40 is not a multiple of BLOCK_N=16; K=200 leaves ragged last steps in every slice.
    generator = torch.Generator().manual_seed(split + 2 * geglu)
    n, k = 40, 200
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    x = torch.randn(3, 2 * k if geglu else k, generator=generator).to(dtype)
    config = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split, "LOOP_STAGES": stages}
    _check(x, weight, geglu, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_geglu_of_a_separate_up(dtype: torch.dtype, split: int) -> None:
    """gelu_tanh(gate) * up from two tensors (Gemma 4's per-layer input gate and its input),
    `up` a strided view: the same oracle as the stacked form, and the stacked form's bits."""
    generator = torch.Generator().manual_seed(7 + split)
    n, k = 40, 200
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    stacked = torch.randn(3, 2 * k, generator=generator).to(dtype)
    gate, up = stacked[:, :k].contiguous(), torch.randn(3, 2, k, generator=generator)[:, 1]
    up.copy_(stacked[:, k:])
    config = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split}
    _check(gate, weight, True, config, up=up.to(dtype))
    separate = gemv_module.gemv_triton(gate, weight, True, config, up=up.to(dtype))
    assert torch.equal(separate, gemv_module.gemv_triton(stacked, weight, True, config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_of_an_add_norm_input(dtype: torch.dtype, split: int) -> None:
    """With an add-norm input the GEMV reads h = residual + round(rms_norm(x) · w), and its
    first row block stores h. h matches `add_rms_norm_reference` up to the RMS's fp32 sum
    order; the product is checked against the fp64 oracle of the h the kernel stored."""
    generator = torch.Generator().manual_seed(11 + split)
    n, k = 40, 200  # three row blocks: only the first stores h
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    x = (torch.randn(3, k, generator=generator) * 3).to(dtype)
    residual = torch.randn(3, k, generator=generator).to(dtype)
    norm_weight = torch.rand(k, generator=generator) + 0.5
    outputs = []
    for config in (None, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split}):
        add_norm = gemv_module.AddNorm(residual, norm_weight, 1e-6, torch.empty_like(x))
        outputs.append(
            (gemv_module.gemv_triton(x, weight, config=config, add_norm=add_norm), add_norm.out)
        )
    (got, summed), (again, summed_again) = outputs
    assert torch.equal(summed_again, summed)  # the same h whatever the tiles
    _, expected = gemv_module.gemv_add_norm_reference(x, weight, residual, norm_weight, 1e-6)
    normed = expected.double() - residual.double()
    ulp = torch.finfo(dtype).eps
    # The RMS's fp32 sums differ in order (~sqrt(K) eps32, +3 for rsqrt and the products),
    # then normed may round the other way (an ulp of it) and so may h (an ulp of h).
    ordering = (math.sqrt(k) + 3) * EPS32 * normed.abs()
    tolerance = ulp * (expected.double().abs() + normed.abs()) + ordering
    assert ((summed.double() - expected.double()).abs() <= tolerance).all()
    for out in (got, again):
        oracle = summed.double() @ weight.double().T
        magnitude = summed.double().abs() @ weight.double().abs().T
        bound = ulp * oracle.abs() + 4 * math.sqrt(k) * EPS32 * magnitude
        assert ((out.double() - oracle).abs() <= bound).all()
    # Off the GPU the public entry point is the reference itself.
    assert torch.equal(
        gemv_module.gemv_add_norm(x, weight, residual, norm_weight, 1e-6)[1], expected
    )


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
    with pytest.raises(ValueError, match="second input"):
        gemv_module.gemv_triton(torch.randn(1, 32), weight, True, up=torch.randn(1, 16))
    x = torch.randn(1, 32)
    add_norm = gemv_module.AddNorm(torch.randn(1, 16), torch.ones(32), 1e-6, torch.empty(1, 32))
    with pytest.raises(ValueError, match="residual"):
        gemv_module.gemv_triton(x, weight, add_norm=add_norm)
