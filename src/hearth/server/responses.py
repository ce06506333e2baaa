"""POST /v1/responses: OpenAI's Responses API (text, function calls, reasoning), JSON or its
event stream, with `previous_response_id` served from an in-memory store."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from hearth.runtime.generate import FINISH_LENGTH, GenerationStats
from hearth.runtime.sampling import SamplingParams
from hearth.server.errors import RequestError, parse_request, read_json_object
from hearth.server.schemas import ResponsesRequest
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
from hearth.server.tools import Reply, ReplyPart, ToolCall

router = APIRouter()
log = logging.getLogger("hearth.server")

RESPONSE_TTL_SECONDS = 3600.0
RESPONSE_STORE_BYTES = 32 * 2**20


class ResponseStore:
    """Each stored response's whole conversation, for `previous_response_id`: least recently
    used first out, bounded by age and by the total size of the stored JSON."""

    def __init__(
        self,
        ttl_seconds: float = RESPONSE_TTL_SECONDS,
        max_bytes: int = RESPONSE_STORE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, int, list[dict[str, Any]]]] = OrderedDict()
        self.bytes = 0

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        # An image or audio part counts as its fields (the base64 or URL the request sent).
        size = len(json.dumps(messages, ensure_ascii=False, default=vars).encode())
        if size > self.max_bytes:  # it could never fit: keep the others
            return
        self._drop_expired()
        while self.bytes + size > self.max_bytes:
            self._remove(next(iter(self._entries)))
        self._entries[response_id] = (self._clock(), size, messages)
        self.bytes += size

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        self._drop_expired()
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[2]

    def __len__(self) -> int:
        return len(self._entries)

    def _drop_expired(self) -> None:
        oldest_kept = self._clock() - self.ttl_seconds
        expired = [key for key, (stored, _, _) in self._entries.items() if stored < oldest_kept]
        for key in expired:
            self._remove(key)

    def _remove(self, response_id: str) -> None:
        self.bytes -= self._entries.pop(response_id)[1]


def store_of(request: Request) -> ResponseStore:
    return request.app.state.response_store


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    body = parse_request(ResponsesRequest, await read_json_object(request))
    state = state_of(request)
    store = store_of(request)
    conversation = _earlier(store, body.previous_response_id) + body.neutral_input()
    policy = body.tool_policy()
    prompt = ChatPrompt(
        _instructions(body) + conversation,
        body.template_tools(),
        body.thinking(),
        "reasoning.effort",
        policy,
    )
    ids, media = await state.encode_chat_with_media(prompt, "input")
    sampling = _sampling(state, body)
    generation = state.plan(
        ids,
        body.max_output_tokens,
        sampling,
        (),
        "input",
        state.chat_stop_ids,
        limit_param="max_output_tokens",
        constraint=reply_constraint(
            body.output_constraint, "text.format", policy, body.template_tools(), body.thinking()
        ),
        media=media,
    )
    draft = _Draft(body, state, sampling, len(ids))
    if body.stream:
        events = _stream(state, generation, draft, store, conversation)
        return sse_response(_named_events(events))
    result = await complete(state, generation, request)
    reply = policy.parse(result.text)
    items = _output_items(reply, _ItemIds.new())
    response = draft.finished(items, result.finish_reason, result.stats, reply.reasoning)
    _remember(store, body, draft.id, conversation, reply)
    return JSONResponse(response)


def _earlier(store: ResponseStore, response_id: str | None) -> list[dict[str, Any]]:
    if response_id is None:
        return []
    messages = store.get(response_id)
    if messages is None:
        message = f"Previous response with id '{response_id}' not found (unknown or expired)."
        raise RequestError(message, "previous_response_id", status=404)
    return messages


def _instructions(body: ResponsesRequest) -> list[dict[str, Any]]:
    # Instructions apply to this response only: they are not carried into the stored history.
    if not body.instructions:
        return []
    return [{"role": "system", "content": body.instructions, "source": "instructions"}]


def _remember(
    store: ResponseStore,
    body: ResponsesRequest,
    response_id: str,
    conversation: list[dict[str, Any]],
    reply: Reply,
) -> None:
    if not body.store:
        return
    answer: dict[str, Any] = {"role": "assistant", "content": reply.text or None}
    if reply.tool_calls:
        answer["tool_calls"] = [
            {"id": _call_id(call), "name": call.name, "arguments": call.arguments_json}
            for call in reply.tool_calls
        ]
    history = [*conversation, answer]
    store.put(response_id, [m | {"source": "previous_response_id"} for m in history])


def _sampling(state: ServerState, body: ResponsesRequest) -> SamplingParams:
    defaults = state.defaults
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        top_k=defaults.top_k,
        min_p=defaults.min_p,
    )


def _call_id(call: ToolCall) -> str:
    return f"call_{call.key}"


@dataclass(frozen=True)
class _ItemIds:
    """One reply's output item ids, shared by its stream events and its final object."""

    reasoning: str
    message: str

    @classmethod
    def new(cls) -> _ItemIds:
        return cls(f"rs_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}")


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _function_call_item(call: ToolCall, status: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{call.key}",
        "call_id": _call_id(call),
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def _output_items(reply: Reply, ids: _ItemIds) -> list[dict[str, Any]]:
    items = [_reasoning_item(ids.reasoning, reply.reasoning)] if reply.reasoning else []
    if reply.text or not reply.tool_calls:
        items.append(_message_item(ids.message, reply.text, "completed"))
    calls = [_function_call_item(c, "completed", c.arguments_json) for c in reply.tool_calls]
    return items + calls


class _Draft:
    """The response object's fixed fields, shared by every event and the final object."""

    def __init__(
        self, body: ResponsesRequest, state: ServerState, sampling: SamplingParams, prompt: int
    ) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.body = body
        self.model = body.model or state.model_id
        self.sampling = sampling
        self.prompt_tokens = prompt
        self.tokenizer = state.engine.tokenizer

    def in_progress(self) -> dict[str, Any]:
        return self._object("in_progress", [], None, None)

    def finished(
        self,
        items: list[dict[str, Any]],
        finish_reason: str,
        stats: GenerationStats,
        reasoning: str,
    ) -> dict[str, Any]:
        cut = finish_reason == FINISH_LENGTH
        status = "incomplete" if cut else "completed"
        details = {"reason": "max_output_tokens"} if cut else None
        return self._object(status, items, details, self._usage(stats, reasoning))

    def _usage(self, stats: GenerationStats, reasoning: str) -> dict[str, Any]:
        # The thought's tokens, counted by encoding its text again (its markers aside).
        thought = len(self.tokenizer.encode(reasoning, add_special_tokens=False))
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens},
            "output_tokens": stats.generated_tokens,
            "output_tokens_details": {"reasoning_tokens": thought if reasoning else 0},
            "total_tokens": self.prompt_tokens + stats.generated_tokens,
        }

    def _object(
        self,
        status: str,
        output: list[dict[str, Any]],
        incomplete: dict[str, str] | None,
        usage: dict[str, Any] | None,
    ) -> dict[str, Any]:
        body = self.body
        effort = body.reasoning.effort if body.reasoning else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": effort, "summary": None},
            "store": body.store,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "tool_choice": _tool_choice_echo(body),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "text": {"format": _format_echo(body)},
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
        }


def _format_echo(body: ResponsesRequest) -> dict[str, Any]:
    text_format = body.text.format if body.text else None
    if text_format is None:
        return {"type": "text"}
    return text_format.model_dump(by_alias=True, exclude_none=True)


def _tool_choice_echo(body: ResponsesRequest) -> Any:
    choice = body.tool_choice or "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


class _EventStream:
    """Turns reply parts into the Responses event chain: output items open, fill and close."""

    def __init__(self, ids: _ItemIds) -> None:
        self.ids = ids
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self._open: str | None = None  # "reasoning" or "text": the part kind of the open item
        self._text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def add(self, part: ReplyPart) -> list[dict[str, Any]]:
        if part.call is not None:
            return [*self.close(), *self._function_call(part.call)]
        events = [] if part.kind == self._open else [*self.close(), *self._begin(part.kind)]
        self._text += part.text
        item_id = self._open_item_id()
        delta = {"item_id": item_id, "output_index": len(self.items), "content_index": 0}
        if part.kind == "reasoning":
            return [*events, self.event("response.reasoning_text.delta", **delta, delta=part.text)]
        delta |= {"delta": part.text, "logprobs": []}
        return [*events, self.event("response.output_text.delta", **delta)]

    def close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        kind, text, item_id = self._open, self._text, self._open_item_id()
        self._open, self._text = None, ""
        at = {"item_id": item_id, "output_index": len(self.items), "content_index": 0}
        if kind == "reasoning":
            item = _reasoning_item(item_id, text)
            done = [self.event("response.reasoning_text.done", **at, text=text)]
        else:
            item = _message_item(item_id, text, "completed")
            done = [
                self.event("response.output_text.done", **at, text=text, logprobs=[]),
                self.event("response.content_part.done", **at, part=_output_text(text)),
            ]
        return [*done, self._item_done(item)]

    def finish(self) -> list[dict[str, Any]]:
        """Close the open item; a reply with no output at all still gets an empty message."""
        if self._open is None and not self.items:
            return [*self._begin("text"), *self.close()]
        return self.close()

    def _open_item_id(self) -> str:
        return self.ids.reasoning if self._open == "reasoning" else self.ids.message

    def _begin(self, kind: str) -> list[dict[str, Any]]:
        self._open = kind
        index = len(self.items)
        if kind == "reasoning":
            item = _reasoning_item(self.ids.reasoning, "")
            return [self.event("response.output_item.added", output_index=index, item=item)]
        item = _message_item(self.ids.message, None, "in_progress")
        at = {"item_id": self.ids.message, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event("response.content_part.added", **at, part=_output_text("")),
        ]

    def _function_call(self, call: ToolCall) -> list[dict[str, Any]]:
        index = len(self.items)
        item_id, arguments = f"fc_{call.key}", call.arguments_json
        added = _function_call_item(call, "in_progress", "")
        at = {"item_id": item_id, "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=added),
            self.event("response.function_call_arguments.delta", **at, delta=arguments),
            self.event("response.function_call_arguments.done", **at, arguments=arguments),
            self._item_done(_function_call_item(call, "completed", arguments)),
        ]

    def _item_done(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        return self.event("response.output_item.done", output_index=len(self.items) - 1, item=item)


async def _stream(
    state: ServerState,
    generation: Generation,
    draft: _Draft,
    store: ResponseStore,
    conversation: list[dict[str, Any]],
) -> AsyncIterator[dict[str, Any]]:
    stream = _EventStream(_ItemIds.new())
    parser = draft.body.tool_policy().parser()
    reply = Reply()
    yield stream.event("response.created", response=draft.in_progress())
    yield stream.event("response.in_progress", response=draft.in_progress())
    async for piece in pieces(state, generation):
        parts = parser.feed(piece.text)
        if piece.finish_reason is not None:
            parts += parser.finish()
        for part in parts:
            reply.add(part)
            for event in stream.add(part):
                yield event
        if piece.finish_reason is not None and piece.stats is not None:
            for event in stream.finish():
                yield event
            response = draft.finished(
                stream.items, piece.finish_reason, piece.stats, reply.reasoning
            )
            _remember(store, draft.body, draft.id, conversation, reply)
            # The API ends a response cut by max_output_tokens with response.incomplete.
            yield stream.event(f"response.{response['status']}", response=response)


async def _named_events(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
    except Exception as error:  # headers are sent: the error can only travel as an event
        log.exception("streamed generation failed")
        failure = {"type": "error", "code": "server_error", "message": str(error), "param": None}
        yield f"event: error\ndata: {json.dumps(failure)}\n\n"
