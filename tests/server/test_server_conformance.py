"""Protocol conformance on a tiny scripted Gemma 4 (the real Gemma 4 template; each test scripts
what the "model" says): what the peers' HTTP suites check, written from reading mlx-lm's
tests/server/test_server.py and llama.cpp's tools/server/tests/unit/ (test_chat_completion.py,
test_completion.py, test_compat_anthropic.py, test_compat_oai_responses.py, test_tool_call.py),
and what the API references document. Each assertion names what it mirrors.
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
from hearth.server.schemas import ChatCompletionRequest
from hearth.server.state import state_of
from scripted_gemma4 import (
    ASK,
    CALL,
    CALL_MARKUP,
    NO_PROMPT_CACHE,
    THOUGHT,
    WEATHER_TOOL,
    last_prompt,
    one_torch_thread,
    say,
    say_in_turn,
    shared_engine,
)

CLAUDE_TOOL = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
FLAT_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
# What a model continues a forced call's opening with: the rest of CALL_MARKUP.
CALL_REST = CALL.removeprefix("<|tool_call>call:")
SECOND_CALL = '<|tool_call>call:get_weather{city:<|"|>Oslo<|"|>}<tool_call|>'
# A forced call's continuation within the tool's schema (it declares `city` only: the grammar
# of a forced call allows no other argument).
FORCED_REST = 'get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'


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


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# --- OpenAI chat ---------------------------------------------------------------------------


def test_the_sdk_loop_sends_the_reply_back(oai: openai.OpenAI, engine: Engine) -> None:
    """`messages.append(reply.choices[0].message)`, the OpenAI SDK's standard loop: the returned
    message (reasoning, refusal: null, annotations: [], tool calls) goes back as it is."""
    say(engine, f"{THOUGHT}Let me check.{CALL}")
    messages: list[Any] = list(ASK)
    first = oai.chat.completions.create(
        model="g", messages=messages, tools=[WEATHER_TOOL], reasoning_effort="high"
    )
    message = first.choices[0].message
    # OpenAI's ChatCompletionMessage: refusal null, annotations a list (API reference).
    assert message.refusal is None and message.annotations == []
    messages.append(message)
    (call,) = message.tool_calls or []
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "mild", "name": "w"})
    say(engine, "Mild.")
    second = oai.chat.completions.create(model="g", messages=messages, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == "Mild."
    # The echoed thought is dropped (the template drops old thoughts); the call and its result
    # are rendered back into the model turn.
    prompt = last_prompt(engine)
    assert "Cold, probably." not in prompt
    assert '<|tool_response>response:get_weather{value:<|"|>mild<|"|>}' in prompt


def test_system_fingerprint_on_every_object(client: TestClient, engine: Engine) -> None:
    """llama.cpp's test_chat_completion / test_completion_with_openai_library check
    system_fingerprint on the JSON reply and on every chunk; OpenAI documents it on both."""
    say(engine, "Fine.")
    chat = client.post("/v1/chat/completions", json={"messages": ASK}).json()
    text = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    body = {"messages": ASK, "stream": True, "stream_options": {"include_usage": True}}
    chunks = _sse(client.post("/v1/chat/completions", json=body).text)
    fingerprints = {chat["system_fingerprint"], text["system_fingerprint"]}
    fingerprints |= {chunk["system_fingerprint"] for chunk in chunks}
    (fingerprint,) = fingerprints  # one configuration, one fingerprint
    assert fingerprint.startswith("fp_") and len(fingerprint) == 13


def test_n_choices_are_indexed_json_and_stream(client: TestClient, engine: Engine) -> None:
    """llama.cpp's test_chat_completions_multiple_choices: n=2 gives two choices, each a whole
    assistant message; OpenAI streams carry each choice's index."""
    say_in_turn(engine, "One.", "Two.")
    reply = client.post("/v1/chat/completions", json={"messages": ASK, "n": 2}).json()
    assert [(c["index"], c["message"]["content"]) for c in reply["choices"]] == [
        (0, "One."),
        (1, "Two."),
    ]
    prompt_tokens = reply["usage"]["prompt_tokens"]
    # The prompt is counted once, every choice's tokens (its text and the end of turn) are.
    encode = engine.tokenizer.encode
    generated = sum(len(encode(text, add_special_tokens=False)) + 1 for text in ("One.", "Two."))
    assert reply["usage"]["completion_tokens"] == generated
    assert reply["usage"]["total_tokens"] == prompt_tokens + reply["usage"]["completion_tokens"]
    say_in_turn(engine, "One.", "Two.")
    body = {"messages": ASK, "n": 2, "stream": True}
    chunks = _sse(client.post("/v1/chat/completions", json=body).text)
    by_index: dict[int, str] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + (
            choice["delta"].get("content") or ""
        )
    assert by_index == {0: "One.", 1: "Two."}
    finishes = [
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]
    ]
    assert finishes == ["stop", "stop"]


def test_completion_prompt_shapes_and_echo(client: TestClient, engine: Engine) -> None:
    """OpenAI's legacy prompt: a string, strings, token ids or lists of them; choices come
    prompt by prompt (index = prompt * n + choice); echo puts the prompt first."""
    say(engine, "!")
    ids = engine.tokenizer.encode("Yo", add_special_tokens=False)
    body = {"prompt": ["Hi", ids], "n": 2, "max_tokens": 3, "echo": True}
    reply = client.post("/v1/completions", json=body).json()
    assert [(c["index"], c["text"]) for c in reply["choices"]] == [
        (0, "Hi!"),
        (1, "Hi!"),
        (2, "Yo!"),
        (3, "Yo!"),
    ]
    assert reply["usage"]["prompt_tokens"] == 2 + len(ids)  # each prompt once: "Hi" is 2 bytes
    stream = client.post("/v1/completions", json=body | {"stream": True}).text
    texts: dict[int, str] = {}
    for chunk in _sse(stream):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "Hi!", 1: "Hi!", 2: "Yo!", 3: "Yo!"}
    bad = client.post("/v1/completions", json={"prompt": [999_999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_forced_tool_call_openai(oai: openai.OpenAI, engine: Engine) -> None:
    """llama.cpp's test_tool_call (tool_choice "required"): exactly one call of the tool, no
    content. The opening is forced in the prompt; the model continues with the arguments,
    held by the grammar to the tool's schema (a `days` the schema lacks is cut)."""
    say(engine, CALL_REST)
    reply = oai.chat.completions.create(
        model="g", messages=ASK, tools=[WEATHER_TOOL], tool_choice="required"
    )
    assert last_prompt(engine).endswith("<|tool_call>call:")
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and reply.choices[0].message.content is None
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    say(engine, FORCED_REST.removeprefix("get_weather{"))
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = oai.chat.completions.create(
        model="g", messages=ASK, tools=[WEATHER_TOOL], tool_choice=named, stream=True
    )
    calls = [t for chunk in reply for t in chunk.choices[0].delta.tool_calls or []]
    assert last_prompt(engine).endswith("<|tool_call>call:get_weather{")
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_parallel_tool_calls_false_keeps_one_call(oai: openai.OpenAI, engine: Engine) -> None:
    # OpenAI: parallel_tool_calls false means at most one call per reply.
    say(engine, f"{CALL_MARKUP}{SECOND_CALL}<|tool_response>")
    both = oai.chat.completions.create(model="g", messages=ASK, tools=[WEATHER_TOOL])
    assert len(both.choices[0].message.tool_calls or []) == 2
    one = oai.chat.completions.create(
        model="g", messages=ASK, tools=[WEATHER_TOOL], parallel_tool_calls=False
    )
    assert [
        json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls or []
    ] == ["Paris"]


def test_sampling_fields_reach_the_sampler(client: TestClient) -> None:
    """mlx_lm.server's fields are honoured: each lands in the SamplingParams the worker runs
    (the sampler itself is checked against mlx-lm in test_sampling_xtc.py)."""
    from hearth.server.openai import _sampling

    state = state_of(client)  # type: ignore[arg-type]
    body = ChatCompletionRequest.model_validate(
        {
            "messages": ASK,
            "xtc_probability": 0.5,
            "xtc_threshold": 0.2,
            "presence_penalty": 0.3,
            "presence_context_size": 7,
            "frequency_penalty": 0.2,
            "repetition_penalty": 0,
            "seed": -1,
        }
    )
    params = _sampling(state, body)
    assert (params.xtc_probability, params.xtc_threshold) == (0.5, 0.2)
    # mlx_lm.server's special list: the encoding of "\n" (with special tokens) and the EOS ids.
    tokenizer = state.engine.tokenizer
    assert set(params.xtc_special_tokens) == {
        *tokenizer.encode("\n", add_special_tokens=True),
        *tokenizer.eos_ids,
    }
    assert (params.presence_penalty, params.presence_context_size) == (0.3, 7)
    assert (params.frequency_penalty, params.frequency_context_size) == (0.2, 20)  # default
    assert params.repetition_penalty == 1.0 and params.seed is None  # 0: off; -1: random


# --- CORS and models -------------------------------------------------------------------------


def test_cors_preflight_and_headers(client: TestClient, engine: Engine) -> None:
    """mlx_lm.server's _set_cors_headers / do_OPTIONS: any OPTIONS is a 204 preflight and
    every response allows the origin (default *), any method and any header."""
    preflight = client.options(
        "/v1/chat/completions",
        headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert preflight.headers["access-control-allow-methods"] == "*"
    assert preflight.headers["access-control-allow-headers"] == "*"
    say(engine, "Hi.")
    reply = client.post("/v1/chat/completions", json={"messages": ASK})
    assert reply.headers["access-control-allow-origin"] == "*"
    listed = ServerDefaults()
    with TestClient(
        create_app(engine, listed, NO_PROMPT_CACHE, cors_origins=("http://ok.example",))
    ) as local:
        allowed = local.get("/health", headers={"Origin": "http://ok.example"})
        assert allowed.headers["access-control-allow-origin"] == "http://ok.example"
        assert allowed.headers["vary"] == "Origin"
        other = local.get("/health", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_models_and_model_by_id(client: TestClient) -> None:
    """OpenAI's /v1/models and /v1/models/{id} (mlx-lm's test_handle_models); an id not in
    the list is a 404 in OpenAI's error shape (issue 41, item 17)."""
    listing = client.get("/v1/models").json()
    (card,) = listing["data"]
    assert (card["object"], card["base_model"]) == ("model", False)  # Gemma 4 has its template
    assert client.get(f"/v1/models/{card['id']}").json() == card
    missing = client.get("/v1/models/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"


# --- Anthropic -----------------------------------------------------------------------------


def test_count_tokens_matches_the_prompt_messages_runs(
    client: TestClient, claude: anthropic.Anthropic, engine: Engine
) -> None:
    """llama.cpp's test_anthropic_count_tokens(_with_system, _no_max_tokens): only
    input_tokens; here equal to the tokens /v1/messages prefills for the same request."""
    ask: dict[str, Any] = {
        "model": "g",
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": ASK,
        "tools": [CLAUDE_TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    counted = claude.messages.count_tokens(**ask)
    say(engine, FORCED_REST.removeprefix("get_weather{"))
    reply = claude.messages.create(**ask, max_tokens=50)
    assert counted.input_tokens == len(engine.model.prompts[-1])  # type: ignore[attr-defined]
    # No prompt cache on this server: every prompt token is an input token (Anthropic's usage).
    usage = reply.usage
    assert (
        usage.input_tokens,
        usage.cache_creation_input_tokens,
        usage.cache_read_input_tokens,
    ) == (
        counted.input_tokens,
        0,
        0,
    )
    assert set(client.post("/v1/messages/count_tokens", json=ask).json()) == {"input_tokens"}


def test_anthropic_tool_choice_any_and_single_call(
    claude: anthropic.Anthropic, engine: Engine
) -> None:
    """Anthropic's tool_choice {"type": "any"} forces a tool_use; disable_parallel_tool_use
    leaves at most one (Messages API reference)."""
    say(engine, f"{FORCED_REST.removesuffix('<|tool_response>')}{SECOND_CALL}<|tool_response>")
    ask: dict[str, Any] = {"model": "g", "max_tokens": 80, "messages": ASK, "tools": [CLAUDE_TOOL]}
    both = claude.messages.create(**ask, tool_choice={"type": "any"})
    assert last_prompt(engine).endswith("<|tool_call>call:")
    assert [b.input["city"] for b in both.content if b.type == "tool_use"] == ["Paris", "Oslo"]  # type: ignore[union-attr]
    assert both.stop_reason == "tool_use"
    single = {"type": "any", "disable_parallel_tool_use": True}
    one = claude.messages.create(**ask, tool_choice=single)  # type: ignore[arg-type]
    assert [b.input["city"] for b in one.content if b.type == "tool_use"] == ["Paris"]  # type: ignore[union-attr]
    with claude.messages.stream(**ask, tool_choice=single) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_message()
    assert [b.input["city"] for b in streamed.content if b.type == "tool_use"] == ["Paris"]  # type: ignore[union-attr]


def test_anthropic_stream_block_indices_and_signature(client: TestClient, engine: Engine) -> None:
    """llama.cpp's test_anthropic_streaming_content_block_indices and
    test_anthropic_thinking_with_reasoning_model: blocks numbered 0, 1, … with matching stops;
    a thinking block gets a signature_delta before it closes."""
    say(engine, f"{THOUGHT}Checking.{CALL}")
    body = {
        "model": "g",
        "max_tokens": 200,
        "stream": True,
        "messages": ASK,
        "tools": [CLAUDE_TOOL],
        "thinking": {"type": "enabled", "budget_tokens": 100},
    }
    events = [
        json.loads(line[6:])
        for line in client.post("/v1/messages", json=body).text.splitlines()
        if line.startswith("data: ")
    ]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [e["index"] for e in starts] == [0, 1, 2]
    assert [e["content_block"]["type"] for e in starts] == ["thinking", "text", "tool_use"]
    assert {e["index"] for e in events if e["type"] == "content_block_stop"} == {0, 1, 2}
    kinds = [e["delta"]["type"] for e in events if e["type"] == "content_block_delta"]
    assert kinds.index("signature_delta") == kinds.index("text_delta") - 1
    start = next(e for e in events if e["type"] == "message_start")
    assert start["message"]["usage"]["cache_creation_input_tokens"] == 0


def test_anthropic_image_is_refused_clearly(client: TestClient) -> None:
    """Issue 41, item 16: an image block says images are not supported, not a type error."""
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is this?"}]}]
    reply = client.post("/v1/messages", json={"model": "g", "max_tokens": 5, "messages": messages})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert message.startswith("messages.0.content.0.source.data: ")  # the block at fault
    assert "images are not supported by this model" in message


# --- Responses -----------------------------------------------------------------------------


def test_openai_agents_echo_is_accepted(client: TestClient, engine: Engine) -> None:
    """What openai-agents sends on every call (include: [], and the response's own fields back):
    a 200 whose object echoes them (Responses API reference)."""
    say(engine, "Hi.")
    body = {
        "model": "g",
        "input": "Hi",
        "include": [],
        "parallel_tool_calls": True,
        "truncation": "disabled",
        "text": {"format": {"type": "text"}},
        "tools": [],
        "store": False,
    }
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    response = reply.json()
    echoed = {key: response[key] for key in ("parallel_tool_calls", "truncation", "text", "tools")}
    assert echoed == {key: body[key] for key in echoed}


def test_responses_usage_counts_reasoning_tokens(oai: openai.OpenAI, engine: Engine) -> None:
    """Responses usage has output_tokens_details.reasoning_tokens (API reference)."""
    say(engine, f"{THOUGHT}Sunny.")
    reply = oai.responses.create(model="g", input="Weather?", reasoning={"effort": "low"})
    thought = engine.tokenizer.encode("Cold, probably.", add_special_tokens=False)
    assert reply.usage is not None
    assert reply.usage.output_tokens_details.reasoning_tokens == len(thought)
    say(engine, "Sunny.")
    plain = oai.responses.create(model="g", input="Weather?")
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_required_tool_and_limit_errors(oai: openai.OpenAI, engine: Engine) -> None:
    """tool_choice "required" on Responses; a too-large max_output_tokens names
    max_output_tokens and an input_image says images are unsupported (issue 41, item 16)."""
    say(engine, CALL_REST)
    reply = oai.responses.create(
        model="g",
        input="Weather?",
        tools=[FLAT_TOOL],
        tool_choice="required",  # type: ignore[list-item]
    )
    assert [item.type for item in reply.output] == ["function_call"]
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.responses.create(model="g", input="Hi", max_output_tokens=100_000)
    assert too_long.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "auto"}
    with pytest.raises(openai.BadRequestError, match="images are not supported by this model"):
        oai.responses.create(
            model="g",
            input=[{"role": "user", "content": [image]}],  # type: ignore[list-item]
        )


def test_serve_flags_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hearth serve --cors-origins a,b --reasoning-field both` (and mlx_lm.server's name,
    --allowed-origins): what `serve` is handed; the defaults are mlx_lm.server's."""
    import inspect

    from hearth import cli
    from hearth.server import app

    signature = inspect.signature(app.serve)
    handed: list[dict[str, Any]] = []

    def fake_serve(*args: Any, **kwargs: Any) -> int:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        handed.append(bound.arguments)
        return 0

    monkeypatch.setattr(cli, "_load", lambda model, args: None)
    monkeypatch.setattr(app, "serve", fake_serve)
    monkeypatch.setattr(app, "listening_socket", lambda host, port: None)  # no port taken
    flags = ["--cors-origins", "http://a,http://b", "--reasoning-field", "both"]
    for argv in (flags, ["--allowed-origins", ""], []):
        assert cli.main(["serve", *argv]) == 0
    first, none, default = handed
    assert first["cors_origins"] == ("http://a", "http://b")
    assert first["defaults"].reasoning_field == "both"
    assert none["cors_origins"] == ()
    assert default["cors_origins"] == ("*",) and default["defaults"].reasoning_field == "reasoning"
