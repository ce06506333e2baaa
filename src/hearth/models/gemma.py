"""Gemma 3 text decoder in PyTorch.

Module and parameter names follow HF transformers (without the `model.` prefix), so canonical
checkpoint tensors load by name. Norms and softmax run in fp32; matmuls in the model dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hearth.config import SLIDING_ATTENTION, Gemma3Config, RopeConfig
from hearth.kv.cache import LayerCache


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: x̂ · (1 + w), computed in fp32 and cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute positions, built in fp32 then cast to the activations' dtype."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # Built on the CPU explicitly: models are constructed on the meta device.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (rope.theta**exponents) / rope.linear_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves (NeoX layout): x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Boolean [queries, keys]: causal, and within `window` keys (q − k < window) if given."""
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def _slow_half_sdpa(q: torch.Tensor) -> bool:
    """PyTorch's CPU SDPA is ~3x slower in bf16/fp16 than two matmuls for one query."""
    return q.device.type == "cpu" and q.dtype != torch.float32


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per head over all keys, GQA by grouping query heads; softmax in fp32."""
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = (grouped @ k.transpose(-1, -2)).float() * scale
    out = scores.softmax(dim=-1).to(v.dtype) @ v
    return out.reshape(batch, heads, 1, dim)


class Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.sliding_window if layer_type == SLIDING_ATTENTION else None
        hidden, q_dim, kv_dim = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: LayerCache | None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        q = apply_rotary(self.q_norm(q).transpose(1, 2), cos, sin)
        k = apply_rotary(self.k_norm(k).transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        key_positions = None
        if cache is not None:
            k, v, key_positions = cache.update_and_fetch(k, v)
        mask = self._mask(positions, key_positions, k.shape[2])
        if length == 1 and mask is None and _slow_half_sdpa(q):
            out = decode_attention(q, k, v, self.scale)
        else:
            grouped = self.num_heads != self.num_kv_heads
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=grouped
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _mask(
        self, positions: torch.Tensor, key_positions: torch.Tensor | None, keys: int
    ) -> torch.Tensor | None:
        if key_positions is None:
            # Keys are positions 0..keys-1 in order: one query at the end needs no causal mask.
            if positions.shape[0] == 1 and (self.window is None or keys <= self.window):
                return None
            key_positions = torch.arange(keys, device=positions.device)
        return attention_mask(positions, key_positions, self.window)


class MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) · up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    """The four-norm sandwich: norm → attention → norm → add; norm → MLP → norm → add."""

    def __init__(self, config: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer_type)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: LayerCache | None,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), rope, positions, cache)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    """Embedding (scaled by √hidden in the weight dtype), decoder layers, final norm, tied head."""

    def __init__(self, config: Gemma3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(config.head_dim, rope) for kind, rope in config.rope.items()}
        )

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        caches: list[LayerCache] | None = None,
        start: int = 0,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [batch, tokens, vocab] (or [batch, 1, vocab] with `last_only`)."""
        weight = self.embed_tokens.weight
        scale = torch.tensor(math.sqrt(self.config.hidden_size), dtype=weight.dtype)
        x = self.embed_tokens(input_ids) * scale
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for index, layer in enumerate(self.layers):
            cache = caches[index] if caches is not None else None
            x = layer(x, ropes[layer.layer_type], positions, cache)
        if last_only:
            x = x[:, -1:]
        logits = F.linear(self.norm(x), self.head_weight)
        softcap = self.config.final_logit_softcapping
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits
