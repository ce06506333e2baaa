"""Triton kernels for the GPU hot path, each beside the torch reference it must equal.

Model code calls a dispatcher that runs the Triton kernel for CUDA tensors
(`kernel_enabled`) and the torch reference otherwise. CPU tests call the Triton entry points
directly under `TRITON_INTERPRET=1` (tests/conftest.py sets it when there is no GPU), so each
kernel is checked against its reference without a GPU. Triton is optional at run time.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton ships with CUDA builds of torch; CPU installs may lack it.
    import triton

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False


def kernel_enabled(tensor: torch.Tensor) -> bool:
    """Whether the model's hot path should use the Triton kernel for `tensor`."""
    return HAS_TRITON and tensor.is_cuda


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while
# the kernel before it in the stream is still finishing, and waits (`wait_for_producer`)
# before it touches memory. The decode step is ~600 short kernels, and the gap between two
# of them is of the order of a microsecond; with PDL the next kernel's launch overlaps the
# previous one's tail. Only for small launches: a long prefill's kernels run long enough that
# the gap does not show, and they measured slower with PDL.
# Largest activation tensor (elements) whose kernels launch with PDL: a decode step's (31B's
# stacked gate/up output is 43k) and prefill chunks of a few tokens, not long prefills.
PDL_MAX_ELEMENTS = 1 << 17
# With PDL a kernel's programs may be resident while the kernel before it still runs, and a
# weight never depends on that kernel: the bf16 GEMV asks L2 for the first this-many 128-byte
# lines of each of its weight rows before it waits (`prefetch_to_l2`), so that the DRAM
# latency and the first bytes overlap the previous kernel's tail and the launch gap. Eight
# lines measured fastest. The affine GEMVs (bound by instruction issue) and the gathered GEMV
# over float experts were no faster with any, so they prefetch nothing.
PREFETCH_LINES = 8


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(tensor: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel whose first step is `wait_for_producer(PDL)`: the
    constexpr `PDL` and Triton's `launch_pdl`, on where the device supports it."""
    small = tensor.numel() <= PDL_MAX_ELEMENTS
    on = small and HAS_TRITON and tensor.is_cuda and _device_has_pdl(tensor.device.index or 0)
    return {"PDL": on, "launch_pdl": on} if on else {"PDL": False}


def prefetch_lines(pdl: dict[str, bool]) -> int:
    """Lines per weight row a bf16 GEMV launched with `pdl` (`pdl_options`) prefetches before
    its wait: none without PDL, where nothing runs before the kernel's own loads."""
    return PREFETCH_LINES if pdl["PDL"] else 0


if HAS_TRITON:
    import triton.language as tl

    @triton.jit
    def wait_for_producer(PDL: tl.constexpr):
        """With PDL: wait until the previous kernel has finished and its writes are visible,
        then let the next kernel launch (its programs wait in turn before reading ours)."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_to_l2(pointers):
        """A hint: bring the 128-byte lines holding `pointers` into L2, writing no register the
        kernel reads. Safe before `wait_for_producer` for data the previous kernel does not
        write (L2 is coherent; the hint never changes a value). GPU only (inline PTX)."""
        tl.inline_asm_elementwise(
            "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];",
            "=r,l",
            [pointers],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def prefetch_row_lines(rows, k_begin, row_length, LINES: tl.constexpr):
        """`prefetch_to_l2` of LINES 128-byte lines of each row from column k_begin on
        (`rows`: [R, 1] pointers to the rows' starts; columns clamped to row_length)."""
        LINE: tl.constexpr = 1024 // rows.dtype.element_ty.primitive_bitwidth
        k = tl.minimum(k_begin + tl.arange(0, LINES) * LINE, row_length - 1)
        prefetch_to_l2(rows + k[None, :])
