"""The client libraries people point at a local server, unchanged, against a live `hearth serve`
(uvicorn on a real socket) over a tiny Gemma 4 whose output each test scripts: litellm,
langchain-openai, the `llm` CLI, openai-agents and pydantic-ai, each doing a plain chat, a
stream and a tool round trip (the tool's result must reach the model's next prompt).

Typed output (pydantic-ai's `output_type`, openai-agents' `output_type`, langchain's
`with_structured_output`) rides on structured output (`response_format` json_schema), tested
with the openai SDK's own `parse` in test_structured_output.py; these clients' typed modes are
not tested here yet.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hearth.engine import Engine
from scripted_gemma4 import (
    last_prompt,
    live_server,
    one_torch_thread,
    say,
    say_in_turn,
    shared_engine,
)

CITY_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
ANSWER = "It is mild in Paris."
# What the tool returns; it must show up in the prompt of the model's second turn.
TOOL_RESULT = "mild, 18 degrees"
QUESTION = "What is the weather in Paris?"


def get_weather(city: str) -> str:
    """Weather for a city."""
    return TOOL_RESULT if city == "Paris" else "unknown"


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with one_torch_thread():
        yield shared_engine()


@pytest.fixture(scope="module")
def base_url(engine: Engine) -> Iterator[str]:
    with live_server(engine) as url:
        yield url


def _tool_round_trip_reached_the_model(engine: Engine) -> bool:
    """The second turn's prompt holds the tool's result, rendered by Gemma 4's template."""
    return TOOL_RESULT in last_prompt(engine) and "<|tool_response>response:get_weather" in (
        last_prompt(engine)
    )


# --- litellm -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def litellm() -> Any:
    # The cost map ships with the package: no fetch from the network at import.
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm

    return litellm


def test_litellm(litellm: Any, base_url: str, engine: Engine) -> None:
    options = {"model": "openai/g", "api_base": f"{base_url}/v1", "api_key": "unused"}
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    say(engine, "Hello.")
    assert litellm.completion(messages=messages, **options).choices[0].message.content == "Hello."
    say(engine, "Hello there.")
    chunks = litellm.completion(messages=messages, stream=True, **options)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there."
    say_in_turn(engine, CITY_CALL, ANSWER)
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    first = litellm.completion(messages=messages, tools=[tool], **options).choices[0].message
    (call,) = first.tool_calls
    messages.append(first)  # litellm's own Message object, sent back as it is
    messages.append({"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT})
    final = litellm.completion(messages=messages, tools=[tool], **options)
    assert final.choices[0].message.content == ANSWER
    assert _tool_round_trip_reached_the_model(engine)


# --- langchain-openai ----------------------------------------------------------------------


def test_langchain_openai(base_url: str, engine: Engine) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI, OpenAI

    chat = ChatOpenAI(model="g", base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    say(engine, "Hello.")
    assert chat.invoke(QUESTION).content == "Hello."
    say(engine, "Hello there.")
    assert "".join(str(chunk.content) for chunk in chat.stream(QUESTION)) == "Hello there."
    say_in_turn(engine, CITY_CALL, ANSWER)
    with_tools = chat.bind_tools([get_weather])
    history: list[Any] = [HumanMessage(QUESTION)]
    first = with_tools.invoke(history)
    (call,) = first.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    history += [first, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    assert with_tools.invoke(history).content == ANSWER
    assert _tool_round_trip_reached_the_model(engine)
    # LangChain's completions class always sends `prompt` as a list of strings (issue 42).
    say(engine, " once.")
    completion = OpenAI(model="g", base_url=f"{base_url}/v1", api_key="unused", max_tokens=10)
    assert completion.invoke("Once upon a time") == " once."


# --- the llm CLI ---------------------------------------------------------------------------


def _llm(user_dir: Path, *args: str) -> str:
    """Run the `llm` command (the one installed beside this Python) and return its output."""
    command = [str(Path(sys.executable).parent / "llm"), "-m", "hearth", "--no-log", *args]
    env = os.environ | {"LLM_USER_PATH": str(user_dir)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_llm_cli(base_url: str, engine: Engine, tmp_path: Path) -> None:
    # llm's documented way to add an OpenAI-compatible server: extra-openai-models.yaml.
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: hearth\n  model_name: g\n  api_base: {base_url}/v1\n  supports_tools: true\n"
    )
    say(engine, "Hello.")
    assert _llm(tmp_path, "--no-stream", QUESTION).strip() == "Hello."
    say(engine, "Hello there.")
    assert _llm(tmp_path, QUESTION).strip() == "Hello there."  # streams by default
    say_in_turn(engine, CITY_CALL, ANSWER)
    function = f'def get_weather(city: str) -> str:\n    return "{TOOL_RESULT}"\n'
    # llm runs the tool and sends its result back for the final answer (a tool chain).
    assert _llm(tmp_path, "--functions", function, QUESTION).strip() == ANSWER
    assert _tool_round_trip_reached_the_model(engine)


# --- openai-agents -------------------------------------------------------------------------


def test_openai_agents(base_url: str, engine: Engine) -> None:
    import agents
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers

    async def scenario() -> None:
        # One event loop for the whole conversation: the SDK's async client is bound to it.
        client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
        # The SDK's default model class: the Responses API (it sends include: [] on each call).
        model = agents.OpenAIResponsesModel(model="g", openai_client=client)
        agent = agents.Agent(name="assistant", instructions="Be brief.", model=model)
        say(engine, "Hello.")
        assert (await agents.Runner.run(agent, QUESTION)).final_output == "Hello."
        say(engine, "Hello there.")
        streamed = agents.Runner.run_streamed(agent, QUESTION)
        deltas = [
            event.data.delta
            async for event in streamed.stream_events()
            if event.type == "raw_response_event"
            and event.data.type == "response.output_text.delta"
        ]
        assert "".join(deltas) == streamed.final_output == "Hello there."
        say_in_turn(engine, CITY_CALL, ANSWER)
        with_tool = agent.clone(tools=[agents.function_tool(get_weather)])
        assert (await agents.Runner.run(with_tool, QUESTION)).final_output == ANSWER

    asyncio.run(scenario())
    assert _tool_round_trip_reached_the_model(engine)


# --- pydantic-ai ---------------------------------------------------------------------------


def test_pydantic_ai(base_url: str, engine: Engine) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def scenario() -> None:
        # One event loop for the whole conversation: the provider's client is bound to it.
        provider = OpenAIProvider(base_url=f"{base_url}/v1", api_key="unused")
        agent = Agent(OpenAIChatModel("g", provider=provider))
        say(engine, "Hello.")
        assert (await agent.run(QUESTION)).output == "Hello."
        say(engine, "Hello there.")
        async with agent.run_stream(QUESTION) as result:
            assert "".join([text async for text in result.stream_text(delta=True)]) == (
                "Hello there."
            )
        say_in_turn(engine, CITY_CALL, ANSWER)
        with_tool = Agent(OpenAIChatModel("g", provider=provider), tools=[get_weather])
        assert (await with_tool.run(QUESTION)).output == ANSWER

    asyncio.run(scenario())
    assert _tool_round_trip_reached_the_model(engine)
