"""The native int8 CPU kernel (hearth/quant/native_kernels.c) against an fp64 oracle, its build
cache, and how Int8Linear dispatches to it.

u = 2^-24 is the fp32 unit roundoff. The kernel forms each product x·q exactly in fp32 (8 + 8
significant bits), sums K of them in fp32 (error <= K·u·Σ|x·q|), multiplies by the scale (one
more u) and rounds to bf16 (8 significant bits: within 2^-8 of |y|). With |y| <= Σ|x|·|w|,
everything is within (2^-8 + (K + 1)·u)·(|x| @ |W|ᵀ) of the exact product, the bound below.
"""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest
import torch

from hearth.quant import cpu, native
from hearth.quant.cpu import Int8Linear

KERNELS = native.kernels()
needs_native = pytest.mark.skipif(
    KERNELS is None, reason="no C compiler with OpenMP or no AVX-512 CPU here"
)


def random_int8(rows: int, in_features: int, out_features: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator).to(torch.bfloat16)
    q = torch.randint(-127, 128, (out_features, in_features), generator=generator)
    scales = (torch.rand(out_features, generator=generator) * 0.01 + 1e-4).to(torch.bfloat16)
    return x, q.to(torch.int8), scales


def exact_product(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * scales.double()[:, None]).T


@needs_native
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    # Row tails (n % 4), K tails (k % 16), one 16-wide step, and the 270M's decode shapes.
    [(1, 16), (5, 24), (37, 70), (262, 640), (1030, 2048), (640, 2048)],
)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_native_int8_kernel_matches_reference(rows: int, out_features: int, in_features: int):
    assert KERNELS is not None
    x, q, scales = random_int8(rows, in_features, out_features, seed=out_features + rows)
    y = KERNELS.int8_rows_matmul(x, q, scales)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
    magnitude = x.double().abs() @ (q.double().abs() * scales.double()[:, None]).T
    bound = (2.0**-8 + (in_features + 1) * 2.0**-24) * magnitude
    excess = ((y.double() - exact_product(x, q, scales)).abs() - bound).max().item()
    assert excess <= 0.0, f"exceeds the bound by {excess}"


@needs_native
def test_native_int8_kernel_hand_example():
    # Small integers: every product and sum is exact, so is the bf16 result.
    assert KERNELS is not None
    x = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5] * 4], dtype=torch.bfloat16)  # k = 20: a tail
    q = torch.tensor([[1] * 20, [-2] * 20, list(range(20))], dtype=torch.int8)
    scales = torch.tensor([1.0, 0.5, 0.25], dtype=torch.bfloat16)
    # Row 0: 4 * (1 + 2 + 3 - 1 + 0.5) = 22; row 1: -2 * 22 * 0.5 = -22;
    # row 2: block b of 5 (j = 5b + i) adds 5b * 5.5 + (0 + 2 + 6 - 3 + 2), so
    # sum_j x_j * j = 27.5 * (0 + 1 + 2 + 3) + 4 * 7 = 193, times 0.25 = 48.25 (8 bits, exact).
    expected = torch.tensor([[22.0, -22.0, 48.25]], dtype=torch.bfloat16)
    assert torch.equal(KERNELS.int8_rows_matmul(x, q, scales), expected)


@needs_native
def test_native_int8_kernel_result_does_not_depend_on_threads():
    # Each output is one thread's dot product, so the thread count changes nothing, bit for bit.
    assert KERNELS is not None
    x, q, scales = random_int8(2, 640, 1030, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = KERNELS.int8_rows_matmul(x, q, scales)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, KERNELS.int8_rows_matmul(x, q, scales))


@needs_native
def test_native_int8_kernel_refuses_what_it_cannot_take():
    assert KERNELS is not None
    x, q, scales = random_int8(17, 64, 8, seed=1)
    with pytest.raises(ValueError, match="int8_rows_matmul"):
        KERNELS.int8_rows_matmul(x, q, scales)  # 17 rows: a prefill, not a decode step
    with pytest.raises(ValueError, match="int8_rows_matmul"):
        KERNELS.int8_rows_matmul(x[:1].float(), q, scales)
    with pytest.raises(ValueError, match="int8_rows_matmul"):
        KERNELS.int8_rows_matmul(x[:1, :32], q, scales)


@needs_native
def test_int8_linear_uses_the_native_kernel_for_one_row():
    generator = torch.Generator().manual_seed(3)
    layer = Int8Linear.from_float(torch.randn(96, 40, generator=generator))  # K = 40: a tail
    assert layer.uses_native and layer.uses_kernel
    x = torch.randn(1, 40, generator=generator).to(torch.bfloat16)
    assert KERNELS is not None
    direct = KERNELS.int8_rows_matmul(x, layer.qweight, layer.scales)
    assert torch.equal(layer(x), direct)


def test_native_kernels_can_be_turned_off(monkeypatch: pytest.MonkeyPatch):
    native.kernels.cache_clear()
    monkeypatch.setenv(native.DISABLE_VARIABLE, "0")
    try:
        assert native.kernels() is None
        assert not Int8Linear.from_float(torch.randn(8, 32)).uses_native
    finally:
        native.kernels.cache_clear()


def _compiler() -> str:
    compiler = native._compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    return compiler


@needs_native
def test_build_compiles_once_into_the_cache(tmp_path: Path):
    compiler = _compiler()
    built = native.build(tmp_path, compiler)
    assert built.is_file() and built.parent == tmp_path
    first_mtime = built.stat().st_mtime_ns
    assert native.build(tmp_path, compiler) == built
    assert built.stat().st_mtime_ns == first_mtime  # found, not rebuilt
    assert [path.name for path in tmp_path.iterdir()] == [built.name]  # no scratch left


def test_a_failing_compiler_leaves_nothing_behind(tmp_path: Path):
    fake = tmp_path / "fake-cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc 1.0'\n[ \"$1\" = --version ] && exit 0\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    cache = tmp_path / "cache"
    with pytest.raises(subprocess.CalledProcessError):
        native.build(cache, str(fake))
    assert list(cache.iterdir()) == []


def test_int8_layers_keep_torch_kernel_without_native(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu, "USE_NATIVE_INT8", False)
    layer = Int8Linear.from_float(torch.randn(64, 32))
    assert not layer.uses_native
    assert layer.uses_kernel == cpu.HAS_INT8_KERNEL
