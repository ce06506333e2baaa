"""CPU weights in transparent huge pages (opt-in: ``HEARTH_HUGE_PAGES=1``).

A CPU decode step streams every weight once. With 4 KiB pages that is a TLB miss every 4 KiB
of weights; 2 MiB pages let the native kernels read the weights faster (docs/benchmarks.md has
the numbers). The price may be paid at load: the first touch of a huge page can cost far more
than a small page's, depending on how fragmented the host's memory is. Hence off by default:
worth it for a long-running server, not always for a one-shot generation.

Linux backs a region with huge pages when asked (``madvise(MADV_HUGEPAGE)``) before the memory
is first touched, so weights are copied, end to end, into one fresh region advised that way: one
region, so that the alignment to 2 MiB costs at most 2 MiB for the whole model.
"""

from __future__ import annotations

import logging
import mmap
import os

import torch
from torch import Tensor, nn

log = logging.getLogger("hearth.ops.native")

HUGE_PAGE_BYTES = 2 << 20
ENABLE_VARIABLE = "HEARTH_HUGE_PAGES"
# Each tensor starts on a cache line boundary (the int8 kernel's loads stay in their lines).
TENSOR_ALIGNMENT = 64


def enabled() -> bool:
    """Whether CPU models load their streamed weights into huge pages (``HEARTH_HUGE_PAGES=1``)."""
    return os.environ.get(ENABLE_VARIABLE) == "1"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def huge_page_buffer(nbytes: int) -> Tensor | None:
    """An untouched uint8 CPU tensor of ``nbytes`` (rounded up to 2 MiB) that the kernel was
    asked to back with huge pages; None where it cannot be asked (not Linux, or refused)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes <= 0:
        return None
    length = _round_up(nbytes, HUGE_PAGE_BYTES)
    # A fresh anonymous mapping: never touched, so the advice holds from the first fault
    # (torch.empty may reuse heap memory that is already backed by small pages).
    private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS  # (a shared mapping would be shmem)
    region = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=private)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    offset = -whole.data_ptr() % HUGE_PAGE_BYTES
    try:
        region.madvise(advice, offset, length)
    except OSError as error:
        log.info("madvise(MADV_HUGEPAGE) refused: %s", error)
        return None
    return whole[offset : offset + length]


def move_into_huge_pages(slots: list[tuple[nn.Module, str]]) -> bool:
    """Move each tensor ``module.name`` of ``slots`` (contiguous, CPU; a buffer or parameter)
    into one huge-page buffer, end to end, as a view of the same shape and dtype. One at a
    time: an old tensor is freed as soon as its copy replaces it, so memory never holds the
    weights twice; a tensor held by several slots moves once. False (nothing moved) where no
    such buffer can be had."""
    offsets: dict[int, int] = {}
    total = 0
    for module, name in slots:
        tensor = getattr(module, name)
        if tensor.data_ptr() not in offsets:
            offsets[tensor.data_ptr()] = total
            total = _round_up(total + tensor.nbytes, TENSOR_ALIGNMENT)
    buffer = huge_page_buffer(total)
    if buffer is None:
        return False
    moved: dict[int, Tensor] = {}
    for module, name in slots:
        tensor = getattr(module, name)
        if tensor.data_ptr() not in moved:
            offset = offsets[tensor.data_ptr()]
            view = buffer[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            if isinstance(tensor, nn.Parameter):
                view = nn.Parameter(view, requires_grad=tensor.requires_grad)
            moved[tensor.data_ptr()] = view
        setattr(module, name, moved[tensor.data_ptr()])
    return True
