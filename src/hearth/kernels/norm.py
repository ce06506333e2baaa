"""RMSNorm, alone or fused with the residual add that precedes it and the norm that follows.

Gemma's decoder layer runs `x = x + post_norm(sublayer(pre_norm(x)))` twice; eagerly each
norm is four kernels (upcast, reduce, scale, downcast) and each add one more, and at batch-1
decode these tiny launches, not bandwidth, set the step time. One kernel here does

    h = residual + round(norm(x) · w)            (round: to the activations' dtype)
    h = round(h · s)                             (optional: Gemma 4's layer scalar)
    out = round(norm(h) · w_next)                (optional)

with the same roundings as the eager reference, so only the fp32 reduction order differs.
Weights are fp32 multipliers (the models store 1 + w for Gemma 3 already), or None for a
weightless norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.kernels import HAS_TRITON, kernel_enabled, pdl_options

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.kernels import wait_for_producer

    @triton.jit
    def _norm_row(x, w, eps, N: tl.constexpr, HAS_WEIGHT: tl.constexpr):
        mean_square = tl.sum(x * x, axis=0) / N
        y = x * tl.rsqrt(mean_square + eps)
        if HAS_WEIGHT:
            y = y * w
        return y

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,
        w_ptr,
        next_w_ptr,
        scale_ptr,
        out_ptr,
        normed_ptr,
        eps,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_NEXT: tl.constexpr,
        HAS_NEXT_WEIGHT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_producer(PDL)
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        mask = columns < N
        # Every load is issued before the first reduction: at batch-1 decode this kernel is
        # one program per row, so its time is load latency, not bandwidth.
        x = tl.load(x_ptr + row * N + columns, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + columns, mask=mask & HAS_WEIGHT, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * N + columns, mask=mask, other=0.0)
        if HAS_NEXT:
            next_w = tl.load(next_w_ptr + columns, mask=mask & HAS_NEXT_WEIGHT, other=0.0)
        y = _norm_row(x, w, eps, N, HAS_WEIGHT)
        y = y.to(out_ptr.dtype.element_ty)
        if HAS_RESIDUAL:
            y = (residual.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        if HAS_SCALE:  # a second rounding, as the eager multiply after the add
            y = (y.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * N + columns, y, mask=mask)
        if HAS_NEXT:
            z = _norm_row(y.to(tl.float32), next_w, eps, N, HAS_NEXT_WEIGHT)
            tl.store(normed_ptr + row * N + columns, z.to(normed_ptr.dtype.element_ty), mask=mask)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x̂ · w in fp32, cast back to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).type_as(x)


def add_rms_norm_reference(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    next_weight: torch.Tensor | None = None,
    normalize_next: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """((residual + norm(x)·w)·s, norm(that)·w_next if asked), with the eager roundings; s is
    a one-element tensor (none: 1)."""
    summed = residual + rms_norm_reference(x, weight, eps)
    if scale is not None:
        summed = summed * scale
    normed = rms_norm_reference(summed, next_weight, eps) if normalize_next else None
    return summed, normed


def _warps(columns: int) -> int:
    return 4 if columns <= 1024 else 8 if columns <= 8192 else 16


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    normalize_next: bool,
    eps: float,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    columns = x.shape[-1]
    if scale is not None and (scale.numel() != 1 or scale.dtype != x.dtype):
        raise ValueError(f"scale must be one {x.dtype} value, got {scale.dtype} {scale.shape}")
    rows = x.numel() // columns
    x2 = x.contiguous()
    out = torch.empty_like(x2)
    normed = torch.empty_like(x2) if normalize_next else None
    placeholder = x2  # any pointer for arguments a constexpr switch leaves unread
    _rms_norm_kernel[(rows,)](
        x2,
        residual.contiguous() if residual is not None else placeholder,
        weight if weight is not None else placeholder,
        next_weight if next_weight is not None else placeholder,
        scale if scale is not None else placeholder,
        out,
        normed if normed is not None else placeholder,
        eps,
        N=columns,
        BLOCK=triton.next_power_of_2(columns),
        HAS_WEIGHT=weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_SCALE=scale is not None,
        HAS_NEXT=normalize_next,
        HAS_NEXT_WEIGHT=next_weight is not None,
        num_warps=_warps(columns),
        **pdl_options(x),
    )
    return out, normed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, None, False, eps)[0]


def add_rms_norm_triton(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    next_weight: torch.Tensor | None = None,
    normalize_next: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _launch(x, residual, weight, next_weight, normalize_next, eps, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim: one Triton kernel on CUDA, the torch reference elsewhere."""
    if kernel_enabled(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    next_weight: torch.Tensor | None = None,
    normalize_next: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(residual + norm(x)·w)·scale` and, with `normalize_next`, its norm by `next_weight`."""
    if kernel_enabled(x):
        return add_rms_norm_triton(residual, x, weight, eps, next_weight, normalize_next, scale)
    return add_rms_norm_reference(residual, x, weight, eps, next_weight, normalize_next, scale)
