"""Gemma 4 text decoder in PyTorch (spec: shared/reference/gemma4-architecture.md §2, §7).

It reuses the Gemma 3 pieces that compute the same thing (x̂·w RMSNorm, stacked projections,
GeGLU MLP, RoPE tables, masks, decode attention, the tied embedding) and adds what Gemma 4
changes: attention scale 1 with a weightless V norm, K standing in for V on k_eq_v layers,
proportional RoPE on full layers, KV sharing, per-layer embeddings (PLE), the MoE block beside
the dense MLP, `layer_scalar` and the final softcap. Parameter names follow HF's, without the
`model.` prefix, so canonical checkpoint tensors load by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hearth import kernels
from hearth.config import FULL_ATTENTION, SLIDING_ATTENTION, Gemma4Config, RopeConfig
from hearth.kernels import kernel_enabled
from hearth.kernels.activation import gelu_tanh_mul
from hearth.kernels.affine_matmul import KERNEL_BITS as AFFINE_KERNEL_BITS
from hearth.kernels.affine_matmul import CodesMajor, float_expert_matmul
from hearth.kernels.gemv import gemv, gemv_add_norm
from hearth.kernels.grouped_matmul import (
    ExpertPlan,
    default_block_m,
    grouped_affine_expert_matmul,
    grouped_expert_matmul,
    plan_experts,
)
from hearth.kernels.norm import (
    Partials,
    add_rms_norm,
    moe_add_rms_norm,
    moe_combine_add_rms_norm,
)
from hearth.kernels.rope import ValueMode, norm_rope
from hearth.kernels.router import route, router_input
from hearth.kernels.slot_sum import weighted_slot_sum
from hearth.kv.cache import KVView, LayerCache
from hearth.models import gemma4_native
from hearth.models.gemma import (
    MLP,
    Embedding,
    RMSNorm,
    RotaryEmbedding,
    StackedLinear,
    attend,
    decode_write,
    is_float_linear,
    last_of,
    ordered_input,
    project,
    project_for_norm,
    store_keys_values,
)

if TYPE_CHECKING:
    from hearth.quant.mlx import MLXQuantizedExperts

Rope = tuple[torch.Tensor, torch.Tensor]
# The narrow projections (the per-layer input's gate and projection, 2560 <-> 256 on E4B; the
# router's 128 logits) through the Triton GEMV at a decode step: cuBLAS took ~6 µs for the
# 256-wide projection (results/gpu_profile_e4b-2026-12-03.md). E4B decode +3.8%, 26B-A4B
# +1.5% (results/ab_gemma4_narrow_gemv-2026-12-03.md). An A/B switch.
NARROW_GEMV = True
# A MoE layer's five norms after attention in two kernels (`_moe_feed_forward`): one RMS of
# the residual for the dense, expert and router inputs; both feed-forward branches' norms with
# the last add. Bit-identical to the separate kernels. An A/B switch.
FUSED_MOE_NORMS = True
# The per-layer input's GeGLU inside its projection's GEMV (float weights), rather than a
# kernel of its own before it: K is 256, so each program recomputing it costs little. An A/B
# switch.
FUSED_PER_LAYER_GEGLU = True
# The residual add and norm after the feed-forward inside the per-layer input gate's GEMV
# (`gemv_add_norm`), rather than an `add_rms_norm` launch before it: the gate has 256 rows,
# so only a few programs each take the row's RMS, one launch fewer a layer. E4B +0.6%,
# logits bit-identical (2026-12-05 A/B on an H100, `ab_e4b_prefetch_h100-2026-12-05.md`).
FUSED_PER_LAYER_NORM = True
# At a decode step with float experts, the experts' gate/up gathered GEMV stores the GeGLU of
# its dots (programs pair gate and up rows), so the GeGLU kernel goes. 26B-A4B decode +0.8%,
# logits bit-identical; on the GPU 0 differing elements against the two launches at each of
# the autotuner's launches (2026-12-05, H100: `ab_26b_geglu_out_h100-…`,
# `gpu_expert_geglu_h100-…`). The down GEMV forming the GeGLU from gate/up instead (each
# program recomputing its pair's 704 products) gave +0.1-0.4%, and was dropped. An A/B switch.
FUSED_EXPERT_GATE_GEGLU = True
# The same for MLX-packed experts, whose gathered GEMV is now the unrolled affine GEMV
# (`affine_matmul.GATHERED_UNROLLED`): 26B-A4B decode +1.3% at 4 bits, +1.5% at 8, logits
# bit-identical (H100, `ab_26b_{4,8}bit_gathered_launch_h100-2026-12-06.md`). The tile GEMV
# storing the GeGLU had measured 3.8% slower (`ab_26b_4bit_packed_geglu_h100-2026-12-05.md`).
FUSED_PACKED_EXPERT_GATE_GEGLU = True
# At a decode step, the router-weighted sum of the experts' slot outputs inside the MoE
# layer's last norm kernel (`moe_combine_add_rms_norm`), not a `weighted_slot_sum` launch
# before it. Needs FUSED_MOE_NORMS. 26B-A4B decode +0.4% in bf16, +0.8% at 4 bits, logits
# bit-identical (2026-12-05 A/B on an H100, `ab_26b_moe_fusions_h100-…`,
# `ab_26b_4bit_slot_sum_h100-…`). An A/B switch.
FUSED_SLOT_SUM = True
# At a prefill with float experts, the gate/up grouped matmul stores the GeGLU of its dots
# (each program holds gate and up accumulators), so the gate/up product [pairs, 2·I] is
# never written and the GeGLU kernel goes; bit-identical to the two launches. 26B-A4B's
# 4096-token gate/up 614-617 µs against 624-638 for the two launches (0 of 23M elements
# differ), end to end +0.2%; MLX 4-bit experts took 2.0-2.4x longer so (two tiles
# dequantized a step), and keep the GeGLU kernel (2026-12-05, H100:
# `gpu_grouped_geglu_h100-…`). An A/B switch.
FUSED_GROUPED_GEGLU = True
# At a prefill, the MoE layer's last norm kernel sums the experts' slot outputs (the down
# matmul's rows, scaled by their routing weights), instead of a torch sum over the slots
# before it. Needs FUSED_MOE_NORMS. 26B-A4B prefill at 4096 tokens +0.9-1.2% (2026-12-05,
# H100, `ab_26b_prefill4096_fusions{,_b}_h100-…`). An A/B switch.
FUSED_PREFILL_SLOT_SUM = True
# From this many tokens (prefill) the experts run as grouped tensor-core matmuls, which read
# each expert's weight once per tile of its rows; below it one GEMV per (token, slot) pair
# reads less, and decode's CUDA graphs capture that path.
GROUPED_EXPERTS_MIN_TOKENS = 64


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


class Gemma4Attention(nn.Module):
    """q/k norms instead of 1/√d; V RMS-normalised without weight.

    On k_eq_v full layers V is the raw K projection (before k_norm and RoPE). KV-sharing
    layers have only q_proj/q_norm/o_proj and attend over their donor's K/V.
    """

    def __init__(self, config: Gemma4Config, layer: int) -> None:
        super().__init__()
        kind = config.layer_types[layer]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.kv_heads_of(kind)
        self.head_dim = config.head_dim_of(kind)
        self.window = config.sliding_window if kind == SLIDING_ATTENTION else None
        self.eps = config.rms_norm_eps
        self.shares_kv = layer >= config.first_kv_shared_layer
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": q_dim}
        self.value_mode = ValueMode.ABSENT
        if not self.shares_kv:
            parts["k_proj"] = kv_dim
            self.value_mode = ValueMode.UNIT_NORM_OF_K
            if not (config.attention_k_eq_v and kind == FULL_ATTENTION):
                parts["v_proj"] = kv_dim
                self.value_mode = ValueMode.UNIT_NORM
            self.k_norm = RMSNorm(self.head_dim, self.eps)
        self.qkv_proj = StackedLinear(config.hidden_size, parts)
        self.q_norm = RMSNorm(self.head_dim, self.eps)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        positions: torch.Tensor,
        cache: LayerCache | None,
        shared: KVView | None,
    ) -> tuple[torch.Tensor | Partials, KVView]:
        """Output (for the layer's add-norm: `project_for_norm`) and the K/V view attended
        over, which KV-sharing layers get as `shared`."""
        batch, length, _ = x.shape
        cos, sin = rope
        write = decode_write(cache, positions, batch * length) if shared is None else None
        # q/k norms, RoPE and the V norm (of raw K on k_eq_v layers) in one kernel on the GPU,
        # which at a GPU decode step also stores K/V in the cache.
        q, k, v = norm_rope(
            project(self.qkv_proj.proj, x, prefer_cublas=True).flatten(0, 1),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.q_norm.weight,
            self.k_norm.weight if not self.shares_kv else None,
            cos[:, 0],
            sin[:, 0],
            self.eps,
            self.value_mode,
            write,
        )
        q = q.unflatten(0, (batch, length)).transpose(1, 2)
        if shared is not None:
            view = shared
        else:
            view = store_keys_values(cache, write, k, v, positions, (batch, length))
        out = attend(q, view, positions, self.window, scale=1.0)
        heads = out.transpose(1, 2).reshape(batch, length, -1)
        return project_for_norm(self.o_proj, heads), view


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
        return route(_narrow(self.proj, router_input), self.top_k, self.per_expert_scale)


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
        must sum them itself. At a decode step (FUSED_SLOT_SUM) the gathered GEMVs' outputs
        and the routing weights; at a prefill (FUSED_PREFILL_SLOT_SUM) the grouped down
        matmul's rows already scaled in fp32 and ones: one rounding a slot, not two (its
        fp32 error 0.0074 against 0.0104, 26B-A4B's shapes, `gpu_grouped_geglu_h100-…`)."""
        gathers = self.gathers(x)
        if gathers and FUSED_SLOT_SUM:
            return self.forward_gathered(x, weights, experts, summed=False), weights
        if not gathers and FUSED_PREFILL_SLOT_SUM and self._has_gathered_kernels(x):
            scaled = self.forward_grouped(x, weights, experts, summed=False)
            return scaled, torch.ones_like(weights)
        return None

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

    def _gate_up_stores_geglu(self) -> bool:
        """Whether the gathered gate/up GEMV stores the GeGLU itself: float experts'
        (FUSED_EXPERT_GATE_GEGLU), packed ones' where FUSED_PACKED_EXPERT_GATE_GEGLU."""
        if isinstance(self.gate_up_proj, torch.Tensor):
            return FUSED_EXPERT_GATE_GEGLU
        return FUSED_PACKED_EXPERT_GATE_GEGLU

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
        if self._gate_up_stores_geglu():
            hidden = self._per_slot(self.gate_up_proj, x, experts, geglu_out=True)
        else:
            hidden = gelu_tanh_mul(self._per_slot(self.gate_up_proj, x, experts))
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
        if FUSED_GROUPED_GEGLU and not packed:
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


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and feed-forward, then the PLE update, all scaled by
    `layer_scalar`. With MoE the feed-forward is dense MLP + experts, each with its own norms."""

    def __init__(self, config: Gemma4Config, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = config.layer_types[layer]
        self.self_attn = Gemma4Attention(config, layer)
        self.mlp = MLP(hidden, config.mlp_width(layer))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.eps = eps
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.has_moe = config.moe is not None
        if self.has_moe:
            self.router = Router(config)
            self.experts = Experts(config)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        per_layer_width = config.hidden_size_per_layer_input
        if per_layer_width:
            self.per_layer_input_gate = nn.Linear(hidden, per_layer_width, bias=False)
            self.per_layer_projection = nn.Linear(per_layer_width, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        normed_input: torch.Tensor,
        rope: Rope,
        positions: torch.Tensor,
        cache: LayerCache | None,
        shared: KVView | None,
        per_layer_input: torch.Tensor | None,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor, KVView]:
        """The residual stream after this layer, its norm by `next_norm` (the next layer's
        input norm, or the final norm) and the K/V view attended over.

        `normed_input` is `input_layernorm(x)`, computed by the layer before with its last
        residual add: each norm here is fused with the add (and the layer scalar) before it.
        """
        attended, view = self.self_attn(normed_input, rope, positions, cache, shared)
        if self.has_moe and per_layer_input is None and FUSED_MOE_NORMS:
            return (*self._moe_feed_forward(x, attended, next_norm), view)
        order = None if self.has_moe else self.mlp.input_order(x)
        x, normed = add_rms_norm(
            x,
            attended,
            self.post_attention_layernorm.weight,
            self.eps,
            self.pre_feedforward_layernorm.weight,
            normalize_next=True,
            codes_major=order,
        )
        assert normed is not None
        ff = self._feed_forward(x, ordered_input(normed, order, x.shape))
        last_norm = self.post_feedforward_layernorm
        if per_layer_input is not None:
            if self._fused_per_layer_norm(ff):
                gate_weight = self.per_layer_input_gate.weight
                gate, x = gemv_add_norm(ff, gate_weight, x, last_norm.weight, self.eps)
            else:
                x = add_rms_norm(x, ff, last_norm.weight, self.eps)[0]
                gate = _narrow(self.per_layer_input_gate, x)
            ff = self._per_layer_update(gate, per_layer_input)
            last_norm = self.post_per_layer_input_norm
        x, normed_next = add_rms_norm(
            x, ff, last_norm.weight, self.eps, next_norm.weight, True, self.layer_scalar
        )
        assert normed_next is not None
        return x, normed_next, view

    def _fused_per_layer_norm(self, ff: torch.Tensor | Partials) -> bool:
        """Whether the add-norm before the per-layer input gate runs in the gate's GEMV: on
        the GPU, at a decode step, with float weights (FUSED_PER_LAYER_NORM)."""
        if isinstance(ff, Partials) or not (FUSED_PER_LAYER_NORM and NARROW_GEMV):
            return False
        if not kernel_enabled(ff):
            return False
        gate = self.per_layer_input_gate
        one_row = ff.numel() == ff.shape[-1]
        return is_float_linear(gate) and gate.weight.dtype == ff.dtype and one_row

    def _per_layer_update(self, gate: torch.Tensor, per_layer_input: torch.Tensor) -> torch.Tensor:
        """per_layer_projection(gelu_tanh(gate) · per_layer_input), `gate` the per-layer input
        gate's output; with float weights at a GPU decode step the GeGLU runs inside the
        projection's GEMV. A CPU decode step takes the native row kernel, as the native layer
        does (torch's GEMM sums in an order that depends on the CPU: AMX, AVX-512, AVX2)."""
        projection = self.per_layer_projection
        float_weight = is_float_linear(projection)
        if FUSED_PER_LAYER_GEGLU and NARROW_GEMV and float_weight and kernel_enabled(gate):
            return gemv(gate, projection.weight, geglu=True, up=per_layer_input)
        return _narrow(projection, gelu_tanh_mul(gate, per_layer_input))

    def _moe_feed_forward(
        self, x: torch.Tensor, attended: torch.Tensor | Partials, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `forward` does from the attention's output on; a MoE layer's five norms in
        two kernels (`moe_add_rms_norm`, `moe_combine_add_rms_norm`)."""
        inputs = moe_add_rms_norm(
            x,
            attended,
            self.post_attention_layernorm.weight,
            self.eps,
            self.pre_feedforward_layernorm.weight,
            self.pre_feedforward_layernorm_2.weight,
            self.router.scale,
        )
        hidden = x.shape[-1]
        router_input = inputs.router.reshape(-1, hidden)
        if kernels.EXPERT_PREFETCH_LINES:
            # The router before the dense MLP (the two are independent), so that its expert
            # ids are final when the gathered GEMV's programs start and prefetch those
            # experts' rows before their PDL wait.
            weights, experts = self.router.route(router_input)
            dense = self.mlp(inputs.dense)
        else:
            dense = self.mlp(inputs.dense)
            weights, experts = self.router.route(router_input)
        expert_input = inputs.experts.reshape(-1, hidden)
        slot_weights = None
        # The slots' outputs go to the combine kernel, which weights and sums them.
        slots = self.experts.slot_outputs(expert_input, weights, experts)
        if slots is not None:
            per_slot, summing_weights = slots
            sparse = per_slot.view(*x.shape[:-1], *per_slot.shape[-2:])
            slot_weights = summing_weights.view(*x.shape[:-1], summing_weights.shape[-1])
        else:
            sparse = self.experts(expert_input, weights, experts).view_as(x)
        return moe_combine_add_rms_norm(
            inputs.residual,
            dense,
            sparse,
            self.post_feedforward_layernorm_1.weight,
            self.post_feedforward_layernorm_2.weight,
            self.post_feedforward_layernorm.weight,
            self.eps,
            next_norm.weight,
            self.layer_scalar,
            slot_weights,
        )

    def _feed_forward(
        self, x: torch.Tensor, normed: torch.Tensor | CodesMajor
    ) -> torch.Tensor | Partials:
        """The feed-forward of the residual `x`, whose pre-feed-forward norm is `normed`
        (`CodesMajor` only without MoE), for the add-norm after it."""
        if not self.has_moe:
            return self.mlp.for_norm(normed)
        dense = self.mlp(normed)
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.router(flat)  # the router reads the unnormalised residual
        sparse = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts)
        # norm_1(dense) + norm_2(sparse), the add fused with the second norm.
        dense = self.post_feedforward_layernorm_1(dense)
        sparse = sparse.view_as(x)
        return add_rms_norm(dense, sparse, self.post_feedforward_layernorm_2.weight, self.eps)[0]


class Gemma4Model(nn.Module):
    """Scaled embedding (+ per-layer inputs), decoder layers, final norm, tied head, softcap."""

    def __init__(self, config: Gemma4Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.compute_dtype = dtype
        self.embed_tokens: nn.Module = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, layer) for layer in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = nn.ModuleDict(
            {
                kind: ProportionalRotaryEmbedding(config.head_dim_of(kind), rope)
                for kind, rope in config.rope.items()
            }
        )
        per_layer_width = config.hidden_size_per_layer_input * config.num_hidden_layers
        if per_layer_width:
            self.embed_tokens_per_layer: nn.Module = Embedding(
                config.vocab_size_per_layer_input, per_layer_width
            )
            self.per_layer_model_projection = nn.Linear(
                config.hidden_size, per_layer_width, bias=False
            )
            self.per_layer_projection_norm = RMSNorm(
                config.hidden_size_per_layer_input, config.rms_norm_eps
            )

    def module_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A canonical checkpoint tensor as this module stores it: norm weights (x̂·w, used as
        they are) in fp32 from the value rounded to the compute dtype, as HF upcasts per call."""
        tensor = tensor.to(self.compute_dtype)
        return tensor.float() if _is_norm_weight(name) else tensor

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        caches: Sequence[LayerCache] | None = None,
        start: int | torch.Tensor = 0,
        last_only: bool = False,
        last_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [batch, tokens, vocab] (or [batch, 1, vocab] with `last_only`).

        `last_index` (with `last_only`): the chunk's last real token, as in `Gemma3Model`.

        `caches` holds one cache per layer that computes K/V (`make_caches`); the KV-sharing
        layers that come last read their donor's view from this same call instead.
        """
        x = self.embed_tokens.embed(input_ids, self.compute_dtype)
        # HF scales by √hidden rounded to the table's dtype (50.5, not 50.596, in bf16).
        x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        per_layer = self._per_layer_inputs(input_ids, x)
        # `start` may be a device tensor, so a captured decode step reads it at replay.
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + start
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        donors: dict[str, KVView] = {}
        first_shared = self.config.first_kv_shared_layer
        normed = self.layers[0].input_layernorm(x)
        natively = gemma4_native.applies(x, caches) and gemma4_native.decode_step(
            self, x, normed, ropes, caches, per_layer
        )  # a CPU bf16 decode step, all layers or none
        for index, layer in enumerate(() if natively else self.layers):
            if index == first_shared and last_only:
                # Sharing layers write no cache, so only the last position still matters.
                x, normed = last_of(x, last_index), last_of(normed, last_index)
                positions = last_of(positions[None], last_index)[0]
                per_layer = None if per_layer is None else last_of(per_layer, last_index)
                ropes = {
                    kind: (last_of(cos[None], last_index)[0], last_of(sin[None], last_index)[0])
                    for kind, (cos, sin) in ropes.items()
                }
                if last_index is not None:  # a padded chunk: mask its padding by position
                    donors = {kind: _numbered(view) for kind, view in donors.items()}
                last_index = None  # the one position left is the last
            owns_kv = index < first_shared
            following = index + 1 < len(self.layers)
            x, normed, view = layer(
                x,
                normed,
                ropes[layer.layer_type],
                positions,
                caches[index] if caches is not None and owns_kv else None,
                None if owns_kv else donors[layer.layer_type],
                None if per_layer is None else per_layer[:, :, index],
                self.layers[index + 1].input_layernorm if following else self.norm,
            )
            if owns_kv:  # the last owner of each type is the donor of the sharers of that type
                donors[layer.layer_type] = view
        x = last_of(normed, last_index) if last_only else normed  # normed by the last layer
        tied = self.config.tie_word_embeddings
        logits = self.embed_tokens.head(x) if tied else self.lm_head(x)
        softcap = self.config.final_logit_softcapping
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    def _per_layer_inputs(
        self, input_ids: torch.Tensor, embedded: torch.Tensor
    ) -> torch.Tensor | None:
        """PLE [batch, tokens, layers, width]: the token's own row (scaled by √width) plus a
        normed projection of the scaled embedding (by 1/√hidden), together scaled by 1/√2."""
        width = self.config.hidden_size_per_layer_input
        if not width:
            return None
        shape = (self.config.num_hidden_layers, width)
        rows = self.embed_tokens_per_layer.embed(input_ids, self.compute_dtype)
        tokens = rows * torch.tensor(math.sqrt(width), dtype=rows.dtype)
        context = project(self.per_layer_model_projection, embedded, prefer_cublas=True)
        context = context * self.config.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.unflatten(-1, shape))
        return (context + tokens.unflatten(-1, shape)) * 2**-0.5


def _narrow(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`linear(x)` for a narrow projection: see NARROW_GEMV."""
    return project(linear, x) if NARROW_GEMV else linear(x)


def _numbered(view: KVView) -> KVView:
    """`view` with its keys' positions spelled out (0..length-1 where implicit), so one query
    that is not the last key masks the keys after it."""
    if view.positions is not None or view.keys is None:
        return view
    numbered = torch.arange(view.length, device=view.keys.device)
    return KVView(view.keys, view.values, view.length, numbered, view.stored)


def _is_norm_weight(name: str) -> bool:
    owner = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and "norm" in owner
