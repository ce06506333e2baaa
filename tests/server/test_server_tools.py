"""Tool calling, reasoning and the Responses API on a tiny random Gemma 4 checkpoint that ships
the real Gemma 4 chat template, driven by the official SDKs.

The model runs for real, but its logits are replaced with scripted token ids, so each test
decides what the "model" says and checks how each API parses and streams it.
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
from hearth.server import ServerDefaults, create_app
from hearth.server.responses import ResponseStore
from hearth.server.tools import ReplyParser, parse_gemma_arguments, parse_reply
from scripted_gemma4 import (
    ASK,
    CALL,
    CALL_MARKUP,
    NO_PROMPT_CACHE,
    THOUGHT,
    WEATHER_TOOL,
    last_prompt,
    one_torch_thread,
    shared_engine,
)
from scripted_gemma4 import say as say_text

MALFORMED = '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>'  # an unclosed string


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with one_torch_thread():
        yield shared_engine()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, limits=NO_PROMPT_CACHE)) as test_client:
        yield test_client


@pytest.fixture(scope="module")
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )


@pytest.fixture(scope="module")
def claude(client: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=client, max_retries=0
    )


@pytest.fixture
def say(engine: Engine) -> Any:
    """Script the next generations' output text (the end of turn is added)."""
    return lambda text: say_text(engine, text)


def _last_prompt(engine: Engine) -> str:
    return last_prompt(engine)


def test_gemma_arguments_parse_nested_values() -> None:
    text = '{a:<|"|>x, "y"<|"|>,n:-1.5,ok:true,none:null,deep:{<|"|>k<|"|>:[1,{b:[]}]}}'
    assert parse_gemma_arguments(text) == {
        "a": 'x, "y"',
        "n": -1.5,
        "ok": True,
        "none": None,
        "deep": {"k": [1, {"b": []}]},
    }


def test_streamed_parts_never_leak_partial_markup() -> None:
    text = f"{THOUGHT}Here.{CALL_MARKUP}"
    parser = ReplyParser(parse_tools=True)
    parts = [part for char in text for part in parser.feed(char)] + parser.finish()
    assert all("<" not in part.text for part in parts)
    whole = parse_reply(text, parse_tools=True)
    assert (whole.reasoning, whole.text) == ("Cold, probably.", "Here.")
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    assert (
        parse_reply("a<|tool_call>call:f{x:1", parse_tools=True).text == "a<|tool_call>call:f{x:1"
    )


def test_openai_tool_call_json_and_stream(oai: openai.OpenAI, engine: Engine, say: Any) -> None:
    say(CALL)
    reply = oai.chat.completions.create(model="g", messages=ASK, tools=[WEATHER_TOOL])
    prompt = _last_prompt(engine)
    assert '<|tool>declaration:get_weather{description:<|"|>Weather for a city<|"|>' in prompt
    assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    chunks = list(
        oai.chat.completions.create(model="g", messages=ASK, tools=[WEATHER_TOOL], stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in streamed] == [
        (0, "get_weather", call.function.arguments)
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_tool_call_is_plain_content(oai: openai.OpenAI, say: Any) -> None:
    say(MALFORMED)
    reply = oai.chat.completions.create(model="g", messages=ASK, tools=[WEATHER_TOOL])
    assert reply.choices[0].message.content == MALFORMED
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model="g", messages=ASK, tools=[WEATHER_TOOL], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == MALFORMED


def test_tool_results_render_back_through_the_template(
    oai: openai.OpenAI, engine: Engine, say: Any
) -> None:
    say("It is 21 degrees.")
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    reply = oai.chat.completions.create(model="g", messages=messages, tools=[WEATHER_TOOL])
    assert reply.choices[0].message.content == "It is 21 degrees."
    assert _last_prompt(engine).endswith(
        '<|turn>model\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
        "<|tool_response>response:get_weather{temp:21}<tool_response|>"
        "<|channel>thought\n<channel|>"
    )


def test_server_chat_template_args_reach_the_template(engine: Engine, say: Any) -> None:
    """`--chat-template-args '{"enable_thinking": true}'`: thinking on without a request field."""
    defaults = ServerDefaults(chat_template_args={"enable_thinking": True})
    with TestClient(create_app(engine, defaults, NO_PROMPT_CACHE)) as local:
        say("Fine.")
        reply = local.post("/v1/chat/completions", json={"model": "g", "messages": ASK})
        assert reply.status_code == 200, reply.text
    assert "<|turn>system\n<|think|>" in _last_prompt(engine)


def test_openai_reasoning_is_split(oai: openai.OpenAI, engine: Engine, say: Any) -> None:
    say(f"{THOUGHT}Bring a coat.")
    reply = oai.chat.completions.create(model="g", messages=ASK, reasoning_effort="high")
    assert "<|turn>system\n<|think|>" in _last_prompt(engine)
    message = reply.choices[0].message
    # mlx_lm.server's field name by default (its generate_response sends "reasoning").
    assert (message.content, message.reasoning) == ("Bring a coat.", "Cold, probably.")  # type: ignore[attr-defined]
    assert not hasattr(message, "reasoning_content")
    fields = {"chat_template_kwargs": {"enable_thinking": True}}
    chunks = list(
        oai.chat.completions.create(model="g", messages=ASK, stream=True, extra_body=fields)
    )
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == "Cold, probably."
    assert "".join(d.content or "" for d in deltas) == "Bring a coat."


@pytest.mark.parametrize(
    ("field", "keys"),
    [("reasoning_content", {"reasoning_content"}), ("both", {"reasoning", "reasoning_content"})],
)
def test_reasoning_field_flag_names_the_field(
    engine: Engine, say: Any, field: Any, keys: set[str]
) -> None:
    """`--reasoning-field`: DeepSeek's name, which llama.cpp's server sends too, or both."""
    defaults = ServerDefaults(reasoning_field=field)
    with TestClient(create_app(engine, defaults, NO_PROMPT_CACHE)) as local:
        say(f"{THOUGHT}Bring a coat.")
        body = {"messages": ASK, "reasoning_effort": "high"}
        message = local.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert {key for key in message if key.startswith("reasoning")} == keys
        assert all(message[key] == "Cold, probably." for key in keys)
        stream = local.post("/v1/chat/completions", json=body | {"stream": True}).text
        deltas = [
            json.loads(line[6:])["choices"][0]["delta"]
            for line in stream.splitlines()
            if line.startswith("data: {")
        ]
        for key in keys:
            assert "".join(d.get(key, "") for d in deltas) == "Cold, probably."


def test_bad_tool_fields_are_refused(client: TestClient) -> None:
    bodies = [
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"messages": ASK, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"messages": ASK, "reasoning_effort": "max"}, "reasoning_effort"),
        ({"messages": ASK, "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs.x"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "a", "content": "x"}]}, None),
    ]
    for body, param in bodies:
        reply = client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, body
        assert param is None or reply.json()["error"]["param"] == param
    assert client.post("/v1/chat/completions", json=bodies[-1][0]).json()["error"]["param"] == (
        "messages.1.role"
    )


ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}


def test_anthropic_tool_use_and_thinking(
    claude: anthropic.Anthropic, engine: Engine, say: Any
) -> None:
    say(f"{THOUGHT}Checking.{CALL}")
    ask: dict[str, Any] = {"model": "g", "max_tokens": 200, "messages": ASK}
    ask |= {"tools": [ANTHROPIC_TOOL], "thinking": {"type": "enabled", "budget_tokens": 1024}}
    reply = claude.messages.create(**ask)
    assert "<|think|>" in _last_prompt(engine)
    assert [block.type for block in reply.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = reply.content
    assert (thinking.thinking, text.text, reply.stop_reason) == (  # type: ignore[union-attr]
        "Cold, probably.",
        "Checking.",
        "tool_use",
    )
    assert (tool_use.name, tool_use.input) == ("get_weather", {"city": "Paris", "days": 2})  # type: ignore[union-attr]
    with claude.messages.stream(**ask) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content[:2]] == [
        b.model_dump() for b in reply.content[:2]
    ]
    assert streamed.content[2].input == tool_use.input  # type: ignore[union-attr]
    assert streamed.stop_reason == "tool_use"


def test_anthropic_tool_result_round_trip(
    claude: anthropic.Anthropic, engine: Engine, say: Any
) -> None:
    say("Mild.")
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "mild"}
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result]},
    ]
    reply = claude.messages.create(
        model="g", max_tokens=50, messages=messages, tools=[ANTHROPIC_TOOL]
    )
    assert reply.content[0].text == "Mild." and reply.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert '<|tool_response>response:get_weather{value:<|"|>mild<|"|>}<tool_response|>' in (
        _last_prompt(engine)
    )


RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}


def test_responses_function_call_then_previous_response(
    oai: openai.OpenAI, engine: Engine, say: Any
) -> None:
    say(CALL)
    first = oai.responses.create(
        model="g", input="Weather in Paris?", instructions="Be brief.", tools=[RESPONSES_TOOL]
    )
    assert "<|turn>system\nBe brief.<|tool>declaration:get_weather" in _last_prompt(engine)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}
    say("Sunny.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    second = oai.responses.create(
        model="g", previous_response_id=first.id, input=[output], tools=[RESPONSES_TOOL]
    )
    assert second.output_text == "Sunny." and second.status == "completed"
    prompt = _last_prompt(engine)
    assert "Be brief." not in prompt  # instructions are not carried over
    assert '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}' in prompt
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="g", previous_response_id="resp_gone", input="Hi")


def test_responses_stream_events(oai: openai.OpenAI, say: Any) -> None:
    say(f"{THOUGHT}Sunny.")
    events = list(
        oai.responses.create(model="g", input="Weather?", reasoning={"effort": "low"}, stream=True)
    )
    kinds = [event.type for event in events]
    for kind in [
        "response.created",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.output_item.done",
    ]:
        assert kind in kinds
    assert kinds[-1] == "response.completed"
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "Sunny."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == "Sunny."
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_stream_function_call(oai: openai.OpenAI, say: Any) -> None:
    say(f"Checking.{CALL}")
    events = list(
        oai.responses.create(model="g", input="Weather?", tools=[RESPONSES_TOOL], stream=True)
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]  # type: ignore[union-attr]
    assert [item.type for item in done] == ["message", "function_call"]
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args[0].arguments) == {"city": "Paris", "days": 2}  # type: ignore[union-attr]


def test_response_store_is_bounded_by_age_and_bytes() -> None:
    now = [0.0]
    store = ResponseStore(ttl_seconds=10, max_bytes=200, clock=lambda: now[0])
    message = [{"role": "user", "content": "x" * 50}]
    for name in "abc":
        store.put(name, message)
    assert store.get("a") is None and store.get("c") == message  # the oldest made room
    assert store.bytes <= 200
    now[0] = 11.0
    assert store.get("c") is None and len(store) == 0
    store.put("huge", [{"role": "user", "content": "x" * 500}])
    assert store.get("huge") is None
