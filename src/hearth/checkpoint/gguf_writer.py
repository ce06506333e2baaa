"""Write a Gemma 3 GGUF in llama.cpp's layout (tests and benchmarks build random models with it).

`stream_gemma3_gguf` writes tensors one at a time, each encoded only when its turn comes, so
a 12B file never needs its weights in memory at once; `write_gemma3_gguf` wraps in-memory
tensors for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hearth.checkpoint.gguf import _BLOCK_NAMES, _GLOBAL_NAMES
from hearth.config import FULL_ATTENTION, parse_config

_TO_GGUF = {
    **{hf: gguf for gguf, hf in _BLOCK_NAMES.items()},
    **{hf: gguf for gguf, hf in _GLOBAL_NAMES.items()},
}


def gguf_name(canonical: str) -> str:
    """llama.cpp's name for a canonical tensor name."""
    parts = canonical.split(".")
    if parts[0] == "layers":
        return f"blk.{parts[1]}.{_TO_GGUF['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{_TO_GGUF[parts[0]]}.{parts[1]}"


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


def write_gemma3_gguf(
    path: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    tokens: Sequence[str] | None = None,
    matrix_type: str = "F32",
    tokenizer: Mapping[str, Any] | None = None,
) -> Path:
    """Write `tensors` (canonical names, HF values) as a gemma3 GGUF.

    Norm weights are stored as 1 + w and 2-D weights in `matrix_type` (F32, F16, BF16, Q8_0,
    Q5_0, Q4_0: those the `gguf` package can quantize), as llama.cpp's converter does. The
    vocabulary is `tokens` (a minimal tokenizer) or `tokenizer`, `tokenizer.*` metadata as
    read from another GGUF file.
    """
    encoded = [_in_memory(name, tensor, matrix_type) for name, tensor in tensors.items()]
    return stream_gemma3_gguf(path, config, encoded, tokenizer or minimal_tokenizer(tokens))


def _in_memory(name: str, tensor: torch.Tensor, matrix_type: str) -> GGUFTensor:
    import gguf

    values = tensor.detach().float().numpy()
    shape = tuple(values.shape)
    if name.endswith("norm.weight"):
        return GGUFTensor(name, shape, "F32", lambda: (values + 1).astype(np.float32))
    if values.ndim == 2 and matrix_type != "F32":
        quant_type = gguf.GGMLQuantizationType[matrix_type]
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


def stream_gemma3_gguf(
    path: Path,
    config: Mapping[str, Any],
    tensors: Iterable[GGUFTensor],
    tokenizer: Mapping[str, Any],
) -> Path:
    """Write a gemma3 GGUF of `config`: the header, then each tensor as it is encoded.

    `tokenizer` holds `tokenizer.*` metadata (`minimal_tokenizer`, `tokenizer_metadata`).
    """
    import gguf

    parsed = parse_config(dict(config))
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(parsed.num_hidden_layers)
    writer.add_context_length(parsed.max_position_embeddings)
    writer.add_embedding_length(parsed.hidden_size)
    writer.add_feed_forward_length(parsed.intermediate_size)
    writer.add_head_count(parsed.num_attention_heads)
    writer.add_head_count_kv(parsed.num_key_value_heads)
    writer.add_key_length(parsed.head_dim)
    writer.add_value_length(parsed.head_dim)
    writer.add_layer_norm_rms_eps(parsed.rms_norm_eps)
    full_rope = parsed.rope[FULL_ATTENTION]
    writer.add_rope_freq_base(full_rope.theta)
    if full_rope.linear_factor != 1.0:  # Gemma 3 4B/12B/27B: linear, factor 8
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full_rope.linear_factor)
    writer.add_sliding_window(parsed.sliding_window)
    _add_tokenizer(writer, tokenizer)
    tensors = list(tensors)
    for tensor in tensors:
        writer.add_tensor_info(
            gguf_name(tensor.name),
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
