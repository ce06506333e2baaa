"""OpenAI-compatible routes, as mlx_lm.server serves them: chat and text completions (JSON or
server-sent events), the model list, and the health check."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from hearth.runtime.generate import GenerationStats, TokenLogprobs
from hearth.runtime.sampling import SamplingParams
from hearth.server.errors import RequestError, parse_request, read_json_object
from hearth.server.logprobs import chat_logprobs, completion_logprobs
from hearth.server.schemas import (
    SEED_LIMIT,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
)
from hearth.server.state import (
    PENALTY_CONTEXT_SIZE,
    ChatPrompt,
    Completion,
    Generation,
    ServerState,
    complete,
    pieces_batched,
    reply_constraint,
    sse_response,
    state_of,
)
from hearth.server.tools import ReplyPart, ToolCall, ToolChoice

T = TypeVar("T")
log = logging.getLogger("hearth.server")
CHAT_CHUNK = "chat.completion.chunk"

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    # Byte-identical to mlx_lm.server's reply, which some clients compare verbatim.
    return Response('{"status": "ok"}', media_type="application/json")


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(state_of(request))]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    if model_id != state.model_id:
        message = f"The model '{model_id}' does not exist"
        raise RequestError(message, "model", status=404, code="model_not_found")
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "hearth",
        "context_window": state.context_length,
        # No chat template of its own: chat replies will be poor (use completions).
        "base_model": state.base_model,
        # What prompts may hold, in OpenRouter's shape (docs/media.md).
        "architecture": _architecture(state.engine.modalities),
    }


def _architecture(modalities: tuple[str, ...]) -> dict[str, Any]:
    return {
        "modality": "+".join(modalities) + "->text",
        "input_modalities": list(modalities),
        "output_modalities": ["text"],
    }


@router.post("/v1/chat/completions")
@router.post("/chat/completions")  # mlx_lm.server answers here too
async def chat_completions(request: Request) -> Response:
    body = parse_request(ChatCompletionRequest, await read_json_object(request))
    state = state_of(request)
    policy = body.tool_policy()
    ids, media = await state.encode_chat_with_media(_chat_prompt(body, policy), "messages")
    constraint = reply_constraint(
        body.output_constraint,
        _constraint_field(body),
        policy,
        body.template_tools(),
        body.thinking(),
    )
    generation = state.plan(
        ids,
        body.token_limit(),
        _sampling(state, body),
        body.stop_strings(),
        "messages",
        state.chat_stop_ids,
        body.logprob_alternatives(),
        body.limit_param(),
        constraint,
        media,
    )
    generations = choices_of(generation, body.choices)
    reply = _Reply(body, state, "chat.completion", f"chatcmpl-{uuid.uuid4().hex}")
    if body.stream:
        return sse_response(_data_lines(reply.chat_events(state, generations, policy)))
    results = [await complete(state, g, request) for g in generations]
    return JSONResponse(reply.chat_completion(results, policy))


def _constraint_field(body: OpenAIRequest) -> str:
    """The field that set the request's output constraint, for error messages."""
    given = body.model_fields_set & {
        "response_format",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
    }
    return min(given) if given else "response_format"


def _chat_prompt(body: ChatCompletionRequest, policy: ToolChoice) -> ChatPrompt:
    kwargs = body.chat_template_kwargs
    explicit = kwargs is not None and kwargs.enable_thinking is not None
    switch = "chat_template_kwargs.enable_thinking" if explicit else "reasoning_effort"
    return ChatPrompt(
        body.neutral_messages(),
        body.template_tools(),
        body.thinking(),
        switch,
        policy,
        body.role_mapping,
    )


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = parse_request(CompletionRequest, await read_json_object(request))
    state = state_of(request)
    generations: list[Generation] = []
    echoes: list[str] = []
    for prompt in body.prompts():
        ids = await state.encode_prompt(prompt, "prompt")
        # echo: the prompt's text comes first (token ids are decoded).
        text = prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(ids)
        generations += choices_of(_plan(state, body, ids), body.choices)
        echoes += [text if body.echo else ""] * body.choices
    reply = _Reply(body, state, "text_completion", f"cmpl-{uuid.uuid4().hex}")
    if body.stream:
        return sse_response(_data_lines(reply.text_events(state, generations, echoes)))
    results = [await complete(state, g, request) for g in generations]
    return JSONResponse(reply.text_completion(results, echoes))


def _plan(state: ServerState, body: CompletionRequest, ids: list[int]) -> Generation:
    return state.plan(
        ids,
        body.token_limit(),
        _sampling(state, body),
        body.stop_strings(),
        "prompt",
        top_logprobs=body.logprob_alternatives(),
        constraint=body.output_constraint,
    )


def choices_of(generation: Generation, n: int) -> list[Generation]:
    """`n` independent generations of one prompt (run one after another). With a seed, choice
    i samples with seed + i (mod 2**64): the choices differ, and a request repeats exactly."""
    seed = generation.sampling.seed
    if seed is None:
        return [generation] * n
    return [
        dataclasses.replace(
            generation,
            sampling=dataclasses.replace(generation.sampling, seed=(seed + i) % SEED_LIMIT),
        )
        for i in range(n)
    ]


def _sampling(state: ServerState, body: OpenAIRequest) -> SamplingParams:
    """Request fields first, then the server's flags, then mlx_lm.server's defaults."""
    defaults = state.defaults
    optional: dict[str, Any] = {
        "repetition_context_size": body.repetition_context_size,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "xtc_probability": body.xtc_probability,
        "xtc_threshold": body.xtc_threshold,
    }
    # mlx_lm.server takes 0 for "no repetition penalty", which is 1 here.
    if body.repetition_penalty:
        optional["repetition_penalty"] = body.repetition_penalty
    if body.xtc_probability:  # as mlx_lm.server: newlines and end tokens are never excluded
        optional["xtc_special_tokens"] = state.xtc_special_tokens
    return SamplingParams(
        temperature=_or_default(body.temperature, defaults.temperature),
        top_p=_or_default(body.top_p, defaults.top_p),
        top_k=_or_default(body.top_k, defaults.top_k),
        min_p=_or_default(body.min_p, defaults.min_p),
        logit_bias=body.token_bias(),
        seed=body.seed,
        presence_context_size=_or_default(body.presence_context_size, PENALTY_CONTEXT_SIZE),
        frequency_context_size=_or_default(body.frequency_context_size, PENALTY_CONTEXT_SIZE),
        **{name: value for name, value in optional.items() if value is not None},
    )


def _or_default(value: T | None, default: T) -> T:
    return default if value is None else value


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments_json}
    return {"id": f"call_{call.key}", "type": "function", "function": function}


def _chat_finish_reason(finish_reason: str, called_tools: bool) -> str:
    return "tool_calls" if called_tools else finish_reason


def usage_of(stats: Sequence[GenerationStats], per_prompt: int = 1) -> dict[str, Any]:
    """One usage for all choices: each prompt counted once (the first of its `per_prompt`
    choices; its prompt cache reuse too), every choice's generated tokens."""
    firsts = stats[::per_prompt]
    prompt_tokens = sum(s.prompt_tokens for s in firsts)
    generated = sum(s.generated_tokens for s in stats)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)},
    }


async def _data_lines(events: AsyncIterator[list[str]]) -> AsyncIterator[str]:
    """SSE `data:` lines; the events ready together (one batch of pieces) go in one write."""
    try:
        async for payloads in events:
            yield "".join(f"data: {payload}\n\n" for payload in payloads)
    except Exception as error:  # headers are sent: the error can only travel as an event
        log.exception("streamed generation failed")
        error_body = {"message": str(error), "type": "server_error", "param": None, "code": None}
        yield f"data: {json.dumps({'error': error_body})}\n\n"
        return
    yield "data: [DONE]\n\n"


def _json(event: dict[str, Any]) -> str:
    return json.dumps(event, ensure_ascii=False)


class _ChunkTemplate:
    """A stream chunk serialised once with a marker where its text goes: each token then
    costs one string escape instead of building and serialising the whole chunk (the HTTP
    thread's per-token work competes with the model's threads for the same cores). The bytes
    are exactly those of `json.dumps` of the chunk `build(text)`."""

    MARKER = "\x00hearth-text\x00"

    def __init__(self, build: Callable[[str], dict[str, Any]]) -> None:
        self.build = build
        text, marker = _json(build(self.MARKER)), _json(self.MARKER)
        # A model name holding the marker would make the split ambiguous: no template then.
        self.parts = text.split(marker) if text.count(marker) == 1 else None

    def fill(self, text: str) -> str:
        if self.parts is None:
            return _json(self.build(text))
        return _json(text).join(self.parts)


class _Reply:
    """Builds one request's response objects: the same id, creation time and model in each."""

    def __init__(self, body: OpenAIRequest, state: ServerState, kind: str, reply_id: str) -> None:
        self.id = reply_id
        self.kind = kind
        self.created = int(time.time())
        self.model = body.model or state.model_id  # echoed back, as mlx_lm.server does
        self.fingerprint = state.system_fingerprint
        self.include_usage = body.include_usage()
        self.per_prompt = body.choices
        self.tokenizer = state.engine.tokenizer
        self.reasoning_keys = state.defaults.reasoning_keys()
        self._templates: dict[tuple[str, int], _ChunkTemplate] = {}

    def chat_completion(self, results: list[Completion], policy: ToolChoice) -> dict[str, Any]:
        choices = [self._chat_choice(index, result, policy) for index, result in enumerate(results)]
        return self._whole(choices, results)

    def _chat_choice(self, index: int, result: Completion, policy: ToolChoice) -> dict[str, Any]:
        reply = policy.parse(result.text)
        # OpenAI sends content null when a reply is only tool calls.
        content = reply.text if reply.text or not reply.tool_calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reply.reasoning:
            message |= dict.fromkeys(self.reasoning_keys, reply.reasoning)
        if reply.tool_calls:
            message["tool_calls"] = [openai_tool_call(call) for call in reply.tool_calls]
        message |= {"refusal": None, "annotations": []}
        finish = _chat_finish_reason(result.finish_reason, bool(reply.tool_calls))
        logprobs = chat_logprobs(self.tokenizer, result.logprobs or ())
        return _choice(index, {"message": message}, finish, logprobs)

    def text_completion(self, results: list[Completion], echoes: list[str]) -> dict[str, Any]:
        choices = []
        for index, (result, echo) in enumerate(zip(results, echoes, strict=True)):
            logprobs = None
            if result.logprobs is not None:
                logprobs, _ = completion_logprobs(self.tokenizer, result.logprobs)
            text = {"text": echo + result.text}
            choices.append(_choice(index, text, result.finish_reason, logprobs))
        return self._whole(choices, results)

    def _whole(self, choices: list[dict[str, Any]], results: list[Completion]) -> dict[str, Any]:
        usage = usage_of([result.stats for result in results], self.per_prompt)
        return self._envelope(self.kind, choices) | {"usage": usage}

    async def chat_events(
        self, state: ServerState, generations: list[Generation], policy: ToolChoice
    ) -> AsyncIterator[list[str]]:
        """The JSON of each chat chunk, a list per batch of generated pieces; the choices one
        after another."""
        stats: list[GenerationStats] = []
        for index, generation in enumerate(generations):
            # OpenAI opens every chat stream (every choice) with the role and an empty content.
            opening = {"role": "assistant", "content": "", "refusal": None}
            yield [_json(self._chunk(CHAT_CHUNK, "delta", opening, None, index=index))]
            async for events in self._chat_choice_events(state, generation, policy, index, stats):
                yield events
        if self.include_usage:
            yield [self._usage_chunk(CHAT_CHUNK, stats)]

    async def _chat_choice_events(
        self,
        state: ServerState,
        generation: Generation,
        policy: ToolChoice,
        index: int,
        stats: list[GenerationStats],
    ) -> AsyncIterator[list[str]]:
        parser = policy.parser()
        calls = 0
        # Tokens whose text the parser holds back go out with the next chunk sent; what is
        # left at the end (the end of turn token, say) with the finishing chunk.
        unsent: list[TokenLogprobs] = []
        async for batch in pieces_batched(state, generation):
            events: list[str] = []
            for piece in batch:
                unsent.extend(piece.logprobs or ())
                parts = parser.feed(piece.text)
                if piece.finish_reason is not None:
                    parts += parser.finish()
                for part in parts:
                    if not unsent and part.call is None:
                        events.append(self._delta_text(part, index))
                    else:
                        logprobs = chat_logprobs(self.tokenizer, unsent)
                        delta = self._delta(part, calls)
                        chunk = self._chunk(CHAT_CHUNK, "delta", delta, None, logprobs, index)
                        events.append(_json(chunk))
                    calls += part.call is not None
                    unsent = []
                if piece.finish_reason is not None:
                    finish = _chat_finish_reason(piece.finish_reason, calls > 0)
                    logprobs = chat_logprobs(self.tokenizer, unsent)
                    chunk = self._chunk(CHAT_CHUNK, "delta", {}, finish, logprobs, index)
                    events.append(_json(chunk))
                if piece.stats is not None:
                    stats.append(piece.stats)
            yield events

    async def text_events(
        self, state: ServerState, generations: list[Generation], echoes: list[str]
    ) -> AsyncIterator[list[str]]:
        """The JSON of each completion chunk, a list per batch of generated pieces; the
        choices one after another."""
        stats: list[GenerationStats] = []
        for index, generation in enumerate(generations):
            if echoes[index]:
                yield [_json(self._chunk(self.kind, "text", echoes[index], None, index=index))]
            async for events in self._text_choice_events(state, generation, index, stats):
                yield events
        if self.include_usage:
            yield [self._usage_chunk(self.kind, stats)]

    async def _text_choice_events(
        self,
        state: ServerState,
        generation: Generation,
        index: int,
        stats: list[GenerationStats],
    ) -> AsyncIterator[list[str]]:
        offset = 0  # text_offset runs on across the stream's chunks
        template = _ChunkTemplate(
            lambda text: self._chunk(self.kind, "text", text, None, index=index)
        )
        async for batch in pieces_batched(state, generation):
            events: list[str] = []
            for piece in batch:
                if piece.text and piece.finish_reason is None and piece.logprobs is None:
                    events.append(template.fill(piece.text))
                elif piece.text or piece.finish_reason:
                    logprobs = None
                    if piece.logprobs is not None:
                        logprobs, offset = completion_logprobs(
                            self.tokenizer, piece.logprobs, offset
                        )
                    chunk = self._chunk(
                        self.kind, "text", piece.text, piece.finish_reason, logprobs, index
                    )
                    events.append(_json(chunk))
                if piece.stats is not None:
                    stats.append(piece.stats)
            yield events

    def _usage_chunk(self, kind: str, stats: list[GenerationStats]) -> str:
        return _json(self._envelope(kind, []) | {"usage": usage_of(stats, self.per_prompt)})

    def _delta_text(self, part: ReplyPart, index: int) -> str:
        """A text or reasoning delta without log-probabilities, from its template."""
        kind = part.kind

        def build(text: str) -> dict[str, Any]:
            delta = self._text_delta(kind, text)
            return self._chunk(CHAT_CHUNK, "delta", delta, None, index=index)

        return self._template((kind, index), build).fill(part.text)

    def _template(
        self, key: tuple[str, int], build: Callable[[str], dict[str, Any]]
    ) -> _ChunkTemplate:
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = _ChunkTemplate(build)
        return template

    def _text_delta(self, kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return dict.fromkeys(self.reasoning_keys, text)
        return {"content": text}

    def _delta(self, part: ReplyPart, call_index: int) -> dict[str, Any]:
        """One reply part as a chat delta; `call_index` numbers tool calls within the reply."""
        if part.call is not None:
            return {"tool_calls": [{"index": call_index, **openai_tool_call(part.call)}]}
        return self._text_delta(part.kind, part.text)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }

    def _chunk(
        self,
        kind: str,
        key: str,
        content: Any,
        finish: str | None,
        logprobs: Any = None,
        index: int = 0,
    ) -> dict[str, Any]:
        chunk = self._envelope(kind, [_choice(index, {key: content}, finish, logprobs)])
        # With include_usage every chunk carries "usage": null until the final usage chunk.
        return chunk | {"usage": None} if self.include_usage else chunk


def _choice(
    index: int, output: dict[str, Any], finish: str | None, logprobs: Any
) -> dict[str, Any]:
    return {"index": index, **output, "logprobs": logprobs, "finish_reason": finish}
