"""Gemma 4 text decoder (spec: shared/reference/gemma4-architecture.md §2, §7).

What Gemma 4 changes from Gemma 3: attention scale 1 with a weightless V norm, K standing in for
V on k_eq_v layers, proportional RoPE on full layers, KV sharing, per-layer embeddings (PLE),
the MoE block beside the dense MLP, `layer_scalar` and the final softcap. Parameter names
follow HF's, without the `model.` prefix, so canonical checkpoint tensors load by name.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from hearth.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Gemma4AudioConfig,
    Gemma4Config,
    Gemma4UnifiedVisionConfig,
)
from hearth.kv.cache import CacheSpec, KVView, LayerCache
from hearth.layers import per_layer
from hearth.layers.attention import Attention, Blocks, ValueMode, last_queries, numbered
from hearth.layers.embedding import Embedding
from hearth.layers.experts import Experts, Router
from hearth.layers.linear import CodesMajor, ordered_input, project
from hearth.layers.mlp import MLP
from hearth.layers.norm import (
    Partials,
    RMSNorm,
    add_rms_norm,
    moe_add_rms_norm,
    moe_combine_add_rms_norm,
)
from hearth.layers.rope import ProportionalRotaryEmbedding
from hearth.media import Audio, Image, MediaError
from hearth.media.audio import LogMelExtractor
from hearth.media.image import (
    DEFAULT_IMAGE_TOKENS,
    image_patches,
    soft_token_count,
    unified_image_patches,
)
from hearth.models.decoder import (
    DecoderModel,
    Rope,
    SoftTokens,
    last_of,
    no_logits,
    no_rows_asked,
)
from hearth.models.gemma4_audio import Gemma4AudioEncoder, Gemma4AudioTower
from hearth.models.gemma4_unified import UnifiedAudioEncoder, UnifiedVisionEmbedder
from hearth.models.gemma4_vision import Gemma4VisionModel, MultimodalEmbedder


def _value_mode(config: Gemma4Config, layer: int) -> ValueMode:
    """How layer `layer` makes V: none on a KV-sharing layer, the normed raw K on a k_eq_v
    full layer, its own projection normed without weight elsewhere."""
    if layer >= config.first_kv_shared_layer:
        return ValueMode.ABSENT
    if config.attention_k_eq_v and config.layer_types[layer] == FULL_ATTENTION:
        return ValueMode.UNIT_NORM_OF_K
    return ValueMode.UNIT_NORM


class Gemma4DecoderLayer(nn.Module):
    """Sandwich-normed attention and feed-forward, then the PLE update, all scaled by
    `layer_scalar`. With MoE the feed-forward is dense MLP + experts, each with its own norms."""

    def __init__(self, config: Gemma4Config, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        kind = config.layer_types[layer]
        self.layer_type = kind
        self.self_attn = Attention(
            hidden,
            config.num_attention_heads,
            config.kv_heads_of(kind),
            config.head_dim_of(kind),
            eps,
            1.0,
            config.sliding_window if kind == SLIDING_ATTENTION else None,
            _value_mode(config, layer),
            window_bounds_blocks=not config.unbounded_image_blocks,
        )
        self.mlp = MLP(hidden, config.mlp_width(layer))
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.eps = eps
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.has_moe = config.moe is not None
        if self.has_moe:
            self.router = Router(config)
            self.experts = Experts(config)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        per_layer_width = config.hidden_size_per_layer_input
        if per_layer_width:
            self.per_layer_input_gate = nn.Linear(hidden, per_layer_width, bias=False)
            self.per_layer_projection = nn.Linear(per_layer_width, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        normed_input: torch.Tensor,
        rope: Rope,
        positions: torch.Tensor,
        cache: LayerCache | None,
        shared: KVView | None,
        per_layer_input: torch.Tensor | None,
        next_norm: RMSNorm,
        blocks: Blocks = (),
    ) -> tuple[torch.Tensor, torch.Tensor, KVView]:
        """The residual stream after this layer, its norm by `next_norm` (the next layer's
        input norm, or the final norm) and the K/V view attended over. `blocks`: position
        runs (images) whose tokens see each other whole on this layer.

        `normed_input` is `input_layernorm(x)`, computed by the layer before with its last
        residual add: each norm here is fused with the add (and the layer scalar) before it.
        """
        attended, view = self.self_attn(normed_input, rope, positions, cache, shared, blocks)
        if self.has_moe and per_layer_input is None:
            return (*self._moe_feed_forward(x, attended, next_norm), view)
        order = None if self.has_moe else self.mlp.input_order(x)
        x, normed = add_rms_norm(
            x,
            attended,
            self.post_attention_layernorm.weight,
            self.eps,
            self.pre_feedforward_layernorm.weight,
            normalize_next=True,
            codes_major=order,
        )
        assert normed is not None
        ff = self._feed_forward(x, ordered_input(normed, order, x.shape))
        last_norm = self.post_feedforward_layernorm
        if per_layer_input is not None:
            gate, x = per_layer.gate_after_add_norm(
                ff, self.per_layer_input_gate, x, last_norm.weight, self.eps
            )
            ff = per_layer.update(gate, per_layer_input, self.per_layer_projection)
            last_norm = self.post_per_layer_input_norm
        x, normed_next = add_rms_norm(
            x, ff, last_norm.weight, self.eps, next_norm.weight, True, self.layer_scalar
        )
        assert normed_next is not None
        return x, normed_next, view

    def _moe_feed_forward(
        self, x: torch.Tensor, attended: torch.Tensor | Partials, next_norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `forward` does from the attention's output on; a MoE layer's five norms in
        two kernels (`moe_add_rms_norm`, `moe_combine_add_rms_norm`)."""
        inputs = moe_add_rms_norm(
            x,
            attended,
            self.post_attention_layernorm.weight,
            self.eps,
            self.pre_feedforward_layernorm.weight,
            self.pre_feedforward_layernorm_2.weight,
            self.router.scale,
        )
        hidden = x.shape[-1]
        dense = self.mlp(inputs.dense)
        weights, experts = self.router.route(inputs.router.reshape(-1, hidden))
        expert_input = inputs.experts.reshape(-1, hidden)
        slot_weights = None
        # Where kernels run, the slots' outputs go to the combine kernel, which sums them.
        slots = self.experts.slot_outputs(expert_input, weights, experts)
        if slots is not None:
            per_slot, summing_weights = slots
            sparse = per_slot.view(*x.shape[:-1], *per_slot.shape[-2:])
            slot_weights = summing_weights.view(*x.shape[:-1], summing_weights.shape[-1])
        else:
            sparse = self.experts(expert_input, weights, experts).view_as(x)
        return moe_combine_add_rms_norm(
            inputs.residual,
            dense,
            sparse,
            self.post_feedforward_layernorm_1.weight,
            self.post_feedforward_layernorm_2.weight,
            self.post_feedforward_layernorm.weight,
            self.eps,
            next_norm.weight,
            self.layer_scalar,
            slot_weights,
        )

    def _feed_forward(
        self, x: torch.Tensor, normed: torch.Tensor | CodesMajor
    ) -> torch.Tensor | Partials:
        """The feed-forward of the residual `x`, whose pre-feed-forward norm is `normed`
        (`CodesMajor` only without MoE), for the add-norm after it."""
        if not self.has_moe:
            return self.mlp.for_norm(normed)
        dense = self.mlp(normed)
        flat = x.reshape(-1, x.shape[-1])
        weights, experts = self.router(flat)  # the router reads the unnormalised residual
        sparse = self.experts(self.pre_feedforward_layernorm_2(flat), weights, experts)
        # norm_1(dense) + norm_2(sparse), the add fused with the second norm.
        dense = self.post_feedforward_layernorm_1(dense)
        sparse = sparse.view_as(x)
        return add_rms_norm(dense, sparse, self.post_feedforward_layernorm_2.weight, self.eps)[0]


class Gemma4Model(DecoderModel):
    """Scaled embedding (+ per-layer inputs), decoder layers, final norm, tied head, softcap;
    with a vision tower, images' soft tokens in place of their placeholder tokens' rows."""

    config: Gemma4Config
    media_kinds: tuple[str, ...] = ()
    # Soft tokens of an image whose request names no budget (the checkpoint's processor's).
    default_image_tokens: int = DEFAULT_IMAGE_TOKENS
    # A clip's features as the checkpoint's processor config sets them (None: HF's defaults).
    audio_features: LogMelExtractor | None = None

    def __init__(self, config: Gemma4Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(config, layer) for layer in range(config.num_hidden_layers)
        )
        self.rotary = nn.ModuleDict(
            {
                kind: ProportionalRotaryEmbedding(config.head_dim_of(kind), rope)
                for kind, rope in config.rope.items()
            }
        )
        per_layer_width = config.hidden_size_per_layer_input * config.num_hidden_layers
        if per_layer_width:
            self.embed_tokens_per_layer: nn.Module = Embedding(
                config.vocab_size_per_layer_input, per_layer_width
            )
            self.per_layer_model_projection = nn.Linear(
                config.hidden_size, per_layer_width, bias=False
            )
            self.per_layer_projection_norm = RMSNorm(
                config.hidden_size_per_layer_input, config.rms_norm_eps
            )
        vision = config.vision
        if isinstance(vision, Gemma4UnifiedVisionConfig):  # 12B: no tower, raw patches
            self.vision_embedder = UnifiedVisionEmbedder(vision)
            self.embed_vision = MultimodalEmbedder(
                vision.mm_embed_dim, config.hidden_size, vision.rms_norm_eps
            )
            self.media_kinds = ("image",)
        elif vision is not None:
            self.vision_tower = Gemma4VisionModel(vision)
            self.embed_vision = MultimodalEmbedder(
                vision.hidden_size, config.hidden_size, vision.rms_norm_eps
            )
            self.media_kinds = ("image",)
        audio = config.audio
        if isinstance(audio, Gemma4AudioConfig):
            self.audio_tower = Gemma4AudioTower(audio)
            self.embed_audio = MultimodalEmbedder(
                audio.output_proj_dims, config.hidden_size, audio.rms_norm_eps
            )
            self.media_kinds = (*self.media_kinds, "audio")
        elif audio is not None:  # 12B: no tower, raw frames
            self.embed_audio = MultimodalEmbedder(
                audio.samples_per_token, config.hidden_size, audio.rms_norm_eps
            )
            self.media_kinds = (*self.media_kinds, "audio")

    def audio_encoder(self) -> Gemma4AudioEncoder | UnifiedAudioEncoder | None:
        """What turns a clip into this model's soft tokens, if it takes audio."""
        audio = self.config.audio
        if audio is None:
            return None
        if not isinstance(audio, Gemma4AudioConfig):
            return UnifiedAudioEncoder(
                self.embed_audio, audio.samples_per_token, self.compute_dtype
            )
        return Gemma4AudioEncoder(
            self.audio_tower, self.embed_audio, self.config.hidden_size, self.audio_features
        )

    @staticmethod
    def specs_for(config: Gemma4Config) -> list[CacheSpec]:
        """The layers before the first KV-sharing one store K/V, each kind at its own head
        size and KV-head count; the sharers read their donor's (the last owner of their kind)."""
        return [
            CacheSpec(
                index,
                kind,
                config.kv_heads_of(kind),
                config.head_dim_of(kind),
                config.sliding_window if kind == SLIDING_ATTENTION else None,
            )
            for index, kind in enumerate(config.cache_layer_types)
        ]

    def module_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A canonical checkpoint tensor as this module stores it: norm weights (x̂·w, used as
        they are) in fp32 from the value rounded to the compute dtype, as HF upcasts per call."""
        tensor = tensor.to(self.compute_dtype)
        return tensor.float() if _is_norm_weight(name) else tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        caches: Sequence[LayerCache] | None = None,
        start: int | torch.Tensor = 0,
        last_only: bool = False,
        last_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        soft: Sequence[SoftTokens] = (),
    ) -> torch.Tensor:
        """Logits [batch, tokens, vocab] (or [batch, 1, vocab] with `last_only`).

        `last_index` (with `last_only`): the chunk's last real token, or a ragged forward's
        asked rows, and `positions`, as in `Gemma3Model`.

        `caches` holds one cache per layer that computes K/V (`cache_specs`); the KV-sharing
        layers that come last read their donor's view from this same call instead.

        `soft` (one sequence, `start` an int): media soft tokens whose rows replace those of
        the chunk's tokens at their positions, as HF merges them; a bidirectional run must lie
        wholly inside the chunk or outside it.
        """
        x = self.embed(input_ids)
        blocks: Blocks = ()
        if soft:
            x, input_ids, blocks = self._place_soft_tokens(x, input_ids, int(start), soft)
        per_layer = self.per_layer_inputs(input_ids, x)
        if positions is None:
            positions = self.positions(input_ids.shape[1], start, input_ids.device)
        ropes = self.rope_tables(positions, x.dtype)
        donors: dict[str, KVView] = {}
        first_shared = self.config.first_kv_shared_layer
        normed = self.layers[0].input_layernorm(x)
        for index, layer in enumerate(self.layers):
            if index == first_shared and no_rows_asked(last_only, last_index):
                break  # the sharing layers write no cache: nothing is left to compute
            if index == first_shared and last_only:
                # Sharing layers write no cache, so only the last position still matters.
                x, normed = last_of(x, last_index), last_of(normed, last_index)
                positions = last_of(positions[None], last_index)[0]
                per_layer = None if per_layer is None else last_of(per_layer, last_index)
                ropes = {
                    kind: (last_of(cos[None], last_index)[0], last_of(sin[None], last_index)[0])
                    for kind, (cos, sin) in ropes.items()
                }
                donors = {kind: last_queries(view) for kind, view in donors.items()}
                if last_index is not None:  # a padded chunk: mask its padding by position
                    donors = {kind: numbered(view) for kind, view in donors.items()}
                last_index, last_only = None, False  # the rows left are the ones asked
            owns_kv = index < first_shared
            x, normed, view = layer(
                x,
                normed,
                ropes[layer.layer_type],
                positions,
                caches[index] if caches is not None and owns_kv else None,
                None if owns_kv else donors[layer.layer_type],
                None if per_layer is None else per_layer[:, :, index],
                self.next_norm(index),
                blocks if self._blocks_on(layer.layer_type) else (),
            )
            if owns_kv:  # the last owner of each type is the donor of the sharers of that type
                donors[layer.layer_type] = view
        if no_rows_asked(last_only, last_index):
            return no_logits(normed, self.config.vocab_size)
        return self.logits(last_of(normed, last_index) if last_only else normed)

    def _blocks_on(self, layer_type: str) -> bool:
        """Whether images attend bidirectionally on layers of this type: on sliding layers
        (HF's `create_masks_for_vision_model`), on every layer for the unified 12B."""
        return layer_type == SLIDING_ATTENTION or self.config.unbounded_image_blocks

    def _place_soft_tokens(
        self, x: torch.Tensor, input_ids: torch.Tensor, start: int, soft: Sequence[SoftTokens]
    ) -> tuple[torch.Tensor, torch.Tensor, Blocks]:
        """The chunk's rows with soft tokens in place (not scaled by √hidden), its ids with
        the pad id there (HF's per-layer inputs read the pad token's row at media positions),
        and the bidirectional runs it holds (which layers see them: `_blocks_on`)."""
        x, input_ids = x.clone(), input_ids.clone()
        end = start + x.shape[1]
        blocks = []
        for item in soft:
            low, high = max(item.start, start), min(item.end, end)
            if low >= high:
                continue
            rows = item.embeddings[low - item.start : high - item.start]
            x[:, low - start : high - start] = rows.to(x.dtype)
            input_ids[:, low - start : high - start] = self.config.pad_token_id
            if item.bidirectional and self.config.bidirectional_vision:
                if (low, high) != (item.start, item.end):
                    raise ValueError("a prefill chunk splits an image that attends bidirectionally")
                blocks.append((item.start, item.end))
        return x, input_ids, tuple(blocks)

    def expand_media(
        self, ids: list[int], media: Sequence[Image | Audio]
    ) -> tuple[list[int], list[tuple[int, int, Image | Audio]]]:
        """`ids` with each media placeholder (in the order of `media`) expanded as HF's
        processor does (an image: `<|image>`, its soft tokens, `<image|>`), and each item's
        (start, length) of soft tokens."""
        placeholders = self._media_tokens()
        expanded: list[int] = []
        spans: list[tuple[int, int, Image | Audio]] = []
        items = iter(media)
        for token in ids:
            kind = placeholders.get(token)
            if kind is None:
                expanded.append(token)
                continue
            item = next(items, None)
            if item is None:
                raise MediaError(f"the prompt has more {kind} placeholders than {kind}s given")
            given = "image" if isinstance(item, Image) else "audio"
            if given != kind:
                raise MediaError(f"the prompt's next placeholder is for {kind}, not {given}")
            begin, soft_id, end = self._wrapping(kind)
            count = self.soft_token_count(item)
            expanded.append(begin)
            spans.append((len(expanded), count, item))
            expanded.extend([soft_id] * count)
            expanded.append(end)
        if next(items, None) is not None:
            raise MediaError("the prompt has fewer media placeholders than images and audio given")
        return expanded, spans

    def _media_tokens(self) -> dict[int, str]:
        """The placeholder token of each media kind the model takes."""
        vision, audio = self.config.vision, self.config.audio
        tokens = {} if vision is None else {vision.image_token_id: "image"}
        if audio is not None:
            tokens[audio.audio_token_id] = "audio"
        return tokens

    def _wrapping(self, kind: str) -> tuple[int, int, int]:
        """(begin, soft token, end) ids of an item of `kind`."""
        vision, audio = self.config.vision, self.config.audio
        if kind == "audio":
            assert audio is not None
            return audio.boa_token_id, audio.audio_token_id, audio.eoa_token_id
        assert kind == "image" and vision is not None
        return vision.boi_token_id, vision.image_token_id, vision.eoi_token_id

    def soft_token_count(self, item: Image | Audio) -> int:
        """How many soft tokens `item` takes in a prompt."""
        if isinstance(item, Audio):
            return self._audio_encoder().soft_tokens(item)
        vision = self.config.vision
        if vision is None:
            raise MediaError("this model takes no image input")
        budget = item.max_tokens or self.default_image_tokens
        return soft_token_count(item.size, budget, vision.patch_size, vision.pooling_kernel_size)

    def embed_media(self, item: Image | Audio) -> SoftTokens:
        """`item`'s soft tokens [count, hidden] in the text embedding space (position 0: the
        caller places them), bidirectional where the model's images are; audio is causal."""
        if isinstance(item, Audio):
            soft = self._audio_encoder().encode(item)
            return SoftTokens(0, soft.to(self.compute_dtype))
        vision = self.config.vision
        if vision is None:
            raise MediaError("this model takes no image input")
        budget = item.max_tokens or self.default_image_tokens
        unified = isinstance(vision, Gemma4UnifiedVisionConfig)
        cut = unified_image_patches if unified else image_patches
        patches = cut(item, budget, vision.patch_size, vision.pooling_kernel_size)
        device = self.device
        pixels = device_pixels(patches.values, device, patches.rescale_in_float64)
        positions = torch.from_numpy(patches.positions).to(device)
        if unified:
            soft = self.embed_vision(self.vision_embedder(pixels, positions))
        else:
            soft = self.embed_vision(self.vision_tower(pixels, positions))
        return SoftTokens(0, soft.to(self.compute_dtype), self.config.bidirectional_vision)

    def _audio_encoder(self) -> Gemma4AudioEncoder | UnifiedAudioEncoder:
        encoder = self.audio_encoder()
        if encoder is None:
            raise MediaError("this model takes no audio input")
        return encoder

    def per_layer_inputs(
        self, input_ids: torch.Tensor, embedded: torch.Tensor
    ) -> torch.Tensor | None:
        """PLE [batch, tokens, layers, width]: the token's own row (scaled by √width) plus a
        normed projection of the scaled embedding (by 1/√hidden), together scaled by 1/√2."""
        width = self.config.hidden_size_per_layer_input
        if not width:
            return None
        shape = (self.config.num_hidden_layers, width)
        rows = self.embed_tokens_per_layer.embed(input_ids, self.compute_dtype)
        tokens = rows * torch.tensor(math.sqrt(width), dtype=rows.dtype)
        context = project(self.per_layer_model_projection, embedded, wide=True)
        context = context * self.config.hidden_size**-0.5
        context = self.per_layer_projection_norm(context.unflatten(-1, shape))
        return (context + tokens.unflatten(-1, shape)) * 2**-0.5


def _is_norm_weight(name: str) -> bool:
    owner = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and "norm" in owner


def device_pixels(
    values: np.ndarray, device: torch.device, in_float64: bool = True
) -> torch.Tensor:
    """8-bit patch values as float32 pixels in [0, 1] on `device`, by the processor's rule
    (`media.image.scaled`, which does the same on the host) run after the copy, which moves a
    quarter of the bytes and leaves the host no float pass over the image."""
    on_device = torch.from_numpy(values).to(device)
    if in_float64:
        return (on_device.to(torch.float64) * (1 / 255)).to(torch.float32)
    return on_device.to(torch.float32) * (1 / 255)
