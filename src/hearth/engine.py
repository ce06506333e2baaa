"""`Engine`: a loaded model and its tokenizer, with text-in, text-out generation."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from hearth.checkpoint import open_checkpoint
from hearth.config import parse_config
from hearth.devices import parse_device
from hearth.embedded import embedded_model_path
from hearth.kv import KVPolicy, LayerCache, parse_kv_quant
from hearth.kv.prompt_cache import PromptCache, Reuse, snapshot_caches
from hearth.media import Audio, Image, MediaError
from hearth.media.audio import LogMelExtractor, checkpoint_audio_settings
from hearth.media.image import checkpoint_image_tokens
from hearth.models import Model, cache_specs
from hearth.models.loading import STORED_BLOCKS, build_model
from hearth.ops import native
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.constraints import OutputConstraint
from hearth.runtime.generate import (
    GenerationChunk,
    GenerationRequest,
    PromptMedia,
    stream_generate,
)
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from hearth.runtime.scheduler import Scheduler
from hearth.tokenizer import Tokenizer

Messages = list[dict[str, Any]]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


QUANTIZE_CHOICES = ("auto", "none", "int8", "int4")
# Gemma's residual stream outgrows float16's range (65504): the 270M passes it at layer 7
# and decodes <pad> from NaN logits. Widening it to float32 would be float32 compute.
FLOAT16_ON_CPU = (
    "float16 overflows Gemma's activations on the CPU (NaN logits): use --dtype bfloat16 or float32"
)


def resolve_precision(
    checkpoint_format: str,
    device: torch.device,
    dtype: torch.dtype | None,
    quantize: str,
    stored_dtype: torch.dtype | None = None,
) -> tuple[torch.dtype, str | None]:
    """The compute dtype and how a load holds the weights (None: as values in that dtype).

    "auto": a GGUF file keeps its quantized blocks as stored ("stored", `hearth.layers.gguf`):
    every product sees the file's exact weights, in fp32 on the CPU and bf16 activations on a
    GPU unless a dtype is given ("none" dequantizes them to the dtype at load instead); every
    other checkpoint keeps its values. "int8"/"int4" re-quantize the weights to
    Hearth's own grids (bf16 compute): an explicit opt-in, since that second rounding changes
    answers (mean KL 0.007 nats against fp32 on the 270M model, 7x bf16's). Without a dtype, a
    checkpoint computes in the dtype it is stored in (MLX-quantized ones in their scales' dtype;
    float16 ones in fp32 on the CPU); GGUF files in fp32 on the CPU (exact) and bf16 on a GPU.
    float16 compute on the CPU is refused (FLOAT16_ON_CPU).
    """
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(
            f"unknown quantize {quantize!r} (choose from {', '.join(QUANTIZE_CHOICES)})"
        )
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError(FLOAT16_ON_CPU)
    if quantize == "auto":
        if checkpoint_format == "gguf" and device.type in ("cpu", "cuda"):
            activations = torch.float32 if device.type == "cpu" else torch.bfloat16
            return dtype or activations, STORED_BLOCKS
        quantize = "none"
    if quantize != "none":
        if dtype not in (None, torch.bfloat16):
            raise ValueError(f"--quantize {quantize} computes in bfloat16, not {dtype}")
        return torch.bfloat16, quantize
    if device.type == "cpu" and stored_dtype == torch.float16:
        stored_dtype = torch.float32  # widening is exact; float16 would overflow (above)
    default = torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype or stored_dtype or default, None


def media_of(prompt: str | Messages) -> list[Image | Audio]:
    """The images and audio of a conversation's content parts, in order."""
    if not isinstance(prompt, list):
        return []
    found: list[Image | Audio] = []
    for message in prompt:
        content = message.get("content")
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image", "audio") and isinstance(part.get(kind), Image | Audio):
                found.append(part[kind])
    return found


@dataclass
class Engine:
    """A loaded model, its tokenizer and its runner: text or token ids in, text out."""

    model: Model
    tokenizer: Tokenizer
    path: Path
    runner: ModelRunner
    format: str = ""  # the checkpoint's: gguf, safetensors, mlx

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        progress: bool = True,
        quantize: str = "auto",
        kv_quant: str = "off",
        plan: ExecutionPlan | None = None,
        mmproj: str | Path | None = None,
    ) -> Engine:
        """Load a GGUF file or HF-format directory; None means the embedded Gemma 3 270M.

        `quantize`: "auto" keeps a GGUF file's blocks as stored on the CPU (exact weights, fp32
        unless `dtype` says otherwise; see `resolve_precision`; the Q4_K/Q6_K decode GEMV rounds
        its inputs to bf16 where the CPU has AVX512-BF16, unless `dtype` is float32),
        "int8"/"int4" re-quantize linear weights to Hearth's grids (bf16 compute), "none" keeps
        every tensor in `dtype`.
        `kv_quant`: the KV cache kind, `off|4|8|config|turbo[:SCHEME]` (docs/kv-cache.md),
        checked against the model before any weight is read. `plan`: how to run it (None: the
        device's default, `ExecutionPlan.for_device`). `mmproj`: llama.cpp's mmproj GGUF of a
        Gemma 4 GGUF model's vision tower (without it, the one `mmproj*.gguf` beside the model).
        """
        path = Path(model) if model is not None else embedded_model_path()
        checkpoint = open_checkpoint(path, mmproj)
        kv_policy = parse_kv_quant(kv_quant, checkpoint=path if path.is_dir() else None)
        kv_policy.check(cache_specs(parse_config(checkpoint.config)))
        device = parse_device(device)
        if isinstance(dtype, str):
            if dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
            dtype = DTYPES[dtype]
        asked_fp32 = dtype == torch.float32
        dtype, weights = resolve_precision(
            checkpoint.format, device, dtype, quantize, checkpoint.stored_dtype
        )
        if device.type == "cpu":
            native.kernels()  # built now if ever: its first build is no part of a timed run
        if plan is None:
            plan = ExecutionPlan.for_device(device)
            if asked_fp32:  # fp32 compute asked for: no GEMV rounds its inputs to bf16 either
                plan = replace(plan, gguf_bf16_gemv_types=(), gguf_amx_head_rows=0)
        tokenizer = checkpoint.tokenizer()
        model_ = build_model(checkpoint, dtype, device, progress, weights, plan)
        if path.is_dir() and (budget := checkpoint_image_tokens(path)) is not None:
            model_.default_image_tokens = budget  # type: ignore[union-attr]
        if path.is_dir() and (audio := checkpoint_audio_settings(path)) is not None:
            model_.audio_features = LogMelExtractor(audio)  # type: ignore[union-attr]
        runner = ModelRunner(model_, plan, kv_policy)
        return cls(model_, tokenizer, path, runner, checkpoint.format)

    @property
    def modalities(self) -> tuple[str, ...]:
        """What a prompt may hold for this model: "text", and "image"/"audio" where its
        checkpoint has that tower (a model lists them in `media_kinds`)."""
        return ("text", *getattr(self.model, "media_kinds", ()))

    @property
    def kv_policy(self) -> KVPolicy:
        return self.runner.kv_policy

    @property
    def plan(self) -> ExecutionPlan:
        return self.runner.plan

    def new_caches(self) -> list[LayerCache]:
        """Empty KV caches of the engine's kind, one per layer that computes K/V."""
        return self.runner.new_caches()

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads: every tensor once (the tied table as head),
        the media towers aside (they run at a prefill only)."""
        towers = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")
        state = self.model.state_dict()
        return sum(t.nbytes for name, t in state.items() if not name.startswith(towers))

    def expand_media(
        self, ids: list[int], media: Sequence[Image | Audio]
    ) -> tuple[list[int], tuple[PromptMedia, ...]]:
        """A rendered prompt's ids with each media placeholder (the chat template writes one
        token per image or clip, in the order of `media`) expanded into the model's soft tokens.

        Raises MediaError for a kind of input the model does not take."""
        for item in media:
            kind = "image" if isinstance(item, Image) else "audio"
            if kind not in self.modalities:
                takes = ", ".join(self.modalities)
                raise MediaError(f"{self.path.name} takes no {kind} input (it takes: {takes})")
        if not media:
            return ids, ()
        expanded, spans = self.model.expand_media(ids, media)  # type: ignore[union-attr]
        return expanded, tuple(PromptMedia(start, length, item) for start, length, item in spans)

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

    def run(
        self,
        request: GenerationRequest,
        cancelled: Callable[[], bool] | None = None,
        prompt_cache: PromptCache | None = None,
    ) -> Iterator[GenerationChunk]:
        """Stream one request's text; the last chunk carries `finish_reason` and the stats.

        With a `prompt_cache` (a server keeps one), the request starts from the caches of an
        earlier one sharing the longest prefix with its prompt, and leaves its own (at the
        prompt boundary) for the next before its last chunk is handed out. `cancelled` is
        checked before each token: once true, the stream ends without a final chunk.
        """
        keys = request.cache_ids  # media soft tokens keyed on their content
        reuse = prompt_cache.take(keys) if prompt_cache else Reuse(None, 0)
        boundary: list[list[LayerCache]] = []  # the caches holding exactly the prompt
        chunks = stream_generate(
            self.runner,
            self.tokenizer,
            request.prompt_ids,
            request.sampling,
            request.max_tokens,
            request.stop,
            request.stop_ids,
            cancelled=cancelled,
            caches=reuse.caches,
            cached_tokens=reuse.cached_tokens,
            on_prefilled=(
                (lambda caches: boundary.append(snapshot_caches(caches)))
                if prompt_cache is not None
                else None
            ),
            top_logprobs=request.top_logprobs,
            constraint=request.constraint,
            media=request.media,
        )
        for chunk in chunks:
            if chunk.stats is not None and prompt_cache is not None and boundary:
                prompt_cache.put(keys, boundary[0])
            yield chunk

    def scheduler(
        self,
        max_running: int,
        prefix_cache: bool = True,
        kv_room: int | None = None,
        on_cancelled: Callable[[], None] | None = None,
    ) -> Scheduler:
        """A scheduler running many requests at once on this engine (continuous batching) on a
        paged K/V pool of `kv_room` bytes (None: the default), sharing cached prompt blocks
        with `prefix_cache`: `submit` each, then `step` until it is idle."""
        return Scheduler(
            self.runner, self.tokenizer, max_running, prefix_cache, kv_room, on_cancelled
        )

    def stream(
        self,
        prompt: str | Messages,
        max_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = None,
        constraint: OutputConstraint | None = None,
    ) -> Iterator[GenerationChunk]:
        """Stream the reply to `prompt`. `max_tokens` None: DEFAULT_MAX_TOKENS, shrunk to fit
        the context; a given count that does not fit beside the prompt raises ValueError.
        `constraint`: what the reply must match (a JSON schema, a regex, ...). Messages may
        hold image and audio parts (`{"type": "image", "image": Image}`); a kind the model
        does not take raises MediaError."""
        ids, media = self.expand_media(self.encode(prompt, chat), media_of(prompt))
        request = GenerationRequest(
            ids,
            max_tokens,
            sampling or SamplingParams(),
            stop,
            constraint=constraint,
            media=media,
        )
        return self.run(request)

    def generate(
        self,
        prompt: str | Messages,
        max_tokens: int | None = None,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        chat: bool | None = None,
        constraint: OutputConstraint | None = None,
    ) -> str:
        chunks = self.stream(prompt, max_tokens, sampling, stop, chat, constraint)
        return "".join(chunk.text for chunk in chunks)
