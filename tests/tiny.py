"""Tiny random Gemma 3 checkpoints, written with HF transformers (the oracle) into temp dirs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_VOCAB = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(252)]


def tiny_gemma3_config(**overrides: Any) -> Any:
    from transformers import Gemma3TextConfig

    fields: dict[str, Any] = {
        "vocab_size": len(TINY_VOCAB),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "sliding_window": 8,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "full_attention",
        ],
        "query_pre_attn_scalar": 24,
        "max_position_embeddings": 512,
        **overrides,
    }
    return Gemma3TextConfig(**fields)


def tiny_gemma3_model(seed: int = 0, **overrides: Any) -> Any:
    """An fp32 HF Gemma3ForCausalLM with random weights, norms included (HF inits them to 0)."""
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(tiny_gemma3_config(**overrides)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3)
    return model


def save_hf(model: Any, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory
