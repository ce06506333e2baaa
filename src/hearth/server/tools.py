"""Gemma 4 tool calling: parse `<|tool_call>call:NAME{key:value,…}<tool_call|>` from generated
text (whole or streamed), and shape conversations with tool calls and results for the chat
template.

Arguments use Gemma's syntax: bare keys, strings wrapped in `<|"|>…<|"|>`, JSON numbers and
literals, nested `{}` and `[]`. Parsing is tolerant of what models write instead (the corpus
in tests/server/test_tool_parsing.py): JSON strings and quoted keys, a bare word for a string,
`call:NAME(key=value)`, a call with no opening tag at the start of the answer, a missing end
tag, bare JSON `{"name": …, "arguments": {…}}` as the whole answer. A call that still does not
parse is kept as plain text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from hearth.server.reasoning import ReasoningSplitter, partial_marker_length

TOOL_CALL_START = "<|tool_call>"
TOOL_CALL_END = "<tool_call|>"
STRING_MARK = '<|"|>'
# Ends generation after a call: the model would go on to imagine the tool's answer.
TOOL_RESPONSE_START = "<|tool_response>"

_BARE_KEY = re.compile(r"[^\s:=,{}()\[\]<\"]+")
# A bare value runs to the next separator: a number, a JSON literal, or an unquoted word.
_LITERAL = re.compile(r"[^,{}()\[\]]+")
_CALL_NAME = re.compile(r"call:([^\s{}()]+)\s*([{(])")
CALL_WITHOUT_TAG = "call:"
_UNUSED = re.compile(r"<unused\d+>")
_PARTIAL_UNUSED = re.compile(r"<(u(n(u(s(e(d\d*)?)?)?)?)?)?$")
# The closers a model writes in place of <tool_call|>.
_CLOSERS = {"{": "}", "(": ")"}
_JSON = json.JSONDecoder()


class MalformedToolCall(ValueError):
    """Tool-call markup that is not Gemma's call syntax."""


def _new_call_key() -> str:
    return uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    key: str = field(default_factory=_new_call_key)  # each API prefixes it (call_, toolu_, fc_)

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


class _GemmaValue:
    """A recursive-descent reader of one Gemma argument value (brace-balanced by construction)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def read(self) -> Any:
        self._skip_spaces()
        if self.text.startswith(STRING_MARK, self.pos):
            return self._string()
        if self.text.startswith('"', self.pos):
            return self._json_string()
        if self._take("{"):
            return self._object()
        if self._take("["):
            return self._array()
        return self._literal()

    def read_arguments(self) -> dict[str, Any]:
        """`{…}` (or, as some replies write it, `(…)`) as a dict, and nothing after it."""
        self._skip_spaces()
        opener = self.text[self.pos : self.pos + 1]
        if opener not in _CLOSERS:
            raise MalformedToolCall("arguments must be one {...} object")
        self.pos += 1
        value = self._object(_CLOSERS[opener])
        if not self.at_end():
            raise MalformedToolCall("text after the arguments")
        return value

    def at_end(self) -> bool:
        self._skip_spaces()
        return self.pos == len(self.text)

    def _string(self) -> str:
        start = self.pos + len(STRING_MARK)
        end = self.text.find(STRING_MARK, start)
        if end < 0:
            raise MalformedToolCall("unterminated string")
        self.pos = end + len(STRING_MARK)
        return self.text[start:end]

    def _json_string(self) -> str:
        try:
            value, self.pos = _JSON.raw_decode(self.text, self.pos)
        except json.JSONDecodeError:
            raise MalformedToolCall("unterminated string") from None
        return value

    def _object(self, closer: str = "}") -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self._take(closer):
            return result
        while True:
            key = self._key()
            if not self._take(":"):
                self._expect("=")  # call:NAME(key=value)
            result[key] = self.read()
            if self._take(closer):
                return result
            self._expect(",")

    def _array(self) -> list[Any]:
        result: list[Any] = []
        if self._take("]"):
            return result
        while True:
            result.append(self.read())
            if self._take("]"):
                return result
            self._expect(",")

    def _key(self) -> str:
        self._skip_spaces()
        if self.text.startswith(STRING_MARK, self.pos):  # the template quotes nested keys
            return self._string()
        if self.text.startswith('"', self.pos):  # JSON's quoted keys
            return self._json_string()
        return self._match(_BARE_KEY, "a key")

    def _literal(self) -> Any:
        token = self._match(_LITERAL, "a value").strip()
        if STRING_MARK in token or not token:
            raise MalformedToolCall(f"not a value: {token!r}")
        try:
            return json.loads(token)  # numbers, true, false, null
        except json.JSONDecodeError:
            return token  # an unquoted word: the string the model meant

    def _match(self, pattern: re.Pattern[str], what: str) -> str:
        self._skip_spaces()
        match = pattern.match(self.text, self.pos)
        if match is None:
            raise MalformedToolCall(f"expected {what} at {self.pos}")
        self.pos = match.end()
        return match.group()

    def _take(self, char: str) -> bool:
        self._skip_spaces()
        if self.text.startswith(char, self.pos):
            self.pos += 1
            return True
        return False

    def _expect(self, char: str) -> None:
        if not self._take(char):
            raise MalformedToolCall(f"expected {char!r} at {self.pos}")

    def _skip_spaces(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1


def parse_gemma_arguments(text: str) -> dict[str, Any]:
    """`{key:value,…}` in Gemma's syntax (or JSON, or between parentheses) as a dict."""
    return _GemmaValue(text).read_arguments()


def parse_tool_call(markup: str) -> ToolCall:
    """One `<|tool_call>call:NAME{…}<tool_call|>` span (either tag may be missing)."""
    body = markup.removeprefix(TOOL_CALL_START).removesuffix(TOOL_CALL_END).strip()
    match = _CALL_NAME.match(body)
    if match is None:
        raise MalformedToolCall("expected call:NAME{...}")
    return ToolCall(match.group(1), parse_gemma_arguments(body[match.start(2) :]))


def parse_json_call(text: str) -> ToolCall:
    """A whole answer that is a call written as bare JSON: `{"name": …, "arguments": {…}}`
    (or "parameters")."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise MalformedToolCall("not JSON") from None
    if not isinstance(value, dict) or set(value) - {"name", "arguments", "parameters", "type"}:
        raise MalformedToolCall("not a call")
    arguments = value.get("arguments", value.get("parameters"))
    if not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
        raise MalformedToolCall("not a call")
    return ToolCall(value["name"], arguments)


PartKind = Literal["reasoning", "text", "tool_call"]


@dataclass(frozen=True)
class ReplyPart:
    kind: PartKind
    text: str = ""
    call: ToolCall | None = None


class _ToolCallSplitter:
    """Answer text in, text and tool calls out; a partial `<|tool_call>` is held back and a
    call's markup is buffered until its end marker (or the next call's start, or the end).

    At the start of the answer (and after each call), `call:` without its tag opens a call too,
    and a `{` holds the whole answer back: bare JSON may be a call (decided at the end).
    """

    def __init__(self) -> None:
        self._pending = ""
        self._at_start = True  # only whitespace since the answer began or the last call
        self._json = False  # holding a whole answer that began with "{"

    def feed(self, text: str) -> list[ReplyPart]:
        self._pending += text
        parts: list[ReplyPart] = []
        while self._pending and not self._json:
            if self._at_start and not self._open_untagged_call():
                return parts
            start = self._pending.find(TOOL_CALL_START)
            if start < 0:
                safe = len(self._pending) - partial_marker_length(self._pending, TOOL_CALL_START)
                parts.append(ReplyPart("text", self._pending[:safe]))
                self._pending = self._pending[safe:]
                return parts
            end = self._call_end(start)
            if end < 0:
                parts.append(ReplyPart("text", self._pending[:start]))
                self._pending = self._pending[start:]
                return parts
            if self._pending.startswith(TOOL_CALL_END, end):
                end += len(TOOL_CALL_END)
            parts.append(ReplyPart("text", self._pending[:start]))
            parts.append(_call_or_text(self._pending[start:end]))
            self._pending = self._pending[end:]
            self._at_start = True
        return parts

    def finish(self) -> list[ReplyPart]:
        """The rest: bare JSON or a call missing its end tag, if they parse; else text."""
        rest, self._pending = self._pending, ""
        if self._json:
            try:
                return [ReplyPart("tool_call", call=parse_json_call(rest))]
            except MalformedToolCall:
                return [ReplyPart("text", rest)]
        start = rest.find(TOOL_CALL_START)
        if start < 0:
            return [ReplyPart("text", rest)]
        return [ReplyPart("text", rest[:start]), _call_or_text(rest[start:])]

    def _open_untagged_call(self) -> bool:
        """At the answer's start: decide what it opens. False while that cannot be told yet."""
        head = self._pending.lstrip()
        if not head or (CALL_WITHOUT_TAG.startswith(head) and head != CALL_WITHOUT_TAG):
            return False  # whitespace, or a partial "call:": wait for more
        if head.startswith(CALL_WITHOUT_TAG):
            self._pending = TOOL_CALL_START + head
        elif head.startswith("{"):
            self._json = True
            return False
        self._at_start = False
        return True

    def _call_end(self, start: int) -> int:
        """Where the call opened at `start` ends: at its end tag, or where the next call's
        tag begins (a call left unclosed); -1 until one is there."""
        after = start + len(TOOL_CALL_START)
        ends = [
            found
            for found in (
                self._pending.find(TOOL_CALL_END, after),
                self._pending.find(TOOL_CALL_START, after),
            )
            if found >= 0
        ]
        return min(ends, default=-1)


def _call_or_text(markup: str) -> ReplyPart:
    try:
        return ReplyPart("tool_call", call=parse_tool_call(markup))
    except MalformedToolCall:
        return ReplyPart("text", markup)


@dataclass(frozen=True)
class ToolChoice:
    """What a request lets the model do with its tools: use them or not (`enabled`), whether
    it must call one (`required`, and `name`: which one), and whether more than one call may
    come (`parallel`)."""

    enabled: bool = True
    required: bool = False
    name: str | None = None
    parallel: bool = True

    def reply_prefix(self) -> str:
        """The start of a forced call, appended to the prompt: with no constrained decoding
        the model is made to begin its reply with the call (and the tool's name, if named)."""
        if not self.required:
            return ""
        return f"{TOOL_CALL_START}call:{self.name}{{" if self.name else f"{TOOL_CALL_START}call:"

    def parser(self) -> ReplyParser:
        return ReplyParser(self.enabled, None if self.parallel else 1, self.reply_prefix())

    def parse(self, text: str) -> Reply:
        """A whole reply, split as `parser` splits a stream."""
        parser = self.parser()
        reply = Reply()
        for part in [*parser.feed(text), *parser.finish()]:
            reply.add(part)
        return reply


class ReplyParser:
    """Generated text in, reasoning / answer text / tool calls out, as the text streams.

    `max_calls`: calls after that many are dropped (a request that disabled parallel calls).
    `prefix`: text the reply begins with that was not generated (a forced call's opening).
    """

    def __init__(self, parse_tools: bool, max_calls: int | None = None, prefix: str = "") -> None:
        self._reasoning = ReasoningSplitter(TOOL_CALL_START if parse_tools else None)
        self._tools = _ToolCallSplitter() if parse_tools else None
        self._calls_left = max_calls
        self._prefix = prefix
        self._unused = ""  # a tail that may be the start of an <unusedNN> token

    def feed(self, text: str) -> list[ReplyPart]:
        text, self._prefix = self._prefix + text, ""
        return self._route(self._reasoning.feed(self._without_unused(text)), final=False)

    def finish(self) -> list[ReplyPart]:
        parts = self.feed("") if self._prefix or self._unused else []
        rest, self._unused = self._unused, ""
        parts += self._route(self._reasoning.feed(rest), final=False) if rest else []
        return parts + self._route(self._reasoning.finish(), final=True)

    def _without_unused(self, text: str) -> str:
        """`text` without Gemma's <unusedNN> tokens, which a confused model repeats in floods;
        a tail that may still become one is held for the next piece."""
        text = _UNUSED.sub("", self._unused + text)
        partial = _PARTIAL_UNUSED.search(text)
        cut = partial.start() if partial else len(text)
        text, self._unused = text[:cut], text[cut:]
        return text

    def _route(self, pieces: list[tuple[str, str]], final: bool) -> list[ReplyPart]:
        parts: list[ReplyPart] = []
        for kind, text in pieces:
            if kind == "reasoning":
                parts.append(ReplyPart("reasoning", text))
            elif self._tools is None:
                parts.append(ReplyPart("text", text))
            else:
                parts.extend(self._tools.feed(text))
        if final and self._tools is not None:
            parts.extend(self._tools.finish())
        return [part for part in parts if (part.text or part.call is not None) and self._keep(part)]

    def _keep(self, part: ReplyPart) -> bool:
        if part.call is None or self._calls_left is None:
            return True
        self._calls_left -= 1
        return self._calls_left >= 0


@dataclass
class Reply:
    """A whole reply, split."""

    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, part: ReplyPart) -> None:
        if part.kind == "reasoning":
            self.reasoning += part.text
        elif part.call is not None:
            self.tool_calls.append(part.call)
        else:
            self.text += part.text


def parse_reply(text: str, parse_tools: bool) -> Reply:
    return ToolChoice(enabled=parse_tools).parse(text)


def function_tool(name: str, description: str | None, parameters: object) -> dict[str, Any]:
    """A tool as chat templates expect it: OpenAI's `{"type": "function", "function": …}`."""
    spec: dict[str, Any] = {"name": name, "description": description or ""}
    if parameters is not None:
        spec["parameters"] = parameters
    return {"type": "function", "function": spec}


class ConversationError(ValueError):
    """A conversation the template cannot be given: the request field at fault, and why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _source(message: dict[str, Any], index: int) -> str:
    """Where a neutral message came from in the request (routes set "source")."""
    return message.get("source", f"messages.{index}")


def template_conversation(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neutral messages (OpenAI chat shape: assistant `tool_calls` with JSON-string arguments,
    `role: tool` results with `tool_call_id`, each optionally with its request "source") as
    the Gemma 4 template reads them: arguments as mappings, results folded into the calling
    model turn as `tool_responses`."""
    folded: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if message["role"] == "tool":
            _fold_tool_result(folded, message, index)
        elif _continues_after_results(folded, message):
            # Gemma answers in the same model turn that holds the calls and their results.
            folded[-1]["content"] = (folded[-1].get("content") or "") + (message["content"] or "")
        else:
            folded.append(_template_message(message, index))
    return folded


def _continues_after_results(folded: list[dict[str, Any]], message: dict[str, Any]) -> bool:
    return bool(
        folded
        and message["role"] == "assistant"
        and not message.get("tool_calls")
        and folded[-1].get("tool_responses")
    )


def _template_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    shaped = {"role": message["role"], "content": message.get("content")}
    if message.get("tool_calls"):
        shaped["tool_calls"] = [
            _template_call(call, _source(message, index)) for call in message["tool_calls"]
        ]
    return shaped


def _template_call(call: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call["arguments"]) if call["arguments"] else {}
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ConversationError(f"{source}.tool_calls", "arguments must be a JSON object")
    function = {"name": call["name"], "arguments": arguments}
    return {"id": call["id"], "type": "function", "function": function}


def _fold_tool_result(folded: list[dict[str, Any]], message: dict[str, Any], index: int) -> None:
    owner = folded[-1] if folded else None
    calls = (owner or {}).get("tool_calls") or []
    source = _source(message, index)
    if owner is None or owner["role"] != "assistant" or not calls:
        raise ConversationError(f"{source}.role", "a tool result must follow the tool calls")
    names = {call["id"]: call["function"]["name"] for call in calls}
    if message.get("tool_call_id") not in names:
        raise ConversationError(f"{source}.tool_call_id", "no earlier tool call has this id")
    response = {"name": names[message["tool_call_id"]], "response": _result_value(message)}
    owner.setdefault("tool_responses", []).append(response)


def _result_value(message: dict[str, Any]) -> Any:
    """A JSON object result stays structured; anything else is its text (the template wraps a
    non-mapping as {value: …})."""
    text = message.get("content") or ""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text
