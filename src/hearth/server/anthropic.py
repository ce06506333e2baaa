"""POST /v1/messages: Anthropic's Messages API (text content), JSON or its event stream."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from hearth.generate import FINISH_LENGTH
from hearth.sampling import SamplingParams
from hearth.server.errors import parse_request, read_json_object
from hearth.server.schemas import MessagesRequest
from hearth.server.state import (
    Generation,
    ServerState,
    complete,
    pieces,
    sse_response,
    state_of,
)

router = APIRouter()
log = logging.getLogger("hearth.server")


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    body = parse_request(MessagesRequest, await read_json_object(request))
    state = state_of(request)
    ids = await state.encode(body.template_messages(), "messages")
    generation = state.plan(
        ids, body.max_tokens, _sampling(state, body), body.stop_sequences or (), "messages"
    )
    message = _message(f"msg_{uuid.uuid4().hex}", body.model, len(ids))
    if body.stream:
        return sse_response(_named_events(_events(state, generation, message)))
    result = await complete(state, generation, request)
    reason = _stop_reason(result.finish_reason, result.stop_sequence)
    content = [{"type": "text", "text": result.text}]
    return JSONResponse(
        message
        | {"content": content, "stop_reason": reason, "stop_sequence": result.stop_sequence}
        | {"usage": _usage(len(ids), result.stats.generated_tokens)}
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
        "usage": _usage(input_tokens, 0),
    }


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def _stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    if finish_reason == FINISH_LENGTH:
        return "max_tokens"
    return "end_turn" if stop_sequence is None else "stop_sequence"


async def _events(
    state: ServerState, generation: Generation, message: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """Anthropic's event sequence for one text block."""
    yield {"type": "message_start", "message": message}
    block = {"type": "text", "text": ""}
    yield {"type": "content_block_start", "index": 0, "content_block": block}
    yield {"type": "ping"}
    async for piece in pieces(state, generation):
        if piece.text:
            delta = {"type": "text_delta", "text": piece.text}
            yield {"type": "content_block_delta", "index": 0, "delta": delta}
        if piece.finish_reason is not None and piece.stats is not None:
            yield {"type": "content_block_stop", "index": 0}
            reason = _stop_reason(piece.finish_reason, piece.stop_sequence)
            yield {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": piece.stop_sequence},
                "usage": {"output_tokens": piece.stats.generated_tokens},
            }
            yield {"type": "message_stop"}


async def _named_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield _event_text(event)
    except Exception as error:  # headers are sent: the error can only travel as an event
        log.exception("streamed generation failed")
        yield _event_text({"type": "error", "error": {"type": "api_error", "message": str(error)}})


def _event_text(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
