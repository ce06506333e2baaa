"""A CPU bf16 decode step as one native call per decoder layer (`hearth.ops.native`).

At batch 1 on the CPU a decode step of a small model is a stream of weights plus hundreds of
tiny ops; dispatching those ops from Python cost ~30% of the 270M's step. Where every layer
fits the native call (int8 or bf16 weights, no expert block, caches storing K/V dense), a step
runs each Gemma 3 or Gemma 4 layer in one call with the module path's order and roundings: the
logits are the module path's bit for bit. KV-sharing layers attend over their donor's planes,
written earlier in the same step. A step where any layer does not fit runs every layer through
the modules (the runner's eager step).

The layers' operands (pointers into their tensors) are built once and kept here, not on the
model, and rebuilt when any tensor they point into moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from hearth.kv.cache import DecodeSlot, LayerCache
from hearth.layers.int8 import Int8Linear
from hearth.models import Gemma4Model, Model
from hearth.ops import native

_GEMMA3_SOURCES = (
    "self_attn.qkv_proj.proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj.proj",
    "mlp.down_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
_GEMMA4_SOURCES = (
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


class NativeLayer(NamedTuple):
    """A layer's operands for the native call: pointers into the layer's tensors, which the
    layer keeps alive (rebuilt when any tensor moves)."""

    operands: native.DecodeLayerOperands | native.Gemma4LayerOperands
    sample: Tensor  # zeros shaped like one token's K: sizes a cache's first slots


class NativeDecodeStep:
    """Decode steps of one model through the native layers (`__call__`), where they apply."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.gemma4 = isinstance(model, Gemma4Model)
        paths = _GEMMA4_SOURCES if self.gemma4 else _GEMMA3_SOURCES
        self._paths = tuple(tuple(path.split(".")) for path in paths)
        # Per layer: the addresses its operands were built from, and the operands (None: the
        # layer cannot run natively).
        self._built: dict[int, tuple[list[int], NativeLayer | None]] = {}

    def applies(self, input_ids: Tensor, caches: Sequence[LayerCache] | None) -> bool:
        """Whether a step over `input_ids` may run natively: one token of one sequence, a
        bf16 CPU model with caches, outside autograd, and the kernels built here."""
        return (
            caches is not None
            and input_ids.shape == (1, 1)
            and self.model.compute_dtype == torch.bfloat16
            and self.model.device.type == "cpu"
            and not torch.is_grad_enabled()
            and native.kernels() is not None
        )

    def __call__(
        self, input_ids: Tensor, caches: Sequence[LayerCache], position: int
    ) -> Tensor | None:
        """Logits [1, 1, vocab] of one token at `position`, every layer natively; None, with
        nothing changed, where any layer cannot (the caller then runs the modules)."""
        model = self.model
        layers = self._layers(caches)
        if layers is None:
            return None
        kernels = native.kernels()
        assert kernels is not None  # `applies` said so
        x = model.embed(input_ids)
        positions = model.positions(1, position, input_ids.device)
        ropes = model.rope_tables(positions, x.dtype)
        normed = model.layers[0].input_layernorm(x)
        if self.gemma4:
            self._gemma4_layers(kernels, layers, x, normed, ropes, caches, input_ids)
        else:
            for index, (layer, built) in enumerate(zip(model.layers, layers, strict=True)):
                slot = caches[index].decode_slot(built.sample)
                assert slot is not None  # `_layers` checked the cache takes decode slots
                cos, sin = ropes[layer.layer_type]
                kernels.gemma3_decode_layer(
                    built.operands, x, normed, cos.reshape(-1), sin.reshape(-1), slot.keys,
                    slot.values, slot.slot, slot.length,
                )  # fmt: skip
        return model.logits(normed)

    def _gemma4_layers(
        self,
        kernels: native.NativeKernels,
        layers: list[NativeLayer],
        x: Tensor,
        normed: Tensor,
        ropes: dict[str, tuple[Tensor, Tensor]],
        caches: Sequence[LayerCache],
        input_ids: Tensor,
    ) -> None:
        model = self.model
        assert isinstance(model, Gemma4Model)
        per_layer = model.per_layer_inputs(input_ids, x)
        first_shared = model.config.first_kv_shared_layer
        donors: dict[str, DecodeSlot] = {}
        for index, (layer, built) in enumerate(zip(model.layers, layers, strict=True)):
            written: int | None = None
            if index < first_shared:
                slot = caches[index].decode_slot(built.sample)
                assert slot is not None  # `_layers` checked the cache takes decode slots
                donors[layer.layer_type] = slot
                written = slot.slot
            else:
                slot = donors[layer.layer_type]
            cos, sin = ropes[layer.layer_type]
            own_input = None if per_layer is None else per_layer[0, 0, index]
            kernels.gemma4_decode_layer(
                built.operands, x, normed, cos.reshape(-1), sin.reshape(-1), slot.keys,
                slot.values, written, slot.length, own_input,
            )  # fmt: skip

    def _layers(self, caches: Sequence[LayerCache]) -> list[NativeLayer] | None:
        """Every layer's operands, or None where any layer, or any cache it writes, cannot
        run natively."""
        model = self.model
        owners = model.config.first_kv_shared_layer if self.gemma4 else len(model.layers)
        built = []
        for index, layer in enumerate(model.layers):
            operands = self._operands(index, layer, model.next_norm(index))
            if operands is None or (index < owners and not _takes_decode_slots(caches[index])):
                return None
            built.append(operands)
        return built

    def _operands(self, index: int, layer: nn.Module, next_norm: nn.Module) -> NativeLayer | None:
        """The layer's operands, kept while the tensors they point into stay where they are
        (a layer that cannot run natively is remembered too)."""
        sources = (*[_child(layer, path) for path in self._paths], next_norm)
        addresses = _tensor_addresses([module for module in sources if module is not None])
        cached = self._built.get(index)
        if cached is None or cached[0] != addresses:
            build = _gemma4_layer if self.gemma4 else _gemma3_layer
            cached = (addresses, build(layer, sources))
            self._built[index] = cached
        return cached[1]


def _gemma3_layer(layer: nn.Module, sources: Sequence[nn.Module | None]) -> NativeLayer | None:
    operands = _layer_operands(layer, sources, layer.self_attn.scale)
    return None if operands is None else NativeLayer(operands, _key_sample(layer))


def _gemma4_layer(layer: nn.Module, sources: Sequence[nn.Module | None]) -> NativeLayer | None:
    """Gemma 3's operands (Gemma 4's attention scale is 1: q and k are normed instead), then
    the per-layer input's gate, projection and norm, and the layer scalar."""
    if layer.has_moe:
        return None
    base = _layer_operands(layer, (*sources[:4], *sources[6:11], *sources[12:]), 1.0)
    gate, projection, norm = sources[4], sources[5], sources[11]
    per_layer = [_native_weight(module) for module in (gate, projection) if module is not None]
    norms = _fitting_norms([norm, sources[12]])
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
    return NativeLayer(operands, _key_sample(layer))


def _layer_operands(
    layer: nn.Module, sources: Sequence[nn.Module | None], scale: float
) -> native.DecodeLayerOperands | None:
    """The operands of Gemma 3's layer, which Gemma 4's extend: `sources` are the qkv, o,
    gate/up and down projections, then the q, k (None: a KV-sharing layer), post-attention,
    pre- and post-feed-forward and next norms. None where any does not fit."""
    attention, mlp = layer.self_attn, layer.mlp
    weights = [_native_weight(module) for module in sources[:4]]
    norms = _fitting_norms(sources[4:])
    if any(w is None for w in weights) or norms is None:
        return None
    return native.DecodeLayerOperands(
        layer.post_attention_layernorm.weight.numel(),
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        mlp.down_proj.in_features,
        *(weight.data_ptr() for weight, _ in weights),
        *(None if scales is None else scales.data_ptr() for _, scales in weights),
        *(None if n is None else n.data_ptr() for n in norms),
        next(module.eps for module in sources[4:] if module is not None),
        scale,
    )


def _native_weight(module: nn.Module | None) -> tuple[Tensor, Tensor | None] | None:
    """(weight, row scales) as the native layer reads them: int8 with bf16 scales, or a
    contiguous bf16 weight with no scales; None for any other projection."""
    if isinstance(module, Int8Linear) and module.uses_native and module.bias is None:
        return module.qweight, module.scales
    if (
        isinstance(module, nn.Linear)
        and module.bias is None
        and module.weight.dtype == torch.bfloat16
        and module.weight.is_contiguous()
    ):
        return module.weight, None
    return None


def _fitting_norms(norms: Sequence[nn.Module | None]) -> list[Tensor | None] | None:
    """The norms' fp32 weights (None for an absent norm), or None unless all fit and share
    one eps."""
    weights = [None if module is None else module.weight for module in norms]
    if not all(w is None or (w.dtype == torch.float32 and w.is_contiguous()) for w in weights):
        return None
    if len({module.eps for module in norms if module is not None}) != 1:
        return None
    return weights


def _key_sample(layer: nn.Module) -> Tensor:
    """Zeros shaped like one token's K of `layer`: sizes a cache's first slots."""
    attention = layer.self_attn
    return torch.zeros(1, attention.num_kv_heads, 1, attention.head_dim, dtype=torch.bfloat16)


def _child(module: nn.Module, path: tuple[str, ...]) -> nn.Module | None:
    """The submodule at `path` (None where absent), read from the registered-children tables:
    what attribute access returns, at a small part of `nn.Module.__getattr__`'s cost, which
    each layer of a decode step would pay about twenty times."""
    found: nn.Module | None = module
    for name in path:
        found = None if found is None else found._modules.get(name)
    return found


def _tensor_addresses(sources: Sequence[nn.Module]) -> list[int]:
    """Where every tensor of `sources` lives now. Operands are rebuilt when any moves: a
    replaced tensor, or one whose storage `module.to()` swapped under the same Parameter."""
    # The modules' own tables, read directly: `parameters()` costs ~20x more, every step.
    return [
        tensor.data_ptr()
        for module in sources
        for table in (module._parameters, module._buffers)
        for tensor in table.values()
        if tensor is not None
    ]


def _takes_decode_slots(cache: LayerCache) -> bool:
    takes = getattr(cache, "takes_decode_slots", None)
    return takes is not None and takes()
