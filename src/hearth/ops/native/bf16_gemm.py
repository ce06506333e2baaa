"""bf16 products on a CPU: torch's bf16 GEMM where the CPU multiplies bf16, its fp32 GEMM elsewhere.

Without bf16 dot-product instructions (AVX512-BF16, AMX-BF16) torch's CPU bf16 GEMM widens
inside its kernel and runs several times slower than its fp32 GEMM on a prefill's shapes.
There a bf16 product runs as the fp32 GEMM of the same numbers (widening is exact), rounded to
bf16 once. torch's bf16 GEMM also sums in fp32 and rounds once, so the two differ only in the
order of the sums (one bf16 step in ~1e-4 of the outputs at those shapes).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

CPUINFO = Path("/proc/cpuinfo")


def cpu_multiplies_bf16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether an x86 CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16); True
    elsewhere and where the flags cannot be read (torch's bf16 GEMM is kept there)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return True
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def widen_bf16_products() -> bool:
    """Whether CPU bf16 products here run as fp32 GEMMs (read once per process)."""
    return not cpu_multiplies_bf16()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``; a CPU bf16 product runs as an fp32 GEMM where ``widen_bf16_products()``."""
    if x.dtype == torch.bfloat16 and x.device.type == "cpu" and widen_bf16_products():
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), wide_bias).to(torch.bfloat16)
    return F.linear(x, weight, bias)
