"""The 12B "unified" Gemma 4's encoder-free image embedder and audio encoder (spec:
shared/reference/gemma4-architecture.md §4.1, HF `Gemma4UnifiedVisionEmbedder`).

There is no vision transformer: each soft token is one (patch · pooling)² square of raw pixels
(48x48x3 = 6912 values in the release), LayerNorm, Linear to `mm_embed_dim`, LayerNorm, plus
a learned row of the x table and one of the y table for the square's place in the grid, and a
last LayerNorm. `embed_vision` (a weightless RMSNorm and a Linear, `MultimodalEmbedder`) then
maps it into the text embedding space. The LayerNorms are torch's (ε 1e-5, with bias), as HF's.
Parameter names follow HF's checkpoint (`vision_embedder.*`; mlx-vlm's conversion keeps them).

Audio has no tower either: each 640-sample frame of the 16 kHz clip goes through `embed_audio`
(the same RMSNorm and Linear) as one soft token, causal in the prompt.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional

from hearth.config import Gemma4UnifiedVisionConfig
from hearth.media import Audio
from hearth.media.audio import waveform_frames
from hearth.models.gemma4_vision import MultimodalEmbedder

_LAYER_NORM_EPS = 1e-5  # torch's nn.LayerNorm default, which HF's embedder keeps


class UnifiedVisionEmbedder(nn.Module):
    """Patch pixels [patches, 6912] and their (x, y) grid places [patches, 2] -> [patches,
    mm_embed_dim], before `embed_vision`."""

    def __init__(self, config: Gemma4UnifiedVisionConfig) -> None:
        super().__init__()
        pixels = config.model_patch_size**2 * 3
        width = config.mm_embed_dim
        self.patch_ln1 = nn.LayerNorm(pixels, eps=_LAYER_NORM_EPS)
        self.patch_dense = nn.Linear(pixels, width)
        self.patch_ln2 = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)
        # [row, axis, width]: axis 0 holds the x (column) rows, axis 1 the y (row) rows.
        self.pos_embedding = nn.Parameter(torch.zeros(config.mm_posemb_size, 2, width))
        self.pos_norm = nn.LayerNorm(width, eps=_LAYER_NORM_EPS)

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # The table's dtype is the model's (a quantized patch_dense may hold no float weight).
        x = _layer_norm(self.patch_ln1, pixels.to(self.pos_embedding.dtype))
        x = _layer_norm(self.patch_ln2, self.patch_dense(x))
        table = self.pos_embedding
        x = x + (table[positions[:, 0], 0] + table[positions[:, 1], 1]).to(x.dtype)
        return _layer_norm(self.pos_norm, x)


def _layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)` with its weights in x's dtype (the loader keeps norm weights in fp32)."""
    return functional.layer_norm(
        x, norm.normalized_shape, norm.weight.to(x.dtype), norm.bias.to(x.dtype), norm.eps
    )


class UnifiedAudioEncoder:
    """A clip to its soft-token embeddings [soft_tokens(audio), text hidden]: raw frames
    through the model's `embed_audio` (HF's `Gemma4UnifiedModel.get_audio_features`)."""

    def __init__(
        self, embedder: MultimodalEmbedder, samples_per_token: int, dtype: torch.dtype
    ) -> None:
        self.embedder = embedder
        self.samples_per_token = samples_per_token
        self.dtype = dtype

    def soft_tokens(self, audio: Audio) -> int:
        """One per frame, the last one zero-padded: HF's processor count."""
        return -(-len(audio.checked_samples()) // self.samples_per_token)

    @torch.inference_mode()
    def encode(self, audio: Audio) -> torch.Tensor:
        frames = waveform_frames(audio.checked_samples(), self.samples_per_token)
        device = self.embedder.embedding_projection.weight.device
        return self.embedder(torch.from_numpy(frames).to(device, self.dtype))
