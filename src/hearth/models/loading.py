"""Build a model from a checkpoint: the config picks the class, tensors load by name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from hearth.checkpoint import Checkpoint
from hearth.config import Gemma3Config, ModelConfig, parse_config
from hearth.errors import CheckpointError
from hearth.models.gemma import Gemma3Model, StackedLinear
from hearth.models.gemma4 import Gemma4Model
from hearth.quant.mlx import (
    PACKED_TENSORS,
    AffineSpec,
    MLXQuantization,
    MLXQuantizedEmbedding,
    MLXQuantizedLinear,
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
) -> Gemma3Model | Gemma4Model:
    """The model of `checkpoint` in `dtype` on `device`; every parameter must come from the file.

    MLX-quantized modules stay packed (their scales and biases keep the file's dtype, so their
    weights dequantize exactly as mlx's); every other tensor is cast to `dtype`.
    """
    config = parse_config(checkpoint.config)
    quantization = parse_quantization(checkpoint.config)
    if quantize is not None and quantization is not None:
        raise ValueError(f"{checkpoint.path} is already quantized (MLX affine): drop {quantize!r}")
    with torch.device("meta"):
        model = _model_class(config)(config, dtype)
    expected = _expected_shapes(model)
    names = [name for name in checkpoint.tensor_names() if not _is_tied_head(name, config)]
    packed_modules = quantization.quantized_modules(names) if quantization else set()
    loaded: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    tensors = tqdm(
        checkpoint.tensors(),
        total=len(names),
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
    packed_weights = {f"{module}.weight" for module in packed_modules}
    missing = sorted(set(expected) - set(loaded) - packed_weights)
    if missing:
        raise CheckpointError(f"{checkpoint.path}: missing tensor {missing[0]!r}")
    if quantization is not None:
        parts = _packed_parts(packed, packed_modules, expected, quantization, checkpoint.path)
        _install_packed(model, parts, loaded, dtype, checkpoint.path)
    model.load_state_dict(_state_dict(model, loaded), assign=True, strict=True)
    model = model.to(device).eval()
    if quantize is not None:
        quantize_weights(model, quantize)
    return model


def _model_class(config: ModelConfig) -> type[Gemma3Model | Gemma4Model]:
    return Gemma3Model if isinstance(config, Gemma3Config) else Gemma4Model


def _is_tied_head(name: str, config: ModelConfig) -> bool:
    return config.tie_word_embeddings and name.startswith("lm_head.")


def _stacked(model: Gemma3Model) -> dict[str, StackedLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, StackedLinear)}


def _expected_shapes(model: Gemma3Model) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor the model needs, by canonical name, with its shape."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for prefix, module in _stacked(model).items():
        del shapes[f"{prefix}.proj.weight"]
        parent = prefix.rsplit(".", 1)[0]
        for part, rows in module.parts.items():
            shapes[f"{parent}.{part}.weight"] = (rows, module.proj.in_features)
    return shapes


def _state_dict(model: Gemma3Model, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Float tensors with each StackedLinear's parts concatenated, plus the packed buffers."""
    state = dict(loaded)
    for prefix, module in _stacked(model).items():
        if not isinstance(module.proj, nn.Linear):
            continue  # already built from packed parts
        parent = prefix.rsplit(".", 1)[0]
        parts = [state.pop(f"{parent}.{part}.weight") for part in module.parts]
        state[f"{prefix}.proj.weight"] = torch.cat(parts)
    for name, module in model.named_modules():
        if isinstance(module, MLXQuantizedLinear | MLXQuantizedEmbedding):
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
    model: Gemma3Model,
    parts: dict[str, _PackedPart],
    loaded: dict[str, torch.Tensor],
    dtype: torch.dtype,
    path: Path,
) -> None:
    """Swap in packed modules; stacked parts share one packed matrix when quantized alike.

    Parts quantized differently (or some not at all) cannot share one: they are dequantized
    into `loaded` in `dtype` and stacked as floats.
    """
    parts = dict(parts)
    for prefix, stacked in _stacked(model).items():
        parent = prefix.rsplit(".", 1)[0]
        names = [f"{parent}.{part}" for part in stacked.parts]
        found = {name: parts.pop(name) for name in names if name in parts}
        if not found:
            continue
        if len(found) == len(names) and _share_layout(list(found.values())):
            model.set_submodule(f"{prefix}.proj", _stack_packed(list(found.values())))
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


def _stack_packed(parts: list[_PackedPart]) -> MLXQuantizedLinear:
    """One packed linear of parts stacked along the output dim (rows are independent)."""
    weight, scales, biases = (
        torch.cat([part.tensors[index] for part in parts], dim=-2) for index in range(3)
    )
    spec = parts[0].spec
    return MLXQuantizedLinear(weight, scales, biases, spec.bits, spec.group_size)


def quantize_weights(model: Gemma3Model, mode: str) -> None:
    """Keep weights int8/int4 in memory (CPU weight-only kernels); the tied table becomes int8."""
    from hearth.quant import QuantizedEmbeddingHead, quantize_model
    from hearth.quant.cpu import QUANT_MODES

    if mode not in QUANT_MODES:
        raise ValueError(
            f"unknown weight quantization {mode!r} (choose from {', '.join(QUANT_MODES)})"
        )
    if model.compute_dtype != torch.bfloat16:
        raise ValueError("weight quantization computes in bfloat16: use --dtype bfloat16")
    quantize_model(model, mode)
    if model.config.tie_word_embeddings:
        model.embed_tokens = QuantizedEmbeddingHead.from_float(model.embed_tokens.weight)
