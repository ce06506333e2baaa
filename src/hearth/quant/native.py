"""Hearth's native CPU kernel (``native_kernels.c``): built on first use, loaded with ctypes.

One kernel, the int8 weight-only matrix-vector product of CPU decode, where torch's own
(``aten._weight_int8pack_mm``) streams short weight rows at about half the memory bandwidth.
It needs a C compiler with OpenMP and an AVX-512 CPU; without either, ``kernels()`` is None and
the int8 layers keep torch's kernel. ``HEARTH_NATIVE=0`` turns it off.

The library is compiled once per source, compiler and CPU into ``$HEARTH_CACHE/native`` (default
``~/.cache/hearth/native``), written to a temporary name and renamed, so concurrent processes
never load a half-written file. torch is imported first: its libgomp is then the one the library
binds to, and both share one OpenMP thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("hearth.native")

SOURCE = Path(__file__).with_name("native_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# Input rows the kernel takes (MAX_INPUT_ROWS in the source).
MAX_INPUT_ROWS = 16
DISABLE_VARIABLE = "HEARTH_NATIVE"
COMPILE_TIMEOUT_S = 120


class NativeKernels:
    """The loaded library, with typed entry points."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._int8_rows_matmul = library.hearth_int8_rows_matmul
        self._int8_rows_matmul.restype = ctypes.c_int
        self._int8_rows_matmul.argtypes = [
            ctypes.c_void_p,  # x, bf16 [m, k]
            ctypes.c_int64,  # m
            ctypes.c_int64,  # k
            ctypes.c_void_p,  # q, int8 [n, k]
            ctypes.c_void_p,  # scales, bf16 [n]
            ctypes.c_int64,  # n
            ctypes.c_void_p,  # y, bf16 [m, n]
            ctypes.c_int,  # threads
        ]

    def int8_rows_matmul(self, x: Tensor, qweight: Tensor, scales: Tensor) -> Tensor:
        """``x [m, k] @ (qweight [n, k] * scales [n])ᵀ`` in bf16, for 1 <= m <= 16."""
        rows, in_features = x.shape
        out_features = qweight.shape[0]
        if not (
            x.dtype == torch.bfloat16
            and qweight.dtype == torch.int8
            and scales.dtype == torch.bfloat16
            and qweight.shape[1] == in_features
            and scales.shape == (out_features,)
            and x.is_contiguous()
            and qweight.is_contiguous()
            and scales.is_contiguous()
            and 1 <= rows <= MAX_INPUT_ROWS
        ):
            raise ValueError("int8_rows_matmul: bf16 x [1..16, k], int8 q [n, k], bf16 scales [n]")
        y = torch.empty(rows, out_features, dtype=torch.bfloat16)
        status = self._int8_rows_matmul(
            x.data_ptr(),
            rows,
            in_features,
            qweight.data_ptr(),
            scales.data_ptr(),
            out_features,
            y.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("int8_rows_matmul could not allocate its buffers")
        return y


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def library_path(cache_dir: Path, compiler: str) -> Path:
    """Where the library for this source, compiler and CPU lives (built or not)."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False, timeout=30
    ).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode()):
        key.update(part)
    key.update(f"{platform.machine()}\n{_cpu_identity()}".encode())
    return cache_dir / f"kernels-{key.hexdigest()[:16]}.so"


def build(cache_dir: Path, compiler: str) -> Path:
    """Compile the library into ``cache_dir`` unless it is there; raises on a compiler error."""
    target = library_path(cache_dir, compiler)
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        partial = Path(scratch) / target.name
        subprocess.run(
            [compiler, *FLAGS, str(SOURCE), "-o", str(partial)],
            capture_output=True,
            text=True,
            check=True,
            timeout=COMPILE_TIMEOUT_S,
        )
        os.replace(partial, target)
    return target


def default_cache_dir() -> Path:
    return Path(os.environ.get("HEARTH_CACHE") or Path.home() / ".cache" / "hearth") / "native"


@functools.cache
def kernels() -> NativeKernels | None:
    """The native kernels, built on first call; None where they cannot run here."""
    if os.environ.get(DISABLE_VARIABLE, "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler: int8 layers use torch's kernel")
        return None
    try:
        path = build(default_cache_dir(), compiler)
        return NativeKernels(ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as error:
        # CalledProcessError carries the compiler's message (e.g. no AVX-512 on this CPU).
        detail = getattr(error, "stderr", "") or error
        log.info("native kernels unavailable, int8 layers use torch's kernel: %s", detail)
        return None
