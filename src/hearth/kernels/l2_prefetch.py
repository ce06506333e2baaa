"""Warm the GPU's L2 cache with a weight while latency-bound kernels leave DRAM idle.

At batch 1 a decode layer alternates bandwidth-bound GEMVs with short latency-bound kernels
(norms, RoPE, the attention split and merge) during which DRAM is mostly idle: about 12 µs
per Gemma 3 12B layer between the qkv and o_proj GEMVs. Reading the next GEMV's weight into
L2 in that gap lets the GEMV read it at L2 speed. The prefetch is one small kernel on a side
stream: each of its lanes issues one Hopper bulk prefetch (``cp.async.bulk.prefetch.L2``, a
TMA operation that needs no registers or shared memory to hold the data), so it runs beside
the attention kernels instead of displacing them. It changes no value anywhere: the weight is
read exactly as before, only sooner from a nearer cache.

`prefetch_branch` forks that side stream and returns the join: inside a CUDA graph capture
the prefetch becomes a parallel branch of the captured step. Elsewhere (eager decode, CPU,
GPUs before Hopper) it does nothing: an eager step is host-bound, and the host time of an
extra launch would cost more than the prefetch saves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache

import torch

from hearth.kernels import HAS_TRITON

# Bulk prefetches need 16-byte aligned addresses and sizes in multiples of 16 bytes.
ALIGN = 16
# Prefetches a program issues (one per lane of one warp).
LANES = 32
# Largest bulk prefetch per lane: sm_90 encodes the size in 16-byte units in 16 bits.
MAX_CHUNK = 1 << 16
# Kill switch for A/B runs (benchmarks/ab_l2_prefetch.py); on by default.
ENABLED = True


@dataclass(frozen=True)
class PrefetchPlan:
    """`programs` x `LANES` lanes; lane i prefetches bytes [i*chunk, min((i+1)*chunk, size))."""

    size: int  # bytes covered: the tensor's bytes rounded down to ALIGN
    chunk: int  # bytes per lane, a multiple of ALIGN
    programs: int

    def ranges(self) -> list[tuple[int, int]]:
        """(start, end) of every lane that prefetches anything, in lane order."""
        lanes = self.programs * LANES
        starts = (i * self.chunk for i in range(lanes))
        return [(s, min(s + self.chunk, self.size)) for s in starts if s < self.size]


def plan_prefetch(nbytes: int, programs: int) -> PrefetchPlan:
    """Spread `nbytes` over about `programs` one-warp programs (more where a lane would pass
    MAX_CHUNK) in ALIGN-multiple chunks."""
    if nbytes < 0 or programs < 1:
        raise ValueError(f"cannot plan a prefetch of {nbytes} bytes over {programs} programs")
    size = nbytes - nbytes % ALIGN
    lanes = programs * LANES
    chunk = max(ALIGN, -(-size // lanes))
    chunk = min(MAX_CHUNK, chunk + -chunk % ALIGN)
    used = max(1, -(-size // (chunk * LANES)))
    return PrefetchPlan(size, chunk, used)


@cache
def _supported(device: torch.device) -> bool:
    """Hopper or newer, where cp.async.bulk exists, and Triton to emit it."""
    return HAS_TRITON and torch.cuda.get_device_capability(device)[0] >= 9


@cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_prefetch_kernel(base, size, chunk, LANES: tl.constexpr):
        """Lane i of program p prefetches `chunk` bytes from base + (p * LANES + i) * chunk
        (fewer at the end, none past `size`). `base` is the address as an integer."""
        lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
        start = lane.to(tl.int64) * chunk
        length = tl.minimum(size - start, chunk).to(tl.int32)
        # The asm has an effect but no result: a dummy output, and not pure, so it stays.
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [base + start, length],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


def l2_prefetch(tensors: Iterable[torch.Tensor]) -> None:
    """Queue L2 prefetches of each contiguous CUDA tensor's bytes on the current stream."""
    for tensor in tensors:
        address = tensor.data_ptr()
        if address % ALIGN or not tensor.is_contiguous():
            continue  # a view that bulk copies cannot address; skipping changes no value
        nbytes = tensor.numel() * tensor.element_size()
        plan = plan_prefetch(nbytes, _multiprocessors(tensor.device))
        if plan.size:
            _l2_prefetch_kernel[(plan.programs,)](
                address, plan.size, plan.chunk, LANES=LANES, num_warps=1
            )


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A layer's weights: parameters and buffers (packed codes, scales, biases)."""
    return [*module.parameters(), *module.buffers()]


def _join_nothing() -> None:
    return None


def prefetch_branch(tensors: Iterable[torch.Tensor], like: torch.Tensor) -> Callable[[], None]:
    """Prefetch `tensors` on a side stream forked from the current one, when `like` (an
    activation of the step) is on a Hopper GPU inside a graph capture; returns the join that
    makes the current stream wait for the branch (call it before the tensors are read)."""
    if not (ENABLED and like.is_cuda and _supported(like.device)):
        return _join_nothing
    if not torch.cuda.is_current_stream_capturing():
        _warm_up(like.device)  # compile and load the kernel before a capture needs it
        return _join_nothing
    main = torch.cuda.current_stream(like.device)
    side = _side_stream(like.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        l2_prefetch(tensors)

    def join() -> None:
        main.wait_stream(side)

    return join


@cache
def _warm_up(device: torch.device) -> None:
    """One launch outside any capture: Triton compiles and loads the kernel here, not while
    a graph is being captured (where loading a module is not allowed)."""
    l2_prefetch([torch.empty(4096, dtype=torch.uint8, device=device)])
