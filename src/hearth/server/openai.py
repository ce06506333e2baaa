"""OpenAI-compatible routes, as mlx_lm.server serves them: chat and text completions (JSON or
server-sent events), the model list, and the health check."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from hearth.runtime.generate import GenerationStats, TokenLogprobs
from hearth.runtime.sampling import SamplingParams
from hearth.server.errors import RequestError, parse_request, read_json_object
from hearth.server.logprobs import chat_logprobs, completion_logprobs
from hearth.server.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from hearth.server.state import (
    ChatPrompt,
    Completion,
    Generation,
    ServerState,
    complete,
    pieces_batched,
    sse_response,
    state_of,
)
from hearth.server.tools import ReplyParser, ReplyPart, ToolCall, parse_reply

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
        raise RequestError(f"The model '{model_id}' does not exist", "model", status=404)
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.model_id,
        "object": "model",
        "created": state.created,
        "owned_by": "hearth",
        "context_window": state.context_length,
    }


@router.post("/v1/chat/completions")
@router.post("/chat/completions")  # mlx_lm.server answers here too
async def chat_completions(request: Request) -> Response:
    body = parse_request(ChatCompletionRequest, await read_json_object(request))
    state = state_of(request)
    ids = await state.encode_chat(_chat_prompt(body), "messages")
    sampling = _sampling(state, body)
    generation = state.plan(
        ids,
        body.token_limit(),
        sampling,
        body.stop_strings(),
        "messages",
        state.chat_stop_ids,
        body.logprob_alternatives(),
    )
    reply = _Reply(body, state, "chat.completion", f"chatcmpl-{uuid.uuid4().hex}")
    tools_on = body.tools_on()
    if body.stream:
        return sse_response(_data_lines(reply.chat_events(state, generation, tools_on)))
    result = await complete(state, generation, request)
    return JSONResponse(reply.chat_completion(result, tools_on))


def _chat_prompt(body: ChatCompletionRequest) -> ChatPrompt:
    kwargs = body.chat_template_kwargs
    explicit = kwargs is not None and kwargs.enable_thinking is not None
    switch = "chat_template_kwargs.enable_thinking" if explicit else "reasoning_effort"
    return ChatPrompt(body.neutral_messages(), body.template_tools(), body.thinking(), switch)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = parse_request(CompletionRequest, await read_json_object(request))
    state = state_of(request)
    ids = await state.encode(body.prompt, "prompt")
    generation = _plan(state, body, ids, body.token_limit(), "prompt")
    reply = _Reply(body, state, "text_completion", f"cmpl-{uuid.uuid4().hex}")
    if body.stream:
        return sse_response(_data_lines(reply.text_events(state, generation)))
    return JSONResponse(reply.text_completion(await complete(state, generation, request)))


def _plan(
    state: ServerState, body: OpenAIRequest, ids: list[int], limit: int | None, prompt_param: str
) -> Generation:
    sampling = _sampling(state, body)
    alternatives = body.logprob_alternatives()
    return state.plan(
        ids, limit, sampling, body.stop_strings(), prompt_param, top_logprobs=alternatives
    )


def _sampling(state: ServerState, body: OpenAIRequest) -> SamplingParams:
    """Request fields first, then the server's flags, then the sampler's own defaults."""
    defaults = state.defaults
    optional: dict[str, Any] = {
        "repetition_penalty": body.repetition_penalty,
        "repetition_context_size": body.repetition_context_size,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
    }
    return SamplingParams(
        temperature=_or_default(body.temperature, defaults.temperature),
        top_p=_or_default(body.top_p, defaults.top_p),
        top_k=_or_default(body.top_k, defaults.top_k),
        min_p=_or_default(body.min_p, defaults.min_p),
        logit_bias=body.token_bias(),
        seed=body.seed,
        **{name: value for name, value in optional.items() if value is not None},
    )


def _or_default(value: T | None, default: T) -> T:
    return default if value is None else value


def openai_tool_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments_json}
    return {"id": f"call_{call.key}", "type": "function", "function": function}


def _chat_finish_reason(finish_reason: str, called_tools: bool) -> str:
    return "tool_calls" if called_tools else finish_reason


def usage_of(stats: GenerationStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
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
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.tokenizer = state.engine.tokenizer
        self._delta_templates: dict[str, _ChunkTemplate] = {}

    def chat_completion(self, result: Completion, tools_on: bool) -> dict[str, Any]:
        reply = parse_reply(result.text, tools_on)
        # OpenAI sends content null when a reply is only tool calls.
        content = reply.text if reply.text or not reply.tool_calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [openai_tool_call(call) for call in reply.tool_calls]
        finish = _chat_finish_reason(result.finish_reason, bool(reply.tool_calls))
        logprobs = chat_logprobs(self.tokenizer, result.logprobs or ())
        return self._whole(result, {"message": message}, finish, logprobs)

    def text_completion(self, result: Completion) -> dict[str, Any]:
        logprobs = None
        if result.logprobs is not None:
            logprobs, _ = completion_logprobs(self.tokenizer, result.logprobs)
        return self._whole(result, {"text": result.text}, result.finish_reason, logprobs)

    def _whole(
        self, result: Completion, output: dict[str, Any], finish: str, logprobs: Any
    ) -> dict[str, Any]:
        choice = {"index": 0, **output, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope(self.kind, [choice]) | {"usage": usage_of(result.stats)}

    async def chat_events(
        self, state: ServerState, generation: Generation, tools_on: bool
    ) -> AsyncIterator[list[str]]:
        """The JSON of each chat chunk, a list per batch of generated pieces."""
        # OpenAI opens every chat stream with the role and an empty content.
        yield [_json(self._chunk(CHAT_CHUNK, "delta", {"role": "assistant", "content": ""}, None))]
        parser = ReplyParser(tools_on)
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
                        events.append(self._delta_text(part))
                    else:
                        logprobs = chat_logprobs(self.tokenizer, unsent)
                        delta = _delta(part, calls)
                        events.append(
                            _json(self._chunk(CHAT_CHUNK, "delta", delta, None, logprobs))
                        )
                    calls += part.call is not None
                    unsent = []
                if piece.finish_reason is not None:
                    finish = _chat_finish_reason(piece.finish_reason, calls > 0)
                    logprobs = chat_logprobs(self.tokenizer, unsent)
                    events.append(_json(self._chunk(CHAT_CHUNK, "delta", {}, finish, logprobs)))
                if piece.stats is not None and self.include_usage:
                    usage = self._envelope(CHAT_CHUNK, []) | {"usage": usage_of(piece.stats)}
                    events.append(_json(usage))
            yield events

    async def text_events(
        self, state: ServerState, generation: Generation
    ) -> AsyncIterator[list[str]]:
        """The JSON of each completion chunk, a list per batch of generated pieces."""
        offset = 0  # text_offset runs on across the stream's chunks
        template = _ChunkTemplate(lambda text: self._chunk(self.kind, "text", text, None))
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
                        self.kind, "text", piece.text, piece.finish_reason, logprobs
                    )
                    events.append(_json(chunk))
                if piece.stats is not None and self.include_usage:
                    usage = self._envelope(self.kind, []) | {"usage": usage_of(piece.stats)}
                    events.append(_json(usage))
            yield events

    def _delta_text(self, part: ReplyPart) -> str:
        """A text or reasoning delta without log-probabilities, from its template."""
        key = "reasoning_content" if part.kind == "reasoning" else "content"
        template = self._delta_templates.get(key)
        if template is None:
            template = _ChunkTemplate(
                lambda text: self._chunk(CHAT_CHUNK, "delta", {key: text}, None)
            )
            self._delta_templates[key] = template
        return template.fill(part.text)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(
        self, kind: str, key: str, content: Any, finish: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        choice = {"index": 0, key: content, "logprobs": logprobs, "finish_reason": finish}
        chunk = self._envelope(kind, [choice])
        # With include_usage every chunk carries "usage": null until the final usage chunk.
        return chunk | {"usage": None} if self.include_usage else chunk


def _delta(part: ReplyPart, index: int) -> dict[str, Any]:
    """One reply part as a chat delta; `index` numbers tool calls within the reply."""
    if part.call is not None:
        return {"tool_calls": [{"index": index, **openai_tool_call(part.call)}]}
    return {"reasoning_content" if part.kind == "reasoning" else "content": part.text}
