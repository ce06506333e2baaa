"""The GeGLU feed-forward of every Gemma decoder layer."""

from __future__ import annotations

import torch
from torch import nn

from hearth.layers.linear import StackedLinear, codes_major_input, project, project_for_norm
from hearth.ops.affine_matmul import CodesMajor
from hearth.ops.norm import Partials


class MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) · up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = StackedLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}
        )
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor | CodesMajor) -> torch.Tensor:
        return project(self.down_proj, *self._hidden(x))

    def for_norm(self, x: torch.Tensor | CodesMajor) -> torch.Tensor | Partials:
        """`forward(x)` for a residual add-norm to read (`project_for_norm`)."""
        return project_for_norm(self.down_proj, *self._hidden(x))

    def input_order(self, x: torch.Tensor) -> tuple[int, int] | None:
        """How x's producer should store it for gate/up (`codes_major_input`)."""
        return codes_major_input(self.gate_up_proj.proj, x)

    def _hidden(self, x: torch.Tensor | CodesMajor) -> tuple[torch.Tensor, bool]:
        """gate/up's output, and whether the GeGLU is still to be applied: a packed gate/up
        whose GPU GEMV stores gelu_tanh(gate) · up itself has applied it."""
        stores = getattr(self.gate_up_proj.proj, "geglu_out", None)
        if stores is not None and (hidden := stores(x)) is not None:
            return hidden, False
        return project(self.gate_up_proj.proj, x, wide=True), True
