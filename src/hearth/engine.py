"""`Engine`: a loaded model and its tokenizer, with text-in, text-out generation."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hearth.checkpoint import open_checkpoint
from hearth.embedded import embedded_model_path
from hearth.generate import GenerationChunk, stream_generate
from hearth.models.gemma import Gemma3Model
from hearth.models.loading import build_model
from hearth.sampling import SamplingParams
from hearth.tokenizer import Tokenizer

Messages = list[dict[str, Any]]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(
    checkpoint_format: str, device: torch.device, quantize: str | None = None
) -> torch.dtype:
    """bf16 on a GPU and with quantized weights; else fp32 on the CPU (exact)."""
    return torch.bfloat16 if device.type == "cuda" or quantize else torch.float32


@dataclass
class Engine:
    model: Gemma3Model
    tokenizer: Tokenizer
    path: Path

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        progress: bool = True,
        quantize: str | None = None,
    ) -> Engine:
        """Load a GGUF file or HF-format directory; None means the embedded Gemma 3 270M.

        `quantize` ("int8" or "int4") keeps linear weights quantized in memory for fast CPU
        decode (bf16 compute); None keeps them in `dtype`.
        """
        path = Path(model) if model is not None else embedded_model_path()
        checkpoint = open_checkpoint(path)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
            dtype = DTYPES[dtype]
        dtype = dtype or default_dtype(checkpoint.format, device, quantize)
        tokenizer = checkpoint.tokenizer()
        return cls(build_model(checkpoint, dtype, device, progress, quantize), tokenizer, path)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every tensor once (the tied table as head)."""
        return sum(t.nbytes for t in self.model.state_dict().values())

    def encode(self, prompt: str | Messages, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt: messages always go through the chat template; text only
        when `chat` is true (None: when the checkpoint ships a chat template)."""
        if isinstance(prompt, list):
            return self.tokenizer.encode_chat(prompt)
        if chat is None:
            chat = self.tokenizer.has_own_chat_template
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def stream(
        self,
        prompt: str | Messages,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = None,
    ) -> Iterator[GenerationChunk]:
        ids = self.encode(prompt, chat)
        return stream_generate(self.model, self.tokenizer, ids, sampling, max_tokens, stop)

    def generate(
        self,
        prompt: str | Messages,
        max_tokens: int = 256,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = None,
    ) -> str:
        return "".join(
            chunk.text for chunk in self.stream(prompt, max_tokens, sampling, stop, chat)
        )
