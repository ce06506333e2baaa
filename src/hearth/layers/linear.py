"""Projections: the float `nn.Linear`, stacked parts, and how a projection picks its kernel.

Quantized projections are their own modules (`layers.affine`, `layers.int8`) with the same
call; `project` is where any of them is applied to an activation.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.ops import native
from hearth.ops.activation import gelu_tanh_mul
from hearth.ops.affine_matmul import CodesMajor
from hearth.ops.gemv import gemv, has_pinned_launch
from hearth.ops.native.bf16_gemm import linear as cpu_linear
from hearth.ops.norm import Partials


class StackedLinear(nn.Module):
    """Several projections of one input as one matmul (fewer, larger kernels per token).

    Checkpoints store the parts separately; the loader stacks them along the output dim in
    `parts` order, so `layers.0.self_attn.k_proj.weight` fills the middle of `qkv_proj`.
    """

    def __init__(self, in_features: int, parts: dict[str, int]) -> None:
        super().__init__()
        self.parts = dict(parts)
        self.proj = nn.Linear(in_features, sum(parts.values()), bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj(x).split(list(self.parts.values()), dim=-1)


def is_float_linear(module: nn.Module) -> bool:
    """A plain float projection without bias: what the GEMV kernels take in its place."""
    return isinstance(module, nn.Linear) and module.bias is None


def project(
    linear: nn.Module, x: torch.Tensor, geglu: bool = False, wide: bool = False
) -> torch.Tensor:
    """`linear(x)`, after gelu_tanh(gate) · up of a stacked gate/up x if `geglu`: the one place
    a projection picks its kernel. Float weights take the native bf16 row kernel at a CPU
    decode step and the Triton GEMV at a GPU one (one kernel, no split-K reduce launches).
    `wide`: a projection with many outputs (qkv, gate/up), which cuBLAS reads near copy
    bandwidth: the GEMV takes it only at a shape with a launch pinned for it."""
    if geglu:
        x = gelu_tanh_mul(x)
    if not is_float_linear(linear):
        return linear(x)
    if (y := native.row_matmul(x, linear.weight)) is not None:
        return y
    if not wide or has_pinned_launch(x, linear.weight):
        return gemv(x, linear.weight)
    return cpu_linear(x, linear.weight)  # F.linear; an fp32 GEMM where CPU bf16 ones are slow


def project_for_norm(
    linear: nn.Module, x: torch.Tensor, geglu: bool = False
) -> torch.Tensor | Partials:
    """`project(linear, x, geglu)` for a residual add-norm to read (o_proj, down): an
    MLX-packed weight whose GPU GEMV splits K leaves its partials for the norm kernel to add
    (`norm.Partials`), so the GEMV's own sum launch goes."""
    split_partials = getattr(linear, "split_partials", None)
    if split_partials is None:
        return project(linear, x, geglu)
    x = gelu_tanh_mul(x) if geglu else x
    partials = split_partials(x)
    return linear(x) if partials is None else partials


def codes_major_input(linear: nn.Module, x: torch.Tensor) -> tuple[int, int] | None:
    """What `linear`'s GPU GEMV wants x's producer to store it as (`CodesMajor`'s codes per
    word and words per block), or None: input order."""
    wanted = getattr(linear, "codes_major_input", None)
    return None if wanted is None else wanted(x)


def ordered_input(normed: torch.Tensor, order: tuple[int, int] | None, shape: torch.Size):
    """A norm stored as `order` asked (see `codes_major_input`), typed for the GEMV to read."""
    return normed if order is None else CodesMajor(normed, shape)
