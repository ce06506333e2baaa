"""Gemma 4's per-layer input update: after the feed-forward, a layer gates its slice of the
per-layer embeddings with the residual stream and adds the projection back.

At a GPU decode step with float weights both narrow projections run in the Triton GEMV with
their neighbours fused in: the add-norm before the gate inside the gate's GEMV (each of its few
programs takes the row's RMS itself), the GeGLU inside the projection's GEMV.
"""

from __future__ import annotations

import torch
from torch import nn

from hearth.layers.linear import is_float_linear, project
from hearth.layers.norm import Partials, add_rms_norm
from hearth.ops import kernel_enabled
from hearth.ops.activation import gelu_tanh_mul
from hearth.ops.gemv import gemv, gemv_add_norm


def gate_after_add_norm(
    ff: torch.Tensor | Partials,
    gate: nn.Module,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate(h), h) for h = x + norm(ff) · norm_weight, the residual after the feed-forward."""
    one_row = isinstance(ff, torch.Tensor) and ff.numel() == ff.shape[-1]
    fused = one_row and kernel_enabled(ff) and is_float_linear(gate)
    if fused and gate.weight.dtype == ff.dtype:
        return gemv_add_norm(ff, gate.weight, x, norm_weight, eps)
    x = add_rms_norm(x, ff, norm_weight, eps)[0]
    return project(gate, x), x


def update(
    gate: torch.Tensor, per_layer_input: torch.Tensor, projection: nn.Module
) -> torch.Tensor:
    """projection(gelu_tanh(gate) · per_layer_input). A CPU decode step takes the native row
    kernel, as the native layer does: torch's GEMM sums in an order that depends on the CPU
    (AMX, AVX-512, AVX2), which would make the two paths differ."""
    if is_float_linear(projection) and kernel_enabled(gate):
        return gemv(gate, projection.weight, geglu=True, up=per_layer_input)
    return project(projection, gelu_tanh_mul(gate, per_layer_input))
