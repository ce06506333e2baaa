"""GGUF reader: llama.cpp metadata and tensors, dequantized by the `gguf` package.

Gemma 3 and Gemma 4 files as llama.cpp's converter writes them (names: `gguf_names`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hearth.checkpoint.gguf_file import GGUFFile, TensorInfo
from hearth.checkpoint.gguf_names import ARCHITECTURES, ROPE_FREQS, canonical_name, gguf_name
from hearth.checkpoint.safetensors import expert_parts, is_layer_kv, split_expert_parts
from hearth.config import FULL_ATTENTION, SLIDING_ATTENTION
from hearth.errors import CheckpointError, UnsupportedModelError
from hearth.layers.mapped_table import MappedBlockTable
from hearth.ops import native

if TYPE_CHECKING:
    from hearth.tokenizer import Tokenizer

# Dequantize this many stored bytes at a time: bounds the fp32 copy of a large table.
_CHUNK_BYTES = 64 << 20
# llama.cpp fixes these for Gemma 3 rather than storing them (llama-model.cpp).
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0
# HF's Gemma 4 sliding-layer RoPE base, where a file does not store its own.
_GEMMA4_LOCAL_ROPE_BASE = 10_000.0
# llama.cpp's converter marks Gemma 4's unrotated frequency pairs with this factor.
_UNROTATED_FACTOR = 1e30
# GGML types that hold plain numbers, not blocks: loaded as values.
_FLOAT_TYPES = frozenset({0, 1, 30})  # F32, F16, BF16


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (fp16 scale d, 32 int8 codes) -> d·q in fp32, 10x faster than numpy.

    Same arithmetic as `gguf.quants` (fp16 d widened to fp32, one product), so bit-identical.
    """
    blocks = raw.reshape(-1, 34)
    scales = blocks[:, :2].contiguous().view(torch.float16).float()
    codes = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (codes * scales).reshape(raw.shape[0], -1)


class GGUFCheckpoint:
    """A GGUF file of a Gemma 3 or Gemma 4 text model; tensors are dequantized to fp32 on read."""

    format = "gguf"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = GGUFFile(path)
        architecture = self.metadata.get("general.architecture")
        if architecture == "clip":
            raise UnsupportedModelError(
                f"{path} is an mmproj file (a vision/audio tower): give the text model's GGUF "
                "as the model and this file with --mmproj"
            )
        if architecture not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {architecture!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        self.architecture: str = architecture

    @property
    def metadata(self) -> dict[str, Any]:
        """Every metadata field as a plain Python value."""
        return self._file.metadata

    def _field(self, key: str, default: Any = None) -> Any:
        """The architecture's metadata field `key`; an error without it and without `default`."""
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise CheckpointError(f"{self.path}: GGUF metadata lacks {self.architecture}.{key}")
        return value

    @cached_property
    def config(self) -> dict[str, Any]:
        """An HF-style text config (`gemma3_text` or `gemma4_text`) built from the metadata."""
        if self.architecture == "gemma4":
            return self._gemma4_config()
        return self._gemma3_config()

    def _common_config(self) -> dict[str, Any]:
        meta = self.metadata
        return {
            "vocab_size": int(self._tensor_info("token_embd.weight").shape[0]),
            "hidden_size": int(self._field("embedding_length")),
            "num_hidden_layers": int(self._field("block_count")),
            "num_attention_heads": int(self._field("attention.head_count")),
            "rms_norm_eps": float(self._field("attention.layer_norm_rms_epsilon")),
            "sliding_window": int(self._field("attention.sliding_window")),
            "final_logit_softcapping": meta.get(f"{self.architecture}.final_logit_softcapping"),
            "max_position_embeddings": int(self._field("context_length", 32768)),
            "tie_word_embeddings": "output.weight" not in self._tensor_infos,
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        }

    def _gemma3_config(self) -> dict[str, Any]:
        common = self._common_config()
        hidden, heads = common["hidden_size"], common["num_attention_heads"]
        head_dim = int(self._field("attention.key_length", hidden // heads))
        layers = common["num_hidden_layers"]
        # llama.cpp scales Gemma 3 27B by 1/sqrt(hidden/heads), the others by 1/sqrt(head_dim).
        pre_attn_scalar = hidden // heads if hidden == 5376 else head_dim
        full_rope: dict[str, Any] = {
            "rope_type": "default",
            "rope_theta": self._field("rope.freq_base"),
        }
        scaling_factor = self.metadata.get("gemma3.rope.scaling.factor")
        if scaling_factor not in (None, 1.0):
            full_rope = {**full_rope, "rope_type": "linear", "factor": float(scaling_factor)}
        return {
            **common,
            "model_type": "gemma3_text",
            "intermediate_size": int(self._field("feed_forward_length")),
            "num_key_value_heads": int(self._field("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "layer_types": [
                "full_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0 else "sliding_attention"
                for i in range(layers)
            ],
            "rope_parameters": {
                "full_attention": full_rope,
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": _GEMMA3_LOCAL_ROPE_BASE,
                },
            },
            "query_pre_attn_scalar": pre_attn_scalar,
            "hidden_activation": "gelu_pytorch_tanh",
        }

    def _gemma4_config(self) -> dict[str, Any]:
        """The fields llama.cpp's converter writes for Gemma 4, back in HF's terms: per-layer
        arrays (sliding pattern, KV heads, MLP width) and the widths of each layer type."""
        common = self._common_config()
        layers = common["num_hidden_layers"]
        sliding = self._per_layer("attention.sliding_window_pattern", layers, bool)
        layer_types = [SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding]
        full_head_dim = int(self._field("attention.key_length"))
        sliding_head_dim = int(self._field("attention.key_length_swa", full_head_dim))
        kv_heads = self._per_layer("attention.head_count_kv", layers, int)
        widths = self._per_layer("feed_forward_length", layers, int)
        first_shared = self._first_kv_shared_layer
        full_layers = [i for i, kind in enumerate(layer_types) if kind == FULL_ATTENTION]
        sliding_layers = [i for i, kind in enumerate(layer_types) if kind == SLIDING_ATTENTION]
        per_type_kv = {kv_heads[i] for i in full_layers}, {kv_heads[i] for i in sliding_layers}
        if any(len(counts) > 1 for counts in per_type_kv):
            raise UnsupportedModelError(
                f"{self.path}: KV head counts differ within a layer type: {kv_heads}"
            )
        config: dict[str, Any] = {
            **common,
            "model_type": "gemma4_text",
            "layer_types": layer_types,
            "head_dim": sliding_head_dim,
            "num_key_value_heads": kv_heads[sliding_layers[0] if sliding_layers else 0],
            # HF 5's dialect: the full-attention widths as overrides of those layers.
            "per_layer_config": {
                str(i): {"head_dim": full_head_dim, "num_key_value_heads": kv_heads[i]}
                for i in full_layers
            },
            "attention_k_eq_v": any(
                f"blk.{i}.attn_v.weight" not in self._tensor_infos
                for i in full_layers
                if i < first_shared
            ),
            "num_kv_shared_layers": layers - first_shared,
            "intermediate_size": widths[0],
            "use_double_wide_mlp": self._double_wide(widths, first_shared),
            "hidden_size_per_layer_input": int(self._field("embedding_length_per_layer_input", 0)),
            "rope_parameters": self._gemma4_rope(full_head_dim, sliding_head_dim),
        }
        per_layer_table = self._tensor_infos.get("per_layer_token_embd.weight")
        if per_layer_table is not None:
            config["vocab_size_per_layer_input"] = int(per_layer_table.shape[0])
        experts = self.metadata.get("gemma4.expert_count")
        if experts:
            config |= {
                "enable_moe_block": True,
                "num_experts": int(experts),
                "top_k_experts": int(self._field("expert_used_count")),
                "moe_intermediate_size": int(self._field("expert_feed_forward_length")),
            }
        return config

    def _per_layer(self, key: str, layers: int, kind: type) -> list[Any]:
        """A field llama.cpp stores as one value or as one value per layer, as a list."""
        value = self._field(key)
        values = value if isinstance(value, list) else [value] * layers
        if len(values) != layers:
            raise CheckpointError(
                f"{self.path}: {self.architecture}.{key} has {len(values)} entries "
                f"for {layers} layers"
            )
        return [kind(v) for v in values]

    def _double_wide(self, widths: list[int], first_shared: int) -> bool:
        """Gemma 4 E2B doubles the MLP of its KV-sharing layers; any other pattern is refused."""
        base = widths[0]
        if all(width == base for width in widths):
            return False
        if widths == [base if i < first_shared else 2 * base for i in range(len(widths))]:
            return True
        raise UnsupportedModelError(f"{self.path}: unsupported per-layer MLP widths {widths}")

    def _gemma4_rope(self, full_head_dim: int, sliding_head_dim: int) -> dict[str, Any]:
        """HF's `rope_parameters`. The full layers' rotated share comes from `rope_freqs`:
        llama.cpp rotates the whole head (neox) with factor 1e30 on the pairs HF leaves still,
        which is HF's "proportional" RoPE with partial_rotary_factor = rotated pairs / half."""
        rotated = int(self._field("rope.dimension_count", full_head_dim))
        sliding_rotated = int(self._field("rope.dimension_count_swa", sliding_head_dim))
        if rotated != full_head_dim or sliding_rotated != sliding_head_dim:
            raise UnsupportedModelError(
                f"{self.path}: RoPE over {rotated}/{full_head_dim} (full) and "
                f"{sliding_rotated}/{sliding_head_dim} (sliding) dims is not supported"
            )
        factors = np.ones(full_head_dim // 2, np.float32)
        if ROPE_FREQS in self._tensor_infos:
            factors = self._dequantize(self._tensor_info(ROPE_FREQS)).numpy().reshape(-1)
        still = factors >= _UNROTATED_FACTOR
        if len(factors) != full_head_dim // 2 or not np.all(still | (factors == 1.0)):
            raise UnsupportedModelError(
                f"{self.path}: rope_freqs holds factors other than 1 and 1e30: not supported"
            )
        full = {
            "rope_type": "proportional",
            "rope_theta": float(self._field("rope.freq_base")),
            "partial_rotary_factor": float((~still).sum() / len(factors)),
        }
        scaling_factor = self.metadata.get("gemma4.rope.scaling.factor")
        if scaling_factor not in (None, 1.0):
            full["factor"] = float(scaling_factor)
        local_base = self._field("rope.freq_base_swa", _GEMMA4_LOCAL_ROPE_BASE)
        return {
            FULL_ATTENTION: full,
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": float(local_base)},
        }

    @property
    def _tensor_infos(self) -> dict[str, TensorInfo]:
        return self._file.tensors

    def _tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._tensor_infos[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: GGUF file lacks tensor {name!r}") from None

    stored_dtype = None  # quantized blocks: the engine picks (see engine.resolve_precision)

    @cached_property
    def _first_kv_shared_layer(self) -> int:
        return int(self._field("block_count")) - int(self._field("attention.shared_kv_layers", 0))

    def _weights(self) -> Iterator[tuple[str, TensorInfo]]:
        """(canonical name, tensor) of each weight the model reads. Not `rope_freqs` (config),
        nor the K/V of KV-sharing layers, which Google's releases keep and nothing reads."""
        for name, info in self._tensor_infos.items():
            if name == ROPE_FREQS and self.architecture == "gemma4":
                continue
            canonical = canonical_name(name, self.architecture)
            kv = is_layer_kv(canonical)
            if kv is not None and kv >= self._first_kv_shared_layer:
                continue
            yield canonical, info

    def tensor_storage(self) -> dict[str, tuple[tuple[int, ...], int, str]]:
        """Each tensor's (shape, bytes, GGML type name); stacked experts count as one."""
        import gguf

        return {
            canonical: (info.shape, info.nbytes, gguf.GGMLQuantizationType(info.type_id).name)
            for canonical, info in self._weights()
        }

    def tensor_names(self) -> list[str]:
        return [part for name, _ in self._weights() for part in expert_parts(name)]

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = (), meta: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each canonical tensor but those in `skip`, dequantized in fp32 and, with `dtype`,
        rounded to it a few rows at a time: a 262144 x 8960 table never exists in fp32.
        `meta`: their shapes only (see `Checkpoint.tensors`)."""
        for name, info in self._weights():
            if name in skip:
                continue
            if meta:
                tensor = torch.empty(tuple(info.shape), dtype=dtype or torch.float32, device="meta")
            else:
                tensor = self._dequantize(info, dtype or torch.float32)
                self._file.release(info)
            yield from split_expert_parts(name, tensor)

    def mapped_table(self, name: str) -> MappedBlockTable | None:
        """The lookup table `name` read in place from the file, where its blocks are of a type
        the native kernels decode; None otherwise."""
        info = self._tensor_infos.get(gguf_name(name, self.architecture))
        if info is None or info.type_id not in native.BLOCK_TYPES or native.kernels() is None:
            return None
        return MappedBlockTable(self._file.raw(info), info.type_id, info.shape[-1])

    def stored_blocks(self, name: str, copy: bool = True) -> tuple[int, np.ndarray] | None:
        """(GGML type id, rows of blocks [rows, bytes per row]) of the canonical tensor `name`
        where its type is one Hearth computes on as stored (`hearth.quant.gguf_blocks`); None
        for a float tensor (F32, F16, BF16), which loads as values. `copy`: the bytes copied
        out of the file once (its pages then dropped), else a view of the memory map. Any other
        quantized type is refused, naming the tensor."""
        import gguf

        from hearth.quant.gguf_blocks import BLOCK_FORMATS

        info = self._tensor_info(gguf_name(name, self.architecture))
        quant_type = gguf.GGMLQuantizationType(info.type_id)
        if info.type_id in BLOCK_FORMATS:
            if not copy:
                return info.type_id, self._file.raw(info)
            return info.type_id, self._file.copy(info)
        if quant_type in _FLOAT_TYPES:
            return None
        supported = ", ".join(block.name for block in BLOCK_FORMATS.values())
        raise UnsupportedModelError(
            f"{self.path}: tensor {info.name} uses {quant_type.name}, which Hearth does not "
            f"compute on as stored (it does {supported}); --quantize none dequantizes it instead"
        )

    def _dequantize(self, info: TensorInfo, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raw = self._file.raw(info)  # [rows, bytes per row], memory-mapped
        kernels = native.kernels()
        if kernels is not None and dtype == torch.bfloat16 and info.type_id in native.BLOCK_TYPES:
            out = torch.empty(info.shape, dtype=dtype)
            # The values below compute, 10-50x sooner (numpy's Q4_K ran at ~40 Mparam/s).
            kernels.blocks_to_bf16(info.type_id, np.asarray(raw).reshape(-1), out)
            return out
        rows_per_chunk = max(1, _CHUNK_BYTES // raw.shape[1])
        out = torch.empty(raw.shape[0], math.prod(info.shape) // raw.shape[0], dtype=dtype)
        for start in range(0, raw.shape[0], rows_per_chunk):
            chunk = raw[start : start + rows_per_chunk]
            out[start : start + len(chunk)] = self._dequantize_rows(info, chunk)
        return out.reshape(info.shape)

    def _dequantize_rows(self, info: TensorInfo, raw: np.ndarray) -> torch.Tensor:
        """Rows of stored bytes as fp32 values."""
        import gguf

        quant_type = gguf.GGMLQuantizationType(info.type_id)
        if quant_type == gguf.GGMLQuantizationType.Q8_0:
            values = dequantize_q8_0(torch.from_numpy(np.array(raw)))
        else:
            try:
                decoded = gguf.quants.dequantize(raw, quant_type)
            except NotImplementedError:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {info.name} uses {quant_type.name}, "
                    "which Hearth cannot dequantize"
                ) from None
            values = torch.from_numpy(np.require(decoded, np.float32, ["C", "W"]))
        # llama.cpp stores Gemma 3's norm weights as 1 + w (Gemma 4's as w); canonical is w.
        if self.architecture == "gemma3" and info.name.endswith("norm.weight"):
            values = values - 1
        return values.reshape(len(raw), -1)

    def tokenizer(self) -> Tokenizer:
        from hearth.tokenizer import Tokenizer, gguf_tokenizer_key

        key = gguf_tokenizer_key(self.metadata)
        return Tokenizer.from_gguf_metadata(self.metadata, cache_key=key)
