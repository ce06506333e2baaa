"""Tiny random Gemma 3 and Gemma 4 checkpoints, written with HF transformers (the oracle)."""

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


SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_gemma4_config(**overrides: Any) -> Any:
    """A tiny `Gemma4TextConfig`: every width is given, since HF's defaults are E2B-sized
    (the PLE table alone would be 262144 x 7680), and PLE is off unless asked for."""
    from transformers import Gemma4TextConfig

    fields: dict[str, Any] = {
        "vocab_size": len(TINY_VOCAB),
        "vocab_size_per_layer_input": len(TINY_VOCAB),
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,  # full layers: 4 of 16 frequency pairs rotate (factor 0.25)
        "hidden_size_per_layer_input": 0,
        "sliding_window": 8,
        "layer_types": [SLIDING, FULL, SLIDING, FULL],
        "final_logit_softcapping": 30.0,
        "max_position_embeddings": 512,
        **overrides,
    }
    return Gemma4TextConfig(**fields)


def tiny_gemma4_model(seed: int = 0, **overrides: Any) -> Any:
    """An fp32 HF Gemma4ForCausalLM with random weights.

    HF initialises norms, `layer_scalar` and the router scales to ones: they are randomised so
    that a wrong convention (1 + w, a missed scale) shows. The token table gets std 0.5 so
    that logits reach the softcap's curved range, and the router std 3 so that expert scores
    differ (with HF's 0.02 they nearly tie, and any rounding reorders the top-k).
    """
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(tiny_gemma4_config(**overrides)).eval()
    randomise_gemma4(model)
    return model


def randomise_gemma4(model: Any) -> None:
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if "norm" in name or name.endswith(("layer_scalar", "router.scale")):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("per_expert_scale"):
                tensor.uniform_(0.5, 2.0)
            elif name.endswith("embed_tokens.weight"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("router.proj.weight"):
                tensor.normal_(0.0, 3.0)


def save_hf(model: Any, directory: Path, max_shard_size: str | None = None) -> Path:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


# Gemma 4 features, to combine into tiny configs.
PLE = {"hidden_size_per_layer_input": 8}
K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
MOE = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 24}

# A tiny Gemma 4 whose head_dims (32 sliding, 64 full) every KV layout can store, with PLE
# and KV sharing: the KV-cache tests run each cache kind on it.
GEMMA4_SHARING = {
    "head_dim": 32,
    "global_head_dim": 64,
    "hidden_size_per_layer_input": 8,
    "num_hidden_layers": 6,
    "num_kv_shared_layers": 2,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
}


# Joins the turns' words: a template the word-level tokenizer below can read back.
WORDS_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def save_tiny_with_tokenizer(directory: Path, chat_template: bool = True, **overrides: Any) -> Path:
    """`tiny_gemma3_model` saved with a word-level tokenizer over TINY_VOCAB (prompts are
    words like "t5 t6"; BOS, EOS as in the vocabulary) and, if asked, a chat template: a
    whole checkpoint `Engine.load` and the CLI take, with a context as short as a test needs
    (`max_position_embeddings`)."""
    import json

    import tokenizers
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    save_hf(tiny_gemma3_model(**overrides), directory)
    backend = tokenizers.Tokenizer(
        WordLevel({token: i for i, token in enumerate(TINY_VOCAB)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = WhitespaceSplit()
    backend.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
    if chat_template:
        config["chat_template"] = WORDS_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
