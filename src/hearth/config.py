"""Model configs: one dataclass per family, parsed from an HF-style config dict."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from hearth.errors import CheckpointError, UnsupportedModelError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding of one layer type: base and linear position scaling.

    `partial_rotary_factor` < 1 is Gemma 4's proportional RoPE: only that fraction of the
    frequency pairs rotates, with exponents still over the full head_dim; the rest pass through.
    """

    theta: float
    linear_factor: float = 1.0
    partial_rotary_factor: float = 1.0


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


@dataclass(frozen=True)
class MoEConfig:
    """Gemma 4's sparse expert block, which runs beside the dense MLP in every layer."""

    num_experts: int
    top_k: int
    intermediate_size: int


@dataclass(frozen=True)
class Gemma4AudioConfig:
    """Gemma 4's Conformer audio tower (HF `Gemma4AudioConfig`) and the prompt tokens around
    a clip's soft tokens."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    subsampling_conv_channels: tuple[int, int]
    conv_kernel_size: int
    residual_weight: float
    attention_chunk_size: int
    attention_context_left: int
    attention_context_right: int
    attention_logit_cap: float
    attention_invalid_logits_value: float
    use_clipped_linears: bool
    rms_norm_eps: float
    gradient_clipping: float
    output_proj_dims: int
    audio_token_id: int
    boa_token_id: int
    eoa_token_id: int


@dataclass(frozen=True)
class Gemma4VisionConfig:
    """Gemma 4's vision tower (HF `Gemma4VisionConfig`) and the prompt tokens around an image."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float  # the axial 2-D RoPE's base
    patch_size: int
    pooling_kernel_size: int
    position_embedding_size: int
    use_clipped_linears: bool
    standardize: bool
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int


@dataclass(frozen=True)
class Gemma4UnifiedVisionConfig:
    """The 12B "unified" model's encoder-free image embedder (HF `Gemma4UnifiedVisionConfig`):
    (patch · pooling)² · 3 raw pixels per soft token, LayerNorm, Linear to `mm_embed_dim`,
    LayerNorm, + learned x and y position rows, LayerNorm, then `embed_vision`."""

    patch_size: int
    pooling_kernel_size: int
    mm_embed_dim: int
    mm_posemb_size: int  # rows of each of the x and y position tables
    rms_norm_eps: float
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def model_patch_size(self) -> int:
        """The side of one soft token's square of pixels (48 in the release)."""
        return self.patch_size * self.pooling_kernel_size


@dataclass(frozen=True)
class Gemma4UnifiedAudioConfig:
    """The 12B "unified" model's audio input (HF `Gemma4UnifiedAudioConfig`): raw 16 kHz frames
    of `samples_per_token` samples, each projected by `embed_audio` into one soft token."""

    samples_per_token: int
    rms_norm_eps: float
    audio_token_id: int
    boa_token_id: int
    eoa_token_id: int


@dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4 text decoder (HF `Gemma4TextConfig` meanings; see docs/gemma4.md).

    Sliding and full-attention layers differ in head_dim and KV heads; the last
    `num_kv_shared_layers` layers reuse the K/V of the last earlier layer of their type.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # sliding-window layers
    global_head_dim: int  # full-attention layers
    num_key_value_heads: int  # sliding-window layers
    num_global_key_value_heads: int  # full-attention layers, whichever field it came from
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope: dict[str, RopeConfig]
    attention_k_eq_v: bool
    num_kv_shared_layers: int
    use_double_wide_mlp: bool
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    moe: MoEConfig | None
    final_logit_softcapping: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str = "gemma4_text"
    # The audio tower (or the unified model's frame embedder), when the checkpoint has one.
    audio: Gemma4AudioConfig | Gemma4UnifiedAudioConfig | None = None
    # The vision tower (or the unified model's encoder-free embedder), when the checkpoint has one.
    vision: Gemma4VisionConfig | Gemma4UnifiedVisionConfig | None = None
    pad_token_id: int = 0  # what per-layer inputs read at soft-token positions
    # Image soft tokens attend to their whole image on sliding layers (26B, 31B).
    bidirectional_vision: bool = False
    # The unified 12B as HF runs it: an image's block on every layer, not bounded by the window
    # (HF's `Gemma4UnifiedModel.forward` passes the blocks to every mask, as Gemma 3 does).
    unbounded_image_blocks: bool = False

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def cache_layer_types(self) -> tuple[str, ...]:
        """Types of the layers that compute K/V and so own a cache (the sharing ones come last)."""
        return self.layer_types[: self.first_kv_shared_layer]

    def head_dim_of(self, layer_type: str) -> int:
        return self.global_head_dim if layer_type == FULL_ATTENTION else self.head_dim

    def kv_heads_of(self, layer_type: str) -> int:
        if layer_type == FULL_ATTENTION:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def mlp_width(self, layer: int) -> int:
        """Dense MLP width: doubled on the KV-sharing layers of double-wide configs (E2B)."""
        doubled = self.use_double_wide_mlp and layer >= self.first_kv_shared_layer
        return self.intermediate_size * (2 if doubled else 1)


_T = TypeVar("_T")


def _field(
    config: Mapping[str, Any], name: str, kind: Callable[[Any], _T], default: _T | None = None
) -> _T:
    """config[name] as `kind`; a missing or null field takes `default`, or is an error without."""
    value = config.get(name)
    if value is None:
        if default is None:
            raise CheckpointError(f"config lacks the field {name!r}")
        return default
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"config field {name!r} has the wrong type: {value!r}") from None


def _optional_field(config: Mapping[str, Any], name: str, kind: Callable[[Any], _T]) -> _T | None:
    return None if config.get(name) is None else _field(config, name, kind)


# HF's Gemma 4 defaults, used when `rope_parameters` is absent.
_GEMMA4_ROPE = {
    SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL_ATTENTION: {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.25},
}


def _gemma4_rope(text: Mapping[str, Any], layer_types: tuple[str, ...]) -> dict[str, RopeConfig]:
    params = text.get("rope_parameters") or _GEMMA4_ROPE
    rope = {}
    for kind in sorted(set(layer_types)):
        entry = params.get(kind)
        if not isinstance(entry, dict):
            raise CheckpointError(f"config field 'rope_parameters' has no entry for {kind!r}")
        rope_type = entry.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported for Gemma 4")
        theta = _field(entry, "rope_theta", float)
        if rope_type == "default":
            rope[kind] = RopeConfig(theta=theta)
            continue
        rope[kind] = RopeConfig(
            theta=theta,
            linear_factor=_field(entry, "factor", float, 1.0),
            partial_rotary_factor=_field(entry, "partial_rotary_factor", float, 1.0),
        )
    return rope


def _full_layer_override(
    overrides: Mapping[str, Any], layer_types: tuple[str, ...]
) -> Mapping[str, Any]:
    """The override that HF's `per_layer_config` applies to every full-attention layer."""
    try:
        by_layer = {int(index): dict(fields) for index, fields in overrides.items()}
    except (TypeError, ValueError):
        raise CheckpointError(
            "config field 'per_layer_config' must map layer indices to objects"
        ) from None
    full = [by_layer.get(i, {}) for i, kind in enumerate(layer_types) if kind == FULL_ATTENTION]
    sliding = any(by_layer.get(i) for i, kind in enumerate(layer_types) if kind != FULL_ATTENTION)
    if sliding or any(fields != full[0] for fields in full):
        raise UnsupportedModelError(
            "config field 'per_layer_config' must override every full-attention layer alike "
            "and no sliding layer (one head_dim and KV head count per layer type)"
        )
    return full[0] if full else {}


def _gemma4_attention_widths(
    text: Mapping[str, Any], layer_types: tuple[str, ...]
) -> tuple[int, int, int, int]:
    """(head_dim, global_head_dim, KV heads, full-layer KV heads) from either config dialect."""
    head_dim = _field(text, "head_dim", int, 256)
    kv_heads = _field(text, "num_key_value_heads", int)
    overrides = text.get("per_layer_config")
    if overrides is not None:  # HF ≥ 5 writes full-layer widths as per-layer overrides
        full = _full_layer_override(overrides, layer_types)
        return (
            head_dim,
            _field(full, "head_dim", int, head_dim),
            kv_heads,
            _field(full, "num_key_value_heads", int, kv_heads),
        )
    # Older HF and MLX: plain fields; the global KV head count applies only with k_eq_v.
    k_eq_v = _field(text, "attention_k_eq_v", bool, False)
    global_kv = _field(text, "num_global_key_value_heads", int, kv_heads)
    global_head_dim = _field(text, "global_head_dim", int, 512)
    return head_dim, global_head_dim, kv_heads, global_kv if k_eq_v else kv_heads


def _gemma4_moe(text: Mapping[str, Any]) -> MoEConfig | None:
    if not _field(text, "enable_moe_block", bool, False):
        return None
    return MoEConfig(
        num_experts=_field(text, "num_experts", int),
        top_k=_field(text, "top_k_experts", int),
        intermediate_size=_field(text, "moe_intermediate_size", int),
    )


def _check_kv_sharing(layer_types: tuple[str, ...], shared: int) -> None:
    """Every KV-sharing layer needs an earlier, non-sharing layer of its type to read from."""
    first_shared = len(layer_types) - shared
    if not 0 <= shared < len(layer_types):
        raise CheckpointError(
            f"config field 'num_kv_shared_layers' is {shared}: it must be below "
            f"num_hidden_layers ({len(layer_types)})"
        )
    for index in range(first_shared, len(layer_types)):
        if layer_types[index] not in layer_types[:first_shared]:
            raise CheckpointError(
                f"config field 'num_kv_shared_layers' is {shared}: layer {index} "
                f"({layer_types[index]}) has no earlier layer of its type to share K/V with"
            )


# The 12B "unified" model: its multimodal config, and its text config (as the safetensors
# reader flattens a multimodal config.json).
_UNIFIED_TYPES = ("gemma4_unified", "gemma4_unified_text")
# HF's `Gemma4UnifiedTextConfig` defaults where they differ from Gemma 4's or where Gemma 4 has
# none; its decoder has no per-layer inputs and no MoE block.
_UNIFIED_TEXT_DEFAULTS = {
    "vocab_size": 262_144,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "sliding_window": 1024,
    "max_position_embeddings": 262_144,
    "use_bidirectional_attention": "vision",
}


def _gemma4_text(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text decoder's fields: the config itself, or `text_config` of a multimodal one."""
    model_type = config.get("model_type")
    if model_type not in ("gemma4", "gemma4_unified"):
        return config
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"config of model_type {model_type!r} lacks a 'text_config' object")
    # The multimodal config holds the tying flag for the whole model.
    return {**text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}


def _sub_config(config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    """A tower's config object (None when absent); anything but an object is refused."""
    value = config.get(name)
    if value is not None and not isinstance(value, dict):
        raise CheckpointError(f"config field {name!r} must be an object")
    return value


def _gemma4_audio(config: Mapping[str, Any]) -> Gemma4AudioConfig | None:
    """The audio tower of a multimodal config (HF's defaults for absent fields), or None."""
    audio = _sub_config(config, "audio_config")
    if audio is None:
        return None
    if audio.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError("the audio tower's activation must be silu")
    channels = tuple(_field(audio, "subsampling_conv_channels", list, [128, 32]))
    if len(channels) != 2:
        raise UnsupportedModelError("the audio tower must have two subsampling convolutions")
    return Gemma4AudioConfig(
        hidden_size=_field(audio, "hidden_size", int, 1024),
        num_hidden_layers=_field(audio, "num_hidden_layers", int, 12),
        num_attention_heads=_field(audio, "num_attention_heads", int, 8),
        subsampling_conv_channels=(int(channels[0]), int(channels[1])),
        conv_kernel_size=_field(audio, "conv_kernel_size", int, 5),
        residual_weight=_field(audio, "residual_weight", float, 0.5),
        attention_chunk_size=_field(audio, "attention_chunk_size", int, 12),
        attention_context_left=_field(audio, "attention_context_left", int, 13),
        attention_context_right=_field(audio, "attention_context_right", int, 0),
        attention_logit_cap=_field(audio, "attention_logit_cap", float, 50.0),
        attention_invalid_logits_value=_field(
            audio, "attention_invalid_logits_value", float, -1.0e9
        ),
        use_clipped_linears=_field(audio, "use_clipped_linears", bool, True),
        rms_norm_eps=_field(audio, "rms_norm_eps", float, 1e-6),
        gradient_clipping=_field(audio, "gradient_clipping", float, 1e10),
        output_proj_dims=_field(audio, "output_proj_dims", int, 1536),
        audio_token_id=_field(config, "audio_token_id", int, 258_881),
        boa_token_id=_field(config, "boa_token_id", int, 256_000),
        # HF's config names it `eoa_token_index`; releases write `eoa_token_id`.
        eoa_token_id=_field(
            config, "eoa_token_id", int, _field(config, "eoa_token_index", int, 258_883)
        ),
    )


def _gemma4_vision(config: Mapping[str, Any]) -> Gemma4VisionConfig | None:
    """The vision tower of a multimodal config, or of its text config that carries the
    tower's fields beside it (HF's defaults for absent fields)."""
    vision = _sub_config(config, "vision_config")
    if vision is None:
        return None
    if vision.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError("the vision tower's activation must be gelu_pytorch_tanh")
    rope = vision.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise UnsupportedModelError("the vision tower's RoPE must be 'axial'")
    heads = _field(vision, "num_attention_heads", int, 12)
    hidden = _field(vision, "hidden_size", int, 768)
    return Gemma4VisionConfig(
        hidden_size=hidden,
        intermediate_size=_field(vision, "intermediate_size", int, 3072),
        num_hidden_layers=_field(vision, "num_hidden_layers", int, 16),
        num_attention_heads=heads,
        num_key_value_heads=_field(vision, "num_key_value_heads", int, heads),
        head_dim=_field(vision, "head_dim", int, 64),
        rms_norm_eps=_field(vision, "rms_norm_eps", float, 1e-6),
        rope_theta=_field(rope, "rope_theta", float, 100.0),
        patch_size=_field(vision, "patch_size", int, 16),
        pooling_kernel_size=_field(vision, "pooling_kernel_size", int, 3),
        position_embedding_size=_field(vision, "position_embedding_size", int, 10 * 1024),
        use_clipped_linears=_field(vision, "use_clipped_linears", bool, False),
        standardize=_field(vision, "standardize", bool, False),
        image_token_id=_field(config, "image_token_id", int, 258_880),
        boi_token_id=_field(config, "boi_token_id", int, 255_999),
        eoi_token_id=_field(config, "eoi_token_id", int, 258_882),
    )


def _unified_text(text: Mapping[str, Any]) -> Mapping[str, Any]:
    """A unified text config as Gemma 4 text fields: its own defaults, no PLE, no MoE."""
    for field in ("hidden_size_per_layer_input", "enable_moe_block"):
        if text.get(field):
            raise UnsupportedModelError(f"a gemma4_unified text config has no {field!r}")
    # Absent fields only: an explicit null (e.g. causal images) keeps its meaning.
    return {
        **_UNIFIED_TEXT_DEFAULTS,
        **text,
        "hidden_size_per_layer_input": 0,
        "enable_moe_block": False,
    }


def _gemma4_unified_vision(config: Mapping[str, Any]) -> Gemma4UnifiedVisionConfig | None:
    vision = _sub_config(config, "vision_config")
    if vision is None:
        return None
    return Gemma4UnifiedVisionConfig(
        patch_size=_field(vision, "patch_size", int, 16),
        pooling_kernel_size=_field(vision, "pooling_kernel_size", int, 3),
        mm_embed_dim=_field(vision, "mm_embed_dim", int, 3840),
        mm_posemb_size=_field(vision, "mm_posemb_size", int, 1120),
        rms_norm_eps=_field(vision, "rms_norm_eps", float, 1e-6),
        image_token_id=_field(config, "image_token_id", int, 258_880),
        boi_token_id=_field(config, "boi_token_id", int, 255_999),
        eoi_token_id=_field(config, "eoi_token_id", int, 258_882),
    )


def _gemma4_unified_audio(config: Mapping[str, Any]) -> Gemma4UnifiedAudioConfig | None:
    audio = _sub_config(config, "audio_config")
    if audio is None:
        return None
    return Gemma4UnifiedAudioConfig(
        samples_per_token=_field(audio, "audio_embed_dim", int, 640),
        rms_norm_eps=_field(audio, "rms_norm_eps", float, 1e-6),
        audio_token_id=_field(config, "audio_token_id", int, 258_881),
        boa_token_id=_field(config, "boa_token_id", int, 256_000),
        eoa_token_id=_field(
            config, "eoa_token_id", int, _field(config, "eoa_token_index", int, 258_883)
        ),
    )


def gemma4_config(config: dict[str, Any]) -> Gemma4Config:
    unified = config.get("model_type") in _UNIFIED_TYPES
    text = _gemma4_text(config)
    if unified:
        text = _unified_text(text)
    if text.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError("use_bidirectional_attention 'all' is not supported")
    layers = _field(text, "num_hidden_layers", int)
    layer_types = _layer_types(dict(text), layers)
    shared = _field(text, "num_kv_shared_layers", int, 0)
    _check_kv_sharing(layer_types, shared)
    head_dim, global_head_dim, kv_heads, global_kv_heads = _gemma4_attention_widths(
        text, layer_types
    )
    return Gemma4Config(
        vocab_size=_field(text, "vocab_size", int),
        hidden_size=_field(text, "hidden_size", int),
        intermediate_size=_field(text, "intermediate_size", int),
        num_hidden_layers=layers,
        num_attention_heads=_field(text, "num_attention_heads", int),
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        num_key_value_heads=kv_heads,
        num_global_key_value_heads=global_kv_heads,
        rms_norm_eps=_field(text, "rms_norm_eps", float, 1e-6),
        sliding_window=_field(text, "sliding_window", int, 512),
        layer_types=layer_types,
        rope=_gemma4_rope(text, layer_types),
        attention_k_eq_v=_field(text, "attention_k_eq_v", bool, False),
        num_kv_shared_layers=shared,
        # HF's default (false); mlx-lm's is true, so converted configs always spell it out.
        use_double_wide_mlp=_field(text, "use_double_wide_mlp", bool, False),
        hidden_size_per_layer_input=_field(text, "hidden_size_per_layer_input", int, 256),
        vocab_size_per_layer_input=_field(text, "vocab_size_per_layer_input", int, 262_144),
        moe=_gemma4_moe(text),
        final_logit_softcapping=_optional_field(text, "final_logit_softcapping", float),
        max_position_embeddings=_field(text, "max_position_embeddings", int, 131_072),
        tie_word_embeddings=_field(text, "tie_word_embeddings", bool, True),
        model_type="gemma4_unified" if unified else "gemma4_text",
        audio=_gemma4_unified_audio(config) if unified else _gemma4_audio(config),
        vision=_gemma4_unified_vision(config) if unified else _gemma4_vision(config),
        pad_token_id=_field(text, "pad_token_id", int, 0),
        bidirectional_vision=text.get("use_bidirectional_attention") == "vision",
        unbounded_image_blocks=unified and text.get("use_bidirectional_attention") == "vision",
    )


ModelConfig = Gemma3Config | Gemma4Config

_PARSERS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "gemma3_text": gemma3_config,
    "gemma3": gemma3_config,
    "gemma4_text": gemma4_config,
    "gemma4": gemma4_config,
    "gemma4_unified_text": gemma4_config,
    "gemma4_unified": gemma4_config,
}


def parse_config(config: dict[str, Any]) -> ModelConfig:
    """The typed config of an HF-style dict; unknown model types are refused by name."""
    model_type = config.get("model_type")
    parser = _PARSERS.get(str(model_type))
    if parser is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(_PARSERS))})"
        )
    return parser(config)
