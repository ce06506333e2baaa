"""What every route shares: the engine, its worker, the server's defaults, and the checks that
turn a parsed request into a generation the worker can run."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse

from hearth import __version__ as hearth_version
from hearth.engine import Engine
from hearth.errors import HearthError
from hearth.lengths import DEFAULT_MAX_TOKENS
from hearth.media import MediaError
from hearth.media.fetch import FetchPolicy
from hearth.runtime.constraints import ConstraintError, OutputConstraint
from hearth.runtime.generate import GenerationChunk, GenerationStats, PromptMedia, TokenLogprobs
from hearth.runtime.sampling import SamplingParams
from hearth.server.admission import MemoryBudget
from hearth.server.errors import RequestError
from hearth.server.media import check_taken, media_sources, read_media
from hearth.server.tool_grammar import forced_call_constraint
from hearth.server.tools import (
    TOOL_CALL_START,
    TOOL_RESPONSE_START,
    ConversationError,
    ToolChoice,
    template_conversation,
)
from hearth.server.worker import GenerationWorker

# Prompts up to this many characters are tokenized on the event loop (about 0.25 ms per 1000
# characters here); longer ones on a worker thread, whose hand-off costs 0.1-5 ms on a busy
# 2-core machine, more than a short prompt's whole encoding. A long text's encoding releases
# the GIL (`Tokenizer.encode`), so that thread does not stall the event loop.
INLINE_ENCODE_CHARS = 2048

# Gemma 4 ends a turn with <turn|>, and a tool call is followed by <|tool_response>.
CHAT_STOP_TOKENS = ("<turn|>", TOOL_RESPONSE_START)


NO_TOOLS = ToolChoice(enabled=False)
ReasoningField = Literal["reasoning", "reasoning_content", "both"]
# mlx_lm.server's window for repetition, presence and frequency penalties.
PENALTY_CONTEXT_SIZE = 20


@dataclass(frozen=True)
class ServerDefaults:
    """Used where a request leaves a field out (mlx_lm.server's flags and defaults)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    # --chat-template-args: extra template variables; a request's own switches win.
    chat_template_args: Mapping[str, Any] = field(default_factory=dict)
    # --reasoning-field: where chat replies put the thought channel (mlx_lm.server: reasoning).
    reasoning_field: ReasoningField = "reasoning"
    # --image-max-tokens: an image's soft-token budget where a request sets none (None: the
    # model's own default).
    image_max_tokens: int | None = None

    def reasoning_keys(self) -> tuple[str, ...]:
        if self.reasoning_field == "both":
            return ("reasoning", "reasoning_content")
        return (self.reasoning_field,)


@dataclass(frozen=True)
class Generation:
    """A validated request, ready for the worker."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stop_ids: tuple[int, ...] | None = None  # None: the tokenizer's end-of-sequence ids
    top_logprobs: int | None = None  # None: no log-probabilities; else alternatives per token
    constraint: OutputConstraint | None = None  # what the text must match (None: anything)
    media: tuple[PromptMedia, ...] = ()  # the prompt's images and audio, in order


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation (neutral messages, see `template_conversation`) and what the chat
    template is told besides it."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    enable_thinking: bool | None = None
    thinking_param: str = "thinking"  # the request field that switched thinking on
    tool_choice: ToolChoice = NO_TOOLS
    # mlx_lm.server's role prefixes, for a model without a chat template of its own.
    role_mapping: Mapping[str, str] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        if self.tools:
            kwargs["tools"] = self.tools
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def uses_tools(self) -> bool:
        return self.tools is not None or any(
            message["role"] == "tool" or message.get("tool_calls") for message in self.messages
        )


OVER_KV_POOL = "context_over_kv_pool"


@dataclass
class ServerState:
    engine: Engine
    worker: GenerationWorker
    defaults: ServerDefaults
    model_id: str
    memory_budget: MemoryBudget | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    fetch: FetchPolicy = field(default_factory=FetchPolicy)  # media URLs: off unless allowed

    @property
    def context_length(self) -> int:
        return self.engine.model.config.max_position_embeddings

    @property
    def base_model(self) -> bool:
        """No chat template of its own: chat goes through a generic one and replies poorly."""
        return not self.engine.tokenizer.has_own_chat_template

    @property
    def system_fingerprint(self) -> str:
        """What produced the replies: Hearth's version, the model and how it runs (OpenAI's
        `system_fingerprint` changes when the backend configuration does)."""
        model = self.engine.model
        setup = f"{hearth_version}|{self.model_id}|{model.compute_dtype}|{model.device}"
        return f"fp_{hashlib.sha256(setup.encode()).hexdigest()[:10]}"

    async def encode_prompt(self, prompt: str | list[int], param: str) -> list[int]:
        """Token ids of a completion prompt: text, or token ids checked against the vocabulary."""
        if isinstance(prompt, str):
            return await self.encode(prompt, param)
        vocab = self.engine.model.config.vocab_size
        if (bad := next((i for i in prompt if i >= vocab), None)) is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary of {vocab}", param)
        return list(prompt)

    async def encode(self, prompt: str, param: str) -> list[int]:
        """Token ids of a raw prompt, with the tokenizer's special tokens (BOS)."""
        return await self._tokenize(prompt, param, self.engine.tokenizer.encode)

    async def encode_chat(self, prompt: ChatPrompt, param: str) -> list[int]:
        """Token ids of a conversation (see `encode_chat_with_media`)."""
        ids, _ = await self.encode_chat_with_media(prompt, param)
        return ids

    async def encode_chat_with_media(
        self, prompt: ChatPrompt, param: str
    ) -> tuple[list[int], tuple[PromptMedia, ...]]:
        """Token ids of a conversation rendered with tools and the thinking switch, followed
        by a forced tool call's opening when the request demands a call; with its images and
        audio read, decoded, and their placeholders expanded to the model's soft tokens."""
        try:
            messages = template_conversation(prompt.messages)
        except ConversationError as error:
            raise RequestError(str(error), error.param) from None
        self._check_template_supports(prompt)
        # A kind the model lacks is refused before anything is fetched or decoded.
        sources = media_sources(messages)
        check_taken(sources, self.engine.modalities, self.model_id)
        if prompt.role_mapping is not None and self.base_model:
            if sources:
                message = "role_mapping renders text only: images and audio need a chat template"
                raise RequestError(message, "role_mapping")
            text = role_mapped_prompt(prompt.messages, prompt.role_mapping)
            return await self.encode(text, param), ()
        messages, media = await read_media(messages, self.fetch, self.defaults.image_max_tokens)
        tokenizer = self.engine.tokenizer
        kwargs = {**self.defaults.chat_template_args, **prompt.template_kwargs()}
        size = _text_size(messages) + _text_size(kwargs)
        try:
            render = functools.partial(tokenizer.apply_chat_template, messages, True, **kwargs)
            text = render() if size <= INLINE_ENCODE_CHARS else await asyncio.to_thread(render)
        except HearthError as error:  # e.g. a chat template that rejects the conversation
            raise RequestError(str(error), param) from None
        ids = await self._tokenize(text, param, tokenizer.encode_rendered)
        try:
            ids, spans = self.engine.expand_media(ids, media)
        except MediaError as error:
            raise RequestError(str(error), param) from None
        prefix = prompt.tool_choice.reply_prefix()
        if prefix:
            ids = ids + tokenizer.encode(prefix, add_special_tokens=False)
        return ids, spans

    async def _tokenize(
        self, text: str, param: str, encode: Callable[[str], list[int]]
    ) -> list[int]:
        """`encode(text)`, off the event loop when long; refused unread when the text alone is
        longer than the context could hold (`Tokenizer.fewest_tokens`)."""
        fewest = self.engine.tokenizer.fewest_tokens(text)
        if fewest >= self.context_length:
            raise RequestError(
                f"the prompt has at least {fewest} tokens ({len(text)} characters); this "
                f"model's context holds {self.context_length}",
                param,
            )
        if len(text) <= INLINE_ENCODE_CHARS:
            ids = encode(text)
        else:
            ids = await asyncio.to_thread(encode, text)
        if not ids:
            raise RequestError("the prompt is empty", param)
        return ids

    def _check_template_supports(self, prompt: ChatPrompt) -> None:
        # A template that never reads `tools` would drop them silently: refuse instead.
        tokenizer = self.engine.tokenizer
        template = tokenizer.chat_template or ""
        if prompt.uses_tools() and "tools" not in template:
            raise RequestError("this model's chat template does not support tools", "tools")
        if prompt.enable_thinking and "enable_thinking" not in template:
            message = "this model's chat template has no thinking switch"
            raise RequestError(message, prompt.thinking_param)
        if prompt.tool_choice.required and tokenizer.token_to_id(TOOL_CALL_START) is None:
            # A call is forced by opening it in the prompt, in a syntax Hearth can parse.
            raise RequestError(
                "a required tool call needs a model with Gemma 4's tool-call syntax; "
                "this model supports tool_choice auto and none",
                "tool_choice",
            )

    @property
    def xtc_special_tokens(self) -> tuple[int, ...]:
        """The tokens XTC never removes, as mlx_lm.server picks them: the encoding of a
        newline (with the tokenizer's special tokens) and the end-of-sequence ids."""
        tokenizer = self.engine.tokenizer
        newline = tokenizer.encode("\n", add_special_tokens=True)
        return tuple(dict.fromkeys([*newline, *sorted(tokenizer.eos_ids)]))

    @property
    def chat_stop_ids(self) -> tuple[int, ...]:
        tokenizer = self.engine.tokenizer
        extra = (tokenizer.token_to_id(token) for token in CHAT_STOP_TOKENS)
        return tuple(sorted(tokenizer.eos_ids | {token for token in extra if token is not None}))

    def plan(
        self,
        prompt_ids: list[int],
        max_tokens: int | None,
        sampling: SamplingParams,
        stop: Sequence[str],
        prompt_param: str,
        stop_ids: tuple[int, ...] | None = None,
        top_logprobs: int | None = None,
        limit_param: str = "max_tokens",
        constraint: OutputConstraint | None = None,
        media: tuple[PromptMedia, ...] = (),
    ) -> Generation:
        """Check the prompt fits the context and the memory budget, and the sampling settings
        are valid; `limit_param` names the request's token limit in errors."""
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model's context holds "
                f"{self.context_length}",
                prompt_param,
            )
        if max_tokens is not None and max_tokens > room:
            raise RequestError(
                f"{limit_param} {max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds "
                f"this model's context of {self.context_length} tokens",
                limit_param,
            )
        try:
            sampling.validate(self.engine.model.config.vocab_size)
        except ValueError as error:
            field_name = str(error).split()[0]  # validate() names the field first
            raise RequestError(str(error), field_name) from None
        scheduler = getattr(self.worker, "scheduler", None)
        # The paged K/V pool holds at most `max_context` tokens of one request.
        pool_room = None if scheduler is None else scheduler.max_context - len(prompt_ids)
        if pool_room is not None:
            room = min(room, pool_room)
        # The server default only ever shrinks to fit; an explicit request is never cut.
        limit = max_tokens if max_tokens is not None else min(self.defaults.max_tokens, room)
        if self.memory_budget is not None:
            self.memory_budget.check(len(prompt_ids), limit)
        if pool_room is not None and (pool_room < 1 or limit > pool_room):
            assert scheduler is not None
            raise RequestError(
                f"the prompt's {len(prompt_ids)} tokens plus {limit_param} {max(limit, 1)} "
                f"can never fit the K/V pool, which holds {scheduler.max_context} tokens of "
                "one request (hearth serve --kv-cache-memory)",
                limit_param,
                code=OVER_KV_POOL,
            )
        return Generation(
            prompt_ids, limit, sampling, tuple(stop), stop_ids, top_logprobs, constraint, media
        )


def reply_constraint(
    output: OutputConstraint | None,
    output_param: str,
    policy: ToolChoice,
    tools: list[dict[str, Any]] | None,
    thinking: bool | None = None,
) -> OutputConstraint | None:
    """What a chat reply must match: the request's output format (`output`, from the field
    `output_param`), or the grammar of the tool call its tool_choice forces; not both. With
    `thinking` on, a format applies after the thought channel (a forced call's opening is
    already in the prompt, so it is not preceded by a thought)."""
    try:
        forced = forced_call_constraint(policy, tools)
        if forced is not None:
            forced.to_grammar()
    except ConstraintError as error:
        raise RequestError(f"tool_choice: {error}", "tool_choice") from None
    if forced is not None and output is not None:
        message = f"tool_choice forces a tool call and {output_param} a format: send one"
        raise RequestError(message, "tool_choice")
    if output is not None and thinking:
        return output.after_thinking()
    return forced or output


def role_mapped_prompt(messages: list[dict[str, Any]], role_mapping: Mapping[str, str]) -> str:
    """mlx_lm.server's prompt for a model without a chat template: each message as its role's
    prefix, its text and the "stop" string, then the "assistant" prefix, trailing space cut."""
    stop = role_mapping.get("stop", "")
    turns = "".join(
        f"{role_mapping.get(m['role'], '')}{m.get('content') or ''}{stop}" for m in messages
    )
    return (turns + role_mapping.get("assistant", "")).rstrip()


def _text_size(value: Any) -> int:
    """Characters of text in a prompt, a conversation, or template arguments (nested)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, Mapping):
        return sum(_text_size(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_text_size(item) for item in value)
    return 0


def state_of(request: Request) -> ServerState:
    return request.app.state.hearth


@dataclass(frozen=True)
class Completion:
    """A whole generation's text and how it ended; `logprobs` when asked, one per token."""

    text: str
    finish_reason: str
    stop_sequence: str | None
    stats: GenerationStats
    logprobs: tuple[TokenLogprobs, ...] | None = None


async def complete(state: ServerState, generation: Generation, request: Request) -> Completion:
    """The whole generation; cancelled if the client disconnects before it ends."""
    collecting = asyncio.ensure_future(_collect(state, generation))
    watching = asyncio.ensure_future(_until_disconnected(request))
    await asyncio.wait((collecting, watching), return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    if not collecting.done():
        collecting.cancel()  # closes the worker's stream, which cancels the generation
        raise ClientGone
    return collecting.result()


class ClientGone(Exception):
    """The client closed the connection before its reply was ready."""


async def _until_disconnected(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(state: ServerState, generation: Generation) -> Completion:
    texts = []
    records: list[TokenLogprobs] = []
    async for piece in pieces(state, generation):
        texts.append(piece.text)
        records.extend(piece.logprobs or ())
        if piece.finish_reason is not None and piece.stats is not None:
            logprobs = None if generation.top_logprobs is None else tuple(records)
            text = "".join(texts)
            return Completion(text, piece.finish_reason, piece.stop_sequence, piece.stats, logprobs)
    raise RuntimeError("the generation ended without a final piece")


def pieces(state: ServerState, generation: Generation) -> AsyncIterator[GenerationChunk]:
    return state.worker.stream(
        generation.prompt_ids,
        generation.max_tokens,
        generation.sampling,
        generation.stop,
        generation.stop_ids,
        generation.top_logprobs,
        generation.constraint,
        generation.media,
    )


def pieces_batched(
    state: ServerState, generation: Generation
) -> AsyncIterator[list[GenerationChunk]]:
    """As `pieces`, with the pieces that are ready together in one list."""
    return state.worker.stream_batches(
        generation.prompt_ids,
        generation.max_tokens,
        generation.sampling,
        generation.stop,
        generation.stop_ids,
        generation.top_logprobs,
        generation.constraint,
        generation.media,
    )


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """A server-sent events response that cancels its generation if the client goes away."""
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
