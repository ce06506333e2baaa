"""Rotary position embeddings: the cos/sin tables of a layer kind's positions."""

from __future__ import annotations

import torch
from torch import nn

from hearth.config import RopeConfig
from hearth.ops.rope import rotary_tables


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute positions, built in fp32 then cast to the activations' dtype."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # Built on the CPU explicitly: models are constructed on the meta device.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (rope.theta**exponents) / rope.linear_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin as [tokens, 1, head_dim] (activations are [batch, tokens, heads, dim])."""
        return rotary_tables(positions, self.inv_freq, dtype)


class ProportionalRotaryEmbedding(RotaryEmbedding):
    """RoPE that rotates only the first `partial_rotary_factor` of the frequency pairs.

    Exponents stay over the full head_dim (1e6^(-2j/512) on a 512-wide head), and the other
    pairs get angle 0, i.e. pass through: HF's "proportional" RoPE, not LLaMA's partial
    rotation (pitfall 3). A factor of 1 is the default RoPE.
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__(head_dim, rope)
        rotated_pairs = int(rope.partial_rotary_factor * head_dim // 2)
        self.inv_freq[rotated_pairs:] = 0.0
