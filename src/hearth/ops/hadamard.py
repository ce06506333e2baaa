"""TurboQuant's rotation (random signs + normalised Walsh–Hadamard) as one matmul on the GPU.

`kv.turbo.rotate` runs the transform as log2(D) butterfly stages of three torch ops each:
~25 launches per call, and a decode step over a TurboQuant cache calls it for the new K/V,
the query and the output of every layer. On a GPU the same orthonormal map is applied as one
fp32 matmul with its dense matrix M = diag(s)·H/√D (D ≤ 512: at most 1 MiB, built once per
device): rotate(x) = x·M, unrotate(y) = y·Mᵀ. It differs from the butterflies by fp32
rounding only (~1e-7 relative; matmuls here run in full fp32: torch leaves TF32 off for
them by default). The CPU path is the reference.

(A Triton kernel running the butterflies in registers matched the reference bit for bit in
the interpreter but not on the GPU at D=32; until that is understood, the matmul serves.)
"""

from __future__ import annotations

from functools import cache

import torch

from hearth.ops import kernel_enabled
from hearth.quant.turbo import hadamard, random_signs, rotate, unrotate


@cache
def rotation_matrix(dim: int, device: torch.device) -> torch.Tensor:
    """M = diag(s)·H/√D in fp32, so that rotate(x) = x·M (H is symmetric)."""
    normalised = hadamard(torch.eye(dim))  # rows of H/√D: the transform of each basis vector
    return (random_signs(dim)[:, None] * normalised).to(device)


def rotate_matmul(x: torch.Tensor) -> torch.Tensor:
    """`turbo.rotate(x)` as x·M (fp32)."""
    return x.float() @ rotation_matrix(x.shape[-1], x.device)


def unrotate_matmul(y: torch.Tensor) -> torch.Tensor:
    """`turbo.unrotate(y)` as y·Mᵀ (fp32)."""
    return y.float() @ rotation_matrix(y.shape[-1], y.device).T


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """`kv.turbo.rotate` (fp32 out): one matmul on the GPU, the torch reference elsewhere."""
    return rotate_matmul(x) if kernel_enabled(x) else rotate(x)


def unrotate_rows(y: torch.Tensor) -> torch.Tensor:
    """`kv.turbo.unrotate` (fp32 out): one matmul on the GPU, the torch reference elsewhere."""
    return unrotate_matmul(y) if kernel_enabled(y) else unrotate(y)
