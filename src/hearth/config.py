"""Model configs: one dataclass per family, parsed from an HF-style config dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hearth.errors import CheckpointError, UnsupportedModelError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type: base and linear position scaling."""

    theta: float
    linear_factor: float = 1.0


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope: dict[str, RopeConfig]
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None
    attn_logit_softcapping: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str = "gemma3_text"

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """Bytes of K and V one token adds to a dense cache across all layers."""
        per_layer = 2 * self.num_key_value_heads * self.head_dim * element_bytes
        return per_layer * self.num_hidden_layers


def _rope_from_hf(config: dict[str, Any]) -> dict[str, RopeConfig]:
    """Both config dialects: `rope_parameters` per layer type (HF 5) or flat fields (HF 4)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and FULL_ATTENTION in params:
        return {kind: _rope_entry(params[kind]) for kind in (FULL_ATTENTION, SLIDING_ATTENTION)}
    full = {
        "rope_theta": config.get("rope_theta", 1_000_000.0),
        **(config.get("rope_scaling") or {}),
    }
    sliding = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
    return {FULL_ATTENTION: _rope_entry(full), SLIDING_ATTENTION: _rope_entry(sliding)}


def _rope_entry(entry: dict[str, Any]) -> RopeConfig:
    rope_type = entry.get("rope_type", entry.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=float(entry["rope_theta"]))
    if rope_type == "linear":
        return RopeConfig(theta=float(entry["rope_theta"]), linear_factor=float(entry["factor"]))
    raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")


def _layer_types(config: dict[str, Any], layers: int) -> tuple[str, ...]:
    types = config.get("layer_types")
    if types is None:
        pattern = int(
            config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6))
        )
        types = [
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION for i in range(layers)
        ]
    if len(types) != layers or any(t not in (FULL_ATTENTION, SLIDING_ATTENTION) for t in types):
        raise CheckpointError(
            f"layer_types must list {layers} of {FULL_ATTENTION}/{SLIDING_ATTENTION}"
        )
    return tuple(types)


def gemma3_config(config: dict[str, Any]) -> Gemma3Config:
    try:
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return Gemma3Config(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or hidden // heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            sliding_window=int(config.get("sliding_window") or 4096),
            layer_types=_layer_types(config, layers),
            rope=_rope_from_hf(config),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            max_position_embeddings=int(config.get("max_position_embeddings", 131072)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )
    except KeyError as error:
        raise CheckpointError(f"config lacks the field {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"config has a field of the wrong type: {error}") from None


_PARSERS = {"gemma3_text": gemma3_config, "gemma3": gemma3_config}


def parse_config(config: dict[str, Any]) -> Gemma3Config:
    """The typed config of an HF-style dict; unknown model types are refused by name."""
    model_type = config.get("model_type")
    parser = _PARSERS.get(str(model_type))
    if parser is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_PARSERS))})"
        )
    return parser(config)
