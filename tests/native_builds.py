"""The native kernels built for another target than this CPU: the AVX2 library (``vec16.h``'s
two-register path, CI's AMD EPYC) built with ``-march=haswell``, which an AVX-512 machine runs
as well. Tests that take the ``kernels_build`` fixture run once on each build."""

from __future__ import annotations

import functools

import pytest

from hearth.ops import native

HASWELL = tuple("-march=haswell" if flag == "-march=native" else flag for flag in native.FLAGS)


@functools.cache
def avx2_kernels() -> native.NativeKernels | None:
    """The library built for Haswell (AVX2, FMA, F16C), or None where native kernels do not
    run here."""
    if native.kernels() is None:
        return None
    compiler = native._compiler()
    assert compiler is not None  # native.kernels() found one
    import ctypes

    return native.NativeKernels(
        ctypes.CDLL(str(native.build(native.default_cache_dir(), compiler, HASWELL)))
    )


@pytest.fixture(params=["native", "avx2"])
def kernels_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs the test with this CPU's library, then with the AVX2 one in its place."""
    if native.kernels() is None:
        pytest.skip("no C compiler with OpenMP, or neither AVX-512 nor AVX2 here")
    if request.param == "avx2":
        built = avx2_kernels()
        monkeypatch.setattr(native, "kernels", lambda: built)
    return request.param
