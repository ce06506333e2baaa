"""Gemma 3 text decoder.

Module and parameter names follow HF transformers (without the `model.` prefix), so canonical
checkpoint tensors load by name. Norms and softmax run in fp32; matmuls in the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hearth.config import SLIDING_ATTENTION, Gemma3Config
from hearth.kv.cache import CacheSpec, LayerCache
from hearth.layers.attention import Attention
from hearth.layers.linear import ordered_input
from hearth.layers.mlp import MLP
from hearth.layers.norm import RMSNorm, add_rms_norm
from hearth.layers.rope import RotaryEmbedding
from hearth.models.decoder import DecoderModel, Rope, last_of, no_logits, no_rows_asked


class DecoderLayer(nn.Module):
    """The four-norm sandwich: norm → attention → norm → add; norm → MLP → norm → add."""

    def __init__(self, config: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        hidden, eps = config.hidden_size, config.rms_norm_eps
        window = config.sliding_window if layer_type == SLIDING_ATTENTION else None
        self.self_attn = Attention(
            hidden,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            eps,
            config.attention_scale,
            window,
        )
        self.mlp = MLP(hidden, config.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        normed_input: torch.Tensor,
        rope: Rope,
        positions: torch.Tensor,
        cache: LayerCache | None,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after this layer and its norm by `next_norm`.

        `normed_input` is `input_layernorm(x)`, computed by the layer before (fused with its
        last residual add): each norm here is fused with the add before it.
        """
        attended, _ = self.self_attn(normed_input, rope, positions, cache)
        order = self.mlp.input_order(x)
        x, normed = add_rms_norm(
            x,
            attended,
            self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps,
            self.pre_feedforward_layernorm.weight,
            normalize_next=True,
            codes_major=order,
        )
        assert normed is not None
        post_ff = self.post_feedforward_layernorm
        hidden = self.mlp.for_norm(ordered_input(normed, order, x.shape))
        x, normed_next = add_rms_norm(
            x, hidden, post_ff.weight, post_ff.eps, next_norm.weight, True
        )
        assert normed_next is not None
        return x, normed_next


class Gemma3Model(DecoderModel):
    """Embedding (scaled by √hidden in the weight dtype), decoder layers, final norm, tied head."""

    config: Gemma3Config

    def __init__(self, config: Gemma3Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_types)
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(config.head_dim, rope) for kind, rope in config.rope.items()}
        )

    @staticmethod
    def specs_for(config: Gemma3Config) -> list[CacheSpec]:
        """Every layer stores K/V, sliding ones a window of them."""
        return [
            CacheSpec(
                index,
                kind,
                config.num_key_value_heads,
                config.head_dim,
                config.sliding_window if kind == SLIDING_ATTENTION else None,
            )
            for index, kind in enumerate(config.layer_types)
        ]

    def module_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A canonical checkpoint tensor as this module stores it.

        Norm weights become 1 + w in fp32, from w rounded to the compute dtype first, which
        is what HF computes on every call (`1.0 + weight.float()` on a weight of that dtype).
        """
        tensor = tensor.to(self.compute_dtype)
        return 1.0 + tensor.float() if name.endswith("norm.weight") else tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        caches: Sequence[LayerCache] | None = None,
        start: int | torch.Tensor = 0,
        last_only: bool = False,
        last_index: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [batch, tokens, vocab] (or [batch, 1, vocab] with `last_only`).

        `last_index` (with `last_only`; a device scalar): the chunk's last real token, when
        the chunk is padded past it (a CUDA-graph prefill); the last token otherwise; or
        ([rows]) the rows whose logits a ragged forward asks (its caches `RaggedBatch`es).
        `positions` ([tokens]): each token's position, where the tokens are not one run from
        `start` (several sequences' tokens side by side, their caches a `SequenceBatch` or a
        `RaggedBatch`).
        """
        x = self.embed(input_ids)
        if positions is None:
            positions = self.positions(input_ids.shape[1], start, input_ids.device)
        ropes = self.rope_tables(positions, x.dtype)
        normed = self.layers[0].input_layernorm(x)
        for index, layer in enumerate(self.layers):
            cache = caches[index] if caches is not None else None
            rope = ropes[layer.layer_type]
            x, normed = layer(x, normed, rope, positions, cache, self.next_norm(index))
        if no_rows_asked(last_only, last_index):
            return no_logits(normed, self.config.vocab_size)
        return self.logits(last_of(normed, last_index) if last_only else normed)
