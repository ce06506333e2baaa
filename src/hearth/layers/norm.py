"""RMSNorm, the norm of every Gemma layer, and its fused forms.

A decoder layer adds each sublayer's output to the residual and normalises the sum for the
next sublayer; `add_rms_norm` and the MoE forms do that in one kernel on the GPU (the torch
reference elsewhere, rounded alike).
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.ops.norm import (
    Partials,
    add_rms_norm,
    moe_add_rms_norm,
    moe_combine_add_rms_norm,
    rms_norm,
)

__all__ = [
    "Partials",
    "RMSNorm",
    "add_rms_norm",
    "moe_add_rms_norm",
    "moe_combine_add_rms_norm",
    "rms_norm",
]


class RMSNorm(nn.Module):
    """x̂ · weight, computed in fp32 and cast back; `weight` is kept in fp32.

    Gemma 3 checkpoints hold w and the norm multiplies by 1 + w: the loader stores 1 + w
    here once (`Gemma3Model.module_tensor`), rather than adding it on every call.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
