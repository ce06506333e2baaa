"""Build a model from a checkpoint: the config picks the class, tensors load by name."""

from __future__ import annotations

import torch
from tqdm import tqdm

from hearth.checkpoint import Checkpoint
from hearth.config import parse_config
from hearth.errors import CheckpointError
from hearth.models.gemma import Gemma3Model, StackedLinear


def build_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: bool = True,
    quantize: str | None = None,
) -> Gemma3Model:
    """The model of `checkpoint` in `dtype` on `device`; every parameter must come from the file."""
    config = parse_config(checkpoint.config)
    with torch.device("meta"):
        model = Gemma3Model(config)
    expected = _expected_shapes(model)
    loaded: dict[str, torch.Tensor] = {}
    names = checkpoint.tensor_names()
    tensors = tqdm(
        checkpoint.tensors(),
        total=len(names),
        desc="Loading",
        unit="tensor",
        disable=None if progress else True,  # None: only on a terminal
        leave=False,
    )
    for name, tensor in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = expected.get(name)
        if target is None:
            raise CheckpointError(f"{checkpoint.path}: unexpected tensor {name!r}")
        if tuple(tensor.shape) != target:
            raise CheckpointError(
                f"{checkpoint.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {target}"
            )
        loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise CheckpointError(f"{checkpoint.path}: missing tensor {missing[0]!r}")
    model.load_state_dict(_stack_parts(model, loaded), assign=True, strict=True)
    model = model.to(device).eval()
    if quantize is not None:
        quantize_weights(model, quantize)
    return model


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


def _stack_parts(model: Gemma3Model, loaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace the separate part tensors of each StackedLinear by their concatenation."""
    for prefix, module in _stacked(model).items():
        parent = prefix.rsplit(".", 1)[0]
        parts = [loaded.pop(f"{parent}.{part}.weight") for part in module.parts]
        loaded[f"{prefix}.proj.weight"] = torch.cat(parts)
    return loaded


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
