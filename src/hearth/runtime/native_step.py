"""A CPU decode step as one native call per decoder layer (`hearth.ops.native`).

At batch 1 on the CPU a decode step of a small model is a stream of weights plus hundreds of
tiny ops; dispatching those ops from Python cost ~30% of the 270M's step. Where every layer
fits the native call (int8 or bf16 weights, no expert block, caches storing K/V dense), a step
runs each Gemma 3 or Gemma 4 layer in one call with the module path's order and roundings: the
logits are the module path's bit for bit. KV-sharing layers attend over their donor's planes,
written earlier in the same step. A step where any layer does not fit runs every layer through
the modules (the runner's eager step).

A Gemma 3 model in fp32 over GGUF blocks kept as stored (the CPU default for GGUF files) runs
each layer as one call too (`gemma3_blocks_layer`), at one token of each of up to 16 sequences
at once (`decode_rows`, each sequence with its own caches): the module path's kernels in its
order, but for attention and GELU, so its logits are the module path's up to the order of fp32
sums there (tests/runtime/test_native_step_blocks.py states the bound). On a paged pool's
caches that call reads and writes each sequence's K/V in its blocks through its block table
(`PagedLayerCache.decode_blocks`), in the order a copy of them would hold them: the logits of
the copy it replaced, bit for bit (tests/runtime/test_native_paged_blocks.py). A Gemma 4 dense
model so stored runs each layer as one call too (`gemma4_blocks_layer`, one sequence), with
the same bound (tests/runtime/test_native_step_gemma4_blocks.py); its MoE layers (26B-A4B)
keep the module path.

The layers' operands (pointers into their tensors) are built once and kept here, not on the
model, and rebuilt when any tensor they point into moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from hearth.kv.cache import DecodeSlot, LayerCache
from hearth.kv.paged import PagedLayerCache
from hearth.layers.gguf import GGUFLinear
from hearth.layers.int8 import Int8Linear
from hearth.models import Gemma4Model, Model
from hearth.ops import native
from hearth.ops.rope import ValueMode

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

    operands: (
        native.DecodeLayerOperands
        | native.Gemma4LayerOperands
        | native.BlocksLayerOperands
        | native.Gemma4BlocksLayerOperands
    )
    sample: Tensor  # zeros shaped like one token's K: sizes a cache's first slots


class NativeDecodeStep:
    """Decode steps of one model through the native layers (`__call__`), where they apply."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.gemma4 = isinstance(model, Gemma4Model)
        # An fp32 Gemma 3 whose projections hold GGUF blocks (the CPU default for a GGUF file).
        self.blocks = (
            model.compute_dtype == torch.float32
            and not self.gemma4
            and isinstance(_child(model.layers[0], ("self_attn", "o_proj")), GGUFLinear)
        )
        # An fp32 Gemma 4 over GGUF blocks: one sequence at a time (`gemma4_blocks_layer`).
        self.gemma4_blocks = (
            model.compute_dtype == torch.float32
            and self.gemma4
            and isinstance(_child(model.layers[0], ("self_attn", "o_proj")), GGUFLinear)
        )
        paths = _GEMMA4_SOURCES if self.gemma4 else _GEMMA3_SOURCES
        self._paths = tuple(tuple(path.split(".")) for path in paths)
        # Per layer: the addresses its operands were built from, and the operands (None: the
        # layer cannot run natively).
        self._built: dict[int, tuple[list[int], NativeLayer | None]] = {}

    def applies(self, input_ids: Tensor, caches: Sequence[LayerCache] | None) -> bool:
        """Whether a step over `input_ids` may run natively: one token of one sequence, a
        bf16 (or fp32 over GGUF blocks) CPU model with caches, outside autograd, and the
        kernels built here."""
        return caches is not None and input_ids.shape == (1, 1) and self._model_fits()

    def _model_fits(self) -> bool:
        return (
            (self.model.compute_dtype == torch.bfloat16 or self.blocks or self.gemma4_blocks)
            and self.model.device.type == "cpu"
            and not torch.is_grad_enabled()
            and native.kernels() is not None
        )

    def decode_rows(
        self,
        tokens: Sequence[int],
        caches: Sequence[Sequence[LayerCache]],
        positions: Sequence[int],
    ) -> Tensor | None:
        """Logits [B, vocab] after one token of each of B sequences (each with its own caches
        and position), every layer natively for all of them at once (the weights read once
        for all B); None, with nothing changed, where this model or any cache cannot (the
        caller then runs the modules). fp32 Gemma 3 over GGUF blocks only."""
        if not (self.blocks and self._model_fits()) or not tokens:
            return None
        layers = self._layers(caches[0])
        if layers is None or not all(
            _takes_decode_slots(cache) for own in caches[1:] for cache in own
        ):
            return None
        if len(tokens) <= native.MAX_INPUT_ROWS:  # one call's rows: no copy of the logits
            return self._blocks_rows(layers, tokens, caches, positions)
        rows = []
        for start in range(0, len(tokens), native.MAX_INPUT_ROWS):
            end = start + native.MAX_INPUT_ROWS
            rows.append(
                self._blocks_rows(
                    layers, tokens[start:end], caches[start:end], positions[start:end]
                )
            )
        return torch.cat(rows)

    def _blocks_rows(
        self,
        layers: list[NativeLayer],
        tokens: Sequence[int],
        caches: Sequence[Sequence[LayerCache]],
        positions: Sequence[int],
    ) -> Tensor:
        """Logits [B, vocab] of B <= 16 sequences' tokens through `gemma3_blocks_layer`."""
        model = self.model
        kernels = native.kernels()
        assert kernels is not None  # `_model_fits` said so
        batch = len(tokens)
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        x = model.embed(ids).reshape(batch, -1).contiguous()
        at = torch.tensor(list(positions), dtype=torch.long)
        ropes = {
            kind: (cos.reshape(batch, -1).contiguous(), sin.reshape(batch, -1).contiguous())
            for kind, (cos, sin) in model.rope_tables(at, x.dtype).items()
        }
        normed = model.layers[0].input_layernorm(x).contiguous()
        # Each block table as the kernel reads it, made once a step (the layers of a cache
        # group share their sequence's table).
        tables: dict[int, native.BlockTable] = {}
        for index, (layer, built) in enumerate(zip(model.layers, layers, strict=True)):
            rows = [_row_kv(own[index], built.sample, tables) for own in caches]
            cos, sin = ropes[layer.layer_type]
            assert isinstance(built.operands, native.BlocksLayerOperands)
            kernels.gemma3_blocks_layer(built.operands, x, normed, cos, sin, rows)
        return model.logits(normed)

    def __call__(
        self, input_ids: Tensor, caches: Sequence[LayerCache], position: int
    ) -> Tensor | None:
        """Logits [1, 1, vocab] of one token at `position`, every layer natively; None, with
        nothing changed, where any layer cannot (the caller then runs the modules)."""
        model = self.model
        layers = self._layers(caches)
        if layers is None:
            return None
        if self.blocks:
            return self._blocks_rows(layers, [int(input_ids)], [caches], [position])[:, None]
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
            run = kernels.gemma4_blocks_layer if self.gemma4_blocks else kernels.gemma4_decode_layer
            run(
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
            build = (
                (_gemma4_blocks_layer if self.gemma4_blocks else _gemma4_layer)
                if self.gemma4
                else _gemma3_blocks_layer
                if self.blocks
                else _gemma3_layer
            )
            cached = (addresses, build(layer, sources))
            self._built[index] = cached
        return cached[1]


def _gemma3_layer(layer: nn.Module, sources: Sequence[nn.Module | None]) -> NativeLayer | None:
    operands = _layer_operands(layer, sources, layer.self_attn.scale)
    return None if operands is None else NativeLayer(operands, _key_sample(layer))


def _gemma3_blocks_layer(
    layer: nn.Module, sources: Sequence[nn.Module | None]
) -> NativeLayer | None:
    """The operands of a Gemma 3 layer whose projections all hold GGUF blocks (`sources` as
    `_gemma3_layer`'s); None where any does not."""
    attention, mlp = layer.self_attn, layer.mlp
    weights = [_blocks_weight(module) for module in sources[:4]]
    norms = _fitting_norms(sources[4:])
    if any(w is None for w in weights) or norms is None or None in norms:
        return None
    operands = native.BlocksLayerOperands(
        layer.post_attention_layernorm.weight.numel(),
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        mlp.down_proj.in_features,
        *weights,
        *(n.data_ptr() for n in norms if n is not None),
        next(module.eps for module in sources[4:] if module is not None),
        attention.scale,
    )
    sample = torch.zeros(1, attention.num_kv_heads, 1, attention.head_dim)
    return NativeLayer(operands, sample)


def _blocks_weight(module: nn.Module | None) -> native.BlocksWeight | None:
    """A GGUFLinear's segments as the native layer reads them; None for any other projection
    or a type the kernels do not take."""
    if not isinstance(module, GGUFLinear):
        return None
    parts = module.parts()
    if len(parts) > native.MAX_BLOCK_SEGMENTS or any(
        t not in native.STORED_BLOCK_TYPES or not blocks.is_contiguous() for t, blocks in parts
    ):
        return None
    weight = native.BlocksWeight()
    weight.segments = len(parts)
    for index, ((type_id, blocks), rows) in enumerate(zip(parts, module.part_rows, strict=True)):
        weight.type[index] = type_id
        weight.rows[index] = rows
        weight.blocks[index] = blocks.data_ptr()
        weight.bf16[index] = int(type_id in module.bf16_gemv_types)
    return weight


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


def _gemma4_blocks_layer(
    layer: nn.Module, sources: Sequence[nn.Module | None]
) -> NativeLayer | None:
    """The operands of a Gemma 4 dense layer whose projections (the per-layer input's
    included) all hold GGUF blocks (`sources` as `_gemma4_layer`'s); None where any does not,
    or for a MoE layer."""
    if layer.has_moe:
        return None
    attention, mlp = layer.self_attn, layer.mlp
    value_mode = int(attention.value_mode)
    weights = [_blocks_weight(module) for module in sources[:4]]
    gate, projection = sources[4], sources[5]
    per_layer = [_blocks_weight(module) for module in (gate, projection) if module is not None]
    norms = _fitting_norms(sources[6:])
    scalar = layer.layer_scalar
    if (
        value_mode not in (ValueMode.ABSENT, ValueMode.UNIT_NORM, ValueMode.UNIT_NORM_OF_K)
        or any(w is None for w in (*weights, *per_layer))
        or norms is None
        or not (scalar.dtype == torch.float32 and scalar.numel() == 1 and scalar.is_contiguous())
    ):
        return None
    q_norm, k_norm, post_attention, pre_feedforward, post_feedforward, post_per_layer, after = norms
    needed = [q_norm, post_attention, pre_feedforward, post_feedforward, after]
    if value_mode != ValueMode.ABSENT:
        needed.append(k_norm)
    if gate is not None:
        needed.append(post_per_layer)
    if any(n is None for n in needed):
        return None
    base = native.BlocksLayerOperands(
        layer.post_attention_layernorm.weight.numel(),
        attention.num_heads,
        attention.num_kv_heads,
        attention.head_dim,
        mlp.down_proj.in_features,
        *weights,
        *(None if n is None else n.data_ptr() for n in norms[:5]),
        after.data_ptr(),
        next(module.eps for module in sources[6:] if module is not None),
        attention.scale,
    )
    gate_weight, projection_weight = per_layer or [native.BlocksWeight(), native.BlocksWeight()]
    operands = native.Gemma4BlocksLayerOperands(
        base,
        0 if gate is None else gate.out_features,
        value_mode,
        gate_weight,
        projection_weight,
        None if post_per_layer is None else post_per_layer.data_ptr(),
        scalar.data_ptr(),
    )
    sample = torch.zeros(1, attention.num_kv_heads, 1, attention.head_dim)
    return NativeLayer(operands, sample)


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


def _row_kv(
    cache: LayerCache | PagedLayerCache, sample: Tensor, tables: dict[int, native.BlockTable]
) -> native.ContiguousKV | native.PagedKV:
    """Where one sequence's token goes and what it reads in one layer: a paged cache's own
    blocks (no copy), else a cache's decode slot."""
    if isinstance(cache, PagedLayerCache):
        slot = cache.decode_blocks()
        assert slot is not None  # `_layers` checked the cache takes decode slots
        table = tables.get(id(slot.table))
        if table is None:
            table = tables[id(slot.table)] = native.BlockTable(slot.table, slot.keys.shape[0])
        return native.PagedKV(slot.keys, slot.values, table, slot.position, slot.runs)
    decode = cache.decode_slot(sample)
    assert decode is not None  # `_layers` checked the cache takes decode slots
    return native.ContiguousKV(decode.keys, decode.values, decode.slot, decode.length)


def _takes_decode_slots(cache: LayerCache) -> bool:
    takes = getattr(cache, "takes_decode_slots", None)
    return takes is not None and takes()
