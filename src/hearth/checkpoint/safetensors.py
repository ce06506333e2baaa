"""HF-format directory: config.json plus one or sharded safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open

from hearth.errors import CheckpointError

if TYPE_CHECKING:
    from hearth.tokenizer import Tokenizer

# Prefixes of the text decoder in the layouts we read, longest first.
_DECODER_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
# Towers and buffers a text-only runtime skips.
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "audio_tower.",
    "embed_vision.",
    "embed_audio.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)


def canonical_name(name: str) -> str | None:
    """The canonical name of an HF tensor name, or None for tensors a text model skips."""
    if name.startswith(_SKIPPED_PREFIXES) or "rotary_emb" in name:
        return None
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for prefix in _DECODER_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


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

    @cached_property
    def config(self) -> dict[str, Any]:
        config = _read_json(self.path / "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{self.path / 'config.json'} is not a JSON object")
        # Multimodal checkpoints nest the decoder's config.
        text = config.get("text_config")
        return (
            {**text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}
            if isinstance(text, dict)
            else config
        )

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

    def tensor_names(self) -> list[str]:
        return [n for n in map(canonical_name, self._files) if n is not None]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name, file in self._files.items():
            by_file.setdefault(file, []).append(name)
        for file, names in by_file.items():
            with self._open(file) as handle:
                for name in names:
                    canonical = canonical_name(name)
                    if canonical is None:
                        continue
                    try:
                        yield canonical, handle.get_tensor(name)
                    except SafetensorError as error:
                        raise CheckpointError(
                            f"{file}: tensor {name} is corrupt: {error}"
                        ) from None

    @cached_property
    def generation_config(self) -> dict[str, Any]:
        path = self.path / "generation_config.json"
        return _read_json(path) if path.exists() else {}

    def tokenizer(self) -> Tokenizer:
        from hearth.tokenizer import Tokenizer

        return Tokenizer.from_directory(self.path)
