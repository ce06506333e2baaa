"""Hearth's MLX affine quantization against mlx itself (`mx.quantize`, `mx.dequantize` on CPU).

Bit for bit (torch.equal): unpacked codes, dequantized weights in fp32, bf16 and fp16, and
`quantize_affine`'s (packed, scales, biases), for bits 2, 3, 4, 5, 6, 8 x group sizes 32, 64,
128 (mlx's 1-bit affine mode fits its groups differently; Hearth refuses it). MLX's codes come
from `mx.dequantize` with scale 1 and bias 0, which returns each code as an exact float.

Linear forward: against `F.linear` on `mx.dequantize`'d weights it must be equal (the same
torch op on bit-identical weights). Against mlx's own fp32 `mx.quantized_matmul` the only
difference is summation order over 256 inputs: a few fp32 ulps of the output, so 1e-5
relative to the largest |output| (measured 3.6e-7).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hearth.errors import CheckpointError
from hearth.layers.affine import MLXQuantizedEmbedding, MLXQuantizedLinear
from hearth.quant.mlx import (
    AFFINE_BITS,
    AFFINE_GROUP_SIZES,
    dequantize_affine,
    pack_codes,
    parse_quantization,
    quantize_affine,
    unpack_codes,
)

TORCH_DTYPES = {mx.float32: torch.float32, mx.bfloat16: torch.bfloat16, mx.float16: torch.float16}
MATMUL_RTOL = 1e-5  # measured max |diff| / max |y|: 3.6e-7
SHAPE = (3, 16, 256)  # a leading "experts" dim, as MoE switch layers store them


def to_torch(array: mx.array) -> torch.Tensor:
    """An mlx array as a torch tensor of the same dtype and bits (numpy has no bf16)."""
    if array.dtype in TORCH_DTYPES:
        return torch.from_numpy(np.array(array.astype(mx.float32))).to(TORCH_DTYPES[array.dtype])
    return torch.from_numpy(np.array(array))


def _mx_weight(dtype: mx.Dtype, seed: int, shape: tuple[int, ...] = SHAPE) -> mx.array:
    """Normal weights with some exact zeros and one constant group (the edge cases of the fit)."""
    key_values, key_zeros = mx.random.split(mx.random.key(seed))
    weight = mx.random.normal(shape, key=key_values) * 0.05
    weight = mx.where(mx.random.uniform(shape=shape, key=key_zeros) < 0.1, 0.0, weight)
    weight[..., 0, :32] = 0.125
    return weight.astype(dtype)


def _quantized(
    dtype: mx.Dtype, bits: int, group_size: int, seed: int = 0
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    weight = _mx_weight(dtype, seed)
    packed, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
    return weight, packed, scales, biases


GRID = [(bits, group) for bits in AFFINE_BITS for group in AFFINE_GROUP_SIZES]
DTYPES = list(TORCH_DTYPES)


@pytest.mark.parametrize(("bits", "group_size"), GRID)
def test_unpacked_codes_equal_mlx_codes(bits: int, group_size: int) -> None:
    _, packed, scales, biases = _quantized(mx.float32, bits, group_size)
    codes = mx.dequantize(
        packed, mx.ones_like(scales), mx.zeros_like(biases), group_size=group_size, bits=bits
    )
    ours = unpack_codes(to_torch(packed), bits)
    assert ours.dtype == torch.uint8 and ours.shape == SHAPE
    assert torch.equal(ours, to_torch(codes).to(torch.uint8))
    assert torch.equal(pack_codes(ours, bits), to_torch(packed))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("bits", "group_size"), GRID)
def test_dequantize_equals_mx_dequantize_bit_for_bit(
    dtype: mx.Dtype, bits: int, group_size: int
) -> None:
    _, packed, scales, biases = _quantized(dtype, bits, group_size)
    theirs = to_torch(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits))
    ours = dequantize_affine(to_torch(packed), to_torch(scales), to_torch(biases), bits, group_size)
    assert ours.dtype == TORCH_DTYPES[dtype]
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("bits", "group_size"), GRID)
def test_quantize_equals_mx_quantize_bit_for_bit(
    dtype: mx.Dtype, bits: int, group_size: int
) -> None:
    weight, packed, scales, biases = _quantized(dtype, bits, group_size, seed=1)
    ours = quantize_affine(to_torch(weight), bits, group_size)
    for mine, theirs in zip(ours, (packed, scales, biases), strict=True):
        assert torch.equal(mine, to_torch(theirs))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_forward_is_f_linear_on_mx_weights(dtype: mx.Dtype) -> None:
    _, packed, scales, biases = _quantized(dtype, 4, 64)
    mx_weight = mx.dequantize(packed, scales, biases, group_size=64, bits=4)
    linear = MLXQuantizedLinear(
        to_torch(packed[0]), to_torch(scales[0]), to_torch(biases[0]), 4, 64
    )
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(0)).to(linear.dtype)
    expected = F.linear(x, to_torch(mx_weight[0]))
    assert torch.equal(linear(x), expected)
    assert torch.equal(linear.dequantize(), to_torch(mx_weight[0]))


def test_linear_forward_matches_mx_quantized_matmul_in_fp32() -> None:
    _, packed, scales, biases = _quantized(mx.float32, 5, 32)
    packed, scales, biases = packed[0], scales[0], biases[0]
    x = mx.random.normal((7, 256), key=mx.random.key(3))
    theirs = mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=32, bits=5)
    linear = MLXQuantizedLinear(to_torch(packed), to_torch(scales), to_torch(biases), 5, 32)
    ours = linear(to_torch(x))
    reference = to_torch(theirs)
    tolerance = MATMUL_RTOL * reference.abs().max().item()
    torch.testing.assert_close(ours, reference, atol=tolerance, rtol=0)


def test_embedding_dequantizes_rows_and_ties_the_head() -> None:
    _, packed, scales, biases = _quantized(mx.bfloat16, 6, 64)
    packed, scales, biases = packed[1], scales[1], biases[1]
    table = to_torch(mx.dequantize(packed, scales, biases, group_size=64, bits=6))
    embedding = MLXQuantizedEmbedding(to_torch(packed), to_torch(scales), to_torch(biases), 6, 64)
    ids = torch.tensor([[3, 0, 15, 3]])
    assert torch.equal(embedding.embed(ids, torch.bfloat16), table[ids])
    assert torch.equal(embedding.embed(ids, torch.float32), table[ids].float())
    x = torch.randn(1, 4, 256).to(torch.bfloat16)
    assert torch.equal(embedding.head(x), F.linear(x, table))


def test_nbytes_counts_the_packed_tensors() -> None:
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    linear = MLXQuantizedLinear.from_float(weight, bits=4, group_size=32)
    # 4 bits per weight + a bf16 scale and bias per 32 weights.
    assert linear.nbytes == 64 * 128 // 2 + 2 * 2 * 64 * 128 // 32
    assert (linear.in_features, linear.out_features) == (128, 64)


def test_bad_shapes_and_values_are_refused() -> None:
    packed, scales, biases = quantize_affine(torch.randn(8, 64), 4, 32)
    with pytest.raises(ValueError, match="scales has shape"):
        MLXQuantizedLinear(packed, scales[:, :1], biases, 4, 32)
    with pytest.raises(ValueError, match="bits"):
        quantize_affine(torch.randn(8, 64), 7, 32)
    with pytest.raises(ValueError, match="group_size"):
        quantize_affine(torch.randn(8, 64), 4, 16)
    with pytest.raises(ValueError, match="32-bit words"):
        unpack_codes(packed.view(torch.uint8), 4)


@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"group_size": 32, "bits": 4, "mode": "mxfp4"}, "'mxfp4'"),
        ({"group_size": 64, "bits": 4, "layers.0.mlp.down_proj": {"mode": "nvfp4"}}, "'nvfp4'"),
        ({"group_size": 64, "bits": 7}, "bits"),
        ({"group_size": 64}, "'bits'"),
    ],
)
def test_unsupported_quantization_is_one_clear_error(
    quantization: dict[str, object], named: str
) -> None:
    with pytest.raises(CheckpointError, match=named):
        parse_quantization({"quantization": quantization})


def test_hf_quantization_methods_are_refused() -> None:
    with pytest.raises(CheckpointError, match="'fp8'"):
        parse_quantization({"quantization_config": {"quant_method": "fp8"}})
    assert parse_quantization({}) is None


def test_per_module_entries_override_and_infer() -> None:
    quantization = parse_quantization(
        {
            "quantization": {
                "group_size": 32,
                "bits": 4,
                "mode": "affine",
                "embed_tokens": {"group_size": 64, "bits": 6},
                "layers.0.mlp.down_proj": False,
                "layers.1.mlp.down_proj": True,
                "layers.2.mlp.down_proj": {"bits": 8},
            }
        }
    )
    assert quantization is not None
    modules = quantization.modules
    assert (modules["embed_tokens"].bits, modules["embed_tokens"].group_size) == (6, 64)
    assert modules["layers.0.mlp.down_proj"] is None
    assert modules["layers.1.mlp.down_proj"] == quantization.default
    # Fields an entry leaves out take mlx's mode defaults (group 64), not the global ones.
    assert modules["layers.2.mlp.down_proj"].group_size == 64
    packed, scales, _ = quantize_affine(torch.randn(8, 128), 3, 128)
    inferred = quantization.spec_for("layers.5.mlp.up_proj", 128, packed, scales)
    assert (inferred.bits, inferred.group_size) == (3, 128)
