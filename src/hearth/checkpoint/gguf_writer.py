"""Write a Gemma 3 GGUF in llama.cpp's layout (tests and benchmarks build random models with it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def write_gemma3_gguf(
    path: Path,
    config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    tokens: Sequence[str],
    matrix_type: str = "F32",
) -> Path:
    """Write `tensors` (canonical names, HF values) as a gemma3 GGUF.

    Norm weights are stored as 1 + w and 2-D weights in `matrix_type` (F32, F16, BF16, Q8_0,
    Q5_0, Q4_0: those the `gguf` package can quantize), as llama.cpp's converter does.
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
    writer.add_rope_freq_base(parsed.rope[FULL_ATTENTION].theta)
    writer.add_sliding_window(parsed.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(list(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    quant_type = gguf.GGMLQuantizationType[matrix_type]
    for name, tensor in tensors.items():
        values = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            writer.add_tensor(gguf_name(name), (values + 1).astype(np.float32))
        elif values.ndim == 2 and matrix_type != "F32":
            data = gguf.quants.quantize(values, quant_type)
            writer.add_tensor(gguf_name(name), data, raw_shape=data.shape, raw_dtype=quant_type)
        else:
            writer.add_tensor(gguf_name(name), values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
