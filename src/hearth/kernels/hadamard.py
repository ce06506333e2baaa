"""TurboQuant's rotation (random signs + normalised Walsh–Hadamard transform) in one kernel.

`kv.turbo.rotate` runs the transform as log2(D) butterfly stages of three torch ops each:
~50 launches per call, and a decode step calls it for the new K/V, the query and the output
of every layer. Here one program per row keeps the row in registers through all stages. The
stages add and subtract in the reference's order, in fp32, so the result is bit-identical.
"""

from __future__ import annotations

import torch

from hearth.kernels import HAS_TRITON, kernel_enabled
from hearth.kv.turbo import random_signs, rotate, unrotate

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _stage(y, D: tl.constexpr, HALF: tl.constexpr):
        """One butterfly stage: pairs (i, i + HALF) in blocks of 2·HALF become (a+b, a−b)."""
        pairs = tl.permute(tl.reshape(y, (D // (2 * HALF), 2, HALF)), (0, 2, 1))
        low, high = tl.split(pairs)
        return tl.reshape(tl.permute(tl.join(low + high, low - high), (0, 2, 1)), (D,))

    @triton.jit
    def _butterflies(y, D: tl.constexpr):
        """The unnormalised Sylvester-order Walsh–Hadamard transform of a row [D ≤ 1024]."""
        # Written out: stage sizes must be compile-time constants, also in the interpreter.
        y = _stage(y, D, 1)
        if D > 2:
            y = _stage(y, D, 2)
        if D > 4:
            y = _stage(y, D, 4)
        if D > 8:
            y = _stage(y, D, 8)
        if D > 16:
            y = _stage(y, D, 16)
        if D > 32:
            y = _stage(y, D, 32)
        if D > 64:
            y = _stage(y, D, 64)
        if D > 128:
            y = _stage(y, D, 128)
        if D > 256:
            y = _stage(y, D, 256)
        if D > 512:
            y = _stage(y, D, 512)
        return y

    @triton.jit
    def _rotation_kernel(x_ptr, signs_ptr, out_ptr, scale, D: tl.constexpr, INVERSE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        dims = tl.arange(0, D)
        x = tl.load(x_ptr + row * D + dims).to(tl.float32)
        signs = tl.load(signs_ptr + dims)
        if INVERSE:  # noqa: SIM108 - the two orders of the reference, kept apart
            y = _butterflies(x, D) * scale * signs
        else:
            y = _butterflies(x * signs, D) * scale
        tl.store(out_ptr + row * D + dims, y)


_SIGNS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _signs(dim: int, device: torch.device) -> torch.Tensor:
    """The sign diagonal on `device`, copied once (a captured step must not copy from the host)."""
    key = (dim, device)
    if key not in _SIGNS:
        _SIGNS[key] = random_signs(dim).to(device)
    return _SIGNS[key]


def rotation_triton(x: torch.Tensor, inverse: bool) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim).contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    _rotation_kernel[(rows.shape[0],)](
        rows,
        _signs(dim, x.device),
        out,
        dim**-0.5,
        D=dim,
        INVERSE=inverse,
        num_warps=1 if dim <= 128 else 2 if dim <= 256 else 4,
    )
    return out.view(x.shape)


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """`kv.turbo.rotate` (fp32 out): one kernel on the GPU, the torch reference elsewhere."""
    return rotation_triton(x, inverse=False) if kernel_enabled(x) else rotate(x)


def unrotate_rows(y: torch.Tensor) -> torch.Tensor:
    """`kv.turbo.unrotate` (fp32 out): one kernel on the GPU, the torch reference elsewhere."""
    return rotation_triton(y, inverse=True) if kernel_enabled(y) else unrotate(y)
