"""A Gemma 4 MoE block's router and experts, and the kernels each shape of work takes.

A decode step's few tokens go through gathered GEMVs that read only the chosen experts' rows
(ids stay on the device, so CUDA graphs capture it); a prefill's many through grouped
tensor-core matmuls over the pairs sorted by expert; on the CPU each expert runs once on the
tokens that chose it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hearth.config import Gemma4Config
from hearth.layers.linear import project
from hearth.ops import kernel_enabled
from hearth.ops.activation import gelu_tanh_mul
from hearth.ops.affine_matmul import KERNEL_BITS as AFFINE_KERNEL_BITS
from hearth.ops.affine_matmul import float_expert_matmul
from hearth.ops.grouped_matmul import (
    ExpertPlan,
    default_block_m,
    grouped_affine_expert_matmul,
    grouped_expert_matmul,
    plan_experts,
)
from hearth.ops.router import route, router_input
from hearth.ops.slot_sum import weighted_slot_sum

if TYPE_CHECKING:
    from hearth.layers.affine import MLXQuantizedExperts


# From this many tokens (prefill) the experts run as grouped tensor-core matmuls, which read
# each expert's weight once per tile of its rows; below it one GEMV per (token, slot) pair
# reads less, and decode's CUDA graphs capture that path.
GROUPED_EXPERTS_MIN_TOKENS = 64


class Router(nn.Module):
    """Chooses `top_k` experts from the unnormalised residual; weights sum to 1, then scaled."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        assert config.moe is not None
        self.top_k = config.moe.top_k
        self.eps = config.rms_norm_eps
        self.proj = nn.Linear(config.hidden_size, config.moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(config.moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights (fp32) and expert ids, both [tokens, top_k]."""
        return self.route(router_input(x, self.scale, self.eps))  # norm, · scale, · hidden^-1/2

    def route(self, router_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` from the router's input (`router_input` of x) rather than from x."""
        # Softmax, top-k, renormalisation and per-expert scale: one kernel on the GPU.
        return route(project(self.proj, router_input), self.top_k, self.per_expert_scale)


class Experts(nn.Module):
    """GeGLU experts: gate and up stacked [E, 2·I, H] as HF stores them, down [E, H, I].

    Checkpoints hold the three projections apart (`gate_proj.weight` [E, I, H], as MLX
    splits them); the loader stacks them along the output dim by `parts`. From an MLX
    checkpoint either weight may be an `MLXQuantizedExperts`, which indexes like the float
    tensor, so only the experts the router picked are dequantized.
    """

    gate_up_proj: torch.Tensor | MLXQuantizedExperts
    down_proj: torch.Tensor | MLXQuantizedExperts

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        assert config.moe is not None
        moe, hidden = config.moe, config.hidden_size
        experts, width = moe.num_experts, moe.intermediate_size
        self.parts = {
            "gate_up_proj": {"gate_proj": width, "up_proj": width},
            "down_proj": {"down_proj": hidden},
        }
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * width, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, width))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """x [tokens, H]; weights (fp32) and expert ids [tokens, top_k]."""
        if self.gathers(x):
            return self.forward_gathered(x, weights, experts)
        if self._has_gathered_kernels(x):  # many tokens: grouped tensor-core matmuls
            return self.forward_grouped(x, weights, experts)
        return self.forward_loop(x, weights, experts)

    def gathers(self, x: torch.Tensor) -> bool:
        """Whether `forward` of these tokens takes `forward_gathered` (a decode step on CUDA)."""
        return self._has_gathered_kernels(x) and x.shape[0] < GROUPED_EXPERTS_MIN_TOKENS

    def slot_outputs(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Each (token, slot) pair's output [tokens, top_k, H] and the weights [tokens, top_k]
        with which a kernel is to sum them (the MoE layer's last norm); None where `forward`
        must sum them itself (no GPU kernels). At a decode step the gathered GEMVs' outputs
        and the routing weights; at a prefill the grouped down matmul's rows already scaled in
        fp32 and ones: one rounding a slot, not two."""
        if not self._has_gathered_kernels(x):
            return None
        if self.gathers(x):
            return self.forward_gathered(x, weights, experts, summed=False), weights
        scaled = self.forward_grouped(x, weights, experts, summed=False)
        return scaled, torch.ones_like(weights)

    def _has_gathered_kernels(self, x: torch.Tensor) -> bool:
        """On CUDA, when every weight is float or packed in widths the kernels cover."""
        return kernel_enabled(x) and self.kernels_cover_weights

    @property
    def kernels_cover_weights(self) -> bool:
        """Every weight is float or packed in widths the gathered kernels read, so a CUDA
        forward never synchronises with the host (and can be captured in a CUDA graph)."""
        return all(
            isinstance(w, torch.Tensor) or w.bits in AFFINE_KERNEL_BITS
            for w in (self.gate_up_proj, self.down_proj)
        )

    @staticmethod
    def _per_slot(
        weight: torch.Tensor | MLXQuantizedExperts,
        x: torch.Tensor,
        experts: torch.Tensor,
        geglu_out: bool = False,
    ) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return float_expert_matmul(x, weight, experts, geglu_out)
        return weight.gathered_matmul(x, experts, geglu_out)

    def forward_gathered(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        summed: bool = True,
    ) -> torch.Tensor:
        """Every (token, slot) pair through its expert, ids kept on the device: no host sync,
        so CUDA graphs can capture it. Equals `forward_loop` up to summation order. With
        `summed` False, the slots' outputs [tokens, top_k, H] before their weighted sum."""
        # The gathered gate/up GEMV stores the GeGLU of its dots (programs pair gate and up).
        hidden = self._per_slot(self.gate_up_proj, x, experts, geglu_out=True)
        y = self._per_slot(self.down_proj, hidden, experts)
        return weighted_slot_sum(y, weights) if summed else y

    @staticmethod
    def _grouped(
        weight: torch.Tensor | MLXQuantizedExperts,
        x: torch.Tensor,
        experts: torch.Tensor,
        plan: ExpertPlan,
        row_scale: torch.Tensor | None = None,
        geglu: bool = False,
    ) -> torch.Tensor:
        if isinstance(weight, torch.Tensor):
            return grouped_expert_matmul(x, weight, experts, row_scale, plan, geglu)
        packed = (weight.packed, weight.scales, weight.biases)
        return grouped_affine_expert_matmul(
            x, *packed, experts, weight.bits, weight.group_size, row_scale, plan, geglu
        )

    def forward_grouped(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        summed: bool = True,
    ) -> torch.Tensor:
        """Pairs sorted by expert on the device, each expert's rows through tensor-core
        matmuls (prefill). Equals `forward_loop` up to summation order and rounding. With
        `summed` False, the slots' outputs [tokens, top_k, H], each scaled by its weight."""
        packed = not isinstance(self.gate_up_proj, torch.Tensor)
        block_m = default_block_m(experts.numel(), self.num_experts, packed)
        plan = plan_experts(experts, self.num_experts, block_m)
        if not packed:  # the grouped matmul stores the GeGLU of float experts' dots
            hidden = self._grouped(self.gate_up_proj, x, experts, plan, geglu=True)
        else:
            hidden = gelu_tanh_mul(self._grouped(self.gate_up_proj, x, experts, plan))
        y = self._grouped(self.down_proj, hidden, experts, plan, weights)
        return y.sum(dim=1) if summed else y

    def forward_loop(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Each expert runs once on the tokens that chose it (syncs to list the experts)."""
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():
            tokens, slots = (experts == expert).nonzero(as_tuple=True)
            gate_up, down = (w[expert].to(x.dtype) for w in (self.gate_up_proj, self.down_proj))
            gate, up = F.linear(x[tokens], gate_up).chunk(2, dim=-1)
            y = F.linear(F.gelu(gate, approximate="tanh") * up, down)
            weighted = (y * weights[tokens, slots, None]).to(x.dtype)
            out.index_put_((tokens,), weighted, accumulate=True)  # ~3x faster than index_add_
        return out
