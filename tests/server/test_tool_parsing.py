"""Tolerant parsing of unconstrained Gemma 4 replies (issue 45, item 3): a corpus of the
malformed outputs users of other servers report, each parsed into what the model meant (or
kept as plain content), the same whole and streamed in any pieces, and through all three APIs.

Each expected value is written out by hand from the reply's text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from hearth.engine import Engine
from hearth.server import create_app
from hearth.server.tools import ReplyParser, ToolChoice
from scripted_gemma4 import ASK, NO_PROMPT_CACHE, WEATHER_TOOL, one_torch_thread, say, shared_engine

Q = '<|"|>'  # Gemma's string mark
Call = tuple[str, dict[str, Any]]
# (name, reply text, (reasoning, content, calls))
CORPUS: list[tuple[str, str, tuple[str, str, list[Call]]]] = [
    (
        "well formed",
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>",
        ("", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ),
    (
        "no opening tag",
        f"call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>",
        ("", "", [("get_weather", {"city": "Paris"})]),
    ),
    (
        "no tags at all",
        f"  call:get_weather{{city:{Q}Paris{Q}}}",
        ("", "", [("get_weather", {"city": "Paris"})]),
    ),
    (
        "parentheses and =",
        f"call:get_weather(city={Q}Paris{Q}, days=2)",
        ("", "", [("get_weather", {"city": "Paris", "days": 2})]),
    ),
    (
        "bare JSON call",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        ("", "", [("get_weather", {"city": "Paris"})]),
    ),
    (
        "JSON arguments in a call",
        '<|tool_call>call:get_weather{"city": "Paris, France", "days": 3}<tool_call|>',
        ("", "", [("get_weather", {"city": "Paris, France", "days": 3})]),
    ),
    (
        "an unquoted word",
        "<|tool_call>call:get_weather{city:New York}<tool_call|>",
        ("", "", [("get_weather", {"city": "New York"})]),
    ),
    (
        "thought straight into a call",
        "<|channel>thought\nNeed weather.<channel|>"
        f"call:get_weather{{city:{Q}Oslo{Q}}}<tool_call|>",
        ("Need weather.", "", [("get_weather", {"city": "Oslo"})]),
    ),
    (
        "call inside the thought",
        "<|channel>thought\nLet me check."
        f"<|tool_call>call:get_weather{{city:{Q}Rome{Q}}}<tool_call|>",
        ("Let me check.", "", [("get_weather", {"city": "Rome"})]),
    ),
    (
        "missing end tag",
        f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}",
        ("", "", [("get_weather", {"city": "Paris"})]),
    ),
    (
        "two calls",
        f"<|tool_call>call:a{{x:1}}<tool_call|><|tool_call>call:b{{y:{Q}z{Q}}}<tool_call|>",
        ("", "", [("a", {"x": 1}), ("b", {"y": "z"})]),
    ),
    (
        "two calls, the first unclosed",
        "<|tool_call>call:a{x:1}<|tool_call>call:b{y:2}<tool_call|>",
        ("", "", [("a", {"x": 1}), ("b", {"y": 2})]),
    ),
    (
        "a second call without its tag",
        "<|tool_call>call:a{x:1}<tool_call|>\ncall:b{y:2}<tool_call|>",
        ("", "", [("a", {"x": 1}), ("b", {"y": 2})]),
    ),
    (
        "quotes, newlines and braces in strings",
        f'<|tool_call>call:note{{text:{Q}He said "hi"\nthen left, {{ok}}{Q},'
        f'meta:{{tags:[{Q}a{Q},{Q}b"c{Q}]}}}}<tool_call|>',
        (
            "",
            "",
            [("note", {"text": 'He said "hi"\nthen left, {ok}', "meta": {"tags": ["a", 'b"c']}})],
        ),
    ),
    (
        "<unusedNN> flood",
        "<unused12><unused12><unused12>Hello<unused3> there<unused7>",
        ("", "Hello there", []),
    ),
    ("a stray channel close", "Answer.<channel|>", ("", "Answer.", [])),
    (
        "text before a call",
        f"Sure. <|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>",
        ("", "Sure. ", [("get_weather", {"city": "Paris"})]),
    ),
    ("prose that starts like a call", "calling you later", ("", "calling you later", [])),
    ("JSON that is not a call", '{"answer": 42}', ("", '{"answer": 42}', [])),
    (
        "beyond repair: an unclosed string",
        f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>",
        ("", f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>", []),
    ),
    (
        "thought then answer",
        "<|channel>thought\nhmm<channel|>The answer is 4.",
        ("hmm", "The answer is 4.", []),
    ),
]
IDS = [name for name, _, _ in CORPUS]


def _split(parts: list[Any]) -> tuple[str, str, list[Call]]:
    reasoning = "".join(p.text for p in parts if p.kind == "reasoning")
    text = "".join(p.text for p in parts if p.kind == "text")
    calls = [(p.call.name, p.call.arguments) for p in parts if p.call is not None]
    return reasoning, text, calls


def _streamed(reply: str, size: int) -> tuple[str, str, list[Call]]:
    parser = ReplyParser(parse_tools=True)
    parts = [part for i in range(0, len(reply), size) for part in parser.feed(reply[i : i + size])]
    return _split(parts + parser.finish())


@pytest.mark.parametrize(("name", "reply", "expected"), CORPUS, ids=IDS)
def test_corpus_whole_and_streamed(name: str, reply: str, expected: Any) -> None:
    whole = ToolChoice().parse(reply)
    calls = [(call.name, call.arguments) for call in whole.tool_calls]
    assert (whole.reasoning, whole.text, calls) == expected
    for size in (1, 2, 5, 13):
        assert _streamed(reply, size) == expected, size


def test_without_tools_nothing_is_a_call() -> None:
    """With no tools given, call-like text stays text (only the thought is split off)."""
    reply = f"<|channel>thought\nx<|tool_call>y<channel|>call:f{{a:{Q}b{Q}}}"
    parsed = ToolChoice(enabled=False).parse(reply)
    assert (parsed.reasoning, parsed.text, parsed.tool_calls) == (
        "x<|tool_call>y",
        f"call:f{{a:{Q}b{Q}}}",
        [],
    )


# --- through the three APIs, on the tiny Gemma 4 whose output is scripted -----------------

API_CASES = [CORPUS[i] for i in (2, 7, 8, 11)]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with one_torch_thread():
        yield shared_engine()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, limits=NO_PROMPT_CACHE)) as test_client:
        yield test_client


@pytest.mark.parametrize(("name", "reply", "expected"), API_CASES, ids=[c[0] for c in API_CASES])
def test_corpus_through_the_apis(
    engine: Engine, client: TestClient, name: str, reply: str, expected: Any
) -> None:
    _, _, calls = expected
    say(engine, reply)
    oai = openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )
    chat = oai.chat.completions.create(model="g", messages=ASK, tools=[WEATHER_TOOL])  # type: ignore[arg-type]
    got = [
        (c.function.name, json.loads(c.function.arguments))
        for c in chat.choices[0].message.tool_calls or []
    ]  # type: ignore[union-attr]
    assert got == calls
    stream = oai.chat.completions.create(model="g", messages=ASK, tools=[WEATHER_TOOL], stream=True)  # type: ignore[arg-type]
    deltas = [t for chunk in stream for t in (chunk.choices[0].delta.tool_calls or [])]
    streamed: dict[int, list[str]] = {}
    for delta in deltas:
        entry = streamed.setdefault(delta.index, ["", ""])
        entry[0] += delta.function.name or "" if delta.function else ""
        entry[1] += delta.function.arguments or "" if delta.function else ""
    assert [(n, json.loads(a)) for n, a in streamed.values()] == calls

    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=client, max_retries=0
    )
    tool = WEATHER_TOOL["function"]
    message = claude.messages.create(
        model="g",
        max_tokens=64,
        messages=ASK,  # type: ignore[arg-type]
        tools=[{"name": tool["name"], "input_schema": tool["parameters"]}],
    )
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == calls

    response = oai.responses.create(
        model="g",
        input="Weather in Paris?",
        tools=[{"type": "function", **tool, "strict": False}],  # type: ignore[list-item]
    )
    items = [i for i in response.output if i.type == "function_call"]
    assert [(i.name, json.loads(i.arguments)) for i in items] == calls  # type: ignore[union-attr]
