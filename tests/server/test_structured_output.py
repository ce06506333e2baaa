"""Structured output through the real SDKs (issue 45's acceptance).

On the embedded Gemma 3 270M base model, which never writes JSON by itself: 20 JSON schemas of
increasing difficulty, each output parsed and validated by the `jsonschema` package (the
oracle), through the `openai` SDK, streamed and not, and with `chat.completions.parse` and
Pydantic models for some. On a tiny random Gemma 4 checkpoint with the real chat template,
whose "model" is scripted to answer in prose or a malformed call: `tool_choice` "required" (or
a named tool) still yields a well-formed call whose arguments validate against the tool's
schema, through all three APIs. Bad input: a 400 naming what is wrong.

Schemas bound every string (maxLength) and array (maxItems) so that a reply ends within its
max_tokens: the grammar only lets the model stop where the value is complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import anthropic
import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from hearth.engine import Engine
from hearth.server import create_app
from scripted_gemma4 import ASK, NO_PROMPT_CACHE, THOUGHT, one_torch_thread, say, shared_engine

# Increasing difficulty: scalars, flat objects, arrays, nesting, unions, references.
SCHEMAS: list[dict[str, Any]] = json.loads(
    (Path(__file__).parents[1] / "data" / "structured_output_schemas.json").read_text()
)


class Colour(BaseModel):
    name: Literal["red", "green", "blue"]
    dark: bool


class Person(BaseModel):
    name: str = Field(max_length=8)
    nickname: str | None = Field(max_length=6)
    pets: list[Literal["cat", "dog"]] = Field(max_length=2)
    home: Colour


PYDANTIC_MODELS: list[type[BaseModel]] = [Colour, Person]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def served(hearth_270m: Engine) -> Iterator[TestClient]:
    """One in-process server on the 270M for the module (batched worker, as `hearth serve`)."""
    with TestClient(create_app(hearth_270m)) as client:
        yield client


@pytest.fixture(scope="module")
def oai(served: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=served, max_retries=0
    )


def _chat(oai: openai.OpenAI, schema: dict[str, Any], stream: bool) -> tuple[str, str]:
    """The reply's text and finish reason for a json_schema response_format."""
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    messages: Any = [{"role": "user", "content": "Answer in JSON."}]
    if not stream:
        reply = oai.chat.completions.create(
            model="g", messages=messages, response_format=response_format, max_tokens=MAX_TOKENS
        )
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    chunks = oai.chat.completions.create(
        model="g",
        messages=messages,
        response_format=response_format,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    text, finish = "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_schema_output_validates(oai: openai.OpenAI, index: int) -> None:
    """Every other schema streams; each reply ends by itself and validates."""
    schema = SCHEMAS[index]
    text, finish = _chat(oai, schema, stream=index % 2 == 1)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
@pytest.mark.parametrize("model", PYDANTIC_MODELS, ids=lambda model: model.__name__)
def test_parse_with_a_pydantic_model(oai: openai.OpenAI, model: type[BaseModel]) -> None:
    """The SDK sends the model's strict schema and parses the reply into the model; the raw
    text also validates against the schema the SDK sent, independently of pydantic."""
    reply = oai.chat.completions.parse(
        model="g",
        messages=[{"role": "user", "content": "Describe it."}],
        response_format=model,
        max_tokens=MAX_TOKENS,
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, model)
    jsonschema.validate(json.loads(message.content or ""), model.model_json_schema())


@pytest.mark.slow
def test_responses_and_anthropic_formats(oai: openai.OpenAI, served: TestClient) -> None:
    """Responses' text.format (echoed back) and Anthropic's output_config.format, as
    `messages.parse` sends it, on the same server."""
    schema = SCHEMAS[6]
    response = oai.responses.create(
        model="g",
        input="A person, as JSON.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema}},
        max_output_tokens=MAX_TOKENS,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"  # type: ignore[union-attr]
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=served, max_retries=0
    )
    parsed = claude.messages.parse(
        model="g",
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "A colour, as JSON."}],
        output_format=Colour,
    )
    assert parsed.stop_reason == "end_turn"
    assert isinstance(parsed.parsed_output, Colour)


@pytest.mark.slow
def test_completions_regex_choice_and_json_object(oai: openai.OpenAI) -> None:
    """vLLM's extension fields on the completions endpoint, checked with Python's `re`."""
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    regex = oai.completions.create(
        model="g", prompt="Code:", max_tokens=16, extra_body={"guided_regex": pattern}
    )
    assert re.fullmatch(pattern, regex.choices[0].text)
    choices = ["yes", "no", "maybe so"]
    choice = oai.completions.create(
        model="g",
        prompt="Well,",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert choice.choices[0].text in choices
    anything = oai.chat.completions.create(
        model="g",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=24,
    )
    text = anything.choices[0].message.content or ""
    if anything.choices[0].finish_reason == "stop":  # an object may run past the budget
        assert isinstance(json.loads(text), dict)
    assert text.startswith("{")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        (
            {"response_format": {"type": "json_schema"}},
            "response_format",
        ),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "strng"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_constraints_are_400s(oai: openai.OpenAI, fields: dict[str, Any], named: str) -> None:
    with pytest.raises(openai.BadRequestError, match=re.escape(named)):
        oai.chat.completions.create(
            model="g", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, extra_body=fields
        )


# --- tool_choice on the tiny Gemma 4 -------------------------------------------------------

CITY_TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
}
CLOCK_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY_TOOL_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK_SCHEMA}},
]
SCHEMA_OF = {"get_weather": CITY_TOOL_SCHEMA, "get_time": CLOCK_SCHEMA}
# What the scripted "model" would write unconstrained: prose, or the malformed call.
UNCONSTRAINED = ["Sure, let me look that up.", "call:get_weather{city:Paris}"]


@pytest.fixture(scope="module")
def gemma4() -> Iterator[Engine]:
    with one_torch_thread():
        yield shared_engine()


@pytest.fixture(scope="module")
def gemma4_client(gemma4: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(gemma4, limits=NO_PROMPT_CACHE)) as client:
        yield client


def _openai_for(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )


@pytest.mark.parametrize("wanted", UNCONSTRAINED)
def test_required_tool_call_on_all_three_apis(
    gemma4: Engine, gemma4_client: TestClient, wanted: str
) -> None:
    say(gemma4, wanted)
    oai = _openai_for(gemma4_client)
    chat = oai.chat.completions.create(
        model="g",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=64,  # type: ignore[arg-type]
    )
    calls = chat.choices[0].message.tool_calls or []
    assert len(calls) == 1 and chat.choices[0].finish_reason == "tool_calls"
    function = calls[0].function  # type: ignore[union-attr]
    jsonschema.validate(json.loads(function.arguments), SCHEMA_OF[function.name])

    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=gemma4_client, max_retries=0
    )
    message = claude.messages.create(
        model="g",
        max_tokens=64,
        messages=ASK,  # type: ignore[arg-type]
        tools=[
            {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
            for t in TOOLS
        ],
        tool_choice={"type": "any"},
    )
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1 and message.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, SCHEMA_OF[uses[0].name])  # type: ignore[union-attr]

    response = oai.responses.create(
        model="g",
        input="Weather in Paris?",
        tools=[{"type": "function", **t["function"], "strict": False} for t in TOOLS],  # type: ignore[misc]
        tool_choice="required",
        max_output_tokens=64,
    )
    items = [item for item in response.output if item.type == "function_call"]
    assert len(items) == 1
    jsonschema.validate(json.loads(items[0].arguments), SCHEMA_OF[items[0].name])  # type: ignore[union-attr]


def test_named_tool_is_the_one_called_streamed(gemma4: Engine, gemma4_client: TestClient) -> None:
    say(gemma4, UNCONSTRAINED[0])
    stream = _openai_for(gemma4_client).chat.completions.create(
        model="g",
        messages=ASK,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=64,
        stream=True,
    )
    names, arguments = [], ""
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names += [call.function.name] if call.function and call.function.name else []
            arguments += call.function.arguments or "" if call.function else ""
    assert names == ["get_time"]
    jsonschema.validate(json.loads(arguments), CLOCK_SCHEMA)


def test_unenforceable_tool_schema_and_conflicts_are_400s(gemma4_client: TestClient) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"s": {"type": "string", "pattern": "a+"}},
                },
            },
        }
    ]
    body = {"model": "g", "messages": ASK, "tools": tools, "tool_choice": "required"}
    reply = gemma4_client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and "'pattern'" in reply.json()["error"]["message"]
    conflict = body | {"tools": TOOLS, "response_format": {"type": "json_object"}}
    reply = gemma4_client.post("/v1/chat/completions", json=conflict)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"


# --- thinking, then the constrained answer --------------------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_a_format_applies_after_the_thought_when_thinking_is_on(
    gemma4: Engine, gemma4_client: TestClient
) -> None:
    """With thinking on, the scripted model thinks in its channel, then answers: the thought is
    free text (no grammar could accept "Cold, probably."), the answer is held to the schema.
    The scripted answer is prose, so the JSON is what the grammar forced, checked against the
    schema by jsonschema; the reasoning is exactly what the model thought."""
    say(gemma4, THOUGHT + "Sure: Paris!")
    oai = _openai_for(gemma4_client)
    chat = oai.chat.completions.create(
        model="g",
        messages=ASK,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY_SCHEMA},
        },
        reasoning_effort="high",
        max_tokens=64,
    )
    message = chat.choices[0].message
    assert message.reasoning == "Cold, probably."  # type: ignore[attr-defined]
    jsonschema.validate(json.loads(message.content or ""), CITY_SCHEMA)

    # Thinking off (the template closes an empty channel itself): the reply cannot open one,
    # so it holds no reasoning, and the grammar starts at its first token.
    say(gemma4, THOUGHT + "Sure: Paris!")
    chat = oai.chat.completions.create(
        model="g",
        messages=ASK,  # type: ignore[arg-type]
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY_SCHEMA},
        },
        max_tokens=64,
    )
    message = chat.choices[0].message
    assert getattr(message, "reasoning", None) is None
    jsonschema.validate(json.loads(message.content or ""), CITY_SCHEMA)


def test_a_thought_cannot_end_the_reply(gemma4: Engine, gemma4_client: TestClient) -> None:
    """A model that would end its turn inside the thought goes on: the end of turn is masked in
    the channel (the scripted model's second token is `<turn|>`; the first allowed token, an
    empty <pad>, is taken instead), and the answer after the channel is held to the schema."""
    say(gemma4, '<|channel><turn|>thought\nCold, probably.<channel|>{"city": "Rome"}')
    claude = anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=gemma4_client, max_retries=0
    )
    message = claude.messages.create(
        model="g",
        max_tokens=64,
        messages=ASK,  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 1024},
        output_config={"format": {"type": "json_schema", "schema": CITY_SCHEMA}},  # type: ignore[call-arg]
    )
    assert message.stop_reason == "end_turn"
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Cold, probably.")  # type: ignore[union-attr]
    assert json.loads(text.text) == {"city": "Rome"}  # type: ignore[union-attr]
