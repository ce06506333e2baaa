"""The token table, which is also the tied output head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.ops import native


class Embedding(nn.Embedding):
    """The token table, which is also the tied output head."""

    def reset_parameters(self) -> None:
        """nn.Embedding's random init, except on the meta device (where a model is built before
        its checkpoint fills it): there normal_ would import torch._dynamo, a second of a CPU
        load, and nothing else needs it."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        y = native.row_matmul(x, self.weight)  # a CPU bf16 decode step
        return F.linear(x, self.weight) if y is None else y
