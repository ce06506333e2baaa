"""The quantize-and-append kernel of quantized static caches equals `quantize_affine` (itself
equal to `mx.quantize`, tests/test_quant_mlx.py) bit for bit, written to the right slot."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hearth.kernels.kv_quantize import (
    quantize_append_reference,
    quantize_append_triton,
)
from hearth.kv.cache import EMPTY_POSITION
from hearth.kv.quantized import AffineCodec

pytestmark = pytest.mark.usefixtures("on_kernel_device")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_quantize_append_equals_quantize_affine(
    bits: int, group_size: int, dtype: torch.dtype, head_dim: int
) -> None:
    heads, capacity, position = 2, 8, 11
    codec = AffineCodec(bits, group_size)
    sample = torch.zeros(1, heads, 1, head_dim, dtype=dtype)
    # Mixed magnitudes: groups whose low edge dominates, high edge dominates, and a constant.
    keys = (torch.randn(1, heads, 1, head_dim) * torch.linspace(0.1, 8, head_dim)).to(dtype)
    values = torch.randn(1, heads, 1, head_dim).to(dtype)
    values[..., :group_size] = 0.25
    results = []
    for append in (quantize_append_triton, quantize_append_reference):
        planes = [
            p.new_zeros((*p.shape[:2], capacity, *p.shape[3:]))
            for p in codec.encode(sample, sample)
        ]
        slots = torch.full((capacity,), EMPTY_POSITION)
        counter = torch.zeros((), dtype=torch.long)
        append(torch.tensor([position]), keys, values, planes, slots, counter, bits, group_size)
        assert int(slots[position % capacity]) == position and int(counter) == position + 1
        results.append(planes)
    for got, expected in zip(*results, strict=True):
        if got.is_floating_point() and got.dtype == torch.bfloat16 and not got.is_cuda:
            # Triton's interpreter casts fp32 to bf16 by truncation, not rounding: allow the
            # one ulp that makes. Compiled kernels round, and the GPU run checks bits.
            ulp = expected.float().abs() * 2**-7
            assert ((got.float() - expected.float()).abs() <= ulp).all()
        else:
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
