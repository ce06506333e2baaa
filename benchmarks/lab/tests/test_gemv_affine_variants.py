"""The candidate affine GEMV kernels of benchmarks/lab/gpu_gemv_affine_variants.py, in Triton's
interpreter: each variant against an independent fp64 oracle and against hearth's reference.

Tolerances. Exact-code variants differ from the oracle by fp32 accumulation only (about
sqrt(K) eps32 of sum |x w|, a factor 4 of slack) and the output's rounding (eps_out |y|).
FOLD accumulates ``x * (C + q)`` per word (C = 2**11 for 4-bit, 2**8 for 8-bit) and subtracts
``C * sum(x)`` per group, so its roundings are relative to sums up to ``(C + max code) sum |x|``
times |scale|: eps32 of that is allowed more (the ~20 roundings per group have both signs;
measured errors stay below a tenth of it, while one wrong code would cost 1/eps32 times more).
The reference also rounds each weight to the scales' dtype (fp16 here): eps16 sum |x w| more.
Shapes are small for the interpreter: N = 24 (past the last whole row block) and K = 384
(the group count is not a multiple of the step: whole steps and a masked tail).
"""

from __future__ import annotations

import math

import pytest
import torch

from hearth.ops import affine_matmul as am
from hearth.quant.mlx import quantize_affine, unpack_codes

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not am.HAS_TRITON,
    reason="interpreter tests; on a GPU the script itself checks the compiled kernels",
)
EPS32 = torch.finfo(torch.float32).eps
EPS16 = torch.finfo(torch.float16).eps
N, K = 24, 384


@pytest.fixture(scope="module")
def variants():
    import gpu_gemv_affine_variants

    return gpu_gemv_affine_variants


def _weights(bits: int, group: int):
    packed, scales, biases = quantize_affine(torch.randn(N, K), bits, group)
    scales, biases = scales.half(), biases.half()
    codes = unpack_codes(packed, bits).double().unflatten(-1, (-1, group))
    oracle = codes * scales.double()[..., None] + biases.double()[..., None]
    return packed, scales, biases, oracle.flatten(-2)


def _check(got, want, x, weight, scales, *, extra_eps=0.0, fold_slack=0.0):
    group = K // scales.shape[-1]
    magnitude = x.double().abs() @ weight.abs().T
    scaled_x = x.double().abs() @ scales.double().abs().repeat_interleave(group, dim=-1).T
    out_eps = torch.finfo(got.dtype).eps
    bound = (
        out_eps * want.double().abs()
        + (4 * math.sqrt(K) * EPS32 + extra_eps) * magnitude
        + fold_slack * scaled_x
    )
    error = (got.double() - want.double()).abs()
    assert (error <= bound + 1e-30).all(), f"max error/bound {(error / bound).max().item():.3f}"


@pytest.mark.parametrize(("bits", "group", "rows"), [(4, 32, 1), (4, 64, 4), (8, 64, 3)])
@pytest.mark.parametrize("name", ["v1", "v1-fold", "v2"])
def test_variant_matches_oracle_and_reference(variants, name, bits, group, rows) -> None:
    torch.manual_seed(bits + group + rows)
    packed, scales, biases, weight = _weights(bits, group)
    x = torch.randn(rows, K)
    oracle = x.double() @ weight.T
    reference = am.affine_matmul_reference(x, packed, scales, biases, bits, group)
    variant = next(v for v in variants.VARIANTS if v.name == name)
    offset = (2**11 if bits == 4 else 2**8) + (1 << bits) - 1
    fold_slack = EPS32 * offset if variant.fold else 0.0
    for config in variants.CPU_CONFIGS:
        got = variants.gemv(variant, config, x, packed, scales, biases, bits, group)
        assert got.shape == (rows, N) and got.dtype == x.dtype, config
        _check(got, oracle, x, weight, scales, fold_slack=fold_slack)
        _check(got, reference, x, weight, scales, extra_eps=EPS16, fold_slack=fold_slack)


def test_split_k_repeats_bits_and_resets_its_counters(variants) -> None:
    torch.manual_seed(7)
    packed, scales, biases, _ = _weights(4, 32)
    x = torch.randn(2, K)
    config = variants.Config(8, 2, split_k=4)
    first = variants.gemv(variants.VARIANTS[0], config, x, packed, scales, biases, 4, 32)
    second = variants.gemv(variants.VARIANTS[0], config, x, packed, scales, biases, 4, 32)
    assert torch.equal(first, second)  # the last split adds the partials in split order
    assert not variants._counters(x.device, 1).any()


def test_fp16_activations(variants) -> None:
    """fp16 in and out (the interpreter's bf16 arithmetic is not the GPU's; the GPU run covers
    bf16)."""
    torch.manual_seed(8)
    packed, scales, biases, weight = _weights(8, 32)
    x = torch.randn(1, K).half()
    got = variants.gemv(
        variants.VARIANTS[0], variants.Config(16, 4), x, packed, scales, biases, 8, 32
    )
    assert got.dtype == torch.float16
    _check(got, x.double() @ weight.T, x, weight, scales)


@pytest.mark.parametrize(("bits", "group", "rows"), [(8, 64, 1), (8, 128, 3)])
def test_library_gemv_is_v1(variants, bits, group, rows) -> None:
    """hearth's GEMV with exact codes (8-bit) is the ported v1: the same launch gives the same
    bits (same operations in the same order), split or not. The library's 4-bit GEMV folds
    its offsets another way than v1-fold (offsets 256 and 16, not 2**11);
    tests/ops/test_affine_matmul.py checks it against the oracle."""
    torch.manual_seed(9 + bits + rows)
    packed, scales, biases, _ = _weights(bits, group)
    x = torch.randn(rows, K)
    v1 = next(v for v in variants.VARIANTS if v.name == "v1")
    for config in variants.CPU_CONFIGS:
        args = (x, packed, scales, biases, bits, group)
        assert torch.equal(am.affine_gemv_triton(*args, config), variants.gemv(v1, config, *args))
