"""Log-probabilities: the generate loop's per-token record, and `logprobs`/`top_logprobs` on
the OpenAI chat and completions endpoints of a real `hearth serve` (embedded Gemma 3 270M in
fp32), driven by the official OpenAI SDK.

The oracle is Hearth's own model run by the test: greedy decoding with a full forward over the
whole prefix at every step (no KV cache), and log_softmax of those logits. Held-back tool-call
and thought markup is checked in process on test_server_tools' scripted Gemma 4.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from hearth.engine import Engine
from hearth.runtime.generate import (
    GenerationStats,
    LogprobRecorder,
    generate_tokens,
    stream_generate,
)
from hearth.runtime.sampling import Sampler, SamplingParams
from hearth.server import create_app
from test_server import CAPITALS, _free_port, _wait_until_healthy
from test_server_tools import (  # the scripted Gemma 4 engine and its fixtures
    ASK,
    CALL,
    NO_PROMPT_CACHE,
    THOUGHT,
    WEATHER_TOOL,
    engine,  # noqa: F401  (a fixture)
    say,  # noqa: F401  (a fixture)
)

pytestmark = pytest.mark.slow

# Server and oracle both run the same GGUF dequantized to fp32 with fp32 math; only the
# summation order differs (chunked prefill and KV-cached decode vs one full forward), which
# moves the log-probabilities by ~1e-6 (measured). 1e-3 leaves a wide margin, while a wrong
# distribution (temperature applied, a processor missed, an off-by-one position) is off by far
# more than 0.01.
LOGPROB_TOLERANCE = 1e-3
TOP = 5
MAX_TOKENS = 4
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module", autouse=True)
def server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Started before any test of the module, so it loads while the oracle model does."""
    port = _free_port()
    # fp32 (the file's exact weights, as stored): the same model the test's oracle runs.
    command = [sys.executable, "-m", "hearth.cli", "serve", "--port", str(port)]
    flags = ["--dtype", "float32", "--log-level", "WARNING"]
    process = subprocess.Popen([*command, *flags], stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.kill()  # as `serving.LiveServer.stop`; signals are test_server_lifecycle's
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def base_url(server: tuple[str, subprocess.Popen[bytes]]) -> str:
    _wait_until_healthy(*server)
    return server[0]


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _greedy_oracle(
    model: Any, prompt_ids: list[int], steps: int, end_ids: frozenset[int] = frozenset()
) -> list[tuple[int, torch.Tensor]]:
    """(token id, the log_softmax row it was the argmax of) per step, until an end id."""
    ids = list(prompt_ids)
    steps_out: list[tuple[int, torch.Tensor]] = []
    with torch.inference_mode():
        for _ in range(steps):
            row = model(torch.tensor([ids]))[0, -1].float().log_softmax(dim=-1)
            token = int(row.argmax())
            steps_out.append((token, row))
            ids.append(token)
            if token in end_ids:
                break
    return steps_out


@pytest.fixture(scope="module")
def capitals_oracle(hearth_270m: Any) -> list[tuple[int, torch.Tensor]]:
    # " Berlin" and ".": the completions test stops at ".".
    ids = hearth_270m.tokenizer.encode(CAPITALS)
    return _greedy_oracle(hearth_270m.model, ids, 2)


@pytest.fixture(scope="module")
def chat_oracle(hearth_270m: Any) -> list[tuple[int, torch.Tensor]]:
    tokenizer = hearth_270m.tokenizer
    end_ids = frozenset(tokenizer.eos_ids)  # the chat stop ids of a Gemma 3 vocabulary
    return _greedy_oracle(hearth_270m.model, tokenizer.encode_chat(CHAT), MAX_TOKENS, end_ids)


# --- the generate loop's record ------------------------------------------------------------


def test_loop_records_processed_logprobs_before_temperature_and_filters(
    hearth_270m: Any, capitals_oracle: list[tuple[int, torch.Tensor]]
) -> None:
    """Sampling at temperature 0.7 with top_k 2 and a logit bias: each record is log_softmax of
    logits + bias (the processors), not of the scaled or truncated distribution, and taking
    the record changes nothing about which tokens are drawn."""
    model, ids = hearth_270m.model, hearth_270m.tokenizer.encode(CAPITALS)
    favoured = capitals_oracle[0][0]
    params = SamplingParams(temperature=0.7, top_k=2, seed=3, logit_bias={favoured: -1.5})
    recorder = LogprobRecorder(top=TOP)
    tokens = generate_tokens(model, ids, Sampler(params), 2, GenerationStats(), logprobs=recorder)
    recorded = list(tokens)
    plain = list(generate_tokens(model, ids, Sampler(params), 2, GenerationStats()))
    assert recorded == plain
    assert [r.token for r in recorder.records] == recorded
    with torch.inference_mode():
        logits = model(torch.tensor([ids + recorded]))[0, len(ids) - 1 : -1].float()
        logits[:, favoured] -= 1.5
        expected = logits.log_softmax(dim=-1)
    for record, row in zip(recorder.records, expected, strict=True):
        assert record.logprob == pytest.approx(row[record.token].item(), abs=LOGPROB_TOLERANCE)
        values, top_ids = row.topk(TOP)
        assert record.top_tokens == tuple(top_ids.tolist())
        torch.testing.assert_close(
            torch.tensor(record.top_logprobs), values, atol=LOGPROB_TOLERANCE, rtol=0
        )
    # top_k=2 would have left two tokens: the record still ranks five, with their full mass.
    assert len(recorder.records[0].top_tokens) == TOP


def test_stream_delivers_every_token_record_once_in_order(
    hearth_270m: Any, capitals_oracle: list[tuple[int, torch.Tensor]]
) -> None:
    """Greedy " Berlin", "." with the stop string " Berlin.": no text comes out, yet each
    generated token's record comes exactly once, in order; without top_logprobs no chunk
    carries any."""
    model, tokenizer = hearth_270m.model, hearth_270m.tokenizer
    ids = tokenizer.encode(CAPITALS)
    stop = [" Berlin."]
    chunks = list(stream_generate(model, tokenizer, ids, None, 4, stop, top_logprobs=2))
    assert "".join(c.text for c in chunks) == "" and chunks[-1].stop_sequence == stop[0]
    records = [record for chunk in chunks for record in chunk.logprobs or ()]
    stats = chunks[-1].stats
    assert stats is not None and stats.generated_tokens == 2
    assert [r.token for r in records] == [token for token, _ in capitals_oracle]
    assert all(len(r.top_tokens) == 2 and r.top_tokens[0] == r.token for r in records)
    assert all(c.logprobs is None for c in stream_generate(model, tokenizer, ids, None, 1))


# --- chat completions ----------------------------------------------------------------------


def _check_chat_entries(
    entries: list[Any], oracle: list[tuple[int, torch.Tensor]], tokenizer: Any
) -> None:
    assert len(entries) == len(oracle)
    for entry, (token, row) in zip(entries, oracle, strict=True):
        assert entry.token == tokenizer.decode([token])
        assert bytes(entry.bytes).decode("utf-8") == entry.token
        assert entry.logprob == pytest.approx(row[token].item(), abs=LOGPROB_TOLERANCE)
        top = entry.top_logprobs
        assert len(top) == TOP
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert (top[0].token, top[0].logprob) == (entry.token, entry.logprob)  # greedy: top-1
        values, ids = row.topk(TOP)
        assert [t.token for t in top] == [tokenizer.decode([i]) for i in ids.tolist()]
        assert [t.logprob for t in top] == pytest.approx(values.tolist(), abs=LOGPROB_TOLERANCE)
        assert all(bytes(t.bytes).decode("utf-8") == t.token for t in top)


def test_chat_logprobs_json_and_stream(
    oai: openai.OpenAI, hearth_270m: Any, chat_oracle: list[tuple[int, torch.Tensor]]
) -> None:
    tokenizer = hearth_270m.tokenizer
    ask: dict[str, Any] = {"model": "g", "messages": CHAT, "max_tokens": MAX_TOKENS}
    ask |= {"temperature": 0, "logprobs": True, "top_logprobs": TOP}
    reply = oai.chat.completions.create(**ask)
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(CHAT))
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    # Every token counted, the end of turn token too (its text is not in the reply).
    assert len(logprobs.content) == reply.usage.completion_tokens
    _check_chat_entries(logprobs.content, chat_oracle, tokenizer)

    stream = oai.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert chunks[-1].usage is not None
    assert len(streamed) == chunks[-1].usage.completion_tokens
    _check_chat_entries(streamed, chat_oracle, tokenizer)
    # Logprobs ride on the chunks that carry text; the first (role) chunk has none.
    assert chunks[0].choices[0].logprobs is None


def test_chat_without_logprobs_has_none(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model="g", messages=CHAT, max_tokens=1, logprobs=False)
    assert reply.choices[0].logprobs is None


def test_held_back_markup_still_reports_every_token_once(request: pytest.FixtureRequest) -> None:
    """A scripted Gemma 4 (test_server_tools) thinks, answers and calls a tool: the parser holds
    the markup back, yet the JSON reply and the stream each report every token once, in order
    (the tokens' texts spell exactly what the model said, markup and stop token included)."""
    scripted: Engine = request.getfixturevalue("engine")
    spoken = f"{THOUGHT}Here.{CALL}"
    request.getfixturevalue("say")(spoken)
    ask: dict[str, Any] = {"model": "g", "messages": ASK, "tools": [WEATHER_TOOL]}
    ask |= {"logprobs": True, "top_logprobs": 1}
    with TestClient(create_app(scripted, limits=NO_PROMPT_CACHE)) as client:
        local = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
        )
        reply = local.chat.completions.create(**ask)
        options = {"include_usage": True}
        chunks = list(local.chat.completions.create(**ask, stream=True, stream_options=options))
    assert reply.choices[0].finish_reason == "tool_calls" and reply.usage is not None
    assert reply.choices[0].logprobs is not None
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content or []
    ]
    for entries in (reply.choices[0].logprobs.content or [], streamed):
        assert "".join(entry.token for entry in entries) == spoken
        assert len(entries) == reply.usage.completion_tokens
        assert all(entry.logprob == 0.0 for entry in entries)  # the script leaves no doubt


# --- text completions (legacy format) ------------------------------------------------------


def _check_legacy(
    logprobs: Any, oracle: list[tuple[int, torch.Tensor]], tokenizer: Any, top: int
) -> None:
    texts = [tokenizer.decode([token]) for token, _ in oracle]
    assert logprobs.tokens == texts
    expected = [row[token].item() for token, row in oracle]
    assert logprobs.token_logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert logprobs.text_offset == offsets
    for alternatives, text, logprob in zip(
        logprobs.top_logprobs, texts, logprobs.token_logprobs, strict=True
    ):
        assert alternatives[text] == logprob  # the sampled token is always in the dict
        values = list(alternatives.values())
        assert len(values) == top and values == sorted(values, reverse=True)


def test_completion_logprobs_json_and_stream_with_a_stop_string(
    oai: openai.OpenAI, hearth_270m: Any, capitals_oracle: list[tuple[int, torch.Tensor]]
) -> None:
    """ " Berlin" then "." (the stop string): both tokens are reported, the stop string's too."""
    tokenizer = hearth_270m.tokenizer
    ask: dict[str, Any] = {"model": "g", "prompt": CAPITALS, "max_tokens": MAX_TOKENS}
    ask |= {"temperature": 0, "logprobs": 3, "stop": ["."]}
    reply = oai.completions.create(**ask)
    assert reply.choices[0].text == " Berlin" and reply.usage is not None
    oracle = capitals_oracle[: reply.usage.completion_tokens]
    assert [tokenizer.decode([t]) for t, _ in oracle][-1] == "."
    _check_legacy(reply.choices[0].logprobs, oracle, tokenizer, top=3)

    chunks = list(oai.completions.create(**ask, stream=True))
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    merged["text_offset"] = []
    for chunk in chunks:
        for key, values in merged.items():
            values.extend(getattr(chunk.choices[0].logprobs, key))
    assert merged == reply.choices[0].logprobs.model_dump()


def test_completion_logprobs_zero_reports_the_tokens_only(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(model="g", prompt=CAPITALS, max_tokens=2, logprobs=0)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 2
    assert [list(d) for d in logprobs.top_logprobs or []] == [[t] for t in logprobs.tokens]


# --- refusals ------------------------------------------------------------------------------

USER = [{"role": "user", "content": "Hi"}]
BAD_BODIES = [
    (
        "/v1/chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": -1},
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
    (
        "/v1/chat/completions",
        {"messages": USER, "logprobs": False, "top_logprobs": 0},
        "top_logprobs",
    ),
    ("/v1/chat/completions", {"messages": USER, "logprobs": 1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", {"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", {"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_bad_logprob_fields_are_refused_by_name(
    base_url: str, path: str, body: dict[str, Any], param: str
) -> None:
    reply = httpx.post(f"{base_url}{path}", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["param"], error["type"], error["code"]) == (param, "invalid_request_error", None)
    assert param in error["message"]


def test_sdk_sees_a_bad_top_logprobs_as_a_bad_request(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model="g", messages=USER, logprobs=True, top_logprobs=21)


def test_anthropic_messages_refuse_logprobs(base_url: str) -> None:
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="logprobs"):
        claude.messages.create(
            model="g", messages=USER, max_tokens=2, extra_body={"logprobs": True}
        )
