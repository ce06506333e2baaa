"""Text configs of the released Gemma 4 sizes, as HF `config.json` dicts (docs/gemma4.md).

They let benchmarks and tests build size-faithful models with random weights:
`Gemma4Model(parse_config(GEMMA4_PRESETS["e4b"]))`. Values come from HF's conversion script
(E2B, E4B, 26B-A4B, 31B); the 12B column is third-party and unverified against Google's file.
Widths use the plain-field dialect (`global_head_dim`, `num_global_key_value_heads`), which
both HF and mlx-lm read.
"""

from __future__ import annotations

from typing import Any

from hearth.config import FULL_ATTENTION, SLIDING_ATTENTION


def _layer_types(sliding_per_full: int, repeats: int) -> list[str]:
    return ([SLIDING_ATTENTION] * sliding_per_full + [FULL_ATTENTION]) * repeats


def _text_config(**fields: Any) -> dict[str, Any]:
    """Fields every size shares, then the size's own."""
    return {
        "model_type": "gemma4_text",
        "vocab_size": 262_144,
        "vocab_size_per_layer_input": 262_144,
        "head_dim": 256,
        "global_head_dim": 512,
        "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_parameters": {
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL_ATTENTION: {
                "rope_type": "proportional",
                "rope_theta": 1_000_000.0,
                "partial_rotary_factor": 0.25,
            },
        },
        "final_logit_softcapping": 30.0,
        "tie_word_embeddings": True,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": False,
        **fields,
    }


GEMMA4_PRESETS: dict[str, dict[str, Any]] = {
    "e2b": _text_config(
        hidden_size=1536,
        num_hidden_layers=35,
        layer_types=_layer_types(4, 7),
        num_attention_heads=8,
        num_key_value_heads=1,
        intermediate_size=6144,
        use_double_wide_mlp=True,
        num_kv_shared_layers=20,
        hidden_size_per_layer_input=256,
        sliding_window=512,
        max_position_embeddings=131_072,
    ),
    "e4b": _text_config(
        hidden_size=2560,
        num_hidden_layers=42,
        layer_types=_layer_types(5, 7),
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=10240,
        num_kv_shared_layers=18,
        hidden_size_per_layer_input=256,
        sliding_window=512,
        max_position_embeddings=131_072,
    ),
    "26b-a4b": _text_config(
        hidden_size=2816,
        num_hidden_layers=30,
        layer_types=_layer_types(5, 5),
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        intermediate_size=2112,
        enable_moe_block=True,
        num_experts=128,
        top_k_experts=8,
        moe_intermediate_size=704,
        sliding_window=1024,
        max_position_embeddings=262_144,
    ),
    "31b": _text_config(
        hidden_size=5376,
        num_hidden_layers=60,
        layer_types=_layer_types(5, 10),
        num_attention_heads=32,
        num_key_value_heads=16,
        num_global_key_value_heads=4,
        attention_k_eq_v=True,
        intermediate_size=21504,
        sliding_window=1024,
        max_position_embeddings=262_144,
    ),
    "12b": _text_config(
        hidden_size=3840,
        num_hidden_layers=48,
        layer_types=_layer_types(5, 8),
        num_attention_heads=16,
        num_key_value_heads=8,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        intermediate_size=15360,
        sliding_window=1024,
        max_position_embeddings=262_144,  # unknown; the 26B/31B value
    ),
}
