"""Build a model from a checkpoint: the config picks the class, tensors load by name."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from hearth.checkpoint import Checkpoint
from hearth.config import (
    Gemma4UnifiedAudioConfig,
    Gemma4UnifiedVisionConfig,
    ModelConfig,
    parse_config,
)
from hearth.errors import CheckpointError
from hearth.layers.affine import MLXQuantizedEmbedding, MLXQuantizedExperts, MLXQuantizedLinear
from hearth.layers.embedding import Embedding
from hearth.layers.experts import Experts
from hearth.layers.gguf import (
    GGUFEmbeddingHead,
    GGUFKernelLinear,
    GGUFKernelTable,
    GGUFLinear,
    GGUFLookupTable,
)
from hearth.layers.int8 import (
    QUANT_MODES,
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedEmbeddingHead,
    quantized_linear_of_parts,
)
from hearth.layers.linear import StackedLinear
from hearth.models import Model, model_class
from hearth.ops.native import huge_pages
from hearth.ops.plan import ExecutionPlan
from hearth.quant.mlx import (
    PACKED_TENSORS,
    AffineSpec,
    MLXQuantization,
    check_packed_shapes,
    dequantize_affine,
    parse_quantization,
)


def build_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: bool = True,
    quantize: str | None = None,
    plan: ExecutionPlan | None = None,
) -> Model:
    """The model of `checkpoint` in `dtype` on `device`; every parameter must come from the file.

    MLX-quantized modules stay packed (their scales and biases keep the file's dtype, so their
    weights dequantize exactly as mlx's); every other tensor is cast to `dtype`.
    """
    config = _without_absent_towers(parse_config(checkpoint.config), checkpoint)
    quantization = parse_quantization(checkpoint.config)
    if quantize is not None and quantization is not None:
        raise ValueError(f"{checkpoint.path} is already quantized (MLX affine): drop {quantize!r}")
    with torch.device("meta"):
        model = model_class(config)(config, dtype)
    expected = _expected_shapes(model)
    names = [name for name in checkpoint.tensor_names() if not _is_tied_head(name, config)]
    packed_modules = quantization.quantized_modules(names) if quantization else set()
    plan = plan or ExecutionPlan.for_device(device)
    streamed: _StreamedQuantization | _StoredBlockWeights | None = None
    if quantize == STORED_BLOCKS:
        streamed = _StoredBlockWeights(model, checkpoint, torch.device(device), plan)
    elif quantize is not None:
        streamed = _StreamedQuantization(model, quantize, checkpoint)
    in_file = streamed.in_file if streamed is not None else frozenset()
    loaded: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    tensors = tqdm(
        checkpoint.tensors(dtype, skip=in_file),
        total=len(names) - len(in_file),
        desc="Loading",
        unit="tensor",
        disable=None if progress else True,  # None: only on a terminal
        leave=False,
    )
    for name, tensor in tensors:
        if _is_tied_head(name, config):
            continue
        module, _, role = name.rpartition(".")
        if module in packed_modules and role in PACKED_TENSORS:
            packed[name] = tensor.to(device)
            continue
        target = expected.get(name)
        if target is None:
            raise CheckpointError(f"{checkpoint.path}: unexpected tensor {name!r}")
        if tuple(tensor.shape) != target:
            raise CheckpointError(
                f"{checkpoint.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {target}"
            )
        loaded[name] = model.module_tensor(name, tensor.to(device))
        if streamed is not None:
            streamed.take(name, loaded)
    packed_weights = {f"{module}.weight" for module in packed_modules}
    consumed = streamed.consumed if streamed is not None else set()
    missing = sorted(set(expected) - set(loaded) - packed_weights - consumed)
    if missing:
        raise CheckpointError(f"{checkpoint.path}: missing tensor {missing[0]!r}")
    if quantization is not None:
        parts = _packed_parts(packed, packed_modules, expected, quantization, checkpoint.path)
        _install_packed(model, parts, loaded, dtype, checkpoint.path)
    if streamed is not None:
        streamed.install(model)
    model.load_state_dict(_state_dict(model, loaded), assign=True, strict=True)
    loaded.clear()  # the model holds the tensors now: each can be freed once replaced below
    model = model.to(device).eval()
    if plan.huge_pages:
        # Every decode step streams these: huge pages spare the TLB misses (opt-in, see there).
        huge_pages.move_into_huge_pages(
            [(module, name) for module in model.modules() for name in _streamed_weights(module)]
        )
    return model


def _without_absent_towers(config: ModelConfig, checkpoint: Checkpoint) -> ModelConfig:
    """`config` without the towers the file has no weights for: mlx-lm's conversions keep the
    multimodal config.json but drop the towers' weights, and load as text models."""
    names = checkpoint.tensor_names()
    for field, prefix in (("vision", "vision_tower."), ("audio", "audio_tower.")):
        tower = getattr(config, field, None)
        if isinstance(tower, (Gemma4UnifiedVisionConfig, Gemma4UnifiedAudioConfig)):
            prefix = "vision_embedder." if field == "vision" else "embed_audio."  # no tower
        if tower is not None and not any(name.startswith(prefix) for name in names):
            config = dataclasses.replace(config, **{field: None})  # type: ignore[type-var]
    return config


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor a checkpoint of `config` holds, with its shape (no memory used)."""
    with torch.device("meta"):
        return _expected_shapes(model_class(config)(config))


# Modules that the loader builds whole; their tensors join the state dict as they are.
_INSTALLED_MODULES = (
    GGUFLinear,  # GGUFKernelLinear and GGUFKernelTable too: subclasses
    GGUFEmbeddingHead,
    GGUFLookupTable,
    MLXQuantizedLinear,
    MLXQuantizedEmbedding,
    MLXQuantizedExperts,
    Int8Linear,
    Int4Linear,
    QuantizedEmbedding,
)


def _is_tied_head(name: str, config: ModelConfig) -> bool:
    return config.tie_word_embeddings and name.startswith("lm_head.")


@dataclass(frozen=True)
class _Stack:
    """Checkpoint modules (`parts`, with their rows) that Hearth keeps as one weight,
    stacked along dim -2 (the output dim, after any expert dim).

    `parameter` is that float weight's name; `target` the module path a packed stack takes.
    """

    target: str
    parameter: str
    parts: dict[str, int]
    packed_kind: type[MLXQuantizedLinear | MLXQuantizedExperts]


def _stacks(model: nn.Module) -> list[_Stack]:
    """The stacked weights of `model`: StackedLinear projections and MoE experts."""
    stacks = []
    for name, module in model.named_modules():
        parent = name.rsplit(".", 1)[0]
        if isinstance(module, StackedLinear):
            parts = {f"{parent}.{part}": rows for part, rows in module.parts.items()}
            target = f"{name}.proj"
            stacks.append(_Stack(target, f"{target}.weight", parts, MLXQuantizedLinear))
        elif isinstance(module, Experts):
            for weight, stacked in module.parts.items():
                parts = {f"{name}.{part}": rows for part, rows in stacked.items()}
                target = f"{name}.{weight}"
                stacks.append(_Stack(target, target, parts, MLXQuantizedExperts))
    return stacks


def _expected_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model needs, by canonical name, with its shape."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for stack in _stacks(model):
        *lead, _, in_features = shapes.pop(stack.parameter)
        for part, rows in stack.parts.items():
            shapes[f"{part}.weight"] = (*lead, rows, in_features)
    return shapes


def _state_dict(model: nn.Module, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float tensors with each stack's parts concatenated, plus the packed buffers."""
    state = dict(loaded)
    for stack in _stacks(model):
        names = [f"{part}.weight" for part in stack.parts]
        if names[0] not in state:
            continue  # already built from packed parts
        parts = [state.pop(name) for name in names]
        # A stack of one (the experts' down_proj) is used as it is, not copied by cat.
        state[stack.parameter] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)
    for name, module in model.named_modules():
        if isinstance(module, _INSTALLED_MODULES):
            state.update({f"{name}.{key}": t for key, t in module.state_dict().items()})
    return state


@dataclass(frozen=True)
class _PackedPart:
    """One MLX-quantized module of the checkpoint: its spec and (packed, scales, biases)."""

    spec: AffineSpec
    tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def dequantize(self) -> torch.Tensor:
        return dequantize_affine(*self.tensors, self.spec.bits, self.spec.group_size)

    def build(self, kind: type[MLXQuantizedLinear | MLXQuantizedEmbedding]) -> nn.Module:
        return kind(*self.tensors, self.spec.bits, self.spec.group_size)


def _packed_parts(
    packed: dict[str, torch.Tensor],
    modules: set[str],
    expected: dict[str, tuple[int, ...]],
    quantization: MLXQuantization,
    path: Path,
) -> dict[str, _PackedPart]:
    """Each packed module's spec (config.json's entry, else its shapes'), shapes checked."""
    parts = {}
    for module in sorted(modules):
        weight_shape = expected.get(f"{module}.weight")
        if weight_shape is None:
            raise CheckpointError(f"{path}: unexpected tensor {module + '.weight'!r}")
        names = [f"{module}.{role}" for role in PACKED_TENSORS]
        absent = [name for name in names if name not in packed]
        if absent:
            raise CheckpointError(f"{path}: missing tensor {absent[0]!r}")
        weight, scales, biases = (packed[name] for name in names)
        try:
            spec = quantization.spec_for(module, weight_shape[-1], weight, scales)
            check_packed_shapes(spec, weight_shape, weight, scales, biases)
        except ValueError as error:
            raise CheckpointError(f"{path}: quantized {module}: {error}") from None
        parts[module] = _PackedPart(spec, (weight, scales, biases))
    return parts


def _install_packed(
    model: nn.Module,
    parts: dict[str, _PackedPart],
    loaded: dict[str, torch.Tensor],
    dtype: torch.dtype,
    path: Path,
) -> None:
    """Swap in packed modules; the parts of a stack share one packed weight when quantized
    alike.

    Parts quantized differently (or some not at all) cannot share one: they are dequantized
    into `loaded` in `dtype` and stacked as floats.
    """
    parts = dict(parts)
    for stack in _stacks(model):
        found = {name: parts.pop(name) for name in stack.parts if name in parts}
        if not found:
            continue
        if len(found) == len(stack.parts) and _share_layout(list(found.values())):
            parent, _, attribute = stack.target.rpartition(".")
            owner = model.get_submodule(parent)
            delattr(owner, attribute)  # an experts weight is a parameter, not a module
            setattr(owner, attribute, _stack_packed(list(found.values()), stack.packed_kind))
            continue
        for name, part in found.items():
            loaded[f"{name}.weight"] = part.dequantize().to(dtype)
    for name, part in parts.items():
        target = model.get_submodule(name)
        if isinstance(target, nn.Embedding):
            model.set_submodule(name, part.build(MLXQuantizedEmbedding))
        elif isinstance(target, nn.Linear):
            model.set_submodule(name, part.build(MLXQuantizedLinear))
        else:
            raise CheckpointError(f"{path}: {name} is packed but Hearth cannot quantize it")


def _share_layout(parts: list[_PackedPart]) -> bool:
    first = parts[0]
    return all(
        part.spec == first.spec and part.tensors[1].dtype == first.tensors[1].dtype
        for part in parts
    )


def _stack_packed(
    parts: list[_PackedPart], kind: type[MLXQuantizedLinear | MLXQuantizedExperts]
) -> MLXQuantizedLinear | MLXQuantizedExperts:
    """One packed weight of parts stacked along the output dim (rows are independent)."""
    weight, scales, biases = (
        torch.cat([part.tensors[index] for part in parts], dim=-2) for index in range(3)
    )
    spec = parts[0].spec
    return kind(weight, scales, biases, spec.bits, spec.group_size)


class _StreamedQuantization:
    """Weight-only int8/int4 for CPU decode, applied while the checkpoint streams in: each
    linear layer (and the tied table and Gemma 4's per-layer table, as int8) is quantized once
    the file has given all of its parts, and its bf16 parts are dropped, so a load never holds
    the whole model in bf16.
    """

    def __init__(self, model: Model, mode: str, checkpoint: Checkpoint) -> None:
        if mode not in QUANT_MODES:
            raise ValueError(
                f"unknown weight quantization {mode!r} (choose from {', '.join(QUANT_MODES)})"
            )
        if model.compute_dtype != torch.bfloat16:
            raise ValueError("weight quantization computes in bfloat16: use --dtype bfloat16")
        self.mode = mode
        # Module path -> the checkpoint weights it is made of, stacked in this order.
        self._parts: dict[str, list[str]] = {}
        stacked = {s.target: s for s in _stacks(model) if s.packed_kind is MLXQuantizedLinear}
        for path, module in model.named_modules():
            # int8/int4 modules have no bias: a biased linear (the audio tower's output) stays.
            if isinstance(module, nn.Linear) and module.bias is None:
                stack = stacked.get(path)
                parts = [f"{p}.weight" for p in stack.parts] if stack else [f"{path}.weight"]
                self._parts[path] = parts
        self._tied_table = "embed_tokens" if model.config.tie_word_embeddings else None
        if self._tied_table:
            self._parts[self._tied_table] = [f"{self._tied_table}.weight"]
        self.modules: dict[str, nn.Module] = {}
        # Checkpoint tensors taken care of here: the loader expects no other module to hold them.
        self.consumed: set[str] = set()
        # Gemma 4's per-layer table: the largest tensor of E2B/E4B, whose rows a step looks up.
        # Left in a GGUF file where its blocks allow (no load, no resident memory), else int8
        # groups (kept in bf16 if its rows are not whole groups).
        self._lookup_table = "embed_tokens_per_layer"
        table = getattr(model, self._lookup_table, None)
        weight = f"{self._lookup_table}.weight"
        mapped = getattr(checkpoint, "mapped_table", None)
        in_place = None if table is None or mapped is None else mapped(weight)
        if in_place is not None:
            self.modules[self._lookup_table] = in_place
            self.consumed.add(weight)
        elif table is not None and table.embedding_dim % QuantizedEmbedding.GROUP == 0:
            self._parts[self._lookup_table] = [weight]
        # Tensors left in the file: the loader does not read them at all.
        self.in_file = frozenset(self.consumed)
        self._module_of = {part: path for path, parts in self._parts.items() for part in parts}

    def take(self, name: str, loaded: dict[str, torch.Tensor]) -> None:
        """Quantize the module `name` completes, moving its parts out of `loaded`."""
        path = self._module_of.get(name)
        if path is None or any(part not in loaded for part in self._parts[path]):
            return
        parts = [loaded.pop(part) for part in self._parts[path]]
        self.consumed.update(self._parts[path])
        with torch.no_grad():
            if path == self._tied_table:
                self.modules[path] = QuantizedEmbeddingHead.from_float(parts[0])
            elif path == self._lookup_table:
                self.modules[path] = QuantizedEmbedding.from_float(parts[0])
            else:
                # Stacked parts (q/k/v, gate/up) are quantized apart and their codes stacked.
                self.modules[path] = quantized_linear_of_parts(parts, self.mode)

    def install(self, model: nn.Module) -> None:
        for path, module in self.modules.items():
            model.set_submodule(path, module)


# `build_model`'s `quantize` value for GGUF blocks kept as stored (`hearth.layers.gguf`).
STORED_BLOCKS = "stored"


class _StoredBlockWeights:
    """GGUF weights computed on as the file stores them: every linear layer whose parts are
    all of a block type `hearth.quant.gguf_blocks` knows (and the tied table) keeps its blocks,
    copied out of the file once; Gemma 4's per-layer table stays in the file's memory map.
    Float tensors (F32/F16/BF16) load as values; the loader never reads the kept ones.
    Under a plan with `gguf_block_kernels` (CUDA) the blocks go to `device` as they are read,
    the layers are the Triton kernels' (`GGUFKernelLinear`), and the per-layer table is
    copied to the device too (a lookup reads the ids where they are: no sync).
    """

    def __init__(
        self, model: Model, checkpoint: Checkpoint, device: torch.device, plan: ExecutionPlan
    ) -> None:
        if getattr(checkpoint, "stored_blocks", None) is None:
            raise ValueError(f"{checkpoint.path} is not a GGUF file: it has no stored blocks")
        self._checkpoint = checkpoint
        self._device = device
        kernels = plan.gguf_block_kernels
        linear_kind = (
            GGUFKernelLinear
            if kernels
            else functools.partial(
                GGUFLinear,
                bf16_gemv_types=plan.gguf_bf16_gemv_types,
                amx_prefill_types=plan.gguf_amx_prefill_types,
                amx_bf16_inputs=plan.gguf_amx_bf16_inputs,
            )
        )
        table_kind = GGUFKernelTable if kernels else GGUFEmbeddingHead
        head_kind = (
            linear_kind
            if kernels
            else functools.partial(linear_kind, amx_decode_rows=plan.gguf_amx_head_rows)
        )
        # On the meta device (a fit's sizing) the blocks are shapes only: nothing is read.
        self._sizing = device.type == "meta"
        self.modules: dict[str, nn.Module] = {}
        self.consumed: set[str] = set()
        stacked = {s.target: s for s in _stacks(model) if s.packed_kind is MLXQuantizedLinear}
        present = set(checkpoint.tensor_names())
        for path, module in model.named_modules():
            if not isinstance(module, nn.Linear) or module.bias is not None:
                continue
            stack = stacked.get(path)
            names = [f"{p}.weight" for p in stack.parts] if stack else [f"{path}.weight"]
            # A name the file lacks (an untied lm_head) is left for the loader to report.
            if not all(name in present for name in names):
                continue
            parts = [self._blocks(name) for name in names]
            if any(part is None for part in parts):
                continue  # float weights: loaded as values
            self.modules[path] = linear_kind(parts, module.in_features)  # type: ignore[arg-type]
            self.consumed.update(names)
        if model.config.tie_word_embeddings:
            table = self._blocks("embed_tokens.weight")
            if table is not None:
                head = head_kind([table], model.config.hidden_size)
                self.modules["embed_tokens"] = table_kind(head)  # type: ignore[arg-type]
                self.consumed.add("embed_tokens.weight")
        per_layer = "embed_tokens_per_layer.weight"
        table_module = getattr(model, "embed_tokens_per_layer", None)
        if table_module is not None and per_layer in present and kernels:
            found = self._blocks(per_layer)
            if found is not None:
                width = table_module.embedding_dim
                self.modules["embed_tokens_per_layer"] = GGUFKernelTable(
                    GGUFKernelLinear([found], width)
                )
                self.consumed.add(per_layer)
        elif table_module is not None and per_layer in present:
            mapped = checkpoint.stored_blocks(per_layer, copy=False)  # type: ignore[attr-defined]
            if mapped is not None:
                type_id, rows = mapped
                width = table_module.embedding_dim
                self.modules["embed_tokens_per_layer"] = GGUFLookupTable(rows, type_id, width)
                self.consumed.add(per_layer)
        self.in_file = frozenset(self.consumed)

    def _blocks(self, name: str) -> tuple[int, torch.Tensor] | None:
        """(type id, blocks) of a checkpoint weight kept as stored; None for float values."""
        stored_blocks = self._checkpoint.stored_blocks  # type: ignore[attr-defined]
        if self._sizing:
            found = stored_blocks(name, copy=False)
            if found is None:
                return None
            type_id, rows = found
            return type_id, torch.empty(rows.shape, dtype=torch.uint8, device="meta")
        found = stored_blocks(name)
        return None if found is None else (found[0], torch.from_numpy(found[1]).to(self._device))

    def take(self, name: str, loaded: dict[str, torch.Tensor]) -> None:
        """Nothing to do as tensors stream in: the kept weights were taken at the start."""

    def install(self, model: nn.Module) -> None:
        for path, module in self.modules.items():
            model.set_submodule(path, module)


def _streamed_weights(module: nn.Module) -> tuple[str, ...]:
    """The weights of `module` that every CPU decode step reads whole (none for most)."""
    if isinstance(module, Int8Linear):
        return ("qweight",)
    if isinstance(module, Int4Linear):
        return ("packed",)
    if isinstance(module, nn.Linear | Embedding):  # Embedding: the tied output head
        return ("weight",)
    return ()
