"""Gemma 4's Conformer audio tower: a clip's log-mel frames to soft tokens in the text
model's embedding space.

HF's `Gemma4AudioModel` + `embed_audio` (spec: shared/reference/gemma4-architecture.md §4.2):
two stride-2 convolutions over (time, mel) with a channel LayerNorm and ReLU, a linear into
the tower's width, then Conformer layers: half-step feed-forward, chunked local
self-attention with sinusoidal relative positions and a logit softcap, a light causal
depthwise convolution, another half-step feed-forward and a final norm. An output projection
and the weightless norm + projection of `embed_audio` end in the text hidden size. Parameter
names follow HF's (`audio_tower.*`, `embed_audio.*`), so canonical checkpoint tensors load by
name.

One clip is encoded at a time and only its real frames (`hearth.media.audio`): HF's padded
frames are masked out of attention and lie after the real ones, where the causal convolution
cannot carry them back, so they change nothing at real positions.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from hearth.config import Gemma4AudioConfig
from hearth.layers.clipped import ClippedLinear
from hearth.layers.linear import project
from hearth.layers.norm import RMSNorm
from hearth.media import Audio
from hearth.media.audio import LogMelExtractor
from hearth.models.gemma4_vision import MultimodalEmbedder

# HF builds the tower's feed-forward and block norms with Gemma4RMSNorm's default epsilon,
# not the config's (which the light convolution and subsampling norms use).
_BLOCK_NORM_EPS = 1e-6


class SubsampleBlock(nn.Module):
    """Conv2d 3x3, stride 2 over (time, mel), no bias; LayerNorm over channels; ReLU."""

    def __init__(self, in_channels: int, out_channels: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(out_channels, eps=eps, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)  # [channels, time, mel]
        norm = self.norm
        channels_last = x.permute(1, 2, 0).float()
        weight = norm.weight.float()  # fp32 as loaded; a benchmark's random one may not be
        normed = F.layer_norm(channels_last, norm.normalized_shape, weight, None, norm.eps)
        return torch.relu(normed.to(x.dtype)).permute(2, 0, 1)


class SubsampleConvProjection(nn.Module):
    """Two subsampling blocks (time and mel / 4), then channels x mel into the tower width."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        first, second = config.subsampling_conv_channels
        self.layer0 = SubsampleBlock(1, first, config.rms_norm_eps)
        self.layer1 = SubsampleBlock(first, second, config.rms_norm_eps)
        # HF sizes this from the channels (first // 4 stands for the 128 mel bins / 4).
        self.input_proj_linear = nn.Linear((first // 4) * second, config.hidden_size, bias=False)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[frames, mel] -> [⌈frames / 4⌉, hidden]."""
        x = self.layer1(self.layer0(features[None]))  # [channels, time, mel / 4]
        x = x.permute(1, 2, 0).flatten(1)  # per time step: mel-major, channel-minor
        return project(self.input_proj_linear, x, wide=True)


class FeedForward(nn.Module):
    """x + residual_weight · norm(W2 silu(W1 norm(x))), activations clamped around it."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden, clipped = config.hidden_size, config.use_clipped_linears
        self.ffw_layer_1 = ClippedLinear(hidden, 4 * hidden, clipped)
        self.ffw_layer_2 = ClippedLinear(4 * hidden, hidden, clipped)
        self.pre_layer_norm = RMSNorm(hidden, _BLOCK_NORM_EPS)
        self.post_layer_norm = RMSNorm(hidden, _BLOCK_NORM_EPS)
        self.clip = config.gradient_clipping
        self.residual_weight = config.residual_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = _clip_bound(self.clip, x.dtype)
        h = self.pre_layer_norm(torch.clamp(x, -clip, clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        h = self.post_layer_norm(torch.clamp(h, -clip, clip))
        return h * self.residual_weight + x


def relative_position_table(
    config: Gemma4AudioConfig, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """[context // 2 + 1, hidden]: sin then cos of distances context // 2 … 0 (descending)
    at timescales geometric from 1 to 10⁴, as HF's `Gemma4AudioRelPositionalEncoding`."""
    context = _context_size(config)
    timescales = config.hidden_size // 2
    step = math.log(10_000.0) / max(timescales - 1, 1)
    inverse = torch.exp(torch.arange(timescales, device=device) * -step)
    distances = torch.arange(context // 2, -1, -1, device=device)[:, None]
    angles = distances * inverse[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(dtype)


def _context_size(config: Gemma4AudioConfig) -> int:
    """Keys a chunk of queries sees: the chunk, its left context, its right context."""
    return (
        config.attention_chunk_size
        + config.attention_context_left
        - 1
        + config.attention_context_right
    )


class ChunkedLocalAttention(nn.Module):
    """Queries in chunks of `chunk`; each chunk attends to a window from `past` keys before
    it to `future` after it. A logit is q·k plus q·(a learned projection of the sinusoid of
    the distance), placed by Transformer-XL's relative shift, then soft-capped; a query sees
    keys 0 … past − 1 steps back and 1 … future − 1 ahead (HF's mask)."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden, clipped = config.hidden_size, config.use_clipped_linears
        self.heads = config.num_attention_heads
        self.head_dim = hidden // self.heads
        self.q_proj = ClippedLinear(hidden, hidden, clipped)
        self.k_proj = ClippedLinear(hidden, hidden, clipped)
        self.v_proj = ClippedLinear(hidden, hidden, clipped)
        self.post = ClippedLinear(hidden, hidden, clipped)
        self.relative_k_proj = nn.Linear(hidden, hidden, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(self.head_dim))
        self.chunk = config.attention_chunk_size
        self.past = config.attention_context_left - 1
        self.future = config.attention_context_right
        self.context = _context_size(config)
        self.softcap = config.attention_logit_cap
        self.invalid_logit = config.attention_invalid_logits_value
        # q is scaled by d^-½ / ln 2 · softplus(per_dim_scale), k by ln(1 + e) / ln 2 (USM's
        # scaling; at per_dim_scale 0 their product is d^-½).
        self.query_scale = self.head_dim**-0.5 / math.log(2)
        self.key_scale = math.log(1 + math.e) / math.log(2)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """x [time, hidden]; positions: `relative_position_table`; visible [blocks, chunk,
        context]: which key of each query's window it attends to."""
        time = x.shape[0]
        heads = (time, self.heads, self.head_dim)
        q = self.q_proj(x).float().view(heads) * self.query_scale
        q = q * F.softplus(self.per_dim_scale)
        k = self.k_proj(x).float().view(heads) * self.key_scale
        v = self.v_proj(x).float().view(heads)

        blocks = visible.shape[0]
        q = F.pad(q, (0, 0, 0, 0, 0, blocks * self.chunk - time)).view(
            blocks, self.chunk, self.heads, self.head_dim
        )
        k, v = self._windows(k), self._windows(v)  # [blocks, context, heads, dim]
        relative = self.relative_k_proj(positions).view(-1, self.heads, self.head_dim).float()

        content = torch.einsum("bqhd,bkhd->hbqk", q, k)
        by_distance = self._shift(torch.einsum("bqhd,lhd->hbql", q, relative))
        logits = torch.tanh((content + by_distance) / self.softcap) * self.softcap
        logits = logits.masked_fill(~visible, self.invalid_logit)
        weights = torch.softmax(logits, dim=-1)
        out = torch.einsum("hbqk,bkhd->bqhd", weights, v).reshape(blocks * self.chunk, -1)
        return self.post(out[:time].to(x.dtype))

    def _windows(self, x: torch.Tensor) -> torch.Tensor:
        """Each chunk's keys: `past` before it to `future` after, zero beyond the clip."""
        padded = F.pad(x, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))
        return padded.unfold(0, self.context, self.chunk).movedim(-1, 1)

    def _shift(self, x: torch.Tensor) -> torch.Tensor:
        """[..., chunk, distances] -> [..., chunk, context]: row r moves right by r, so a
        column counts keys from the window's start (Transformer-XL's relative shift: pad,
        flatten, drop the tail, refold)."""
        *lead, rows, distances = x.shape
        x = F.pad(x, (0, self.context + 1 - distances))
        x = x.reshape(*lead, rows * (self.context + 1))[..., : rows * self.context]
        return x.reshape(*lead, rows, self.context)


class LightConv(nn.Module):
    """x + W_out silu(norm(causal depthwise conv(GLU(W_in norm(x)))))."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden, clipped = config.hidden_size, config.use_clipped_linears
        self.linear_start = ClippedLinear(hidden, 2 * hidden, clipped)
        self.linear_end = ClippedLinear(hidden, hidden, clipped)
        self.depthwise_conv1d = nn.Conv1d(
            hidden, hidden, config.conv_kernel_size, groups=hidden, bias=False
        )
        self.pre_layer_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.conv_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.clip = config.gradient_clipping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        causal = F.pad(h.T, (self.depthwise_conv1d.kernel_size[0] - 1, 0))
        h = self.depthwise_conv1d(causal).T
        clip = _clip_bound(self.clip, h.dtype)
        h = self.conv_norm(torch.clamp(h, -clip, clip))
        return self.linear_end(F.silu(h)) + x


class ConformerLayer(nn.Module):
    """½ feed-forward, attention (pre/post norms), light conv, ½ feed-forward, norm."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.feed_forward1 = FeedForward(config)
        self.self_attn = ChunkedLocalAttention(config)
        self.lconv1d = LightConv(config)
        self.feed_forward2 = FeedForward(config)
        self.norm_pre_attn = RMSNorm(hidden, _BLOCK_NORM_EPS)
        self.norm_post_attn = RMSNorm(hidden, _BLOCK_NORM_EPS)
        self.norm_out = RMSNorm(hidden, _BLOCK_NORM_EPS)
        self.clip = config.gradient_clipping

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        # HF bounds these clamps by the norm weights' dtype (fp32), not the activations'.
        clip = _clip_bound(self.clip, self.norm_pre_attn.weight.dtype)
        x = self.feed_forward1(x)
        attended = self.self_attn(
            self.norm_pre_attn(torch.clamp(x, -clip, clip)), positions, visible
        )
        x = self.norm_post_attn(torch.clamp(attended, -clip, clip)) + x
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(torch.clamp(x, -clip, clip))


class Gemma4AudioTower(nn.Module):
    """HF's `Gemma4AudioModel`: log-mel frames [frames, mel] -> [⌈frames / 4⌉, output dims]."""

    def __init__(self, config: Gemma4AudioConfig) -> None:
        super().__init__()
        self.config = config
        self.subsample_conv_projection = SubsampleConvProjection(config)
        self.layers = nn.ModuleList(ConformerLayer(config) for _ in range(config.num_hidden_layers))
        self.output_proj = nn.Linear(config.hidden_size, config.output_proj_dims, bias=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.subsample_conv_projection(features.to(self.output_proj.weight.dtype))
        positions = relative_position_table(self.config, x.device, x.dtype)
        visible = self.visible_keys(x.shape[0], x.device)
        for layer in self.layers:
            x = layer(x, positions, visible)
        return self.output_proj(x)

    def visible_keys(self, time: int, device: torch.device) -> torch.Tensor:
        """[blocks, chunk, context] bool: query i = chunk·b + r sees key j = chunk·b − past + c
        when both lie in the clip and 0 ≤ i − j < past or 0 < j − i < future (HF's window)."""
        config = self.config
        chunk, past = config.attention_chunk_size, config.attention_context_left - 1
        future = config.attention_context_right
        blocks = -(-time // chunk)
        query = torch.arange(blocks * chunk, device=device).view(blocks, chunk, 1)
        offsets = torch.arange(_context_size(config), device=device)
        key = torch.arange(blocks, device=device).view(blocks, 1, 1) * chunk - past + offsets
        distance = query - key
        window = ((distance >= 0) & (distance < past)) | ((distance < 0) & (-distance < future))
        return window & (key >= 0) & (key < time) & (query < time)


class Gemma4AudioEncoder:
    """A clip to its soft-token embeddings [soft_tokens(audio), text hidden]: features, the
    tower and `embed_audio`. The modules are the model's (`Gemma4Model.audio_tower`,
    `.embed_audio`); this adds the clip-level arithmetic."""

    def __init__(
        self,
        tower: Gemma4AudioTower,
        embedder: MultimodalEmbedder,
        text_hidden: int,
        features: LogMelExtractor | None = None,
    ) -> None:
        self.tower = tower
        self.embedder = embedder
        self.text_hidden = text_hidden
        self.features = features or _default_features()

    @classmethod
    def create(cls, config: Gemma4AudioConfig, text_hidden: int) -> Gemma4AudioEncoder:
        """An encoder with freshly initialised modules (tests, benchmarks)."""
        tower = Gemma4AudioTower(config)
        embedder = MultimodalEmbedder(config.output_proj_dims, text_hidden, config.rms_norm_eps)
        return cls(tower, embedder, text_hidden)

    def soft_tokens(self, audio: Audio) -> int:
        """How many soft tokens `encode(audio)` returns: HF's processor count."""
        return self.features.soft_tokens(len(audio.checked_samples()))

    @torch.inference_mode()
    def encode(self, audio: Audio) -> torch.Tensor:
        frames = self.features(audio.checked_samples())
        # the output projection keeps a float weight under any --quantize (it has a bias)
        like = self.tower.output_proj.weight
        if len(frames) == 0:  # under 10 ms: no soft token
            return like.new_zeros(0, self.text_hidden)
        features = torch.from_numpy(frames).to(like.device)
        return self.embedder(self.tower(features))


@functools.cache
def _default_features() -> LogMelExtractor:
    """HF's default extractor settings (window and mel bank made once)."""
    return LogMelExtractor()


def _clip_bound(clip: float, dtype: torch.dtype) -> float:
    """The activation clamp, at most the dtype's largest value (1e10 overflows fp16)."""
    return min(clip, torch.finfo(dtype).max)
