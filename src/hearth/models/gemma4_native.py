"""A Gemma 4 decode step on the CPU as one native call per layer (`hearth.native`).

As `gemma_native` for Gemma 3: at one CPU bf16 token, where every layer fits the native call
(dense MLP, int8 or bf16 weights, caches storing K/V dense), `decode_step` runs each layer
in one call with the module path's roundings, so the logits are the same bit for bit. The
KV-sharing layers attend over their donor's planes, written earlier in the same step. A step
where any layer does not fit (an expert block, a quantized KV cache, int4 weights) runs every
layer through the modules: the donors' views must come from one path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hearth import native
from hearth.kv.cache import DecodeSlot, LayerCache
from hearth.models import gemma_native
from hearth.models.gemma_native import (
    NativeLayer,
    cached_layer,
    child,
    fitting_norms,
    key_sample,
    layer_operands,
    native_weight,
    source_paths,
)

if TYPE_CHECKING:
    from hearth.models.gemma4 import Gemma4Model


_SOURCE_PATHS = source_paths(
    "self_attn.qkv_proj.proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj.proj",
    "mlp.down_proj",
    "per_layer_input_gate",
    "per_layer_projection",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
    "post_per_layer_input_norm",
)


def _sources(layer: nn.Module, next_norm: nn.Module) -> tuple[nn.Module | None, ...]:
    """The modules whose tensors a layer's operands point into, in the operands' order: six
    projections, then seven norms (None where the layer has no such module: the per-layer
    input's without per-layer inputs, k_norm on a KV-sharing layer)."""
    return (*[child(layer, path) for path in _SOURCE_PATHS], next_norm)


def _build(layer: nn.Module, next_norm: nn.Module) -> NativeLayer | None:
    if layer.has_moe:
        return None
    sources = _sources(layer, next_norm)
    # Gemma 3's operands (Gemma 4's attention scale is 1: q and k are normed instead), then
    # the per-layer input's gate, projection and norm, and the layer scalar.
    base = layer_operands(layer, sources[:4] + sources[6:11] + sources[12:], 1.0)
    gate, projection, norm = sources[4], sources[5], sources[11]
    per_layer = [native_weight(module) for module in (gate, projection) if module is not None]
    norms = fitting_norms([norm, sources[12]])
    scalar = layer.layer_scalar
    if (
        base is None
        or any(w is None for w in per_layer)
        or norms is None
        or not (scalar.dtype == torch.bfloat16 and scalar.numel() == 1 and scalar.is_contiguous())
    ):
        return None
    weights = [w for w, _ in per_layer] or [None, None]
    scales = [s for _, s in per_layer] or [None, None]
    operands = native.Gemma4LayerOperands(
        base,
        0 if gate is None else gate.out_features,
        int(layer.self_attn.value_mode),
        *(None if w is None else w.data_ptr() for w in weights),
        *(None if s is None else s.data_ptr() for s in scales),
        None if norms[0] is None else norms[0].data_ptr(),
        scalar.data_ptr(),
    )
    return NativeLayer(operands, key_sample(layer))


# One CPU bf16 token of one sequence, with caches, outside autograd: as for Gemma 3.
applies = gemma_native.applies


def decode_step(
    model: Gemma4Model,
    x: Tensor,
    normed: Tensor,
    ropes: dict[str, tuple[Tensor, Tensor]],
    caches: list[LayerCache],
    per_layer: Tensor | None,
) -> bool:
    """Run every layer at one token natively, updating `x` and `normed` in place (`normed`
    ends as the final norm's output); False, with nothing changed, where any layer cannot."""
    kernels = native.kernels()
    if kernels is None:
        return False
    layers, first_shared = model.layers, model.config.first_kv_shared_layer
    built = []
    for index, layer in enumerate(layers):
        next_norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else model.norm
        sources = _sources(layer, next_norm)
        operands = cached_layer(layer, sources, lambda: _build(layer, next_norm))  # noqa: B023
        owns_kv = index < first_shared
        if operands is None or (owns_kv and not _takes_decode_slots(caches[index])):
            return False
        built.append(operands)
    donors: dict[str, DecodeSlot] = {}
    for index, (layer, operands) in enumerate(zip(layers, built, strict=True)):
        if index < first_shared:
            slot = caches[index].decode_slot(operands.sample)
            assert slot is not None  # _takes_decode_slots said so
            donors[layer.layer_type] = slot
            written: int | None = slot.slot
        else:
            slot, written = donors[layer.layer_type], None
        cos, sin = ropes[layer.layer_type]
        own_input = None if per_layer is None else per_layer[0, 0, index]
        kernels.gemma4_decode_layer(
            operands.operands, x, normed, cos.reshape(-1), sin.reshape(-1), slot.keys,
            slot.values, written, slot.length, own_input,
        )  # fmt: skip
    return True


def _takes_decode_slots(cache: LayerCache) -> bool:
    takes = getattr(cache, "takes_decode_slots", None)
    return takes is not None and takes()
