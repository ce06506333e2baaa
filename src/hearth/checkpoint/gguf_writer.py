"""Write a Gemma 3 or Gemma 4 GGUF in llama.cpp's layout (for tests and benchmarks).

`stream_gguf` writes tensors one at a time, each encoded only when its turn comes, so a 12B
file never needs its weights in memory at once; `write_gguf` wraps in-memory tensors for it.
Metadata, names and value conventions follow llama.cpp's `convert_hf_to_gguf.py`: Gemma 3
norms stored as 1 + w, Gemma 4's as w; Gemma 4's per-layer arrays (sliding pattern, KV heads,
MLP width) and its full layers' RoPE as frequency factors (`rope_freqs`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hearth.checkpoint.gguf_names import ROPE_FREQS, gguf_name
from hearth.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Gemma3Config,
    Gemma4Config,
    parse_config,
)

# The factor llama.cpp's converter gives the frequency pairs that Gemma 4's full layers keep still.
UNROTATED_FACTOR = 1e30


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor to write: canonical name, shape (torch order), GGML type name, and `encode`,
    called once when the tensor is written, returning the bytes the file stores (any numpy
    array of exactly that size: float32 for F32, float16 for F16, raw blocks otherwise)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    encode: Callable[[], np.ndarray]

    def nbytes(self) -> int:
        import gguf

        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.ggml_type]]
        return math.prod(self.shape) // block * block_bytes


def write_gguf(
    path: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    tokens: Sequence[str] | None = None,
    matrix_type: str = "F32",
    tokenizer: Mapping[str, Any] | None = None,
) -> Path:
    """Write `tensors` (canonical names, HF values) as a gemma3 or gemma4 GGUF, as `config` says.

    Weights of two or more dims whose rows are whole blocks are stored in `matrix_type` (F32,
    F16, BF16, Q8_0, Q5_0, Q4_0: those the `gguf` package can quantize), the rest in F32.
    Gemma 4's expert projections are stacked as llama.cpp stores them (gate rows, then up
    rows). The vocabulary is `tokens` (a minimal tokenizer) or `tokenizer`, `tokenizer.*`
    metadata as read from another GGUF file.
    """
    shifted_norms = isinstance(parse_config(dict(config)), Gemma3Config)
    encoded = [
        _in_memory(name, tensor, matrix_type, shifted_norms)
        for name, tensor in stack_experts(tensors).items()
    ]
    return stream_gguf(path, config, encoded, tokenizer or minimal_tokenizer(tokens))


def stack_experts(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical expert parts back in HF's stacked form: gate_proj + up_proj -> gate_up_proj."""
    stacked: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, part = name.rpartition(".experts.")
        if not prefix:
            stacked[name] = tensor
        elif part == "gate_proj.weight":
            up = tensors[f"{prefix}.experts.up_proj.weight"]
            stacked[f"{prefix}.experts.gate_up_proj"] = torch.cat([tensor, up], dim=-2)
        elif part == "down_proj.weight":
            stacked[f"{prefix}.experts.down_proj"] = tensor
    return stacked


def _in_memory(
    name: str, tensor: torch.Tensor, matrix_type: str, shifted_norms: bool
) -> GGUFTensor:
    import gguf

    values = tensor.detach().float().numpy()
    shape = tuple(values.shape)
    if name.endswith("norm.weight"):
        shift = 1.0 if shifted_norms else 0.0
        return GGUFTensor(name, shape, "F32", lambda: (values + shift).astype(np.float32))
    quant_type = gguf.GGMLQuantizationType[matrix_type]
    block = gguf.GGML_QUANT_SIZES[quant_type][0]
    # As llama.cpp's converter, a row that is not whole blocks stays F32.
    if values.ndim >= 2 and matrix_type != "F32" and values.shape[-1] % block == 0:
        quantized = lambda: gguf.quants.quantize(values, quant_type)  # noqa: E731
        return GGUFTensor(name, shape, matrix_type, quantized)
    return GGUFTensor(name, shape, "F32", lambda: values.astype(np.float32))


def minimal_tokenizer(tokens: Sequence[str] | None) -> dict[str, Any]:
    """`tokenizer.*` metadata of a plain vocabulary: <...> tokens are control tokens."""
    if tokens is None:
        raise ValueError("give the vocabulary: `tokens` or `tokenizer` metadata")
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": list(tokens),
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [
            3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens
        ],
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }


def tokenizer_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The `tokenizer.*` fields of a GGUF file's metadata (e.g. `GGUFFile.metadata`)."""
    return {key: value for key, value in metadata.items() if key.startswith("tokenizer.")}


def _add_tokenizer(writer: Any, tokenizer: Mapping[str, Any]) -> None:
    """Typed as llama.cpp reads them: ids uint32, flags bool, scores float32, types int32."""
    for key, value in tokenizer.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)  # item type from the first item: str, int32, float32
        else:
            raise ValueError(f"tokenizer field {key} has an unsupported value {type(value)}")


def stream_gguf(
    path: Path,
    config: Mapping[str, Any],
    tensors: Iterable[GGUFTensor],
    tokenizer: Mapping[str, Any],
) -> Path:
    """Write a gemma3 or gemma4 GGUF of `config`: the header, then each tensor as it is encoded.

    `tokenizer` holds `tokenizer.*` metadata (`minimal_tokenizer`, `tokenizer_metadata`).
    """
    import gguf

    parsed = parse_config(dict(config))
    architecture = "gemma4" if isinstance(parsed, Gemma4Config) else "gemma3"
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(parsed.num_hidden_layers)
    writer.add_context_length(parsed.max_position_embeddings)
    writer.add_embedding_length(parsed.hidden_size)
    writer.add_head_count(parsed.num_attention_heads)
    writer.add_layer_norm_rms_eps(parsed.rms_norm_eps)
    writer.add_sliding_window(parsed.sliding_window)
    full_rope = parsed.rope[FULL_ATTENTION]
    writer.add_rope_freq_base(full_rope.theta)
    if full_rope.linear_factor != 1.0:  # Gemma 3 4B/12B/27B: linear, factor 8
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full_rope.linear_factor)
    tensors = list(tensors)
    if isinstance(parsed, Gemma4Config):
        tensors += _add_gemma4_fields(writer, parsed)
    else:
        writer.add_feed_forward_length(parsed.intermediate_size)
        writer.add_head_count_kv(parsed.num_key_value_heads)
        writer.add_key_length(parsed.head_dim)
        writer.add_value_length(parsed.head_dim)
    _add_tokenizer(writer, tokenizer)
    for tensor in tensors:
        writer.add_tensor_info(
            tensor.name if tensor.name == ROPE_FREQS else gguf_name(tensor.name, architecture),
            tensor.shape,
            np.dtype(np.float32),  # unused: raw_dtype gives the type, shape stays logical
            tensor.nbytes(),
            raw_dtype=gguf.GGMLQuantizationType[tensor.ggml_type],
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in tensors:
        data = tensor.encode()
        if data.nbytes != tensor.nbytes():
            raise ValueError(
                f"{tensor.name}: encoded to {data.nbytes} bytes, "
                f"{tensor.ggml_type} {tensor.shape} needs {tensor.nbytes()}"
            )
        writer.write_tensor_data(data)
    writer.close()
    return path


def _add_gemma4_fields(writer: Any, config: Gemma4Config) -> list[GGUFTensor]:
    """Gemma 4's metadata as llama.cpp's converter writes it; returns the `rope_freqs` tensor.

    The full layers' proportional RoPE becomes a whole-head rotation whose frequency factor is
    1 on the pairs HF rotates and 1e30 (no rotation) on the rest.
    """
    layers = range(config.num_hidden_layers)
    writer.add_feed_forward_length(
        [config.mlp_width(i) for i in layers]
        if config.use_double_wide_mlp
        else config.intermediate_size
    )
    writer.add_head_count_kv([config.kv_heads_of(kind) for kind in config.layer_types])
    writer.add_key_length(config.global_head_dim)
    writer.add_value_length(config.global_head_dim)
    writer.add_key_length_swa(config.head_dim)
    writer.add_value_length_swa(config.head_dim)
    writer.add_rope_dimension_count(config.global_head_dim)
    writer.add_rope_dimension_count_swa(config.head_dim)
    if SLIDING_ATTENTION in config.rope:
        writer.add_rope_freq_base_swa(config.rope[SLIDING_ATTENTION].theta)
    writer.add_sliding_window_pattern([kind == SLIDING_ATTENTION for kind in config.layer_types])
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    if config.final_logit_softcapping is not None:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.moe is not None:
        writer.add_expert_count(config.moe.num_experts)
        writer.add_expert_used_count(config.moe.top_k)
        writer.add_expert_feed_forward_length(config.moe.intermediate_size)
    pairs = config.global_head_dim // 2
    rotated = int(pairs * config.rope[FULL_ATTENTION].partial_rotary_factor)
    factors = np.array([1.0] * rotated + [UNROTATED_FACTOR] * (pairs - rotated), np.float32)
    return [GGUFTensor(ROPE_FREQS, (pairs,), "F32", lambda: factors)]
