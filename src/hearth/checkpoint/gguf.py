"""GGUF reader: llama.cpp metadata and tensors, dequantized by the `gguf` package."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hearth.checkpoint.gguf_file import GGUFFile, TensorInfo
from hearth.errors import CheckpointError, UnsupportedModelError

if TYPE_CHECKING:
    from hearth.tokenizer import Tokenizer

# llama.cpp tensor names -> canonical (HF) names; `{}` is the block index.
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
_SUPPORTED_ARCHITECTURES = ("gemma3",)
# llama.cpp fixes these for Gemma 3 rather than storing them (llama-model.cpp).
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def canonical_name(gguf_name: str) -> str:
    """The canonical name of a llama.cpp tensor name, e.g. blk.0.attn_q.weight."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _BLOCK_NAMES:
        return f"layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise UnsupportedModelError(f"unknown GGUF tensor {gguf_name!r}")


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (fp16 scale d, 32 int8 codes) -> d·q in fp32, 10x faster than numpy.

    Same arithmetic as `gguf.quants` (fp16 d widened to fp32, one product), so bit-identical.
    """
    blocks = raw.reshape(-1, 34)
    scales = blocks[:, :2].contiguous().view(torch.float16).float()
    codes = blocks[:, 2:].contiguous().view(torch.int8).float()
    return (codes * scales).reshape(raw.shape[0], -1)


class GGUFCheckpoint:
    """A GGUF file. Tensors are dequantized to float32 on read."""

    format = "gguf"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = GGUFFile(path)
        architecture = self.metadata.get("general.architecture")
        if architecture not in _SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: GGUF architecture {architecture!r} is not supported "
                f"(supported: {', '.join(_SUPPORTED_ARCHITECTURES)})"
            )

    @property
    def metadata(self) -> dict[str, Any]:
        """Every metadata field as a plain Python value."""
        return self._file.metadata

    @cached_property
    def config(self) -> dict[str, Any]:
        """An HF-style `gemma3_text` config built from the metadata."""
        meta = self.metadata
        prefix = meta["general.architecture"]

        def field(key: str, default: Any = None) -> Any:
            value = meta.get(f"{prefix}.{key}", default)
            if value is None:
                raise CheckpointError(f"{self.path}: GGUF metadata lacks {prefix}.{key}")
            return value

        hidden = int(field("embedding_length"))
        heads = int(field("attention.head_count"))
        head_dim = int(field("attention.key_length", hidden // heads))
        layers = int(field("block_count"))
        embedding = self._tensor_info("token_embd.weight")
        # llama.cpp scales Gemma 3 27B by 1/sqrt(hidden/heads), the others by 1/sqrt(head_dim).
        pre_attn_scalar = hidden // heads if hidden == 5376 else head_dim
        scaling_factor = meta.get(f"{prefix}.rope.scaling.factor")
        full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": field("rope.freq_base")}
        if scaling_factor not in (None, 1.0):
            full_rope = {**full_rope, "rope_type": "linear", "factor": float(scaling_factor)}
        return {
            "model_type": "gemma3_text",
            "vocab_size": int(embedding.shape[0]),
            "hidden_size": hidden,
            "intermediate_size": int(field("feed_forward_length")),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(field("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon")),
            "sliding_window": int(field("attention.sliding_window")),
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
            "final_logit_softcapping": meta.get(f"{prefix}.final_logit_softcapping"),
            "max_position_embeddings": int(field("context_length", 32768)),
            "tie_word_embeddings": "output.weight" not in self._tensor_infos,
            "hidden_activation": "gelu_pytorch_tanh",
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
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

    def tensor_storage(self) -> dict[str, tuple[tuple[int, ...], int, str]]:
        """Each tensor's (shape, bytes, GGML type name)."""
        import gguf

        return {
            canonical_name(name): (
                info.shape,
                info.nbytes,
                gguf.GGMLQuantizationType(info.type_id).name,
            )
            for name, info in self._tensor_infos.items()
        }

    def tensor_names(self) -> list[str]:
        return [canonical_name(name) for name in self._tensor_infos]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, info in self._tensor_infos.items():
            yield canonical_name(name), self._dequantize(info)

    def _dequantize(self, info: TensorInfo) -> torch.Tensor:
        import gguf

        quant_type = gguf.GGMLQuantizationType(info.type_id)
        raw = self._file.raw(info)
        if quant_type == gguf.GGMLQuantizationType.Q8_0:
            tensor = dequantize_q8_0(torch.from_numpy(np.array(raw))).reshape(info.shape)
        else:
            try:
                values = gguf.quants.dequantize(raw, quant_type)
            except NotImplementedError:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {info.name} uses {quant_type.name}, "
                    "which Hearth cannot dequantize"
                ) from None
            tensor = torch.from_numpy(np.require(values, np.float32, ["C", "W"]))
            tensor = tensor.reshape(info.shape)
        # llama.cpp stores Gemma norm weights as 1 + w; the canonical value is w.
        if info.name.endswith("norm.weight"):
            tensor = tensor - 1
        return tensor

    def tokenizer(self) -> Tokenizer:
        from hearth.tokenizer import Tokenizer

        stat = self.path.stat()
        cache_key = f"{self.path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        return Tokenizer.from_gguf_metadata(self.metadata, cache_key=cache_key)
