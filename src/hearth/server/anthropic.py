"""POST /v1/messages: Anthropic's Messages API (text, tool use, thinking), JSON or its event
stream."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from hearth.runtime.generate import FINISH_LENGTH, GenerationStats
from hearth.runtime.sampling import SamplingParams
from hearth.server.errors import parse_request, read_json_object
from hearth.server.schemas import AnthropicPrompt, MessagesRequest
from hearth.server.state import (
    ChatPrompt,
    Generation,
    ServerState,
    complete,
    pieces,
    reply_constraint,
    sse_response,
    state_of,
)
from hearth.server.tools import Reply, ReplyPart, ToolCall, ToolChoice

router = APIRouter()
log = logging.getLogger("hearth.server")


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    body = parse_request(MessagesRequest, await read_json_object(request))
    state = state_of(request)
    policy = body.tool_policy()
    ids, media = await state.encode_chat_with_media(_prompt(body), "messages")
    stop = body.stop_sequences or ()
    sampling = _sampling(state, body)
    constraint = reply_constraint(
        body.output_constraint,
        "output_config.format",
        policy,
        body.template_tools(),
        body.thinking_on(),
    )
    generation = state.plan(
        ids,
        body.max_tokens,
        sampling,
        stop,
        "messages",
        state.chat_stop_ids,
        constraint=constraint,
        media=media,
    )
    message = _message(f"msg_{uuid.uuid4().hex}", body.model, len(ids))
    if body.stream:
        return sse_response(_named_events(_events(state, generation, message, policy)))
    result = await complete(state, generation, request)
    reply = policy.parse(result.text)
    reason = _stop_reason(result.finish_reason, result.stop_sequence, bool(reply.tool_calls))
    content = _content_blocks(reply)
    return JSONResponse(
        message
        | {"content": content, "stop_reason": reason, "stop_sequence": result.stop_sequence}
        | {"usage": _usage(result.stats)}
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """The prompt's tokens, exactly as /v1/messages would render the same request."""
    body = parse_request(AnthropicPrompt, await read_json_object(request))
    ids = await state_of(request).encode_chat(_prompt(body), "messages")
    return {"input_tokens": len(ids)}


def _prompt(body: AnthropicPrompt) -> ChatPrompt:
    return ChatPrompt(
        body.neutral_messages(),
        body.template_tools(),
        body.thinking_on(),
        tool_choice=body.tool_policy(),
    )


def _sampling(state: ServerState, body: MessagesRequest) -> SamplingParams:
    """Request fields first, then the server's flags."""
    defaults = state.defaults
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k if body.top_k is None else body.top_k,
        min_p=defaults.min_p,
    )


def _message(message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The message object before any content: what message_start carries."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        # Sent before the worker looks in the prompt cache: message_delta has the split.
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        },
    }


def _usage(stats: GenerationStats) -> dict[str, int]:
    """Anthropic's split: input_tokens counts only the prompt tokens not read from the cache.
    Hearth caches every prompt by itself, at no extra cost: none are counted as "creation"."""
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": stats.cached_tokens,
        "output_tokens": stats.generated_tokens,
    }


def _stop_reason(finish_reason: str, stop_sequence: str | None, called_tools: bool) -> str:
    if called_tools:
        return "tool_use"
    if finish_reason == FINISH_LENGTH:
        return "max_tokens"
    return "end_turn" if stop_sequence is None else "stop_sequence"


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{call.key}",
        "name": call.name,
        "input": call.arguments,
    }


def _thinking(text: str) -> dict[str, Any]:
    # Hearth has no signature to give; clients send the block back and it is dropped.
    return {"type": "thinking", "thinking": text, "signature": ""}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def _content_blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks = [_thinking(reply.reasoning)] if reply.reasoning else []
    if reply.text or not reply.tool_calls:  # a reply with nothing else still has a text block
        blocks.append(_text(reply.text))
    return blocks + [_tool_use(call) for call in reply.tool_calls]


async def _events(
    state: ServerState, generation: Generation, message: dict[str, Any], policy: ToolChoice
) -> AsyncIterator[dict[str, Any]]:
    """Anthropic's event sequence: one block per run of thinking or text, one per tool call."""
    yield {"type": "message_start", "message": message}
    parser = policy.parser()
    blocks = _BlockStream()
    async for piece in pieces(state, generation):
        parts = parser.feed(piece.text)
        if piece.finish_reason is not None:
            parts += parser.finish()
        for part in parts:
            for event in blocks.add(part):
                yield event
        if piece.finish_reason is not None and piece.stats is not None:
            for event in blocks.finish():
                yield event
            reason = _stop_reason(piece.finish_reason, piece.stop_sequence, blocks.called_tools)
            yield {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": piece.stop_sequence},
                "usage": _usage(piece.stats),
            }
            yield {"type": "message_stop"}


class _BlockStream:
    """Opens, fills and closes content blocks as reply parts arrive."""

    def __init__(self) -> None:
        self.index = -1
        self.open_kind: str | None = None  # the reply part kind of the open block
        self.called_tools = False

    def add(self, part: ReplyPart) -> list[dict[str, Any]]:
        if part.call is not None:
            self.called_tools = True
            closed = self.close()
            start = self._start(_tool_use(part.call) | {"input": {}}, part.kind)
            delta = {"type": "input_json_delta", "partial_json": part.call.arguments_json}
            return [*closed, *start, self._delta(delta), *self.close()]
        events = []
        if part.kind != self.open_kind:
            block = _thinking("") if part.kind == "reasoning" else _text("")
            events = [*self.close(), *self._start(block, part.kind)]
        if part.kind == "reasoning":
            return [*events, self._delta({"type": "thinking_delta", "thinking": part.text})]
        return [*events, self._delta({"type": "text_delta", "text": part.text})]

    def close(self) -> list[dict[str, Any]]:
        if self.open_kind is None:
            return []
        # A thinking block ends with its signature (empty: Hearth has none to give).
        signed = (
            [self._delta({"type": "signature_delta", "signature": ""})]
            if self.open_kind == "reasoning"
            else []
        )
        self.open_kind = None
        return [*signed, {"type": "content_block_stop", "index": self.index}]

    def finish(self) -> list[dict[str, Any]]:
        if self.index < 0:  # a reply with no content still has an (empty) text block
            return [*self._start(_text(""), "text"), *self.close()]
        return self.close()

    def _start(self, block: dict[str, Any], kind: str) -> list[dict[str, Any]]:
        self.index += 1
        self.open_kind = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        # Anthropic pings once, after the first block opens.
        return [start, {"type": "ping"}] if self.index == 0 else [start]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}


async def _named_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield _event_text(event)
    except Exception as error:  # headers are sent: the error can only travel as an event
        log.exception("streamed generation failed")
        yield _event_text({"type": "error", "error": {"type": "api_error", "message": str(error)}})


def _event_text(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
