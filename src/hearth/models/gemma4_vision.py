"""Gemma 4's vision tower: image patches to soft tokens in the text model's embedding space.

HF's `Gemma4VisionModel` + `embed_vision` (spec: shared/reference/gemma4-architecture.md §4.1):
a linear patch embedding plus a learned 2-D position table, sandwich-normed encoder layers
with q/k/v norms and axial 2-D RoPE (attention scale 1, every patch sees every patch), a
GeGLU MLP, linears that may clamp their input and output, then 3x3 average pooling by patch
position, √hidden scaling, optional standardization and the weightless norm + projection into
the text hidden size. Parameter names follow HF's, so canonical checkpoint tensors load by name.

One image is encoded at a time, without the processor's padding patches: HF masks them out of
attention and pooling, so they change nothing but the order of some fp32 sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hearth.config import Gemma4VisionConfig
from hearth.layers.clipped import ClippedLinear
from hearth.layers.linear import project
from hearth.layers.norm import RMSNorm, rms_norm


def axial_rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [patches, head_dim] of 2-D RoPE: the first half of a head rotates by the
    patch's x, the second by its y, each half NeoX-style with frequencies over head_dim / 2."""
    half = head_dim // 2
    exponents = torch.arange(0, half, 2, dtype=torch.float32, device=positions.device) / half
    inv_freq = 1.0 / (theta**exponents)
    angles = positions[..., None].float() * inv_freq  # [patches, 2, half / 2]
    cos, sin = angles.cos(), angles.sin()

    def layout(table: torch.Tensor) -> torch.Tensor:
        x, y = table[:, 0], table[:, 1]
        return torch.cat([x, x, y, y], dim=-1).to(dtype)

    return layout(cos), layout(sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [patches, heads, head_dim] rotated: each half by its own axis's angles."""
    cos, sin = cos[:, None], sin[:, None]
    halves = []
    for part, c, s in zip(x.chunk(2, -1), cos.chunk(2, -1), sin.chunk(2, -1), strict=True):
        halves.append(part * c + _rotate_half(part) * s)
    return torch.cat(halves, dim=-1)


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's patches: q/k RMSNorm with weights, V's
    without, 2-D RoPE on q and k, scale 1."""

    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, dim, clip = config.hidden_size, config.head_dim, config.use_clipped_linears
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            dim,
        )
        self.eps = config.rms_norm_eps
        self.q_proj = ClippedLinear(hidden, self.heads * dim, clip)
        self.k_proj = ClippedLinear(hidden, self.kv_heads * dim, clip)
        self.v_proj = ClippedLinear(hidden, self.kv_heads * dim, clip)
        self.o_proj = ClippedLinear(self.heads * dim, hidden, clip)
        self.q_norm = RMSNorm(dim, self.eps)
        self.k_norm = RMSNorm(dim, self.eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        patches = x.shape[0]
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(patches, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(patches, self.kv_heads, self.head_dim))
        v = rms_norm(self.v_proj(x).view(patches, self.kv_heads, self.head_dim), None, self.eps)
        q, k = apply_axial_rope(q, cos, sin), apply_axial_rope(k, cos, sin)
        # [1, heads, patches, dim]: with a batch dim the CPU takes SDPA's flash kernel (5x
        # faster at 2520 patches than the 3-D call).
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, scale=1.0, enable_gqa=self.heads != self.kv_heads
        )
        return self.o_proj(out[0].transpose(0, 1).reshape(patches, -1))


class VisionMLP(nn.Module):
    """GeGLU (tanh GELU) over clipped linears."""

    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, width, clip = (
            config.hidden_size,
            config.intermediate_size,
            config.use_clipped_linears,
        )
        self.gate_proj = ClippedLinear(hidden, width, clip)
        self.up_proj = ClippedLinear(hidden, width, clip)
        self.down_proj = ClippedLinear(width, hidden, clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = F.gelu(self.gate_proj(x), approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class VisionEncoderLayer(nn.Module):
    """x + post_norm(attn(pre_norm(x))), then the same around the MLP."""

    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    """Pixels in [0, 1] to 2x − 1, a linear map, plus the x and y rows of the position table."""

    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * config.patch_size**2, config.hidden_size, bias=False)
        self.position_embedding_table = nn.Parameter(
            torch.ones(2, config.position_embedding_size, config.hidden_size)
        )

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        table = self.position_embedding_table  # in the compute dtype, whatever the linear's
        x = project(self.input_proj, (2 * (pixels - 0.5)).to(table.dtype))
        return x + (table[0][positions[:, 0]] + table[1][positions[:, 1]])


class VisionEncoder(nn.Module):
    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(config) for _ in range(config.num_hidden_layers)
        )


class Gemma4VisionModel(nn.Module):
    """HF's `Gemma4VisionModel`: patches of one image to its pooled, scaled soft tokens."""

    def __init__(self, config: Gemma4VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = VisionEncoder(config)
        if config.standardize:
            self.std_bias = nn.Parameter(torch.empty(config.hidden_size))
            self.std_scale = nn.Parameter(torch.empty(config.hidden_size))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Soft tokens [patches / k², hidden] of one image's patches [patches, 3·p²] (values in
        [0, 1]) at `positions` [patches, 2] (x, y), the grid's rows in order."""
        config = self.config
        x = self.patch_embedder(pixels, positions)
        rope = axial_rope_tables(positions, config.head_dim, config.rope_theta, x.dtype)
        for layer in self.encoder.layers:
            x = layer(x, rope)
        pooled = pool_patches(x, positions, config.pooling_kernel_size)
        # Scaled and standardized in fp32, as HF does: √hidden can pass float16's range.
        pooled = pooled.float() * config.hidden_size**0.5
        if config.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        return pooled.to(x.dtype)


def pool_patches(x: torch.Tensor, positions: torch.Tensor, kernel: int) -> torch.Tensor:
    """The mean of each kernel x kernel block of patches, by position, in fp32: slot
    floor(x/k) + (width/k)·floor(y/k), the pooled grid's rows in order."""
    width = int(positions[:, 0].max()) + 1
    slots = positions[:, 0] // kernel + (width // kernel) * (positions[:, 1] // kernel)
    count = x.shape[0] // kernel**2
    weights = F.one_hot(slots, count).float() / kernel**2
    return (weights.T @ x.float()).to(x.dtype)


class MultimodalEmbedder(nn.Module):
    """HF's `Gemma4MultimodalEmbedder`: a weightless RMSNorm, then a linear map into the text
    model's hidden size (the soft tokens are not scaled by √hidden as token rows are)."""

    def __init__(self, width: int, text_hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.embedding_projection = nn.Linear(width, text_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.embedding_projection, rms_norm(x, None, self.eps))
