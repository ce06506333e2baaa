"""hearth.ops.native.bf16_gemm: CPU bf16 products as fp32 GEMMs on CPUs without bf16 ops."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hearth.ops.native import bf16_gemm


def test_cpu_multiplies_bf16_reads_the_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(bf16_gemm.platform, "machine", lambda: "x86_64")
    sapphire = tmp_path / "sapphire"
    sapphire.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    zen4 = tmp_path / "zen4"
    zen4.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    zen2 = tmp_path / "zen2"
    zen2.write_text("flags\t\t: fpu avx2 fma f16c\n")
    assert bf16_gemm.cpu_multiplies_bf16(sapphire) and bf16_gemm.cpu_multiplies_bf16(zen4)
    assert not bf16_gemm.cpu_multiplies_bf16(zen2)
    # Unreadable flags, or not x86: torch's bf16 GEMM is kept.
    assert bf16_gemm.cpu_multiplies_bf16(tmp_path / "missing")
    monkeypatch.setattr(bf16_gemm.platform, "machine", lambda: "arm64")
    assert bf16_gemm.cpu_multiplies_bf16(zen2)


@pytest.fixture(params=[False, True], ids=["bf16-gemm", "fp32-gemm"])
def widened(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(bf16_gemm, "widen_bf16_products", lambda: request.param)
    return request.param


def test_linear_of_exact_products_is_the_product_rounded_once(widened: bool):
    generator = torch.Generator().manual_seed(0)
    # Integers below 2^4 and 48 terms: every product and partial sum (< 2^14) is exact in
    # fp32, in any order, so the result is the exact product rounded to bf16 once.
    x = torch.randint(-15, 16, (20, 48), generator=generator).to(torch.bfloat16)
    weight = torch.randint(-15, 16, (24, 48), generator=generator).to(torch.bfloat16)
    bias = torch.randint(-15, 16, (24,), generator=generator).to(torch.bfloat16)
    exact = F.linear(x.double(), weight.double(), bias.double())
    got = bf16_gemm.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, exact.to(torch.bfloat16))
    assert torch.equal(
        bf16_gemm.linear(x, weight), F.linear(x.double(), weight.double()).bfloat16()
    )


def test_linear_of_random_numbers_is_within_the_fp32_sum_bound_of_fp64(widened: bool):
    generator = torch.Generator().manual_seed(1)
    k = 640
    x = torch.randn(17, k, generator=generator).to(torch.bfloat16)
    weight = torch.randn(96, k, generator=generator).to(torch.bfloat16)
    exact = F.linear(x.double(), weight.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs())
    got = bf16_gemm.linear(x, weight).double()
    # An fp32 sum of k products is within k * 2^-24 * sum |x w| of the exact sum (the usual
    # gamma_k bound); rounding it to bf16 (8 significant bits) adds at most 2^-8 relative.
    bound = 2.0**-8 * exact.abs() + (1 + 2.0**-8) * k * 2.0**-24 * magnitude
    assert ((got - exact).abs() <= bound).all()
