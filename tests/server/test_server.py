"""`hearth serve` end to end: a real server process on the embedded Gemma 3 270M, driven by the
official OpenAI and Anthropic SDKs and by raw HTTP for the malformed cases.

The model is a base model, so the tests check structure, token counts, stop handling and
determinism, not what the replies say.
"""

from __future__ import annotations

import base64
import json
import math
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest

from hearth.checkpoint import open_checkpoint
from hearth.embedded import embedded_model_path
from hearth.media import MAX_MEDIA_BYTES
from hearth.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

CAPITALS = "The capital of France is Paris. The capital of Germany is"
STARTUP_SECONDS = 180  # loading the model on a busy 2-core machine can take a while


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_healthy(base: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"hearth serve exited with {process.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("hearth serve did not become healthy in time")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    port = _free_port()
    command = [sys.executable, "-m", "hearth.cli", "serve", "--port", str(port)]
    process = subprocess.Popen([*command, "--log-level", "WARNING"], stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_healthy(base, process)
        yield base
    finally:
        process.kill()  # as `serving.LiveServer.stop`; signals are test_server_lifecycle's
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return open_checkpoint(embedded_model_path()).tokenizer()


def _complete(oai: openai.OpenAI, **fields: Any) -> Any:
    return oai.completions.create(model="gemma", prompt=CAPITALS, **fields)


def test_health_and_models(base_url: str, oai: openai.OpenAI) -> None:
    assert httpx.get(f"{base_url}/health").content == b'{"status": "ok"}'
    models = oai.models.list().data
    assert [m.object for m in models] == ["model"]
    assert oai.models.retrieve(models[0].id).id == models[0].id
    # The embedded model has no chat template of its own: /v1/models says so (issue 41, item 9).
    assert models[0].base_model is True  # type: ignore[attr-defined]


def test_completion_stops_at_a_stop_string(oai: openai.OpenAI, tokenizer: Tokenizer) -> None:
    reply = _complete(oai, max_tokens=8, stop=["."], temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text == " Berlin"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(tokenizer.encode(CAPITALS))


def test_completion_stream_matches_json(oai: openai.OpenAI) -> None:
    whole = _complete(oai, max_tokens=4)
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.completion_tokens, whole.usage.total_tokens) == (
        4,
        whole.usage.prompt_tokens + 4,
    )
    chunks = list(_complete(oai, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_chat_completion_json_and_stream(oai: openai.OpenAI, tokenizer: Tokenizer) -> None:
    messages: list[Any] = [
        {"role": "developer", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}],
        },
    ]
    reply = oai.chat.completions.create(model="gemma", messages=messages, max_completion_tokens=5)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason in ("stop", "length")
    as_template = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
    ]
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(as_template))
    stream = oai.chat.completions.create(
        model="gemma",
        messages=messages,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and reply.usage is not None
    uncached = {"prompt_tokens_details"}
    assert usage.model_dump(exclude=uncached) == reply.usage.model_dump(exclude=uncached)
    # The same prompt again: the prompt cache holds all of it but the token left to prefill.
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_seeded_sampling_is_reproducible(oai: openai.OpenAI) -> None:
    # top_k is an mlx-lm extension, so the SDK sends it as an extra field.
    fields = {"max_tokens": 6, "temperature": 1.0, "seed": 1234, "extra_body": {"top_k": 50}}
    first, second = (_complete(oai, **fields).choices[0].text for _ in range(2))
    assert first == second


def test_n_seeded_choices_differ_and_repeat(oai: openai.OpenAI) -> None:
    """llama.cpp's test_consistent_result_same_seed / test_different_result_different_seed,
    for n > 1: with a seed, choice i samples with seed + i, so the choices differ and the
    request repeats exactly; choice 0 is what n = 1 gives."""
    fields = {"max_tokens": 4, "temperature": 1.0, "seed": 42}
    first = [c.text for c in _complete(oai, n=2, **fields).choices]
    assert first[0] != first[1]
    # Each choice is the seeded single request, which repeats exactly (seeded test above).
    assert _complete(oai, **fields).choices[0].text == first[0]
    assert _complete(oai, **fields | {"seed": 43}).choices[0].text == first[1]


def test_completion_prompt_forms_agree(oai: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """llama.cpp's test_completion_with_tokens_input: token ids, a batch, or text: the same
    prompt gives the same greedy completion; a batch gives one choice per prompt, in order."""
    ids = tokenizer.encode(CAPITALS)
    text = _complete(oai, max_tokens=3).choices[0].text
    as_ids = oai.completions.create(model="gemma", prompt=ids, max_tokens=3)
    batch = oai.completions.create(model="gemma", prompt=[ids, CAPITALS], max_tokens=3)
    assert as_ids.choices[0].text == text
    assert [(c.index, c.text) for c in batch.choices] == [(0, text), (1, text)]
    assert batch.usage is not None and batch.usage.prompt_tokens == 2 * len(ids)


def test_role_mapping_renders_as_mlx_lm_server(oai: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """mlx_lm.server's convert_chat for a model without a chat template: each message as its
    role's prefix, its text and the stop string, then the assistant prefix, stripped."""
    mapping = {"system": "RULES: ", "user": "Q: ", "assistant": "A:", "stop": "\n"}
    messages = [
        {"role": "system", "content": "Answer with a city."},
        {"role": "user", "content": "Capital of France?"},
    ]
    rendered = "RULES: Answer with a city.\nQ: Capital of France?\nA:"
    chat = oai.chat.completions.create(
        model="gemma", messages=messages, max_tokens=3, extra_body={"role_mapping": mapping}
    )
    plain = oai.completions.create(model="gemma", prompt=rendered, max_tokens=3)
    assert chat.usage is not None and chat.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert chat.choices[0].message.content == plain.choices[0].text


def test_empty_tools_on_a_template_without_tools(oai: openai.OpenAI) -> None:
    # Issue 42: `tools: []` asks for no tools, so a model without tool support answers it.
    reply = oai.chat.completions.create(model="gemma", messages=USER, tools=[], max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_xtc_excludes_the_top_choices(oai: openai.OpenAI) -> None:
    """mlx-lm's apply_xtc end to end: with xtc_probability 1, every token above the threshold
    but the least likely of them is removed, so top_k 1 takes that one. The expectation comes
    from the reply's own log-probabilities: the distribution XTC saw (no other filter)."""
    xtc = {"top_k": 1, "xtc_probability": 1.0, "xtc_threshold": 0.1}
    reply = oai.completions.create(
        model="gemma", prompt="I like", max_tokens=1, temperature=1.0, logprobs=20, extra_body=xtc
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs and logprobs.tokens
    above = sorted(
        (lp, text) for text, lp in logprobs.top_logprobs[0].items() if math.exp(lp) > 0.1
    )
    assert len(above) >= 2  # else XTC would remove nothing here
    assert logprobs.tokens[0] == above[0][1]
    greedy = oai.completions.create(model="gemma", prompt="I like", max_tokens=1)
    assert greedy.choices[0].text == above[-1][1] != reply.choices[0].text


def test_100_concurrent_requests_are_all_answered(oai: openai.OpenAI, base_url: str) -> None:
    """100 clients at once (half of them malformed): every one answered, the server stays up."""

    def call(index: int) -> Any:
        if index % 2:
            return httpx.post(f"{base_url}/v1/completions", json={"prompt": 5}, timeout=120)
        return _complete(oai, max_tokens=2)

    with ThreadPoolExecutor(100) as pool:
        replies = list(pool.map(call, range(100)))
    good = replies[::2]
    assert len({r.choices[0].text for r in good}) == 1  # greedy: every reply the same
    assert all(r.usage.completion_tokens == 2 for r in good)
    assert all(r.status_code == 400 for r in replies[1::2])
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}


# Counting-like prompts: the 270M continues each with clear picks (top-2 margins mostly > 1).
SIXTEEN_PROMPTS = [
    "1, 2, 3, 4, 5,",
    "January, February, March,",
    "a b c d e f",
    "10, 20, 30, 40,",
    "A, B, C, D,",
    "2, 4, 6, 8,",
    "100, 200, 300,",
    "x1 x2 x3 x4",
    "5, 10, 15, 20,",
    "3, 6, 9, 12,",
    "11, 12, 13, 14,",
    "p1 p2 p3 p4",
    "1000, 2000, 3000,",
    "A1 A2 A3 A4",
    "7, 8, 9, 10,",
    "item1 item2 item3",
]
# A batched step and a request alone may sum in another order (~1e-6 of logits of 10-30), and
# on a CPU with AMX a step of 6+ rows runs the head with its input rounded to bf16: logits then
# move by up to ~0.1 (bound 0.3, tests/runtime/test_native_paged_blocks.py). A token is compared
# only where the alone run's top two log-probs are further apart than twice that bound.
NEAR_TIE = 0.6


def test_sixteen_concurrent_streams_each_equal_its_own_sequential_answer(base_url: str) -> None:
    """16 streaming requests at once through the openai SDK (more than the CPU default of 8
    running: the rest wait their turn) all complete, and each streams the tokens its request
    gives when sent alone, up to the first near tie of the alone run. A client of its own: the
    module's holds connections idle since earlier tests, which the server closes after 5 s
    (uvicorn's keep-alive) — one reused just as it closed failed a full run, retries off."""
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    fields: dict[str, Any] = {"model": "gemma", "max_tokens": 10, "temperature": 0, "logprobs": 2}
    alone = [
        oai.completions.create(prompt=p, **fields).choices[0].logprobs for p in SIXTEEN_PROMPTS
    ]

    def stream(prompt: str) -> list[str]:
        chunks = oai.completions.create(prompt=prompt, stream=True, **fields)
        return [token for chunk in chunks for token in (chunk.choices[0].logprobs.tokens or [])]

    with oai, ThreadPoolExecutor(16) as pool:
        together = list(pool.map(stream, SIXTEEN_PROMPTS))
    compared = 0
    for prompt, own, streamed in zip(SIXTEEN_PROMPTS, alone, together, strict=True):
        assert len(streamed) == len(own.tokens) == 10, prompt
        for position, top in enumerate(own.top_logprobs):
            first, second = sorted(top.values(), reverse=True)[:2]
            if first - second < NEAR_TIE:
                break
            assert streamed[position] == own.tokens[position], (prompt, position)
            compared += 1
    assert compared > 0.8 * 16 * 10


def test_openai_sdk_sees_refusals_as_bad_requests(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="response_format"):
        oai.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": "Hi"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strng"}},
            },
        )


USER = [{"role": "user", "content": "Hi"}]
BAD_CHAT_BODIES = [
    (
        {
            "messages": USER,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "strng"}},
            },
        },
        "response_format",
    ),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "seed": 99999999999999999999999}, "seed"),  # issue 41 item 5
    ({"messages": USER, "store": True}, "store"),
    ({"messages": USER, "logprobs": "yes"}, "logprobs"),
    ({"messages": USER, "colour": "blue"}, "colour"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ({"messages": USER, "max_tokens": -1}, "max_tokens"),
    ({"messages": USER, "max_tokens": 10**12}, "max_tokens"),
    ({"messages": USER, "max_tokens": 40_000}, "max_tokens"),  # beyond the 32k context
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"999999999": 1}}, "logit_bias"),
    ({}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT_BODIES)
def test_bad_chat_fields_are_refused_by_name(base_url: str, body: dict, param: str) -> None:
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", None)
    assert error["message"]


@pytest.mark.parametrize(
    ("content", "status"),
    [
        (b'{"prompt": "x",', 400),  # malformed JSON
        (b'["prompt"]', 400),  # not an object
        (b'{"prompt": "\xff"}', 400),  # not UTF-8
        (b'{"prompt": "x", "temperature": NaN}', 400),  # not JSON either
        (b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}', 413),
    ],
)
def test_malformed_bodies_are_refused(base_url: str, content: bytes, status: int) -> None:
    reply = httpx.post(f"{base_url}/v1/completions", content=content)
    assert reply.status_code == status
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_a_body_holding_the_largest_media_file_is_read(base_url: str) -> None:
    """A 20 MiB file as a base64 data URL (27 MiB of body) is read, not refused as too large:
    the text-only model then refuses the image itself (400, naming the part)."""
    data = base64.b64encode(bytes(MAX_MEDIA_BYTES)).decode()
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    body = {"model": "gemma", "messages": [{"role": "user", "content": [image]}]}
    reply = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages.0.content.0.image_url"


def test_unknown_path_gets_an_error_body(base_url: str) -> None:
    reply = httpx.get(f"{base_url}/v1/nothing-here")
    assert reply.status_code == 404 and "error" in reply.json()


def test_anthropic_messages_and_stop_sequence(claude: anthropic.Anthropic) -> None:
    ask = {"model": "gemma", "messages": [{"role": "user", "content": CAPITALS}]}
    free = claude.messages.create(**ask, max_tokens=6)
    assert (free.type, free.role, free.stop_reason) == ("message", "assistant", "max_tokens")
    assert free.usage.output_tokens == 6
    text = free.content[0].text
    stop = text.strip()[1:3]  # a stop string the greedy reply is known to contain
    cut = claude.messages.create(**ask, max_tokens=6, stop_sequences=[stop])
    assert cut.content[0].text == text[: text.index(stop)]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)


def test_anthropic_stream_event_sequence(base_url: str, claude: anthropic.Anthropic) -> None:
    ask: dict[str, Any] = {"model": "gemma", "system": "Be brief.", "max_tokens": 4}
    ask["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    whole = claude.messages.create(**ask)
    events = list(claude.messages.create(**ask, stream=True))  # the SDK drops "ping" events
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    raw = httpx.post(f"{base_url}/v1/messages", json=ask | {"stream": True}).text
    kinds = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event:")]
    deltas = kinds.count("content_block_delta")
    assert kinds == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_anthropic_errors_have_anthropic_shape(base_url: str, claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="gemma", messages=[], max_tokens=4)
    reply = httpx.post(f"{base_url}/v1/messages", json={"model": "gemma", "messages": USER})
    body = reply.json()
    assert reply.status_code == 400 and body["type"] == "error"
    assert (
        body["error"]["type"] == "invalid_request_error"
        and "max_tokens" in body["error"]["message"]
    )


def _quick_reply_seconds(oai: openai.OpenAI) -> float:
    started = time.monotonic()
    _complete(oai, max_tokens=1)
    return time.monotonic() - started


def test_a_dropped_stream_stops_its_generation(base_url: str, oai: openai.OpenAI) -> None:
    # 8000 tokens would hold the single worker for minutes if the disconnect went unnoticed.
    body = {"prompt": CAPITALS, "max_tokens": 8000, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as events:
        lines = events.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first.removeprefix("data: "))["object"] == "text_completion"
    assert _quick_reply_seconds(oai) < 30


def test_a_dropped_request_stops_its_generation(base_url: str, oai: openai.OpenAI) -> None:
    body = {"prompt": CAPITALS, "max_tokens": 8000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=2))
    assert _quick_reply_seconds(oai) < 30
