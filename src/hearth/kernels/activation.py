"""GeGLU's elementwise half, gelu_tanh(gate) · up, in one kernel over the stacked projection.

The MLP computes gate and up as one matmul (`StackedLinear`): its output [..., 2·I] holds
gate then up. Eagerly that is a split, a GELU and a multiply (two launches, two round trips
of the intermediate); here it is one pass that rounds the GELU to the activations' dtype
before the multiply, as the eager ops do.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hearth.kernels import HAS_TRITON, kernel_enabled

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def gelu_tanh(g, coefficient):
        """gelu with the tanh approximation, fp32 in and out (coefficient = sqrt(2/pi))."""
        inner = coefficient * (g + 0.044715 * g * g * g)
        # tanh from exp, which every backend has; exp(-2|z|) never overflows.
        decay = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.where(inner >= 0, 1.0, -1.0) * (1.0 - decay) / (1.0 + decay)
        return 0.5 * g * (1.0 + tanh)

    @triton.jit
    def _gelu_tanh_mul_kernel(gate_up_ptr, out_ptr, width, coefficient, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < width
        gate = tl.load(gate_up_ptr + row * 2 * width + columns, mask=mask, other=0.0)
        up = tl.load(gate_up_ptr + row * 2 * width + width + columns, mask=mask, other=0.0)
        gelu = gelu_tanh(gate.to(tl.float32), coefficient).to(out_ptr.dtype.element_ty)
        product = gelu.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * width + columns, product.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_mul_triton(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    source = gate_up.contiguous()
    rows = source.numel() // (2 * width)
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype, device=gate_up.device)
    grid = (rows, triton.cdiv(width, block))
    _gelu_tanh_mul_kernel[grid](source, out, width, SQRT_2_OVER_PI, BLOCK=block)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) · up of a stacked [..., 2·I] gate/up projection."""
    if kernel_enabled(gate_up):
        return gelu_tanh_mul_triton(gate_up)
    return gelu_tanh_mul_reference(gate_up)
