"""A Gemma 3 decode step on the CPU as one native call per layer (`hearth.native`).

At batch 1 on the CPU, a decode step of a small model is a stream of weights plus hundreds of
tiny ops; dispatching those ops from Python cost ~30% of the 270M's step. Where every operand
fits the native layer (bf16 activations, int8 or bf16 weights, a cache storing K/V dense),
`decode_layer` runs a whole `DecoderLayer` in one call, with the module path's roundings: the
logits are the same bit for bit. Anything else (a quantized KV cache, int4 weights, several
tokens) keeps the module path, layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from hearth import native
from hearth.kv.cache import LayerCache
from hearth.quant.cpu import Int8Linear


def native_weight(module: nn.Module) -> tuple[Tensor, Tensor | None] | None:
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


def child(module: nn.Module, path: tuple[str, ...]) -> nn.Module | None:
    """The submodule at `path` (None where absent), read from the registered-children tables:
    what attribute access returns, at a small part of `nn.Module.__getattr__`'s cost, which
    each layer of a decode step would pay about twenty times."""
    found: nn.Module | None = module
    for name in path:
        found = None if found is None else found._modules.get(name)
    return found


def source_paths(*dotted: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(path.split(".")) for path in dotted)


_SOURCE_PATHS = source_paths(
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


def _sources(layer: nn.Module, next_norm: nn.Module) -> tuple[nn.Module | None, ...]:
    """The modules whose tensors a layer's operands point into, in a fixed order."""
    return (*[child(layer, path) for path in _SOURCE_PATHS], next_norm)


def tensor_addresses(sources: Sequence[nn.Module]) -> list[int]:
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


class NativeLayer(NamedTuple):
    """A layer's operands for the native call: pointers into the layer's tensors, which the
    layer keeps alive (rebuilt when any tensor moves)."""

    operands: native.DecodeLayerOperands | native.Gemma4LayerOperands
    sample: Tensor  # zeros shaped like one token's K: sizes a cache's first slots


def fitting_norms(norms: Sequence[nn.Module | None]) -> list[Tensor | None] | None:
    """The norms' fp32 weights (None for an absent norm), or None unless all fit and share
    one eps."""
    weights = [None if module is None else module.weight for module in norms]
    if not all(w is None or (w.dtype == torch.float32 and w.is_contiguous()) for w in weights):
        return None
    if len({module.eps for module in norms if module is not None}) != 1:
        return None
    return weights


def layer_operands(
    layer: nn.Module, sources: Sequence[nn.Module | None], scale: float
) -> native.DecodeLayerOperands | None:
    """The operands of Gemma 3's layer, which Gemma 4's extend: `sources` are the qkv, o,
    gate/up and down projections, then the q, k (None: a KV-sharing layer), post-attention,
    pre- and post-feed-forward and next norms. None where any does not fit."""
    attention, mlp = layer.self_attn, layer.mlp
    weights = [native_weight(module) for module in sources[:4]]
    norms = fitting_norms(sources[4:])
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


def key_sample(layer: nn.Module) -> Tensor:
    """Zeros shaped like one token's K of `layer`: sizes a cache's first slots."""
    attention = layer.self_attn
    return torch.zeros(1, attention.num_kv_heads, 1, attention.head_dim, dtype=torch.bfloat16)


def cached_layer(
    layer: nn.Module,
    sources: Sequence[nn.Module | None],
    build: Callable[[], NativeLayer | None],
) -> NativeLayer | None:
    """The layer's operands, kept on it while the tensors of `sources` stay where they are
    (a layer that cannot run natively is remembered too)."""
    addresses = tensor_addresses([module for module in sources if module is not None])
    cached: tuple[list[int], NativeLayer | None] | None = getattr(layer, "_native_layer", None)
    if cached is None or cached[0] != addresses:
        cached = (addresses, build())
        layer._native_layer = cached
    return cached[1]


def _build(layer: nn.Module, next_norm: nn.Module) -> NativeLayer | None:
    operands = layer_operands(layer, _sources(layer, next_norm), layer.self_attn.scale)
    return None if operands is None else NativeLayer(operands, key_sample(layer))


def applies(x: Tensor, caches: list[LayerCache] | None) -> bool:
    """Whether a forward over `x` (embedded tokens) may run its layers natively: one CPU bf16
    token of one sequence, with caches, outside autograd, and the kernels built here."""
    return (
        caches is not None
        and x.shape[:2] == (1, 1)
        and native.for_cpu_bf16(x) is not None
        and not torch.is_grad_enabled()
    )


def decode_layer(
    layer: nn.Module,
    x: Tensor,
    normed: Tensor,
    rope: tuple[Tensor, Tensor],
    cache: LayerCache,
    next_norm: nn.Module,
) -> bool:
    """Run `layer` at one token natively, updating `x` and `normed` in place (the module
    path's `(x, normed)` results); False, with nothing changed, where it cannot."""
    kernels = native.kernels()
    decode_slot = getattr(cache, "decode_slot", None)
    if kernels is None or decode_slot is None:
        return False
    sources = _sources(layer, next_norm)
    built = cached_layer(layer, sources, lambda: _build(layer, next_norm))
    if built is None:
        return False
    slot = decode_slot(built.sample)
    if slot is None:
        return False
    cos, sin = rope
    kernels.gemma3_decode_layer(
        built.operands, x, normed, cos.reshape(-1), sin.reshape(-1), slot.keys, slot.values,
        slot.slot, slot.length,
    )  # fmt: skip
    return True
