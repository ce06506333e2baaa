"""`hearth inspect`: what a checkpoint holds, from its headers and config only."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

from hearth.checkpoint import open_checkpoint
from hearth.config import ModelConfig, parse_config
from hearth.kv.footprint import KVFootprint
from hearth.models import cache_specs
from hearth.quant.mlx import parse_quantization

# Canonical-name fragments -> module kind, first match wins.
_KINDS = (
    ("embed_tokens_per_layer", "per-layer embeddings"),
    ("per_layer", "per-layer inputs"),
    ("embed_tokens", "embedding"),
    ("lm_head", "head"),
    ("experts", "experts"),
    ("router", "router"),
    ("self_attn", "attention"),
    ("norm", "norms"),
    ("mlp", "mlp"),
)


# Module classes that hold a model's linear weights packed, and how to name them.
_PACKED_KINDS = (
    ("GGUFLinear", "as-stored GGUF"),
    ("GGUFKernelLinear", "as-stored GGUF"),
    ("MLXQuantizedLinear", "MLX-packed"),
    ("Int8Linear", "int8"),
    ("Int4Linear", "int4"),
)


def held_weights(model: torch.nn.Module) -> str | None:
    """How a loaded model holds its linear weights when not as floats: "as-stored GGUF",
    "int8", "int4", "MLX-packed"; None for float weights."""
    kinds = {type(module).__name__ for module in model.modules()}
    return next((name for kind, name in _PACKED_KINDS if kind in kinds), None)


def module_kind(name: str) -> str:
    return next((kind for fragment, kind in _KINDS if fragment in name), "other")


def _layer_pattern(layer_types: tuple[str, ...]) -> str:
    """Run-length form, e.g. '5 sliding, 1 full (x3)'."""
    runs: list[tuple[str, int]] = []
    for kind in layer_types:
        short = kind.removesuffix("_attention")
        if runs and runs[-1][0] == short:
            runs[-1] = (short, runs[-1][1] + 1)
        else:
            runs.append((short, 1))
    period = next(
        (
            p
            for p in range(1, len(runs) + 1)
            if len(runs) % p == 0 and runs == runs[:p] * (len(runs) // p)
        ),
        len(runs),
    )
    unit = ", ".join(f"{count} {kind}" for kind, count in runs[:period])
    repeats = len(runs) // period
    return f"{unit} (x{repeats})" if repeats > 1 else unit


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return ""


def describe(path: str | Path) -> str:
    """A human-readable summary of the checkpoint at `path`."""
    from hearth.models import model_class

    checkpoint = open_checkpoint(path)
    config = parse_config(checkpoint.config)
    with torch.device("meta"):
        model = model_class(config)(config, torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    storage = checkpoint.tensor_storage()
    by_kind: dict[str, int] = defaultdict(int)
    types: Counter[str] = Counter()
    for name, (_, nbytes, type_name) in storage.items():
        by_kind[module_kind(name)] += nbytes
        types[type_name] += 1
    tied = " (tied head)" if config.tie_word_embeddings else ""
    if checkpoint.format == "gguf":
        quantization = _gguf_quantization(checkpoint.metadata, storage)
    else:
        quantization = _quantization_summary(checkpoint.config)
    lines = [
        f"model: {checkpoint.path}",
        f"format: {checkpoint.format}",
        f"architecture: {config.model_type}, {config.num_hidden_layers} layers, "
        f"hidden {config.hidden_size}, vocab {config.vocab_size}{tied}",
        f"layers: {_layer_pattern(config.layer_types)}; sliding window {config.sliding_window}",
        f"parameters: {parameters / 1e6:,.1f} M",
        f"stored: {_bytes(sum(by_kind.values()))}",
        *(
            f"  {kind}: {_bytes(size)}"
            for kind, size in sorted(by_kind.items(), key=lambda kv: -kv[1])
        ),
        "tensor types: " + ", ".join(f"{name} x{count}" for name, count in types.most_common()),
        f"quantization: {quantization}",
        *(_gguf_memory(storage) if checkpoint.format == "gguf" else []),
        _kv_summary(config),
    ]
    return "\n".join(lines)


def _gguf_memory(storage: dict[str, tuple[tuple[int, ...], int, str]]) -> list[str]:
    """Per GGML type: its tensors and the bytes they take in memory on each device, as a
    default load holds them. Both keep the block types Hearth computes on as stored (the file's
    bytes); the CPU widens float tensors to fp32, a GPU holds them in bf16."""
    from hearth.quant.gguf_blocks import BLOCK_FORMATS

    as_stored = {block.name for block in BLOCK_FORMATS.values()}
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for shape, nbytes, type_name in storage.values():
        values = math.prod(shape)
        row = rows[type_name]
        row[0] += 1
        row[1] += nbytes
        row[2] += nbytes if type_name in as_stored else 4 * values
        row[3] += nbytes if type_name in as_stored else 2 * values
    lines = [
        "in memory by tensor type (blocks as stored; floats in fp32 on the CPU, bf16 on a GPU):"
    ]
    for type_name, (count, stored, cpu, gpu) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        lines.append(
            f"  {type_name}: {count} tensors, {_bytes(stored)} stored; "
            f"CPU {_bytes(cpu)}, GPU {_bytes(gpu)}"
        )
    total_cpu = sum(row[2] for row in rows.values())
    total_gpu = sum(row[3] for row in rows.values())
    lines.append(f"  all: CPU {_bytes(total_cpu)}, GPU {_bytes(total_gpu)}")
    return lines


def _kv_summary(config: ModelConfig) -> str:
    """The dense caches' bytes at a few contexts up to the model's longest, as they allocate
    them (`hearth.kv.footprint`): sliding layers stop at their window."""
    footprint = KVFootprint.of(cache_specs(config), torch.bfloat16)
    longest = config.max_position_embeddings
    contexts = sorted({context for context in (4096, 32768, longest) if context <= longest})
    at = ", ".join(f"{_bytes(footprint.bytes_at(c))} at {c:,} tokens" for c in contexts)
    full = sum(layer.dense for layer in footprint.layers if layer.window is None)
    return (
        f"KV cache in bf16: {at} ({_bytes(full)} a token on full layers; sliding layers keep "
        f"{config.sliding_window})"
    )


# llama.cpp ORs this into general.file_type when the converter guessed the type.
_GUESSED_FILE_TYPE = 1024


def _gguf_quantization(metadata: dict[str, Any], storage: dict[str, tuple[Any, int, str]]) -> str:
    """A GGUF file's quantization as llama.cpp names it (Q4_K_M, Q8_0, F16...): its
    general.file_type, or, without one, the type that holds most of its weight bytes."""
    import gguf

    file_type = metadata.get("general.file_type")
    if isinstance(file_type, int):
        kind = file_type & ~_GUESSED_FILE_TYPE
        try:
            name = gguf.LlamaFileType(kind).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return f"unknown (general.file_type {file_type})"
        return f"{name} (general.file_type {file_type})"
    by_type: Counter[str] = Counter()
    for shape, nbytes, type_name in storage.values():
        if len(shape) >= 2:
            by_type[type_name] += nbytes
    most = by_type.most_common(1)
    return f"mostly {most[0][0]} (no general.file_type)" if most else "none"


def _quantization_summary(raw_config: dict[str, Any]) -> str:
    """MLX affine: the default bits/group and how many modules override it."""
    quantization = parse_quantization(raw_config)
    if quantization is None:
        return "none declared (GGUF files quantize per tensor: see tensor types)"
    default = quantization.default
    overrides = Counter(
        "float" if spec is None else f"{spec.bits}-bit/g{spec.group_size}"
        for spec in quantization.modules.values()
    )
    text = f"MLX affine, {default.bits}-bit, group {default.group_size}"
    if overrides:
        text += "; per module: " + ", ".join(f"{k} x{n}" for k, n in overrides.most_common())
    return text


def describe_plan(device: str | None = None) -> str:
    """The execution plan a load on `device` (None: CUDA if present, else the CPU) gets."""
    from hearth.ops.plan import ExecutionPlan

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = ExecutionPlan.for_device(device).describe()
    return "plan:\n" + "\n".join(f"  {line}" for line in plan.splitlines())
