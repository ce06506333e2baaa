"""llama.cpp's multimodal projector files (`mmproj-*.gguf`): Gemma 4's vision tower beside a
Gemma 4 text model read from its own GGUF file.

An mmproj file is a GGUF of architecture `clip`. llama.cpp's converter (the Gemma 4 mmproj
class of convert_hf_to_gguf.py; the graph in tools/mtmd/models/gemma4v.cpp) writes Gemma 4's
vision tower with projector type `gemma4v` under `v.*` names and `embed_vision`'s projection as
`mm.input_projection`; the reading of each name and layout is in `_vision_name` and
`_hf_layout`. What the file does not store, Hearth takes from llama.cpp's fixed choices for
Gemma 4 (RoPE base 100, pooling 3 unless `clip.vision.projector.scale_factor` says otherwise)
and from the tensors' shapes (head width, KV heads, position table size, clipping and
standardization by the presence of their tensors). The image tokens' ids come from the text
model's vocabulary, as llama.cpp's runtime finds them.

`GGUFWithMmproj` joins the two files into one checkpoint: the config of a multimodal Gemma 4
(`text_config` + `vision_config`) and the tensors of both under canonical names, so that
`build_model` loads the text model and its tower as it does an HF checkpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hearth.checkpoint.gguf import GGUFCheckpoint
from hearth.checkpoint.gguf_file import GGUFFile, TensorInfo
from hearth.errors import CheckpointError, UnsupportedModelError
from hearth.layers.mapped_table import MappedBlockTable

if TYPE_CHECKING:
    from hearth.tokenizer import Tokenizer

log = logging.getLogger("hearth.checkpoint")

MMPROJ_ARCHITECTURE = "clip"
VISION_PROJECTOR = "gemma4v"
AUDIO_PROJECTOR = "gemma4a"
# llama.cpp fixes these for gemma4v (clip.cpp's hparams), as HF's config defaults do.
_VISION_ROPE_THETA = 100.0
_DEFAULT_POOLING = 3
_DEFAULT_EPS = 1e-6
# The text vocabulary's image tokens: the begin, soft-token placeholder and end of an image.
IMAGE_TOKENS = {
    "boi_token_id": "<|image>",
    "image_token_id": "<|image|>",
    "eoi_token_id": "<image|>",
}

# Outside the blocks: llama.cpp name -> canonical name.
_VISION_GLOBAL = {
    "v.patch_embd.weight": "vision_tower.patch_embedder.input_proj.weight",
    "v.position_embd.weight": "vision_tower.patch_embedder.position_embedding_table",
    "v.std_bias": "vision_tower.std_bias",
    "v.std_scale": "vision_tower.std_scale",
    "mm.input_projection.weight": "embed_vision.embedding_projection.weight",
}
# Within `v.blk.{i}.`: the clipped linears (weight and clip scalars) and the norms.
_CLIPPED_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")
_NORMS = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ln1": "input_layernorm",
    "attn_post_norm": "post_attention_layernorm",
    "ln2": "pre_feedforward_layernorm",
    "ffn_post_norm": "post_feedforward_layernorm",
}


def _vision_name(name: str) -> str | None:
    """The canonical name of a vision tensor of an mmproj file; None for any other name."""
    if name in _VISION_GLOBAL:
        return _VISION_GLOBAL[name]
    if not name.startswith("v.blk."):
        return None
    index, _, tail = name.removeprefix("v.blk.").partition(".")
    module, _, role = tail.partition(".")
    if not index.isdigit():
        return None
    prefix = f"vision_tower.encoder.layers.{index}"
    if module in _CLIPPED_LINEARS and role == "weight":
        return f"{prefix}.{_CLIPPED_LINEARS[module]}.linear.weight"
    if module in _CLIPPED_LINEARS and role in _CLIP_BOUNDS:
        return f"{prefix}.{_CLIPPED_LINEARS[module]}.{role}"
    if module in _NORMS and role == "weight":
        return f"{prefix}.{_NORMS[module]}.weight"
    return None


def _hf_layout(canonical: str, values: torch.Tensor) -> torch.Tensor:
    """A tensor as the converter stored it, back in HF's layout: the patch embedding was made a
    conv kernel [hidden, 3, p, p] from HF's [hidden, p·p·3] (rows, then columns, then channels
    within a patch); the clip scalars were made 1-D."""
    if canonical.endswith("patch_embedder.input_proj.weight"):
        return values.permute(0, 2, 3, 1).reshape(values.shape[0], -1)
    if canonical.rpartition(".")[2] in _CLIP_BOUNDS:
        return values.reshape(())
    return values


def _shortest(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-6, not 9.99e-7)."""
    return float(str(np.float32(value)))


def find_sibling_mmproj(model: Path) -> Path | None:
    """The one `mmproj*.gguf` beside a model GGUF file (or inside a model folder), as LM Studio
    and llama.cpp's releases lay them out; None when there is none, or more than one (then the
    log says to name one with --mmproj)."""
    folder = model if model.is_dir() else model.parent
    found = sorted(p for p in folder.glob("*.gguf") if is_mmproj_name(p))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        log.warning("several mmproj files beside the model (%s): none is used; name one", names)
        return None
    return found[0] if found else None


def is_mmproj_name(path: Path) -> bool:
    return path.name.lower().startswith("mmproj")


class MmprojFile:
    """An mmproj GGUF's Gemma 4 vision tower: its HF-style config and canonical tensors."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = GGUFFile(path)
        architecture = self._file.metadata.get("general.architecture")
        if architecture != MMPROJ_ARCHITECTURE:
            raise CheckpointError(
                f"{path} is not an mmproj file: its GGUF architecture is {architecture!r}, "
                f"not {MMPROJ_ARCHITECTURE!r} (a multimodal projector from llama.cpp's converter)"
            )
        meta = self._file.metadata
        self.vision_projector = meta.get("clip.vision.projector_type") or (
            meta.get("clip.projector_type") if meta.get("clip.has_vision_encoder") else None
        )
        self.audio_projector = meta.get("clip.audio.projector_type") or (
            meta.get("clip.projector_type") if meta.get("clip.has_audio_encoder") else None
        )
        if self.vision_projector != VISION_PROJECTOR:
            found = self.vision_projector or self.audio_projector or meta.get("clip.projector_type")
            raise UnsupportedModelError(
                f"{path}: projector type {found!r} is not supported: Hearth reads Gemma 4's "
                f"vision tower ({VISION_PROJECTOR!r}) from mmproj files"
            )

    @property
    def metadata(self) -> dict[str, Any]:
        return self._file.metadata

    def _key(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"clip.vision.{key}", default)
        if value is None:
            raise CheckpointError(f"{self.path}: mmproj metadata lacks clip.vision.{key}")
        return value

    def _info(self, name: str) -> TensorInfo:
        info = self._file.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: mmproj file lacks tensor {name!r}")
        return info

    @cached_property
    def _vision_tensors(self) -> dict[str, TensorInfo]:
        """Canonical name -> stored tensor, for every `v.*` and `mm.*` tensor of the file."""
        found = {}
        for name, info in self._file.tensors.items():
            if not name.startswith(("v.", "mm.")):
                continue  # the audio tower (`a.*`), read elsewhere or not at all
            canonical = _vision_name(name)
            if canonical is None:
                raise UnsupportedModelError(
                    f"{self.path}: unknown {VISION_PROJECTOR} tensor {name!r}"
                )
            found[canonical] = info
        return found

    def vision_config(self) -> dict[str, Any]:
        """HF's `vision_config` fields of the tower, from the metadata and the tensors' shapes."""
        hidden = int(self._key("embedding_length"))
        heads = int(self._key("attention.head_count"))
        head_dim = self._info("v.blk.0.attn_q_norm.weight").shape[0]
        key_rows = self._info("v.blk.0.attn_k.weight").shape[0]
        return {
            "model_type": "gemma4_vision",
            "hidden_size": hidden,
            "intermediate_size": int(self._key("feed_forward_length")),
            "num_hidden_layers": int(self._key("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": key_rows // head_dim,
            "head_dim": head_dim,
            "rms_norm_eps": _shortest(self._key("attention.layer_norm_epsilon", _DEFAULT_EPS)),
            "rope_parameters": {"rope_theta": _VISION_ROPE_THETA},
            "patch_size": int(self._key("patch_size")),
            "pooling_kernel_size": int(self._key("projector.scale_factor", _DEFAULT_POOLING)),
            "position_embedding_size": self._info("v.position_embd.weight").shape[1],
            "use_clipped_linears": "v.blk.0.attn_q.input_min" in self._file.tensors,
            "standardize": "v.std_bias" in self._file.tensors,
        }

    @property
    def projection_width(self) -> int:
        """The text hidden size the tower projects into."""
        return self._info("mm.input_projection.weight").shape[0]

    def tensor_names(self) -> list[str]:
        return list(self._vision_tensors)

    def tensor_storage(self) -> dict[str, tuple[tuple[int, ...], int, str]]:
        import gguf

        return {
            canonical: (
                tuple(_hf_layout(canonical, torch.empty(info.shape, device="meta")).shape),
                info.nbytes,
                gguf.GGMLQuantizationType(info.type_id).name,
            )
            for canonical, info in self._vision_tensors.items()
        }

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = (), meta: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each canonical tensor in HF's layout, dequantized exactly (fp32) and then cast to
        `dtype`; the towers are small, so each is read whole."""
        for canonical, info in self._vision_tensors.items():
            if canonical in skip:
                continue
            if meta:
                shaped = torch.empty(info.shape, dtype=dtype or torch.float32, device="meta")
                yield canonical, _hf_layout(canonical, shaped)
                continue
            values = _hf_layout(canonical, self._dequantize(info))
            yield canonical, values.to(dtype) if dtype is not None else values

    def _dequantize(self, info: TensorInfo) -> torch.Tensor:
        import gguf

        quant_type = gguf.GGMLQuantizationType(info.type_id)
        try:
            values = gguf.quants.dequantize(np.array(self._file.raw(info)), quant_type)
        except NotImplementedError:
            raise UnsupportedModelError(
                f"{self.path}: tensor {info.name} uses {quant_type.name}, "
                "which Hearth cannot dequantize"
            ) from None
        return torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(info.shape)


class GGUFWithMmproj:
    """A Gemma 4 text model's GGUF file and the mmproj file of its vision tower, read as one
    multimodal checkpoint (HF's `Gemma4ForConditionalGeneration` config and names)."""

    format = "gguf"
    stored_dtype = None

    def __init__(self, text: GGUFCheckpoint, mmproj: MmprojFile) -> None:
        if text.architecture != "gemma4":
            raise UnsupportedModelError(
                f"{mmproj.path} holds a Gemma 4 vision tower, but {text.path} is a "
                f"{text.architecture} model, which Hearth runs as text only"
            )
        hidden = int(text.config["hidden_size"])
        declared = mmproj.metadata.get("clip.vision.projection_dim", mmproj.projection_width)
        if mmproj.projection_width != hidden or int(declared) != hidden:
            raise CheckpointError(
                f"{mmproj.path} does not fit {text.path.name}: its tower projects into "
                f"{mmproj.projection_width} dims, the text model's hidden size is {hidden} "
                "(the mmproj file belongs to another model)"
            )
        self.text = text
        self.mmproj = mmproj
        self.path = text.path
        if mmproj.audio_projector is not None:
            log.warning(
                "%s: its audio tower (%s) is not read yet: the model takes images, not audio",
                mmproj.path.name,
                mmproj.audio_projector,
            )

    @property
    def metadata(self) -> dict[str, Any]:
        """The text model's metadata (its quantization, its tokenizer)."""
        return self.text.metadata

    @cached_property
    def config(self) -> dict[str, Any]:
        """A multimodal Gemma 4 config: the text file's config and the tower's; the image
        tokens' ids from the text vocabulary."""
        text = dict(self.text.config)
        # A GGUF does not record which models attend bidirectionally within an image. Gemma 4's
        # releases do so exactly where there are no per-layer inputs (26B-A4B, 31B; E2B and E4B
        # are causal), and the file records per-layer inputs.
        text["use_bidirectional_attention"] = (
            None if text.get("hidden_size_per_layer_input") else "vision"
        )
        return {
            "model_type": "gemma4",
            "text_config": text,
            "vision_config": self.mmproj.vision_config(),
            "tie_word_embeddings": text["tie_word_embeddings"],
            **self._image_token_ids(),
        }

    def _image_token_ids(self) -> dict[str, int]:
        tokens = self.text.metadata.get("tokenizer.ggml.tokens") or []
        index = {token: i for i, token in enumerate(tokens) if token in IMAGE_TOKENS.values()}
        missing = [token for token in IMAGE_TOKENS.values() if token not in index]
        if missing:
            raise CheckpointError(
                f"{self.text.path.name}'s vocabulary has no {missing[0]} token: it cannot take "
                f"the images of {self.mmproj.path.name}"
            )
        return {field: index[token] for field, token in IMAGE_TOKENS.items()}

    def tensor_names(self) -> list[str]:
        return [*self.text.tensor_names(), *self.mmproj.tensor_names()]

    def tensor_storage(self) -> dict[str, tuple[tuple[int, ...], int, str]]:
        return {**self.text.tensor_storage(), **self.mmproj.tensor_storage()}

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = (), meta: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.text.tensors(dtype, skip, meta)
        yield from self.mmproj.tensors(dtype, skip, meta)

    def mapped_table(self, name: str) -> MappedBlockTable | None:
        return self.text.mapped_table(name)

    def stored_blocks(self, name: str, copy: bool = True) -> tuple[int, np.ndarray] | None:
        """The text model's stored blocks; the tower's tensors load as values (None), which
        they dequantize to exactly."""
        if name in self._tower_names:
            return None
        return self.text.stored_blocks(name, copy)

    @cached_property
    def _tower_names(self) -> frozenset[str]:
        return frozenset(self.mmproj.tensor_names())

    def tokenizer(self) -> Tokenizer:
        return self.text.tokenizer()
