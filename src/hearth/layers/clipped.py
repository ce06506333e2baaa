"""The clipped linear layer of Gemma 4's vision and audio towers."""

from __future__ import annotations

import math

import torch
from torch import nn

from hearth.layers.linear import project


class ClippedLinear(nn.Module):
    """A linear layer without bias whose input and output are clamped to scalars from the
    checkpoint (`use_clipped_linears`), else a plain linear; the weight sits in `.linear`, as
    in HF's checkpoints (`q_proj.linear.weight`, `q_proj.input_min`, ...)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            self.input_min = nn.Parameter(torch.tensor(-math.inf))
            self.input_max = nn.Parameter(torch.tensor(math.inf))
            self.output_min = nn.Parameter(torch.tensor(-math.inf))
            self.output_max = nn.Parameter(torch.tensor(math.inf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.clipped:
            return project(self.linear, x, wide=True)
        x = _clamp(x, self.input_min, self.input_max)
        return _clamp(project(self.linear, x, wide=True), self.output_min, self.output_max)


def _clamp(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """x clamped to [low, high] as HF does (bounds in x's dtype). On the CPU the bounds go as
    numbers, which torch clamps ~2x faster than with tensor bounds; on a GPU reading them would
    wait for the device."""
    low, high = low.to(x.dtype), high.to(x.dtype)
    if x.device.type == "cpu":
        return torch.clamp(x, low.item(), high.item())
    return torch.clamp(x, low, high)
