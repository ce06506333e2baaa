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

Gemma 4's MoE layers have more norms around the feed-forward, and the same kernel takes them
(`moe_add_rms_norm`, `moe_combine_add_rms_norm`): after attention, h feeds three inputs (the
dense MLP's norm, the experts' norm and the router's weightless norm · scale · hidden^-1/2),
one RMS for all; before the last add, the sublayer output is itself
``round(norm(dense) · w1) + round(norm(experts) · w2)``. Five launches a layer become two.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hearth.ops import HAS_TRITON, kernel_enabled, native, pdl_options
from hearth.ops.launch import launch_kernel
from hearth.ops.slot_sum import weighted_slot_sum_reference

if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer

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
        dense_ptr,
        dense_w_ptr,
        x_w_ptr,
        next2_w_ptr,
        normed2_ptr,
        router_w_ptr,
        router_ptr,
        slot_w_ptr,
        router_factor,
        eps,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_NEXT: tl.constexpr,
        HAS_NEXT_WEIGHT: tl.constexpr,
        COMBINE: tl.constexpr,
        HAS_NEXT2: tl.constexpr,
        HAS_ROUTER: tl.constexpr,
        PDL: tl.constexpr,
        SLOTS: tl.constexpr = 0,
        SPLITS: tl.constexpr = 0,
        NEXT_CODES: tl.constexpr = 0,
        NEXT_BLOCK_WORDS: tl.constexpr = 0,
    ):
        """See `_launch`. NEXT_CODES > 0 stores the normed output `codes_major` (codes per
        word, NEXT_BLOCK_WORDS words a block), the order the 4-bit GEMV after it reads."""
        wait_for_producer(PDL)
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        mask = columns < N
        dtype = out_ptr.dtype.element_ty
        # Every load is issued before the first reduction: at batch-1 decode this kernel is
        # one program per row, so its time is load latency, not bandwidth.
        if SLOTS > 0:  # x is a MoE token's expert outputs [SLOTS, N], weighted and summed
            x = tl.zeros([BLOCK], tl.float32)
            for slot in tl.static_range(SLOTS):
                pair = row * SLOTS + slot
                y = tl.load(x_ptr + pair * N + columns, mask=mask, other=0.0)
                weighted = y.to(tl.float32) * tl.load(slot_w_ptr + pair)
                x += weighted.to(dtype).to(tl.float32)  # `weighted_slot_sum`'s roundings
            x = x.to(dtype).to(tl.float32)
        elif SPLITS > 0:  # x is a K-split GEMV's fp32 partials [SPLITS, rows, N] (`Partials`)
            x = tl.zeros([BLOCK], tl.float32)
            for split in tl.static_range(SPLITS):
                at = x_ptr + (split * tl.num_programs(0) + row) * N + columns
                x += tl.load(at, mask=mask, other=0.0)
            x = x.to(dtype).to(tl.float32)  # the GEMV's output, rounded as it stores it
        else:
            x = tl.load(x_ptr + row * N + columns, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + columns, mask=mask & HAS_WEIGHT, other=0.0)
        if HAS_RESIDUAL:
            residual = tl.load(residual_ptr + row * N + columns, mask=mask, other=0.0)
        if HAS_NEXT:
            next_w = tl.load(next_w_ptr + columns, mask=mask & HAS_NEXT_WEIGHT, other=0.0)
        if COMBINE:  # x is round(norm(dense) · w1) + round(norm(x) · w2), rounded
            dense = tl.load(dense_ptr + row * N + columns, mask=mask, other=0.0).to(tl.float32)
            dense_w = tl.load(dense_w_ptr + columns, mask=mask, other=0.0)
            x_w = tl.load(x_w_ptr + columns, mask=mask, other=0.0)
            dense = _norm_row(dense, dense_w, eps, N, True).to(dtype).to(tl.float32)
            x = _norm_row(x, x_w, eps, N, True).to(dtype).to(tl.float32)
            x = (dense + x).to(dtype).to(tl.float32)
        if HAS_NEXT2:
            next2_w = tl.load(next2_w_ptr + columns, mask=mask, other=0.0)
        if HAS_ROUTER:
            router_w = tl.load(router_w_ptr + columns, mask=mask, other=0.0).to(tl.float32)
        y = _norm_row(x, w, eps, N, HAS_WEIGHT)
        y = y.to(dtype)
        if HAS_RESIDUAL:
            y = (residual.to(tl.float32) + y.to(tl.float32)).to(dtype)
        if HAS_SCALE:  # a second rounding, as the eager multiply after the add
            y = (y.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(dtype)
        tl.store(out_ptr + row * N + columns, y, mask=mask)
        if HAS_NEXT or HAS_NEXT2 or HAS_ROUTER:
            h = y.to(tl.float32)
            # The norms of h share one RMS, each computed as _norm_row does.
            inverse_rms = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
            if HAS_NEXT:
                z = h * inverse_rms
                if HAS_NEXT_WEIGHT:
                    z = z * next_w
                z = z.to(dtype)
                if NEXT_CODES > 0:  # element (w, j) of a block goes to (j, w)
                    BLOCKS: tl.constexpr = BLOCK // (NEXT_CODES * NEXT_BLOCK_WORDS)
                    blocks = tl.reshape(z, [BLOCKS, NEXT_BLOCK_WORDS, NEXT_CODES])
                    # Moved in registers and shared memory, so the stores stay contiguous.
                    z = tl.reshape(tl.permute(blocks, (0, 2, 1)), [BLOCK])
                tl.store(normed_ptr + row * N + columns, z, mask=mask)
            if HAS_NEXT2:
                z2 = h * inverse_rms * next2_w
                tl.store(normed2_ptr + row * N + columns, z2.to(dtype), mask=mask)
            if HAS_ROUTER:  # weightless norm, · scale, · factor: each rounded, as eagerly
                r = (h * inverse_rms).to(dtype).to(tl.float32)
                r = (r * router_w).to(dtype).to(tl.float32)
                tl.store(router_ptr + row * N + columns, (r * router_factor).to(dtype), mask=mask)


class Partials(NamedTuple):
    """A K-split GEMV's output before its splits are added: fp32 partials [splits, ..., N]
    (`affine_matmul.affine_gemv_partials`). The norm kernels add them in split order and round
    the sum to `dtype`, as the GEMV's own sum launch would (the same bits), one launch fewer."""

    values: torch.Tensor
    dtype: torch.dtype

    def total(self) -> torch.Tensor:
        """The GEMV's output: the splits added in order in fp32, rounded to `dtype` once."""
        total = torch.zeros_like(self.values[0])
        for split in self.values:
            total += split
        return total.to(self.dtype)


def resolved(x: torch.Tensor | Partials) -> torch.Tensor:
    """x itself, or a `Partials`' total."""
    return x.total() if isinstance(x, Partials) else x


def _values(x: torch.Tensor | Partials) -> torch.Tensor:
    return x.values if isinstance(x, Partials) else x


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


def router_input_reference(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma 4's router input: round(round(round(x̂) · scale) · hidden^-1/2), x̂ the weightless
    RMSNorm in fp32."""
    return rms_norm_reference(x, None, eps) * scale * x.shape[-1] ** -0.5


class MoEInputs(NamedTuple):
    """What a Gemma 4 MoE layer's feed-forward reads, from h = residual + norm(attention)·w."""

    residual: torch.Tensor  # h
    dense: torch.Tensor  # pre_feedforward_layernorm(h): the dense MLP's input
    experts: torch.Tensor  # pre_feedforward_layernorm_2(h): the experts' input
    router: torch.Tensor  # router_input_reference(h, router scale)


def moe_add_rms_norm_reference(
    residual: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dense_weight: torch.Tensor,
    experts_weight: torch.Tensor,
    router_scale: torch.Tensor,
) -> MoEInputs:
    summed, dense = add_rms_norm_reference(residual, x, weight, eps, dense_weight, True)
    assert dense is not None
    experts = rms_norm_reference(summed, experts_weight, eps)
    return MoEInputs(summed, dense, experts, router_input_reference(summed, router_scale, eps))


def moe_combine_add_rms_norm_reference(
    residual: torch.Tensor,
    dense: torch.Tensor,
    experts: torch.Tensor,
    dense_weight: torch.Tensor,
    experts_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    next_weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    slot_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The end of a Gemma 4 MoE layer: ff = norm(dense)·w1 + norm(experts)·w2, then
    `add_rms_norm_reference(residual, ff, weight, eps, next_weight, True, scale)`. With
    `slot_weights` [T, top_k], experts is each slot's output [T, top_k, H], summed first by
    `weighted_slot_sum_reference`."""
    if slot_weights is not None:
        experts = weighted_slot_sum_reference(experts, slot_weights)
    ff = add_rms_norm_reference(
        rms_norm_reference(dense, dense_weight, eps), experts, experts_weight, eps
    )[0]
    summed, normed = add_rms_norm_reference(residual, ff, weight, eps, next_weight, True, scale)
    assert normed is not None
    return summed, normed


def _warps(columns: int) -> int:
    return 4 if columns <= 1024 else 8 if columns <= 8192 else 16


def _launch(
    x: torch.Tensor | Partials,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    next_weight: torch.Tensor | None,
    normalize_next: bool,
    eps: float,
    scale: torch.Tensor | None = None,
    *,
    combine: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    next_weight_2: torch.Tensor | None = None,
    router_scale: torch.Tensor | None = None,
    slot_weights: torch.Tensor | None = None,
    codes_major: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """(out, normed or None, normed_2 if next_weight_2, router input if router_scale).
    With `codes_major` (codes per word, words per block) normed is stored in that order,
    ``[rows, blocks, codes, words]`` (`affine_matmul.codes_major`).
    `combine` is (dense, dense_weight, x_weight): x is first replaced by
    ``round(norm(dense) · dense_weight) + round(norm(x) · x_weight)``. With `slot_weights`
    [..., top_k], x is [..., top_k, N] and stands for `weighted_slot_sum(x, slot_weights)`.
    x may be a GEMV's `Partials`, which the kernel adds first."""
    splits, dtype = 0, x.dtype
    if isinstance(x, Partials):
        if slot_weights is not None:
            raise ValueError("a norm adds a GEMV's split partials or experts' slots, not both")
        splits, dtype, x = x.values.shape[0], x.dtype, x.values
    columns = x.shape[-1]
    shape = x.shape[1:] if splits else x.shape
    if slot_weights is not None:
        if slot_weights.shape != x.shape[:-1]:
            raise ValueError(
                f"slot weights {tuple(slot_weights.shape)} do not match x {tuple(x.shape)}"
            )
        shape = torch.Size((*x.shape[:-2], columns))
    if scale is not None and (scale.numel() != 1 or scale.dtype != dtype):
        raise ValueError(f"scale must be one {dtype} value, got {scale.dtype} {scale.shape}")
    for name, vector in (("router scale", router_scale), ("next weight 2", next_weight_2)):
        if vector is not None and vector.shape != (columns,):
            raise ValueError(f"{name} {tuple(vector.shape)} does not match width {columns}")
    rows = shape.numel() // columns
    x2 = x.contiguous()

    def like_out() -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=x.device)

    out = like_out()
    normed = like_out() if normalize_next else None
    codes, block_words = codes_major or (0, 0)
    if codes_major is not None:
        per_block = codes * block_words
        if normed is None or columns % per_block or per_block & (per_block - 1):
            raise ValueError(f"a codes-major norm needs blocks of 2^n inputs dividing {columns}")
        normed = normed.view(rows, columns // per_block, codes, block_words)
    normed_2 = like_out() if next_weight_2 is not None else None
    routed = like_out() if router_scale is not None else None
    dense, dense_weight, x_weight = combine if combine is not None else (None, None, None)
    if dense is not None and dense.shape != shape:
        raise ValueError(f"dense {tuple(dense.shape)} does not match x {tuple(x.shape)}")

    def pointer(tensor: torch.Tensor | None) -> torch.Tensor:
        # Any pointer serves for arguments a constexpr switch leaves unread.
        return tensor if tensor is not None else x2

    launch_kernel(
        _rms_norm_kernel,
        (rows,),
        x2,
        pointer(residual.contiguous() if residual is not None else None),
        pointer(weight),
        pointer(next_weight),
        pointer(scale),
        out,
        pointer(normed),
        pointer(dense.contiguous() if dense is not None else None),
        pointer(dense_weight),
        pointer(x_weight),
        pointer(next_weight_2),
        pointer(normed_2),
        pointer(router_scale),
        pointer(routed),
        pointer(slot_weights.float().contiguous() if slot_weights is not None else None),
        columns**-0.5,
        eps,
        N=columns,
        BLOCK=triton.next_power_of_2(columns),
        HAS_WEIGHT=weight is not None,
        HAS_RESIDUAL=residual is not None,
        HAS_SCALE=scale is not None,
        HAS_NEXT=normalize_next,
        HAS_NEXT_WEIGHT=next_weight is not None,
        COMBINE=combine is not None,
        HAS_NEXT2=next_weight_2 is not None,
        HAS_ROUTER=router_scale is not None,
        SLOTS=x.shape[-2] if slot_weights is not None else 0,
        SPLITS=splits,
        NEXT_CODES=codes,
        NEXT_BLOCK_WORDS=block_words,
        num_warps=_warps(columns),
        **pdl_options(x),
    )
    extras = tuple(t for t in (normed_2, routed) if t is not None)
    return (out, normed, *extras)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, None, False, eps)[0]


def add_rms_norm_triton(
    residual: torch.Tensor,
    x: torch.Tensor | Partials,
    weight: torch.Tensor | None,
    eps: float,
    next_weight: torch.Tensor | None = None,
    normalize_next: bool = False,
    scale: torch.Tensor | None = None,
    codes_major: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    out, normed = _launch(
        x, residual, weight, next_weight, normalize_next, eps, scale, codes_major=codes_major
    )
    return out, normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of the last dim: one Triton kernel on CUDA, the torch reference elsewhere."""
    if kernel_enabled(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor | Partials,
    weight: torch.Tensor | None,
    eps: float,
    next_weight: torch.Tensor | None = None,
    normalize_next: bool = False,
    scale: torch.Tensor | None = None,
    codes_major: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(residual + norm(x)·w)·scale` and, with `normalize_next`, its norm by `next_weight`.
    x may be a K-split GEMV's `Partials`, which the kernel adds first. With `codes_major`
    (codes per word, words per block) the norm is returned `affine_matmul.codes_major`."""
    if kernel_enabled(_values(x)):
        return add_rms_norm_triton(
            residual, x, weight, eps, next_weight, normalize_next, scale, codes_major
        )
    if codes_major is not None:
        # A lazy import: affine_matmul imports hearth.quant.mlx, which imports this module.
        from hearth.ops.affine_matmul import WORD_BITS
        from hearth.ops.affine_matmul import codes_major as reorder

        out, normed = add_rms_norm(residual, x, weight, eps, next_weight, normalize_next, scale)
        codes, block_words = codes_major
        flat = None if normed is None else normed.reshape(-1, normed.shape[-1])
        return out, None if flat is None else reorder(flat, WORD_BITS // codes, block_words)
    x = resolved(x)
    if (
        scale is None
        and weight is not None
        and (next_weight is not None or not normalize_next)
        and residual.shape == x.shape
        and (kernels := native.for_cpu_bf16(residual, x)) is not None
    ):
        # A CPU bf16 step: one native call with the reference's roundings.
        return kernels.add_rms_norm(
            residual.contiguous(), x.contiguous(), weight, eps,
            next_weight if normalize_next else None,
        )  # fmt: skip
    if (
        scale is None
        and weight is not None
        and weight.dtype == torch.float32
        and (next_weight is not None or not normalize_next)
        and residual.shape == x.shape
        and (kernels := native.for_cpu_fp32_row(x, residual)) is not None
    ):
        # A CPU fp32 decode step: one native call, the reference's ops in fp32.
        return kernels.add_rms_norm(
            residual.contiguous(), x.contiguous(), weight.contiguous(), eps,
            next_weight.contiguous() if normalize_next and next_weight is not None else None,
        )  # fmt: skip
    return add_rms_norm_reference(residual, x, weight, eps, next_weight, normalize_next, scale)


def moe_add_rms_norm_triton(
    residual: torch.Tensor,
    x: torch.Tensor | Partials,
    weight: torch.Tensor,
    eps: float,
    dense_weight: torch.Tensor,
    experts_weight: torch.Tensor,
    router_scale: torch.Tensor,
) -> MoEInputs:
    summed, dense, experts, router = _launch(
        x,
        residual,
        weight,
        dense_weight,
        True,
        eps,
        next_weight_2=experts_weight,
        router_scale=router_scale,
    )
    return MoEInputs(summed, dense, experts, router)


def moe_combine_add_rms_norm_triton(
    residual: torch.Tensor,
    dense: torch.Tensor,
    experts: torch.Tensor,
    dense_weight: torch.Tensor,
    experts_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    next_weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    slot_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    combine = (dense, dense_weight, experts_weight)
    out = _launch(
        experts,
        residual,
        weight,
        next_weight,
        True,
        eps,
        scale,
        combine=combine,
        slot_weights=slot_weights,
    )
    return out[0], out[1]


def moe_add_rms_norm(
    residual: torch.Tensor,
    x: torch.Tensor | Partials,
    weight: torch.Tensor,
    eps: float,
    dense_weight: torch.Tensor,
    experts_weight: torch.Tensor,
    router_scale: torch.Tensor,
) -> MoEInputs:
    """h = residual + norm(x)·w and the three inputs of the MoE feed-forward from it (one
    Triton kernel on CUDA: one RMS of h for all three). x may be a GEMV's `Partials`."""
    args = (residual, x, weight, eps, dense_weight, experts_weight, router_scale)
    if kernel_enabled(_values(x)):
        return moe_add_rms_norm_triton(*args)
    return moe_add_rms_norm_reference(residual, resolved(x), *args[2:])


def moe_combine_add_rms_norm(
    residual: torch.Tensor,
    dense: torch.Tensor,
    experts: torch.Tensor,
    dense_weight: torch.Tensor,
    experts_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    next_weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    slot_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_combine_add_rms_norm_reference`: the layer's last three norms (and, with
    `slot_weights`, the experts' weighted slot sum) in one Triton kernel on CUDA."""
    args = (residual, dense, experts, dense_weight, experts_weight, weight, eps, next_weight)
    if kernel_enabled(experts):
        return moe_combine_add_rms_norm_triton(*args, scale, slot_weights)
    return moe_combine_add_rms_norm_reference(*args, scale, slot_weights)
