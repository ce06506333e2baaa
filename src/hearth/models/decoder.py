"""What Gemma 3 and Gemma 4 models share: the scaled token embedding, RoPE tables per layer
kind, the final norm, the tied head and the final logit softcap."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hearth.config import ModelConfig
from hearth.kv.cache import CacheSpec
from hearth.layers.embedding import Embedding
from hearth.layers.norm import RMSNorm

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class SoftTokens:
    """Rows that stand in for the embeddings of a run of prompt tokens: one image's (or
    clip's) soft tokens, computed by its tower before the prompt is prefilled."""

    start: int  # the absolute position of the first
    embeddings: torch.Tensor  # [tokens, hidden] in the model's compute dtype
    bidirectional: bool = False  # its tokens see each other on the layers where the model says

    @property
    def end(self) -> int:
        return self.start + self.embeddings.shape[0]


def chunk_end(start: int, end: int, step: int, soft: Sequence[SoftTokens]) -> int:
    """Where a prefill chunk from `start` ends: `step` tokens on, moved back to the start of
    a bidirectional run of soft tokens it would split (or on to that run's end, if the run
    begins at `start` and outgrows the step), since each must see its whole run at once."""
    cut = min(start + step, end)
    for run in soft:
        if run.bidirectional and run.start < cut < run.end:
            cut = run.start if run.start > start else run.end
    return cut


class DecoderModel(nn.Module):
    """The ends of a decoder-only Gemma: subclasses add `layers` and the forward between."""

    rotary: nn.ModuleDict
    layers: nn.ModuleList

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.compute_dtype = dtype
        self.embed_tokens: nn.Module = Embedding(config.vocab_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @staticmethod
    def specs_for(config: ModelConfig) -> list[CacheSpec]:
        """One `CacheSpec` per layer of `config` that stores K/V, in layer order."""
        raise NotImplementedError

    def cache_specs(self) -> list[CacheSpec]:
        """The caches this model reads and writes: one per layer that stores K/V."""
        return self.specs_for(self.config)

    def next_norm(self, index: int) -> RMSNorm:
        """The norm applied after layer `index`: the next layer's input norm, or the final."""
        following = index + 1 < len(self.layers)
        return self.layers[index + 1].input_layernorm if following else self.norm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' rows scaled by √hidden, which HF rounds to the table's dtype first
        (25.25, not 25.298, in bf16 for 640)."""
        x = self.embed_tokens.embed(input_ids, self.compute_dtype)
        return x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, Rope]:
        """cos/sin of each layer kind at `positions`."""
        return {kind: rotary(positions, dtype) for kind, rotary in self.rotary.items()}

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """The head over the finally normed residual, then the softcap if the config has one."""
        tied = self.config.tie_word_embeddings
        logits = self.embed_tokens.head(normed) if tied else self.lm_head(normed)
        softcap = self.config.final_logit_softcapping
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits

    @staticmethod
    def positions(tokens: int, start: int | torch.Tensor, device: torch.device) -> torch.Tensor:
        """Absolute positions of a chunk; `start` may be a device tensor, so that a captured
        decode step reads it at replay."""
        return torch.arange(tokens, device=device) + start


def last_of(x: torch.Tensor, last_index: torch.Tensor | None) -> torch.Tensor:
    """x[:, last_index] kept as a dim of length 1 (the last token when `last_index` is None),
    or of one row per index where `last_index` holds several (a ragged forward's asked rows)."""
    return x[:, -1:] if last_index is None else x.index_select(1, last_index.reshape(-1))


def no_rows_asked(last_only: bool, last_index: torch.Tensor | None) -> bool:
    """Whether a forward asks for no logits at all (a ragged forward none of whose sequences
    ends its prompt): its K/V are all it makes."""
    return last_only and last_index is not None and last_index.numel() == 0


def no_logits(normed: torch.Tensor, vocab: int) -> torch.Tensor:
    """The logits of no rows, [batch, 0, vocab]."""
    return normed.new_empty((normed.shape[0], 0, vocab))
