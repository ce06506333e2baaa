"""GeGLU's elementwise half, gelu_tanh(gate) · up, in one kernel over the stacked projection.

The MLP computes gate and up as one matmul (`StackedLinear`): its output [..., 2·I] holds
gate then up. Eagerly that is a split, a GELU and a multiply (two launches, two round trips
of the intermediate); here it is one pass that rounds the GELU to the activations' dtype
before the multiply, as the eager ops do. Gate and up may also be two tensors (Gemma 4's
per-layer input gate: gelu_tanh(gate(x)) · per_layer_input).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hearth.ops import HAS_TRITON, kernel_enabled, pdl_options
from hearth.ops.launch import launch_kernel

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
# Elements per program of the GeGLU kernel.
BLOCK = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer

    @triton.jit
    def gelu_tanh(g, coefficient):
        """gelu with the tanh approximation, fp32 in and out (coefficient = sqrt(2/pi))."""
        inner = coefficient * (g + 0.044715 * g * g * g)
        # tanh from exp, which every backend has; exp(-2|z|) never overflows.
        decay = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.where(inner >= 0, 1.0, -1.0) * (1.0 - decay) / (1.0 + decay)
        return 0.5 * g * (1.0 + tanh)

    _COEFFICIENT = tl.constexpr(SQRT_2_OVER_PI)

    @triton.jit
    def geglu(gate, up):
        """gelu_tanh(gate) · up of gate and up in the activations' dtype, rounded as the eager
        ops round them: the GELU to that dtype before the multiply, then the product."""
        gelu = gelu_tanh(gate.to(tl.float32), _COEFFICIENT).to(gate.dtype)
        return (gelu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)

    @triton.jit
    def _gelu_tanh_mul_kernel(
        gate_ptr,
        up_ptr,
        out_ptr,
        width,
        gate_stride,
        up_stride,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_producer(PDL)
        row = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < width
        gate = tl.load(gate_ptr + row * gate_stride + columns, mask=mask, other=0.0)
        up = tl.load(up_ptr + row * up_stride + columns, mask=mask, other=0.0)
        tl.store(out_ptr + row * width + columns, geglu(gate, up), mask=mask)


def _gate_and_up(gate_up: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """(gate, up): halves of a stacked projection, or the two tensors given."""
    if up is None:
        return gate_up.chunk(2, dim=-1)
    if up.shape != gate_up.shape:
        raise ValueError(f"gate {tuple(gate_up.shape)} and up {tuple(up.shape)} differ")
    return gate_up, up


def gelu_tanh_mul_reference(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    gate, up = _gate_and_up(gate_up, up)
    return F.gelu(gate, approximate="tanh") * up


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, width] with unit column stride (a view where the layout allows)."""
    rows = tensor.reshape(-1, tensor.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def gelu_tanh_mul_triton(
    gate_up: torch.Tensor, up: torch.Tensor | None = None, block: int | None = None
) -> torch.Tensor:
    gate, up = _gate_and_up(gate_up, up)
    width = gate.shape[-1]
    block = block or BLOCK
    gates, ups = _rows(gate), _rows(up)
    out = torch.empty((*gate.shape[:-1], width), dtype=gate.dtype, device=gate.device)
    grid = (gates.shape[0], triton.cdiv(width, block))
    launch_kernel(_gelu_tanh_mul_kernel, grid,
        gates, ups, out, width, gates.stride(0), ups.stride(0), BLOCK=block,
        **pdl_options(gates),
    )  # fmt: skip
    return out


def gelu_tanh_mul(gate_up: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """gelu_tanh(gate) · up of a stacked [..., 2·I] gate/up projection, or of gate `gate_up`
    and a separate `up` of the same shape."""
    if kernel_enabled(gate_up):
        return gelu_tanh_mul_triton(gate_up, up)
    return gelu_tanh_mul_reference(gate_up, up)
