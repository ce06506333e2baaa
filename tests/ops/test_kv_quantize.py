"""The quantize-and-append kernel of quantized static caches equals `quantize_affine` (itself
equal to `mx.quantize`, tests/layers/test_mlx_affine.py) bit for bit, written to the right slot."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hearth.kv.cache import EMPTY_POSITION
from hearth.ops.kv_quantize import (
    quantize_append_reference,
    quantize_append_triton,
)
from hearth.quant.kv_codecs import AffineCodec

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


@pytest.mark.parametrize("dim", [32, 64, 256, 512])
def test_rotation_as_a_matmul_is_the_reference(dim: int) -> None:
    """The GPU's dense-matrix rotation against kv.turbo's butterflies: fp32 rounding only.
    Each output sums D products whose magnitudes add up to ≤ √D·max|x|; with random-walk
    rounding (√D·u per term sum) that is D·u·max|x|, u = 2^-24; twice for a round trip."""
    from hearth.ops.hadamard import rotate_matmul, unrotate_matmul
    from hearth.quant.turbo import rotate, unrotate

    x = torch.randn(3, 2, dim).bfloat16()
    bound = 2 * dim * 2**-24 * x.float().abs().max()
    rotated = rotate(x)
    assert (rotate_matmul(x) - rotated).abs().max() <= bound
    assert (unrotate_matmul(rotated) - unrotate(rotated)).abs().max() <= bound
    assert (unrotate_matmul(rotate_matmul(x)) - x.float()).abs().max() <= bound


@pytest.mark.parametrize("scheme", ["k8v3", "k4v3", "t4v3", "k8v2", "k8v4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_turbo_append_matches_the_codec(scheme: str, dtype: torch.dtype) -> None:
    """The kernels store what TurboCodec.encode stores. σ is summed in another order, so a σ
    may differ by one fp16 ulp (and the codes of its group by one level, rarely; none seen):
    bound the σ difference at one ulp, and require ≥ 99% identical codes."""
    from hearth.ops.kv_quantize import turbo_append_reference, turbo_append_triton
    from hearth.quant.mlx import unpack_codes
    from hearth.quant.turbo import TurboCodec

    codec = TurboCodec.parse(scheme)
    heads, dim, capacity, position = 2, 256, 8, 19
    sample = torch.zeros(1, heads, 1, dim, dtype=dtype)
    keys = (torch.randn(1, heads, 1, dim) * 3).to(dtype)
    values = torch.randn(1, heads, 1, dim).to(dtype)
    results = []
    for append in (turbo_append_triton, turbo_append_reference):
        planes = [
            p.new_zeros((*p.shape[:2], capacity, *p.shape[3:]))
            for p in codec.encode(sample, sample)
        ]
        slots = torch.full((capacity,), EMPTY_POSITION)
        counter = torch.zeros((), dtype=torch.long)
        append(torch.tensor([position]), keys, values, planes, slots, counter, codec)
        assert int(slots[position % capacity]) == position and int(counter) == position + 1
        results.append(planes)
    slot = position % capacity
    for got, expected in zip(*results, strict=True):
        got, expected = got[:, :, slot], expected[:, :, slot]
        if got.dtype == torch.uint32:
            bits = (got.shape[-1] * 32) // dim
            same = unpack_codes(got, bits) == unpack_codes(expected, bits)
            assert same.float().mean() >= 0.99
        elif got.dtype == torch.float16:
            ulp = expected.float().abs() * 2**-10
            assert ((got.float() - expected.float()).abs() <= ulp).all()
        elif got.dtype == torch.bfloat16 and not got.is_cuda:  # interpreter truncation
            assert ((got.float() - expected.float()).abs() <= expected.float().abs() * 2**-7).all()
        else:
            assert torch.equal(got, expected)
    decoded = [
        codec.decode([plane[:, :, slot : slot + 1] for plane in planes], torch.float32)
        for planes in results
    ]
    for got, expected in zip(*decoded, strict=True):
        # Equal codes and σ; an interpreted bf16 key scale one ulp off moves a decoded key
        # by up to 255 codes x that ulp: ~1% of the range (exactly 0 on a GPU).
        assert ((got - expected).abs() <= 0.02 * expected.abs().max()).all()


@pytest.mark.parametrize("scheme", ["k8v3", "k4v3", "t4v3"])
def test_turbo_kernels_vouch_for_themselves(scheme: str) -> None:
    """The once-per-device check the static cache runs before trusting the turbo kernels."""
    from hearth.ops.kv_quantize import turbo_kernel_agrees
    from hearth.quant.turbo import TurboCodec

    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert turbo_kernel_agrees(TurboCodec.parse(scheme), 64, torch.float32, device)


def test_turbo_self_check_rejects_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check must fail when the kernel path stores something else than the codec: here
    a kernel whose value codes all come out zero."""
    from hearth.ops import kv_quantize
    from hearth.quant.turbo import TurboCodec

    honest = kv_quantize.turbo_append_triton

    def broken(position, keys, values, planes, *rest):
        honest(position, keys, values, planes, *rest)
        planes[-2].zero_()

    monkeypatch.setattr(kv_quantize, "turbo_append_triton", broken)
    codec = TurboCodec.parse("k4v3")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reason = kv_quantize.turbo_kernel_mismatch(codec, 64, torch.float32, device)
    assert reason is not None and reason.startswith("values")
