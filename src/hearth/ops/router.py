"""Gemma 4's MoE routing around the router projection: its input and output, a kernel each.

The router's input is a weightless RMSNorm of x, times `scale`, times hidden^-1/2: three
eager launches, each rounding to the activations' dtype; `router_input` does the three
roundings in one pass.

From the router logits [tokens, experts] the model takes the softmax (fp32), the top_k
experts, renormalises their probabilities to sum to 1 and scales each by its expert's
`per_expert_scale`. Eagerly that is about eight launches (upcast, softmax, top-k, sum,
divide, gather, multiply) per MoE layer for a few hundred bytes; at a batch-1 decode step
their launch gaps cost more than the work. One program per token does it here: the top_k
are found by repeated argmax (largest first, the lower expert id on a tie), so the experts
come out in `torch.topk`'s order. Each argmax is one reduction of an int64 key per expert,
the probability's bits above the inverted id (a probability is >= 0, so its bits order as
it does), instead of a max and then a min of the ids holding it.
"""

from __future__ import annotations

import torch

from hearth.ops import HAS_TRITON, kernel_enabled, pdl_options
from hearth.ops.launch import launch_kernel
from hearth.ops.norm import router_input_reference

# Warps of the routing kernel. One token's 128 logits fit one warp (4 a thread), whose
# reductions are register shuffles alone, where Triton's default 4 warps add a shared-memory
# round and a barrier to each of its ~10 reductions. The softmax sums in another order than
# with 4 warps, so logits move by float rounding.
ROUTE_WARPS = 1


def route_reference(
    logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32, expert ids int64), each [tokens, top_k], largest probability first."""
    probabilities = logits.float().softmax(dim=-1)
    weights, experts = probabilities.topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale[experts], experts


if HAS_TRITON:
    import triton
    import triton.language as tl

    from hearth.ops import wait_for_producer
    from hearth.ops.norm import _norm_row

    @triton.jit
    def _router_input_kernel(
        x_ptr,
        scale_ptr,
        out_ptr,
        eps,
        factor,
        N: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_producer(PDL)
        row = tl.program_id(0).to(tl.int64)
        columns = tl.arange(0, BLOCK)
        mask = columns < N
        x = tl.load(x_ptr + row * N + columns, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + columns, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        y = _norm_row(x, scale, eps, N, False).to(dtype)  # the weightless norm, rounded
        y = (y.to(tl.float32) * scale).to(dtype)
        y = (y.to(tl.float32) * factor).to(dtype)
        tl.store(out_ptr + row * N + columns, y, mask=mask)

    def router_input_triton(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
        columns = x.shape[-1]
        if scale.shape != (columns,):
            raise ValueError(f"scale {tuple(scale.shape)} does not match width {columns}")
        source = x.contiguous()
        out = torch.empty_like(source)
        launch_kernel(_router_input_kernel, (source.numel() // columns,),
            source, scale, out, eps, columns**-0.5, N=columns,
            BLOCK=triton.next_power_of_2(columns), num_warps=4 if columns <= 1024 else 8,
            **pdl_options(source),
        )  # fmt: skip
        return out

    @triton.jit
    def _route_kernel(
        logits_ptr,
        scale_ptr,
        weights_ptr,
        experts_ptr,
        EXPERTS: tl.constexpr,
        BLOCK_E: tl.constexpr,
        TOP_K: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr,
    ):
        wait_for_producer(PDL)
        token = tl.program_id(0).to(tl.int64)
        ids = tl.arange(0, BLOCK_E)
        valid = ids < EXPERTS
        logits = tl.load(logits_ptr + token * EXPERTS + ids, mask=valid, other=float("-inf"))
        logits = logits.to(tl.float32)
        exps = tl.exp(logits - tl.max(logits, axis=0))
        probabilities = exps / tl.sum(exps, axis=0)
        # Key: the probability's bits (>= 0: ordered as the floats are) above BLOCK_E - 1 - id,
        # so the largest key is the largest probability at its lowest id; -1 for padding.
        bits = probabilities.to(tl.int32, bitcast=True).to(tl.int64)
        keys = tl.where(valid, (bits << 32) | (BLOCK_E - 1 - ids), -1)
        slots = tl.arange(0, BLOCK_K)
        chosen_keys = tl.zeros([BLOCK_K], tl.int64)
        for slot in tl.static_range(TOP_K):
            best = tl.max(keys, axis=0)
            chosen_keys = tl.where(slots == slot, best, chosen_keys)
            keys = tl.where(keys == best, -1, keys)
        chosen = (chosen_keys >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        chosen_ids = BLOCK_E - 1 - (chosen_keys & 0xFFFFFFFF)
        in_k = slots < TOP_K
        total = tl.sum(tl.where(in_k, chosen, 0.0), axis=0)
        scales = tl.load(scale_ptr + chosen_ids, mask=in_k, other=0.0).to(tl.float32)
        out = token * TOP_K + slots
        tl.store(weights_ptr + out, chosen / total * scales, mask=in_k)
        tl.store(experts_ptr + out, chosen_ids, mask=in_k)

    def route_triton(
        logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, experts = logits.shape
        if not 0 < top_k <= experts or per_expert_scale.shape != (experts,):
            shape = tuple(per_expert_scale.shape)
            raise ValueError(f"top_k {top_k} of {experts} experts with scales {shape}")
        source = logits.contiguous()
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
        launch_kernel(
            _route_kernel,
            (tokens,),
            source,
            per_expert_scale,
            weights,
            ids,
            EXPERTS=experts,
            BLOCK_E=triton.next_power_of_2(experts),
            TOP_K=top_k,
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=ROUTE_WARPS,
            **pdl_options(source),
        )
        return weights, ids


def router_input(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """`router_input_reference`; one Triton kernel on CUDA."""
    if kernel_enabled(x):
        return router_input_triton(x, scale, eps)
    return router_input_reference(x, scale, eps)


def route(
    logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_reference` for logits [tokens, experts]; one Triton kernel on CUDA."""
    if kernel_enabled(logits):
        return route_triton(logits, top_k, per_expert_scale)
    return route_reference(logits, top_k, per_expert_scale)
