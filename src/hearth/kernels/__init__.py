"""Triton kernels for the GPU hot path, each beside the torch reference it must equal.

Model code calls a dispatcher that runs the Triton kernel for CUDA tensors
(`kernel_enabled`) and the torch reference otherwise. CPU tests call the Triton entry points
directly under `TRITON_INTERPRET=1` (tests/conftest.py sets it when there is no GPU), so each
kernel is checked against its reference without a GPU. Triton is optional at run time.
"""

from __future__ import annotations

import torch

try:  # Triton ships with CUDA builds of torch; CPU installs may lack it.
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False


def kernel_enabled(tensor: torch.Tensor) -> bool:
    """Whether the model's hot path should use the Triton kernel for `tensor`."""
    return HAS_TRITON and tensor.is_cuda
