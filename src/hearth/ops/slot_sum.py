"""A MoE token's expert outputs, weighted by the router and summed, in one kernel.

At a decode step the gathered experts return y [tokens, top_k, hidden]; the combine is
`(y * weights[..., None]).to(dtype).sum(dim=1)`, three launches (a multiply into fp32, a
downcast, a reduction) for a few KB. Here one program per (token, block of hidden) does it
with the eager roundings: each weighted slot rounded to y's dtype, the slots summed in fp32
and rounded once.
"""

from __future__ import annotations

import torch

from hearth.ops import HAS_TRITON, kernel_enabled, pdl_options
from hearth.ops.launch import launch_kernel


def weighted_slot_sum_reference(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_slot round(y[t, s] · w[t, s]) for y [T, top_k, H] and fp32 weights [T, top_k]."""
    return (y * weights[..., None]).to(y.dtype).sum(dim=1)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer

    @triton.jit
    def _slot_sum_kernel(
        y_ptr, w_ptr, out_ptr, hidden, SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):
        wait_for_producer(PDL)
        token = tl.program_id(0).to(tl.int64)
        columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = columns < hidden
        total = tl.zeros([BLOCK], tl.float32)
        for slot in tl.static_range(SLOTS):
            row = token * SLOTS + slot
            y = tl.load(y_ptr + row * hidden + columns, mask=mask, other=0.0)
            weight = tl.load(w_ptr + row)
            weighted = (y.to(tl.float32) * weight).to(out_ptr.dtype.element_ty)
            total += weighted.to(tl.float32)
        tl.store(out_ptr + token * hidden + columns, total.to(out_ptr.dtype.element_ty), mask=mask)

    def weighted_slot_sum_triton(
        y: torch.Tensor, weights: torch.Tensor, block: int = 1024
    ) -> torch.Tensor:
        tokens, slots, hidden = y.shape
        if weights.shape != (tokens, slots):
            raise ValueError(f"weights {tuple(weights.shape)} do not match y {tuple(y.shape)}")
        rows = y.contiguous()
        scales = weights.float().contiguous()
        out = torch.empty(tokens, hidden, dtype=y.dtype, device=y.device)
        grid = (tokens, triton.cdiv(hidden, block))
        launch_kernel(
            _slot_sum_kernel,
            grid,
            rows,
            scales,
            out,
            hidden,
            SLOTS=slots,
            BLOCK=block,
            **pdl_options(rows),
        )
        return out


def weighted_slot_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`weighted_slot_sum_reference`; one Triton kernel on CUDA."""
    if kernel_enabled(y):
        return weighted_slot_sum_triton(y, weights)
    return weighted_slot_sum_reference(y, weights)
