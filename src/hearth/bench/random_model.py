"""Models with random weights at real shapes, built directly on the device.

Speed depends on shapes and dtypes, not on values, so a benchmark needs no checkpoint: a
preset (or any config.json) gives the shapes, and the weights are drawn where they will live
(a 31B model never passes through host memory). `quant="4bit"|"8bit"` builds MLX affine
packed modules from random words and random scales/biases, as an mlx-community checkpoint
would load: every linear layer, expert stack and token table whose width packs.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hearth.config import parse_config
from hearth.errors import HearthError
from hearth.layers.affine import MLXQuantizedEmbedding, MLXQuantizedExperts, MLXQuantizedLinear
from hearth.layers.embedding import Embedding
from hearth.layers.norm import RMSNorm
from hearth.models import Model, model_class
from hearth.models.gemma4 import Experts
from hearth.models.presets import GEMMA4_PRESETS
from hearth.quant.mlx import DEFAULT_GROUP_SIZE, WORD_BITS

# Gemma 3 12B text shapes (google/gemma-3-12b), for comparison with llama.cpp's numbers.
GEMMA3_12B: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262_208,
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
}
# Gemma 3 270M (google/gemma-3-270m), the embedded model's shapes.
GEMMA3_270M: dict[str, Any] = {
    "model_type": "gemma3_text",
    "vocab_size": 262_144,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
PRESETS: dict[str, dict[str, Any]] = {
    "gemma3-270m": GEMMA3_270M,
    "gemma3-12b": GEMMA3_12B,
    **GEMMA4_PRESETS,
}

QUANT_BITS: dict[str, int | None] = {"bf16": None, "8bit": 8, "4bit": 4}
# Standard deviation of every random weight (HF's initializer_range): magnitudes only need
# to keep activations finite; speed does not depend on them.
WEIGHT_STD = 0.02

__all__ = [
    "GEMMA3_12B",
    "GEMMA3_270M",
    "PRESETS",
    "QUANT_BITS",
    "build_random",
    "build_random_model",
    "quantize_4bit",
    "resolve_config",
]


def resolve_config(spec: str) -> dict[str, Any]:
    """The config dict of a preset name, or of a config.json (or a directory holding one).

    Raises HearthError with one line for an unknown name or an unreadable/invalid file.
    """
    if spec in PRESETS:
        return copy.deepcopy(PRESETS[spec])
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise HearthError(
            f"--random {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json"
        )
    try:
        config = json.loads(path.read_text())
    except OSError as error:
        raise HearthError(f"cannot read {path}: {error.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise HearthError(f"{path} is not a JSON config: {error}") from None
    if not isinstance(config, dict):
        raise HearthError(f"{path} is not a JSON object")
    parse_config(config)  # unsupported or incomplete configs fail here, with one line
    return config


def build_random_model(
    config: dict[str, Any],
    device: str | torch.device,
    quant: str = "bf16",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Model:
    """A model of `config` with random weights drawn on `device`, computing in `dtype`.

    Parameters get what the loader would give them: matrices in `dtype`, norm weights fp32.
    """
    if quant not in QUANT_BITS:
        raise ValueError(f"unknown quant {quant!r} (choose from {', '.join(QUANT_BITS)})")
    device = torch.device(device)
    parsed = parse_config(config)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = model_class(parsed)(parsed, dtype)
    bits = QUANT_BITS[quant]
    if bits is not None:
        _pack_randomly(model, bits, dtype, device)
    _materialize(model, dtype, device)
    return model.to(device).eval()


def build_random(preset: dict[str, Any], device: torch.device) -> nn.Module:
    """A bf16 model with random weights (benchmarks/gpu_decode.py's entry point)."""
    return build_random_model(preset, device)


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter by a random (matrices) or unit (norms, scalars) tensor."""
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None or not parameter.is_meta:
                continue
            shape = tuple(parameter.shape)
            if isinstance(module, RMSNorm):
                # Gemma 3 keeps 1 + w here, Gemma 4 w: ones are a plausible value for both.
                value = torch.ones(shape, dtype=torch.float32, device=device)
            elif len(shape) >= 2:
                value = torch.randn(shape, dtype=dtype, device=device) * WEIGHT_STD
            else:  # layer_scalar, router scales
                value = torch.ones(shape, dtype=dtype, device=device)
            setattr(module, name, nn.Parameter(value, requires_grad=False))


def random_packed(
    lead: tuple[int, ...],
    in_features: int,
    bits: int,
    dtype: torch.dtype,
    device: torch.device,
    group_size: int = DEFAULT_GROUP_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MLX affine (packed uint32, scales, biases) for a weight [*lead, in_features].

    Codes are uniform over 0..2^bits-1; scales are sized so the weights have a standard
    deviation near WEIGHT_STD, and biases centre them on zero.
    """
    words = in_features * bits // WORD_BITS
    raw = torch.randint(0, 256, (*lead, words * 4), dtype=torch.uint8, device=device)
    packed = raw.view(torch.uint32)
    levels = (1 << bits) - 1
    code_std = ((levels + 1) ** 2 - 1) ** 0.5 / 12**0.5  # std of a uniform code
    groups = (*lead, in_features // group_size)
    scales = (torch.rand(groups, device=device) + 0.5) * (WEIGHT_STD / code_std)
    biases = -scales * (levels / 2)
    return packed, scales.to(dtype), biases.to(dtype)


def _packs(in_features: int, bits: int) -> bool:
    return in_features % DEFAULT_GROUP_SIZE == 0 and in_features * bits % WORD_BITS == 0


def _pack_randomly(model: nn.Module, bits: int, dtype: torch.dtype, device: torch.device) -> None:
    """Swap linear layers, expert stacks and token tables for random packed modules."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and _packs(module.in_features, bits):
            tensors = random_packed((module.out_features,), module.in_features, bits, dtype, device)
            model.set_submodule(name, MLXQuantizedLinear(*tensors, bits, DEFAULT_GROUP_SIZE))
        elif isinstance(module, Embedding) and _packs(module.embedding_dim, bits):
            rows = (module.num_embeddings,)
            tensors = random_packed(rows, module.embedding_dim, bits, dtype, device)
            model.set_submodule(name, MLXQuantizedEmbedding(*tensors, bits, DEFAULT_GROUP_SIZE))
        elif isinstance(module, Experts):
            for weight in ("gate_up_proj", "down_proj"):
                *lead, in_features = getattr(module, weight).shape
                if not _packs(in_features, bits):
                    continue
                tensors = random_packed(tuple(lead), in_features, bits, dtype, device)
                delattr(module, weight)  # a parameter until now
                setattr(module, weight, MLXQuantizedExperts(*tensors, bits, DEFAULT_GROUP_SIZE))


def quantize_4bit(model: nn.Module) -> None:
    """Every float linear layer to MLX affine 4-bit, group 64, quantized from its weights.

    The token table stays float (benchmarks/gpu_decode.py's 4-bit rows); `--quant 4bit`
    of `hearth bench` packs it too, as an mlx-community checkpoint does.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            model.set_submodule(name, MLXQuantizedLinear.from_float(module.weight.data, 4, 64))
            del module
