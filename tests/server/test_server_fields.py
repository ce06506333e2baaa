"""docs/server.md's field table, executed: every field of every endpoint is sent to a server on
a tiny scripted Gemma 4 (the real Gemma 4 template, so tools and thinking are on), and gets what
the table says. "honoured" and "ignored" values get a 200; "default only" fields get a 200 at
their default and a 400 naming them otherwise; "refused" fields get a 400 naming them. What a
"honoured" field does is checked by the behaviour tests (test_server_conformance.py and the
others); here, that the table and the server agree, row by row, in both directions.

The rule (docs/server.md, "What is accepted"): absent, null, the documented default, an echo of
Hearth's own reply, or informational fields are accepted; a value asking for behaviour Hearth
lacks is refused, naming the field and what is supported.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hearth.engine import Engine
from hearth.server import create_app
from scripted_gemma4 import ASK, NO_PROMPT_CACHE, WEATHER_TOOL, one_torch_thread, say, shared_engine

DOCS = Path(__file__).parents[2] / "docs" / "server.md"
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "responses": "/v1/responses",
}
BASE: dict[str, dict[str, Any]] = {
    "chat": {"model": "g", "messages": ASK, "max_tokens": 4},
    "completions": {"model": "g", "prompt": "Hi", "max_tokens": 4},
    "messages": {"model": "g", "messages": ASK, "max_tokens": 4},
    "count_tokens": {"model": "g", "messages": ASK},
    "responses": {"model": "g", "input": "Hi", "max_output_tokens": 4},
}
STATUSES = ("honoured", "ignored", "default only", "refused")

TOOLS = [WEATHER_TOOL]
CLAUDE_TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": WEATHER_TOOL["function"]["parameters"],
    }
]
FLAT_TOOLS = [{"type": "function", **WEATHER_TOOL["function"]}]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
# The standard SDK loop sends Hearth's own reply back (`messages.append(choice.message)`).
ECHOED_REPLY = {
    "role": "assistant",
    "content": "Cold.",
    "reasoning": "Winter.",
    "reasoning_content": "Winter.",
    "refusal": None,
    "annotations": [],
    "audio": None,
    "function_call": None,
    "tool_calls": None,
}
CACHED = {"cache_control": {"type": "ephemeral"}}
TOOL_USE = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
RESPONSES_IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AA=="}


def after(reply: dict[str, Any]) -> dict[str, Any]:
    """A chat whose history holds `reply` as the assistant's turn."""
    return {"messages": [*ASK, reply, {"role": "user", "content": "And now?"}]}


def claude_after(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"messages": [*ASK, {"role": "assistant", "content": blocks}, *ASK]}


@dataclass(frozen=True)
class Row:
    """One row of the table: the fields, their status, and what the test sends."""

    endpoint: str
    fields: str  # as the table's field column lists them
    status: str
    accepted: tuple[dict[str, Any], ...] = ()
    refused: tuple[tuple[dict[str, Any], str], ...] = ()  # (fields sent, the param named)


def rows_for_sampling(endpoint: str) -> list[Row]:
    """The sampling and bookkeeping fields chat and completions share (OpenAIRequest)."""
    return [
        Row(
            endpoint,
            "temperature, top_p, top_k, min_p",
            "honoured",
            ({"temperature": 0.7, "top_p": 0.9, "top_k": 20, "min_p": 0.05},),
            (({"top_p": 0}, "top_p"), ({"temperature": "hot"}, "temperature")),
        ),
        Row(
            endpoint,
            "seed",
            "honoured",
            ({"seed": 5}, {"seed": -1}, {"seed": 2**64 - 1}),
            (({"seed": 2**64}, "seed"), ({"seed": -2}, "seed")),
        ),
        Row(endpoint, "stop", "honoured", ({"stop": "x"}, {"stop": ["x", "y"]}, {"stop": None})),
        Row(endpoint, "n", "honoured", ({"n": 2}, {"n": 1}), (({"n": 0}, "n"), ({"n": 129}, "n"))),
        Row(
            endpoint, "stream", "honoured", ({"stream": True}, {"stream": False}, {"stream": None})
        ),
        Row(
            endpoint,
            "stream_options.include_usage",
            "honoured",
            ({"stream": True, "stream_options": {"include_usage": True}},),
        ),
        Row(
            endpoint,
            "stream_options.include_obfuscation",
            "ignored",
            ({"stream": True, "stream_options": {"include_obfuscation": False}},),
        ),
        Row(
            endpoint,
            "logit_bias",
            "honoured",
            ({"logit_bias": {"70": -100}},),
            (({"logit_bias": {"x": 1}}, "logit_bias"),),
        ),
        Row(
            endpoint,
            "repetition_penalty, repetition_context_size",
            "honoured",
            (
                {"repetition_penalty": 1.1, "repetition_context_size": 10},
                {"repetition_penalty": 0},
            ),
            (({"repetition_penalty": -1}, "repetition_penalty"),),
        ),
        Row(
            endpoint,
            "presence_penalty, presence_context_size, frequency_penalty, frequency_context_size",
            "honoured",
            (
                {
                    "presence_penalty": 0.5,
                    "presence_context_size": 8,
                    "frequency_penalty": 0.5,
                    "frequency_context_size": 8,
                },
            ),
            (
                ({"presence_penalty": 3}, "presence_penalty"),
                ({"frequency_context_size": 0}, "frequency_context_size"),
            ),
        ),
        Row(
            endpoint,
            "xtc_probability, xtc_threshold",
            "honoured",
            ({"xtc_probability": 0.5, "xtc_threshold": 0.1, "temperature": 1.0},),
            (({"xtc_threshold": 0.7}, "xtc_threshold"),),
        ),
        Row(
            endpoint,
            "user, metadata, service_tier, prompt_cache_key, safety_identifier, cache_prompt",
            "ignored",
            (
                {
                    "user": "u",
                    "metadata": {"run": "1"},
                    "service_tier": "auto",
                    "prompt_cache_key": "k",
                    "safety_identifier": "s",
                    "cache_prompt": True,
                },
            ),
        ),
        Row(endpoint, "num_draft_tokens", "ignored", ({"num_draft_tokens": 3},)),
        Row(endpoint, "store", "default only", ({"store": False},), (({"store": True}, "store"),)),
        Row(
            endpoint,
            "response_format, guided_json, guided_regex, guided_choice, guided_grammar, "
            "structured_outputs",
            "honoured",
            (
                {"response_format": {"type": "text"}},
                {"response_format": None},
                {"response_format": {"type": "json_object"}},
                {"guided_regex": "[ab]{1,3}"},
                {"guided_choice": ["yes", "no"]},
                {"guided_grammar": 'root ::= "x" | "y"'},
                {"structured_outputs": {"choice": ["yes", "no"]}},
            ),
            (
                ({"guided_regex": "(ab"}, "guided_regex"),
                ({"guided_json": {"type": "strng"}}, "guided_json"),
                ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json"),
                ({"response_format": {"type": "json_schema"}}, "response_format"),
                ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
                ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
            ),
        ),
        Row(
            endpoint,
            "grammar, json_schema, adapters, draft_model, web_search_options",
            "refused",
            refused=(
                ({"grammar": "root ::= x"}, "grammar"),
                ({"json_schema": {}}, "json_schema"),
                ({"draft_model": "d"}, "draft_model"),
                ({"web_search_options": {}}, "web_search_options"),
            ),
        ),
        Row(endpoint, "(any other)", "refused", refused=(({"colour": "blue"}, "colour"),)),
    ]


CHAT = [
    Row("chat", "model", "ignored", ({"model": "any-name"}, {"model": None})),
    Row("chat", "messages", "honoured", (), (({"messages": []}, "messages"),)),
    Row(
        "chat",
        "messages[].role",
        "honoured",
        ({"messages": [{"role": "developer", "content": "Be brief."}, *ASK]},),
        (({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),),
    ),
    Row(
        "chat",
        "messages[].content",
        "honoured",
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},),
        (
            (
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages.0.content",
            ),
            ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ),
    ),
    Row(
        "chat",
        "messages[].name",
        "ignored",
        ({"messages": [{"role": "user", "content": "Hi", "name": "ann"}]},),
    ),
    Row(
        "chat",
        "messages[].tool_calls, messages[].tool_call_id",
        "honoured",
        (
            {
                "tools": TOOLS,
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "mild", "name": "w"},
                ],
            },
        ),
        (
            (
                {"messages": [*ASK, {"role": "tool", "tool_call_id": "x", "content": "y"}]},
                "messages.1.role",
            ),
        ),
    ),
    Row(
        "chat",
        "messages[].reasoning, messages[].reasoning_content, messages[].annotations",
        "ignored",
        (after(ECHOED_REPLY),),
    ),
    Row(
        "chat",
        "messages[].refusal",
        "honoured",
        (after({"role": "assistant", "content": None, "refusal": "I can't."}),),
    ),
    Row(
        "chat",
        "messages[].audio, messages[].function_call",
        "default only",
        (after(ECHOED_REPLY),),
        (
            (
                after({"role": "assistant", "content": "x", "audio": {"id": "a"}}),
                "messages.1.audio",
            ),
            (
                after({"role": "assistant", "content": "x", "function_call": {"name": "f"}}),
                "messages.1.function_call",
            ),
        ),
    ),
    Row(
        "chat",
        "max_tokens, max_completion_tokens",
        "honoured",
        ({"max_tokens": 2}, {"max_completion_tokens": 2}, {"max_tokens": None}),
        (
            ({"max_tokens": -1}, "max_tokens"),
            ({"max_completion_tokens": 100_000}, "max_completion_tokens"),
        ),
    ),
    *rows_for_sampling("chat"),
    Row(
        "chat",
        "logprobs, top_logprobs",
        "honoured",
        ({"logprobs": True, "top_logprobs": 2}, {"logprobs": None}),
        (({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),),
    ),
    Row("chat", "tools", "honoured", ({"tools": TOOLS}, {"tools": []}, {"tools": None})),
    Row(
        "chat",
        "tool_choice",
        "honoured",
        (
            {"tools": TOOLS, "tool_choice": "auto"},
            {"tools": TOOLS, "tool_choice": "none"},
            {"tools": TOOLS, "tool_choice": "required"},
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
        ),
        (
            ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
            (
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
                "tool_choice",
            ),
        ),
    ),
    Row(
        "chat",
        "parallel_tool_calls",
        "honoured",
        ({"tools": TOOLS, "parallel_tool_calls": False}, {"parallel_tool_calls": True}),
    ),
    Row(
        "chat",
        "reasoning_effort, chat_template_kwargs.enable_thinking",
        "honoured",
        ({"reasoning_effort": "high"}, {"chat_template_kwargs": {"enable_thinking": False}}),
        (({"reasoning_effort": "max"}, "reasoning_effort"),),
    ),
    Row("chat", "role_mapping", "honoured", ({"role_mapping": {"user": "USER: "}},)),
    Row(
        "chat",
        "modalities",
        "default only",
        ({"modalities": ["text"]},),
        (({"modalities": ["text", "audio"]}, "modalities"),),
    ),
    Row(
        "chat",
        "audio, functions, function_call",
        "default only",
        ({"audio": None, "functions": None, "function_call": None},),
        (
            ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
            ({"functions": [{"name": "f"}]}, "functions"),
            ({"function_call": "auto"}, "function_call"),
        ),
    ),
    Row(
        "chat",
        "prediction",
        "ignored",
        ({"prediction": {"type": "content", "content": "Cold."}}, {"prediction": None}),
    ),
]

COMPLETIONS = [
    Row("completions", "model", "ignored", ({"model": "any-name"},)),
    Row(
        "completions",
        "prompt",
        "honoured",
        ({"prompt": ["Hi", "Yo"]}, {"prompt": [72, 105]}, {"prompt": [[72], [89, 111]]}),
        (({"prompt": []}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, "a"]}, "prompt")),
    ),
    Row(
        "completions",
        "max_tokens",
        "honoured",
        ({"max_tokens": 1},),
        (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 600}, "max_tokens")),
    ),
    *rows_for_sampling("completions"),
    Row(
        "completions",
        "logprobs",
        "honoured",
        ({"logprobs": 2}, {"logprobs": 0}),
        (({"logprobs": 21}, "logprobs"),),
    ),
    Row(
        "completions",
        "echo",
        "honoured",
        ({"echo": True}, {"echo": False}),
        (({"echo": True, "logprobs": 1}, "echo"),),
    ),
    Row(
        "completions",
        "best_of",
        "default only",
        ({"best_of": 1}, {"n": 2, "best_of": 2}),
        (({"best_of": 3}, "best_of"),),
    ),
    Row(
        "completions",
        "suffix",
        "default only",
        ({"suffix": None}, {"suffix": ""}),
        (({"suffix": "end"}, "suffix"),),
    ),
    Row("completions", "top_logprobs", "refused", refused=(({"top_logprobs": 2}, "top_logprobs"),)),
]

MESSAGES = [
    Row("messages", "model", "ignored", ({"model": "any-name"},)),
    Row("messages", "messages", "honoured", (), (({"messages": []}, "messages"),)),
    Row(
        "messages",
        "messages[].content",
        "honoured",
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]},),
        (({"messages": [{"role": "user", "content": [IMAGE]}]}, "images are not supported"),),
    ),
    Row(
        "messages",
        "messages[].content[].cache_control, messages[].content[].citations",
        "ignored",
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "Hi", **CACHED}]},
                    {
                        "role": "assistant",
                        "content": [{"type": "text", "text": "Hello.", "citations": None}],
                    },
                    {"role": "user", "content": [{"type": "text", "text": "Bye", **CACHED}]},
                ]
            },
        ),
    ),
    Row(
        "messages",
        "messages[].content[].type: thinking, redacted_thinking",
        "ignored",
        (
            claude_after(
                [
                    {"type": "thinking", "thinking": "Hm.", "signature": ""},
                    {"type": "redacted_thinking", "data": "x"},
                    {"type": "text", "text": "Hello."},
                ]
            ),
        ),
    ),
    Row(
        "messages",
        "messages[].content[].type: image, document",
        "refused",
        refused=(
            ({"messages": [{"role": "user", "content": [IMAGE]}]}, "images are not supported"),
            (
                {"messages": [{"role": "user", "content": [{"type": "document"}]}]},
                "documents are not supported",
            ),
        ),
    ),
    Row(
        "messages",
        "messages[].content[].type: tool_use, tool_result; is_error",
        "honoured",
        (
            {
                "tools": CLAUDE_TOOLS,
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [TOOL_USE | CACHED]},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t1",
                                "content": [{"type": "text", "text": "mild", **CACHED}],
                                "is_error": True,
                                **CACHED,
                            }
                        ],
                    },
                ],
            },
        ),
    ),
    Row(
        "messages",
        "system",
        "honoured",
        ({"system": "Be brief."}, {"system": [{"type": "text", "text": "Be brief.", **CACHED}]}),
        (({"system": [{"type": "image"}]}, "system"),),
    ),
    Row(
        "messages",
        "max_tokens",
        "honoured",
        ({"max_tokens": 1},),
        (({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 600}, "max_tokens")),
    ),
    Row(
        "messages",
        "stop_sequences, temperature, top_p, top_k",
        "honoured",
        ({"stop_sequences": ["x"], "temperature": 0.5, "top_p": 0.9, "top_k": 40},),
        (({"top_p": 0}, "top_p"),),
    ),
    Row("messages", "stream", "honoured", ({"stream": True}, {"stream": False})),
    Row(
        "messages",
        "output_config.format, output_format",
        "honoured",
        (
            {"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            {"output_format": {"type": "json_schema", "schema": {"type": "boolean"}}},
            {"output_config": {"format": None, "effort": None}},
        ),
        (
            ({"output_config": {"format": {"type": "json_schema", "schema": {"not": {}}}}}, "not"),
            ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ),
    ),
    Row(
        "messages",
        "metadata.user_id, service_tier",
        "ignored",
        ({"metadata": {"user_id": "u"}, "service_tier": "auto"},),
    ),
    Row(
        "messages",
        "tools",
        "honoured",
        ({"tools": CLAUDE_TOOLS}, {"tools": []}, {"tools": [CLAUDE_TOOLS[0] | CACHED]}),
        (({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),),
    ),
    Row(
        "messages",
        "tool_choice",
        "honoured",
        tuple(
            {"tools": CLAUDE_TOOLS, "tool_choice": choice}
            for choice in (
                {"type": "auto"},
                {"type": "any"},
                {"type": "tool", "name": "get_weather"},
                {"type": "none"},
            )
        ),
        (
            ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
            ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice"),
        ),
    ),
    Row(
        "messages",
        "tool_choice.disable_parallel_tool_use",
        "honoured",
        (
            {
                "tools": CLAUDE_TOOLS,
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
            },
        ),
    ),
    Row(
        "messages",
        "thinking",
        "honoured",
        ({"thinking": {"type": "enabled"}}, {"thinking": {"type": "disabled"}}),
        (({"thinking": {"type": "adaptive"}}, "thinking"),),
    ),
    Row(
        "messages",
        "thinking.budget_tokens",
        "ignored",
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}},),
    ),
    Row(
        "messages",
        "(any other)",
        "refused",
        refused=(({"container": "c"}, "container"), ({"mcp_servers": []}, "mcp_servers")),
    ),
]

COUNT_TOKENS = [
    Row(
        "count_tokens",
        "model, messages, system, tools, tool_choice, thinking",
        "honoured",
        (
            {
                "system": [{"type": "text", "text": "Be brief.", **CACHED}],
                "tools": CLAUDE_TOOLS,
                "tool_choice": {"type": "any"},
                "thinking": {"type": "enabled", "budget_tokens": 100},
            },
        ),
        (({"messages": [{"role": "user", "content": [IMAGE]}]}, "images are not supported"),),
    ),
    Row(
        "count_tokens",
        "(any other)",
        "refused",
        refused=(({"max_tokens": 5}, "max_tokens"), ({"stream": True}, "stream")),
    ),
]

RESPONSES = [
    Row("responses", "model", "ignored", ({"model": "any-name"},)),
    Row(
        "responses",
        "input",
        "honoured",
        (
            {"input": [{"role": "user", "content": "Hi"}]},
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                    {
                        "type": "message",
                        "role": "assistant",
                        "id": "msg_1",
                        "status": "completed",
                        "content": [
                            {"type": "output_text", "text": "Hello.", "annotations": []},
                            {"type": "refusal", "refusal": "No."},
                        ],
                    },
                    {"role": "user", "content": "Bye"},
                ]
            },
        ),
        (
            (
                {"input": [{"role": "user", "content": [RESPONSES_IMAGE]}]},
                "images are not supported",
            ),
            ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ),
    ),
    Row(
        "responses",
        "input[].type: function_call, function_call_output",
        "honoured",
        (
            {
                "tools": FLAT_TOOLS,
                "input": [
                    *ASK,
                    {
                        "type": "function_call",
                        "call_id": "c1",
                        "name": "get_weather",
                        "arguments": '{"city": "Paris"}',
                    },
                    {"type": "function_call_output", "call_id": "c1", "output": "mild"},
                ],
            },
        ),
    ),
    Row(
        "responses",
        "input[].type: reasoning",
        "ignored",
        ({"input": [*ASK, {"type": "reasoning", "id": "rs_1", "summary": []}, *ASK]},),
    ),
    Row(
        "responses",
        "instructions, temperature, top_p",
        "honoured",
        ({"instructions": "Be brief.", "temperature": 0.5, "top_p": 0.9},),
    ),
    Row(
        "responses",
        "max_output_tokens",
        "honoured",
        ({"max_output_tokens": 1},),
        (({"max_output_tokens": 600}, "max_output_tokens"),),
    ),
    Row("responses", "tools", "honoured", ({"tools": FLAT_TOOLS}, {"tools": []})),
    Row(
        "responses",
        "tool_choice, parallel_tool_calls",
        "honoured",
        tuple(
            {"tools": FLAT_TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel}
            for choice, parallel in (
                ("auto", True),
                ("none", True),
                ("required", False),
                ({"type": "function", "name": "get_weather"}, False),
            )
        ),
        (({"tools": FLAT_TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),),
    ),
    Row(
        "responses",
        "reasoning.effort",
        "honoured",
        ({"reasoning": {"effort": "low"}},),
        (({"reasoning": {"effort": "max"}}, "reasoning.effort"),),
    ),
    Row(
        "responses",
        "reasoning.summary, reasoning.generate_summary",
        "default only",
        ({"reasoning": {"effort": "low", "summary": "auto"}},),
        (({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),),
    ),
    Row(
        "responses",
        "previous_response_id, store, stream",
        "honoured",
        ({"store": False}, {"stream": True}, {"previous_response_id": None}),
    ),
    Row(
        "responses",
        "stream_options.include_obfuscation",
        "ignored",
        ({"stream": True, "stream_options": {"include_obfuscation": False}},),
    ),
    Row(
        "responses",
        "metadata, user, service_tier, prompt_cache_key, safety_identifier",
        "ignored",
        (
            {
                "metadata": {"run": "1"},
                "user": "u",
                "service_tier": "auto",
                "prompt_cache_key": "k",
                "safety_identifier": "s",
            },
        ),
    ),
    Row(
        "responses",
        "include",
        "default only",
        ({"include": []}, {"include": ["reasoning.encrypted_content"]}),
        (({"include": ["message.output_text.logprobs"]}, "include"),),
    ),
    Row(
        "responses",
        "truncation",
        "default only",
        ({"truncation": "disabled"},),
        (({"truncation": "auto"}, "truncation"),),
    ),
    Row(
        "responses",
        "text.format",
        "honoured",
        (
            {"text": {"format": {"type": "text"}}},
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
            {"text": {"format": {"type": "json_object"}}},
        ),
        (
            (
                {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
                "text.format",
            ),
        ),
    ),
    Row(
        "responses",
        "text.verbosity",
        "default only",
        ({"text": {"verbosity": "medium"}},),
        (({"text": {"verbosity": "low"}}, "text.verbosity"),),
    ),
    Row(
        "responses",
        "top_logprobs",
        "default only",
        ({"top_logprobs": 0},),
        (({"top_logprobs": 3}, "top_logprobs"),),
    ),
    Row(
        "responses",
        "background",
        "default only",
        ({"background": False},),
        (({"background": True}, "background"),),
    ),
    Row(
        "responses",
        "(any other)",
        "refused",
        refused=(
            ({"max_tool_calls": 2}, "max_tool_calls"),
            ({"conversation": "conv_1"}, "conversation"),
        ),
    ),
]

ROWS = [*CHAT, *COMPLETIONS, *MESSAGES, *COUNT_TOKENS, *RESPONSES]


def documented_rows() -> set[tuple[str, str, str]]:
    """(endpoint, fields, status) of each row of docs/server.md's field table."""
    text = DOCS.read_text()
    table = text[text.index("<!-- field-table -->") : text.index("<!-- /field-table -->")]
    rows = set()
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("endpoint", "") or set(cells[0]) <= {"-"}:
            continue
        rows.add((cells[0], cells[1].replace("`", ""), cells[2]))
    return rows


def test_the_table_lists_exactly_the_rows_tested() -> None:
    tested = {(row.endpoint, row.fields, row.status) for row in ROWS}
    documented = documented_rows()
    assert documented - tested == set(), "documented but not tested"
    assert tested - documented == set(), "tested but not documented"


def test_each_row_exercises_its_status() -> None:
    for row in ROWS:
        assert row.status in STATUSES, row
        if row.status in ("honoured", "ignored"):
            assert row.accepted or row.fields == "messages", row
        if row.status == "default only":
            assert row.accepted and row.refused, row  # the default, and a value beyond it
        if row.status == "refused":
            assert row.refused and not row.accepted, row


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with one_torch_thread():
        yield shared_engine()


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[TestClient]:
    # Every reply is the end of turn at once: the table is about acceptance, not output.
    say(engine, "")
    with TestClient(create_app(engine, limits=NO_PROMPT_CACHE)) as test_client:
        yield test_client


def _row_id(row: Row) -> str:
    return f"{row.endpoint}:{re.sub(r'[^a-z_.]+', '-', row.fields)}"


@pytest.mark.parametrize("row", ROWS, ids=_row_id)
def test_field_status(client: TestClient, row: Row) -> None:
    path = PATHS[row.endpoint]
    for fields in row.accepted:
        reply = client.post(path, json=BASE[row.endpoint] | fields)
        assert reply.status_code == 200, (fields, reply.text)
    for fields, named in row.refused:
        reply = client.post(path, json=BASE[row.endpoint] | fields)
        assert reply.status_code == 400, (fields, reply.text)
        body = reply.json()
        # `named`: the field (OpenAI's param), or with a space, words the message must hold.
        if row.endpoint in ("messages", "count_tokens"):
            # Anthropic's error body has no param: the message names the field.
            assert body["type"] == "error" and named in body["error"]["message"], body
        elif " " in named:
            assert named in body["error"]["message"], body
        else:
            assert body["error"]["param"] == named, body
