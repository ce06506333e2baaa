"""Weights asked into L2 ahead of their GEMV, while latency-bound kernels leave DRAM idle.

A batch-1 decode step alternates weight-streaming GEMVs with short kernels that read almost
nothing from DRAM (q/k norms and RoPE, decode attention at short contexts, norms, GeGLU).
During those, the memory system idles. `prefetch_weights` launches one small kernel that asks
L2 for the first bytes of weights a later GEMV will read (`prefetch.global.L2`, one hint per
128-byte line), so that GEMV finds part of them in L2.

Under programmatic dependent launch the kernel first lets the next kernel launch, then issues
its hints while the kernel before it still runs, and only then waits for that kernel: it
completes after its predecessor, so the next kernel's own wait still orders it after every
earlier kernel. A hint never changes a value (L2 is coherent and weights are never written),
so results are bit-identical with and without it. GPU only: the hints are inline PTX, which
Triton's interpreter does not run; elsewhere `prefetch_weights` does nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from hearth.kernels import HAS_TRITON, pdl_options
from hearth.kernels.launch import launch_kernel

# Off until measured: see docs/kernels.md.
L2_AHEAD = False
# Bytes asked for at one point, all weights together: well under L2 (50 MB on an H100 or
# H200), which also holds the GEMV streaming meanwhile.
MAX_BYTES = 24 << 20
LINE_BYTES = 128
# Weights one launch takes.
SPANS = 3

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.kernels import prefetch_to_l2

    @triton.jit
    def _prefetch_span(base, lines):
        """Hints for lines [0, lines) of `base`, spread over the programs."""
        LINE: tl.constexpr = 1024 // base.dtype.element_ty.primitive_bitwidth
        BLOCK: tl.constexpr = 128  # one line per thread of 4 warps
        step = tl.num_programs(0) * BLOCK
        for first in range(tl.program_id(0) * BLOCK, lines, step):
            line = tl.minimum(first + tl.arange(0, BLOCK), lines - 1).to(tl.int64)
            prefetch_to_l2(base + line * LINE)

    @triton.jit
    def _l2_ahead_kernel(
        first, first_lines, second, second_lines, third, third_lines, PDL: tl.constexpr
    ):
        if PDL:  # the next kernel may launch now; it waits for this one to complete
            tl.extra.cuda.gdc_launch_dependents()
        _prefetch_span(first, first_lines)
        _prefetch_span(second, second_lines)
        _prefetch_span(third, third_lines)
        if PDL:  # complete only after the kernel before, as the stream's order requires
            tl.extra.cuda.gdc_wait()


def spans(weights: Sequence[torch.Tensor], max_bytes: int) -> list[tuple[torch.Tensor, int]]:
    """(weight, lines) to hint, in order, within `max_bytes` in all: each weight's first lines
    (a GEMV's first programs read its first rows), at most SPANS weights."""
    chosen: list[tuple[torch.Tensor, int]] = []
    left = max_bytes
    for weight in weights[:SPANS]:
        if left < LINE_BYTES:
            break
        if not weight.is_contiguous():
            raise ValueError("prefetch_weights takes contiguous weights")
        size = min(weight.numel() * weight.element_size(), left)
        lines = size // LINE_BYTES
        chosen.append((weight, lines))
        left -= lines * LINE_BYTES
    return chosen


@functools.cache
def _programs(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefetch_weights(
    weights: Sequence[torch.Tensor], activation: torch.Tensor, max_bytes: int | None = None
) -> None:
    """Ask L2 for the first `max_bytes` (default MAX_BYTES) of `weights` (contiguous
    tensors on the GPU), ahead of the GEMVs that will read them. `activation` is the tensor
    the kernels around this launch work on (it decides PDL as for them). Only at a decode
    step of one token (a prefill is bound by its matmuls); nothing where switched off or off
    the GPU."""
    one_row = activation.numel() == activation.shape[-1]
    if not (L2_AHEAD and HAS_TRITON and weights and activation.is_cuda and one_row):
        return
    chosen = spans(weights, MAX_BYTES if max_bytes is None else max_bytes)
    if not chosen:
        return
    padded = chosen + [(chosen[0][0], 0)] * (SPANS - len(chosen))
    arguments = [value for weight, lines in padded for value in (weight, lines)]
    programs = _programs(activation.device.index or 0)
    launch_kernel(_l2_ahead_kernel, (programs,), *arguments, num_warps=4, **pdl_options(activation))
