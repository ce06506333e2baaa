"""llama.cpp's multimodal projector files (`mmproj-*.gguf`): Gemma 4's vision tower (and the
audio tower of E2B/E4B) beside a Gemma 4 text model read from its own GGUF file.

An mmproj file is a GGUF of architecture `clip`. llama.cpp's converter (the Gemma 4 mmproj
class of convert_hf_to_gguf.py; the graphs in tools/mtmd/models/gemma4v.cpp and gemma4a) writes
the vision tower with projector type `gemma4v` under `v.*` names and `embed_vision`'s
projection as `mm.input_projection`, the audio tower with `gemma4a` under `a.*` and
`mm.a.input_projection`; `_vision_name`, `_audio_name` and `_hf_layout` undo its names and
layouts. What the file does not store, Hearth takes from llama.cpp's fixed choices for Gemma 4,
which are HF's defaults (vision RoPE base 100, pooling 3 unless
`clip.vision.projector.scale_factor` says otherwise; the audio attention's chunking and cap),
and from the tensors' shapes (widths, KV heads, position table, channels, kernel; clipping and
standardization by the presence of their tensors). The media tokens' ids come from the text
model's vocabulary, as llama.cpp's runtime finds them.

`GGUFWithMmproj` joins the two files into one checkpoint: the config of a multimodal Gemma 4
(`text_config`, `vision_config`, `audio_config`) and the tensors of both under canonical
names, so that `build_model` loads the text model and its towers as it does an HF checkpoint's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

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


# The audio tower (`gemma4a`, E2B/E4B): outside the blocks.
_AUDIO_GLOBAL = {
    "a.conv1d.0.weight": "audio_tower.subsample_conv_projection.layer0.conv.weight",
    "a.conv1d.0.norm.weight": "audio_tower.subsample_conv_projection.layer0.norm.weight",
    "a.conv1d.1.weight": "audio_tower.subsample_conv_projection.layer1.conv.weight",
    "a.conv1d.1.norm.weight": "audio_tower.subsample_conv_projection.layer1.norm.weight",
    "a.input_projection.weight": "audio_tower.subsample_conv_projection.input_proj_linear.weight",
    "a.pre_encode.out.weight": "audio_tower.output_proj.weight",
    "a.pre_encode.out.bias": "audio_tower.output_proj.bias",
    "mm.a.input_projection.weight": "embed_audio.embedding_projection.weight",
}
# Within `a.blk.{i}.`: the clipped linears, then the other weights (norms included).
_AUDIO_CLIPPED_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.post",
    "ffn_up": "feed_forward1.ffw_layer_1",
    "ffn_down": "feed_forward1.ffw_layer_2",
    "ffn_up_1": "feed_forward2.ffw_layer_1",
    "ffn_down_1": "feed_forward2.ffw_layer_2",
    "conv_pw1": "lconv1d.linear_start",
    "conv_pw2": "lconv1d.linear_end",
}
_AUDIO_WEIGHTS = {
    "attn_k_rel": "self_attn.relative_k_proj.weight",
    "per_dim_scale": "self_attn.per_dim_scale",
    "conv_dw": "lconv1d.depthwise_conv1d.weight",
    "ffn_norm": "feed_forward1.pre_layer_norm.weight",
    "ffn_post_norm": "feed_forward1.post_layer_norm.weight",
    "ffn_norm_1": "feed_forward2.pre_layer_norm.weight",
    "ffn_post_norm_1": "feed_forward2.post_layer_norm.weight",
    "conv_norm": "lconv1d.pre_layer_norm.weight",
    "norm_conv": "lconv1d.conv_norm.weight",
    "attn_pre_norm": "norm_pre_attn.weight",
    "attn_post_norm": "norm_post_attn.weight",
    "ln2": "norm_out.weight",
}
# Hearth's log-mel features (HF's extractor) have this many bins.
_MEL_BINS = 128
# The text vocabulary's audio tokens.
AUDIO_TOKENS = {
    "boa_token_id": "<|audio>",
    "audio_token_id": "<|audio|>",
    "eoa_token_id": "<audio|>",
}


def _audio_name(name: str) -> str | None:
    """The canonical name of an audio tensor of an mmproj file; None for any other name."""
    return _tower_name(
        name, _AUDIO_GLOBAL, "a.blk.", "audio_tower.layers", _AUDIO_CLIPPED_LINEARS, _AUDIO_WEIGHTS
    )


def _vision_name(name: str) -> str | None:
    """The canonical name of a vision tensor of an mmproj file; None for any other name."""
    norms = {module: f"{canonical}.weight" for module, canonical in _NORMS.items()}
    return _tower_name(
        name, _VISION_GLOBAL, "v.blk.", "vision_tower.encoder.layers", _CLIPPED_LINEARS, norms
    )


def _tower_name(
    name: str,
    global_names: dict[str, str],
    block: str,
    layers: str,
    clipped: dict[str, str],
    weights: dict[str, str],
) -> str | None:
    """The canonical name of a tower tensor: one of `global_names`, or a layer's (`block`N.
    module.role in the file, `layers`.N.... canonically) clipped linear, its clip bounds or one
    of its other `weights`; None for any other name."""
    if name in global_names:
        return global_names[name]
    if not name.startswith(block):
        return None
    index, _, tail = name.removeprefix(block).partition(".")
    module, _, role = tail.partition(".")
    if not index.isdigit():
        return None
    prefix = f"{layers}.{index}"
    if module in clipped and role == "weight":
        return f"{prefix}.{clipped[module]}.linear.weight"
    if module in clipped and role in _CLIP_BOUNDS:
        return f"{prefix}.{clipped[module]}.{role}"
    if module in weights and role == "weight":
        return f"{prefix}.{weights[module]}"
    return None


def _hf_layout(canonical: str, values: torch.Tensor) -> torch.Tensor:
    """A tensor as the converter stored it, back in HF's layout: the patch embedding was made a
    conv kernel [hidden, 3, p, p] from HF's [hidden, p·p·3] (rows, then columns, then channels
    within a patch); the clip scalars were made 1-D."""
    if canonical.endswith("patch_embedder.input_proj.weight"):
        return values.permute(0, 2, 3, 1).reshape(values.shape[0], -1)
    if canonical.rpartition(".")[2] in _CLIP_BOUNDS:
        return values.reshape(())
    if canonical.endswith("depthwise_conv1d.weight"):  # stored [channels, kernel]
        return values.unsqueeze(1)
    if canonical.endswith("per_dim_scale") and values.device.type != "meta":
        return softplus_preimage(values)
    return values


def softplus_preimage(stored: torch.Tensor) -> torch.Tensor:
    """The fp32 `per_dim_scale` whose softplus is `stored`: the converter stores the scale
    after softplus, the tower applies it. The float64 inverse rounded to fp32 maps back exactly
    for ~98% of values; the nearest fp32 neighbours that do are taken for the rest."""
    target = stored.float()
    guess = torch.log(torch.expm1(target.double())).float()
    best, found = guess, F.softplus(guess) == target
    up, down = guess, guess
    for _ in range(4):
        up = torch.nextafter(up, torch.full_like(up, math.inf))
        down = torch.nextafter(down, torch.full_like(down, -math.inf))
        for candidate in (up, down):
            hit = ~found & (F.softplus(candidate) == target)
            best, found = torch.where(hit, candidate, best), found | hit
    return best


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
    """An mmproj GGUF's Gemma 4 towers (vision; audio where the file has E2B/E4B's): their
    HF-style configs and canonical tensors."""

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

    @property
    def reads_audio(self) -> bool:
        """Whether the file's audio tower is Gemma 4's (read with the vision tower)."""
        return self.audio_projector == AUDIO_PROJECTOR

    @cached_property
    def _tower_tensors(self) -> dict[str, TensorInfo]:
        """Canonical name -> stored tensor, for every tensor of the towers Hearth reads."""
        found = {}
        for name, info in self._file.tensors.items():
            audio = name.startswith(("a.", "mm.a."))
            if audio and not self.reads_audio:
                continue
            projector = AUDIO_PROJECTOR if audio else VISION_PROJECTOR
            canonical = _audio_name(name) if audio else _vision_name(name)
            if canonical is None:
                raise UnsupportedModelError(f"{self.path}: unknown {projector} tensor {name!r}")
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

    def audio_config(self) -> dict[str, Any]:
        """HF's `audio_config` fields of the audio tower. The file stores the widths; llama.cpp
        fixes the rest for gemma4a (chunks of 12 frames, 13 to the left, logit cap 50, ...),
        which are HF's defaults, so they are left to those. Its `layer_norm_epsilon` (1e-5) is
        the converter's constant, not the checkpoint's: HF's default (1e-6) applies."""
        mel_bins = int(self.metadata.get("clip.audio.num_mel_bins", _MEL_BINS))
        if mel_bins != _MEL_BINS:
            raise UnsupportedModelError(
                f"{self.path}: the audio tower takes {mel_bins} mel bins; Hearth's features "
                f"have {_MEL_BINS}"
            )
        return {
            "model_type": "gemma4_audio",
            "hidden_size": int(self._audio_key("embedding_length")),
            "num_hidden_layers": int(self._audio_key("block_count")),
            "num_attention_heads": int(self._audio_key("attention.head_count")),
            "subsampling_conv_channels": [
                self._info("a.conv1d.0.weight").shape[0],
                self._info("a.conv1d.1.weight").shape[0],
            ],
            "conv_kernel_size": self._info("a.blk.0.conv_dw.weight").shape[-1],
            "output_proj_dims": self._info("a.pre_encode.out.weight").shape[0],
            "use_clipped_linears": "a.blk.0.attn_q.input_min" in self._file.tensors,
        }

    def _audio_key(self, key: str) -> Any:
        value = self.metadata.get(f"clip.audio.{key}")
        if value is None:
            raise CheckpointError(f"{self.path}: mmproj metadata lacks clip.audio.{key}")
        return value

    @property
    def projection_width(self) -> int:
        """The text hidden size the vision tower projects into."""
        return self._info("mm.input_projection.weight").shape[0]

    @property
    def audio_projection_width(self) -> int:
        return self._info("mm.a.input_projection.weight").shape[0]

    def tensor_names(self) -> list[str]:
        return list(self._tower_tensors)

    def tensor_storage(self) -> dict[str, tuple[tuple[int, ...], int, str]]:
        import gguf

        return {
            canonical: (
                tuple(_hf_layout(canonical, torch.empty(info.shape, device="meta")).shape),
                info.nbytes,
                gguf.GGMLQuantizationType(info.type_id).name,
            )
            for canonical, info in self._tower_tensors.items()
        }

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = (), meta: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each canonical tensor in HF's layout, dequantized exactly (fp32) and then cast to
        `dtype`; the towers are small, so each is read whole."""
        for canonical, info in self._tower_tensors.items():
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
    """A Gemma 4 text model's GGUF file and the mmproj file of its towers, read as one
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
        if mmproj.reads_audio and mmproj.audio_projection_width != hidden:
            raise CheckpointError(
                f"{mmproj.path} does not fit {text.path.name}: its audio tower projects into "
                f"{mmproj.audio_projection_width} dims, the text model's hidden size is {hidden}"
            )
        self.text = text
        self.mmproj = mmproj
        self.path = text.path
        if mmproj.audio_projector is not None and not mmproj.reads_audio:
            log.warning(
                "%s: its audio tower (%s) is not one Hearth reads: the model takes no audio",
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
        config = {
            "model_type": "gemma4",
            "text_config": text,
            "vision_config": self.mmproj.vision_config(),
            "tie_word_embeddings": text["tie_word_embeddings"],
            **self._token_ids(IMAGE_TOKENS, "images"),
        }
        if self.mmproj.reads_audio:
            config["audio_config"] = self.mmproj.audio_config()
            config.update(self._token_ids(AUDIO_TOKENS, "audio"))
        return config

    def _token_ids(self, fields: dict[str, str], kind: str) -> dict[str, int]:
        """`fields`' tokens' ids in the text vocabulary, as llama.cpp's runtime finds them."""
        tokens = self.text.metadata.get("tokenizer.ggml.tokens") or []
        wanted = set(fields.values())
        index = {token: i for i, token in enumerate(tokens) if token in wanted}
        missing = [token for token in fields.values() if token not in index]
        if missing:
            raise CheckpointError(
                f"{self.text.path.name}'s vocabulary has no {missing[0]} token: it cannot take "
                f"the {kind} of {self.mmproj.path.name}"
            )
        return {field: index[token] for field, token in fields.items()}

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
        """The text model's stored blocks; the towers' tensors load as values (None), which
        they dequantize to exactly."""
        if name in self._tower_names:
            return None
        return self.text.stored_blocks(name, copy)

    @cached_property
    def _tower_names(self) -> frozenset[str]:
        return frozenset(self.mmproj.tensor_names())

    def tokenizer(self) -> Tokenizer:
        return self.text.tokenizer()
