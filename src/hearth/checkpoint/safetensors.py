"""HF-format directory: config.json plus one or sharded safetensors files."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from hearth.errors import CheckpointError
from hearth.quant.mlx import parse_quantization

if TYPE_CHECKING:
    from hearth.tokenizer import Tokenizer

# Prefixes of the text decoder in the layouts we read, longest first.
_DECODER_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# Tensors Hearth does not read. The vision and audio towers and their `embed_*` projections
# load (canonical names `vision_tower.*`, `embed_vision.*`, `audio_tower.*`, `embed_audio.*`:
# HF's `model.` prefix dropped, mlx-vlm's kept as they are).
_SKIPPED_PREFIXES = (
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)
# A multimodal config.json's top-level fields that the model reads beside its text_config.
_MULTIMODAL_KEYS = (
    "vision_config",
    "audio_config",
    "image_token_id",
    "boi_token_id",
    "eoi_token_id",
    "audio_token_id",
    "boa_token_id",
    "eoa_token_id",
    "eoa_token_index",
)
# K/V tensors of a layer; Gemma 4's KV-sharing layers never read theirs, which releases keep.
_LAYER_KV = re.compile(r"layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm)\.")
# Keys of MLX's config.json `quantization` that are settings; the others are module paths.
_QUANTIZATION_SETTINGS = ("group_size", "bits", "mode")
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_SCALE_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# MLX nests Gemma 4's expert projections in a SwitchGLU; canonical names drop that level.
_MLX_EXPERTS = ".experts.switch_glu."
# HF's stacked expert tensors and the canonical parts they hold, stacked along dim -2.
_HF_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_HF_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")


def canonical_name(name: str) -> str | None:
    """The canonical name of an HF tensor name, or None for tensors a text model skips."""
    if name.startswith(_SKIPPED_PREFIXES) or "rotary_emb" in name:
        return None
    if name.startswith(("lm_head.", "language_model.lm_head.")):
        return name[name.index("lm_head.") :]  # also an MLX head's .scales and .biases
    name = name.replace(_MLX_EXPERTS, ".experts.")
    for prefix in _DECODER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def is_layer_kv(canonical: str) -> int | None:
    """The layer index of a K/V projection or K norm tensor, else None."""
    kv = _LAYER_KV.match(canonical)
    return int(kv[1]) if kv else None


def expert_parts(name: str) -> tuple[str, ...]:
    """The canonical tensors that tensor `name` holds: itself, or HF's experts' parts.

    Canonical checkpoints hold each expert projection apart, as MLX does
    (`layers.0.experts.gate_proj.weight` [E, I, H]); HF stacks gate and up ([E, 2·I, H])
    and names its weights without `.weight`.
    """
    stacked = _HF_EXPERTS.match(name)
    if stacked is None:
        return (name,)
    return tuple(f"{stacked[1]}.{part}.weight" for part in _HF_EXPERT_PARTS[stacked[2]])


# safetensors' dtype names (from a file's header) as torch dtypes.
_STORED_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


def _meta_tensor(handle: Any, name: str) -> torch.Tensor:
    """A meta tensor of the stored tensor's shape and dtype, from the header alone."""
    piece = handle.get_slice(name)
    stored = piece.get_dtype()
    if stored not in _STORED_DTYPES:
        raise CheckpointError(f"tensor {name} has the unsupported dtype {stored}")
    return torch.empty(tuple(piece.get_shape()), dtype=_STORED_DTYPES[stored], device="meta")


def torch_conv_layout(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An audio-tower convolution weight in torch's layout: mlx-vlm stores Conv2d weights as
    [out, kH, kW, in] and depthwise Conv1d ones as [out, k, in], told apart from torch's
    [out, in, 3, 3] and [out, 1, k] by their shapes (the tower's 3x3 kernels, and its inputs of
    1 or 128 channels, never 3)."""
    if not name.startswith("audio_tower."):
        return tensor
    shape = tuple(tensor.shape)
    conv2d = name.endswith(".conv.weight") and len(shape) == 4
    if conv2d and shape[1:3] == (3, 3) and shape[3] != 3:
        return tensor.permute(0, 3, 1, 2)
    if name.endswith("depthwise_conv1d.weight") and len(shape) == 3 and shape[1] != 1:
        return tensor.permute(0, 2, 1)
    return tensor


def split_expert_parts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) of each part that tensor `name` holds (see `expert_parts`)."""
    parts = expert_parts(name)
    pieces = tensor.chunk(len(parts), dim=-2) if len(parts) > 1 else (tensor,)
    yield from zip(parts, pieces, strict=True)


def _canonical_quantization(quantization: dict[str, Any]) -> dict[str, Any]:
    """MLX's `quantization` with per-module keys (MLX module paths) made canonical."""
    canonical: dict[str, Any] = {}
    for key, entry in quantization.items():
        if key in _QUANTIZATION_SETTINGS:
            canonical[key] = entry
        elif (name := canonical_name(f"{key}.weight")) is not None:
            canonical[name.removesuffix(".weight")] = entry
    return canonical


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None


class SafetensorsCheckpoint:
    """A directory with config.json and model*.safetensors (single or sharded)."""

    format = "safetensors"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.config  # noqa: B018 -- fail now, not at first use
        try:
            parse_quantization(self.config)
        except CheckpointError as error:
            raise CheckpointError(f"{path / 'config.json'}: {error}") from None

    @cached_property
    def config(self) -> dict[str, Any]:
        config = _read_json(self.path / "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{self.path / 'config.json'} is not a JSON object")
        # Multimodal checkpoints nest the decoder's config.
        text = config.get("text_config")
        if isinstance(text, dict):
            text = {**text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}
            # MLX (and HF quantizers) keep the quantization at the top level, and the towers'
            # configs and media token ids live there too.
            for key in ("quantization", "quantization_config", *_MULTIMODAL_KEYS):
                if key in config:
                    text[key] = config[key]
            config = text
        if isinstance(config.get("quantization"), dict):
            config["quantization"] = _canonical_quantization(config["quantization"])
        if "use_double_wide_mlp" not in config and config.get("num_kv_shared_layers"):
            config["use_double_wide_mlp"] = self._mlp_is_double_wide(config)
        return config

    def _mlp_is_double_wide(self, config: dict[str, Any]) -> bool:
        """A Gemma 4 config without the flag: the first KV-sharing layer's MLP width says."""
        layer = int(config["num_hidden_layers"]) - int(config["num_kv_shared_layers"])
        wanted = f"layers.{layer}.mlp.gate_proj.weight"
        for name, file in self._files.items():
            if canonical_name(name) == wanted:
                with self._open(file) as handle:
                    rows = handle.get_slice(name).get_shape()[0]
                return rows == 2 * int(config["intermediate_size"])
        return False

    @cached_property
    def _files(self) -> dict[str, Path]:
        """Each tensor name -> the file that holds it."""
        index_path = self.path / "model.safetensors.index.json"
        if index_path.exists():
            weight_map = _read_json(index_path).get("weight_map", {})
            missing = sorted({f for f in weight_map.values() if not (self.path / f).exists()})
            if missing:
                raise CheckpointError(f"{self.path}: missing shard {missing[0]}")
            return {name: self.path / file for name, file in weight_map.items()}
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path} has no .safetensors files")
        mapping: dict[str, Path] = {}
        for file in files:
            with self._open(file) as handle:
                mapping.update(dict.fromkeys(handle.keys(), file))
        return mapping

    def _open(self, file: Path) -> Any:
        try:
            return safe_open(file, framework="pt")
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file} is not a readable safetensors file: {error}") from None

    @cached_property
    def _first_kv_shared_layer(self) -> float:
        shared = self.config.get("num_kv_shared_layers") or 0
        return self.config.get("num_hidden_layers", 0) - shared if shared else math.inf

    def _canonical(self, name: str) -> str | None:
        """`canonical_name`, also None for the unused K/V of Gemma 4 KV-sharing layers."""
        canonical = canonical_name(name)
        if canonical is None:
            return None
        kv = is_layer_kv(canonical)
        return None if kv is not None and kv >= self._first_kv_shared_layer else canonical

    def tensor_names(self) -> list[str]:
        names = (n for n in map(self._canonical, self._files) if n is not None)
        return [part for name in names for part in expert_parts(name)]

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = (), meta: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        del dtype  # stored as they are: the loader casts float tensors, packed ones stay packed
        by_file: dict[Path, list[str]] = {}
        for name, file in self._files.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with self._open(file) as handle:
                for name in names:
                    canonical = self._canonical(name)
                    if canonical is None or canonical in skip:
                        continue
                    try:
                        tensor = _meta_tensor(handle, name) if meta else handle.get_tensor(name)
                    except SafetensorError as error:
                        raise CheckpointError(
                            f"{file}: tensor {name} is corrupt: {error}"
                        ) from None
                    yield from split_expert_parts(canonical, torch_conv_layout(canonical, tensor))

    @cached_property
    def quantized_dtype(self) -> torch.dtype | None:
        """The dtype of the MLX scales, which packed weights dequantize in; None if unpacked."""
        for name, file in self._files.items():
            if name.endswith(".scales"):
                with self._open(file) as handle:
                    stored = handle.get_slice(name).get_dtype()  # from the header only
                return _SCALE_DTYPES.get(stored)
        return None

    def tensor_storage(self) -> dict[str, tuple[tuple[int, ...], int, str]]:
        """Each stored tensor's (shape, bytes, dtype name), from the file headers only."""
        storage = {}
        for name, file in self._files.items():
            canonical = self._canonical(name)
            if canonical is None:
                continue
            with self._open(file) as handle:
                view = handle.get_slice(name)
                shape, dtype = tuple(view.get_shape()), view.get_dtype()
            storage[canonical] = (shape, math.prod(shape) * _DTYPE_BYTES[dtype], dtype)
        return storage

    @cached_property
    def stored_dtype(self) -> torch.dtype | None:
        """The dtype weights compute in by default: the MLX scales' for packed checkpoints,
        else the first floating tensor's."""
        if self.quantized_dtype is not None:
            return self.quantized_dtype
        for _, _, dtype in self.tensor_storage().values():
            if dtype in _SCALE_DTYPES:
                return _SCALE_DTYPES[dtype]
        return None

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        path = self.path / "generation_config.json"
        return _read_json(path) if path.exists() else {}

    def tokenizer(self) -> Tokenizer:
        from hearth.tokenizer import Tokenizer

        return Tokenizer.from_directory(self.path)
