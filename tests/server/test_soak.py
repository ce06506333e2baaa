"""A soak of a live `hearth serve` (issue 41's acceptance): 200 mixed requests over all three
APIs (OpenAI chat and completions, Anthropic messages, Responses), streamed and not, with
clients that leave mid-stream and bad inputs, four at a time. No 5xx, every good request
answered in full, and the server's resident memory grows less than 5% after a warm-up.

Replies are 1-2 tokens of the embedded model: the 200 take ~20 s on a quiet 2-core machine.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from serving import LiveServer, start_server

pytestmark = pytest.mark.slow

REQUESTS = 200
WARM_UP = 40
CONCURRENCY = 4
NO_END = {"1": -100, "106": -100}  # <eos>, <end_of_turn>: a stream runs until it is left
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Die Hauptstadt von Deutschland ist",
    "日本の首都は",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(tmp_path_factory.mktemp("soak") / "serve.log", "--log-level", "WARNING")
    yield live
    live.stop()


@dataclass(frozen=True)
class Call:
    """One request: where, what, whether streamed, and what a full answer ends with."""

    path: str
    body: dict | bytes
    stream: bool = False
    ends: tuple[str, ...] = ()  # the events that end a full stream
    good: bool = True
    leave_early: bool = False  # a client that goes away after the first event


def _good_calls(i: int) -> list[Call]:
    prompt = PROMPTS[i % len(PROMPTS)]
    user = [{"role": "user", "content": prompt}]
    return [
        Call("/v1/completions", {"prompt": prompt, "max_tokens": 2}),
        Call("/v1/completions", {"prompt": prompt, "max_tokens": 2, "stream": True}, True,
             ("data: [DONE]",)),
        Call("/v1/chat/completions", {"messages": user, "max_tokens": 1}),
        Call("/v1/chat/completions", {"messages": user, "max_tokens": 1, "stream": True}, True,
             ("data: [DONE]",)),
        Call("/v1/messages", {"messages": user, "max_tokens": 1, "model": "m"}),
        Call("/v1/messages", {"messages": user, "max_tokens": 1, "model": "m", "stream": True},
             True, ("event: message_stop",)),
        Call("/v1/responses", {"input": prompt, "max_output_tokens": 1, "temperature": 0.7}),
        # Cut at max_output_tokens, a Responses stream ends "incomplete" (OpenAI's way).
        Call("/v1/responses", {"input": prompt, "max_output_tokens": 2, "stream": True}, True,
             ("event: response.completed", "event: response.incomplete")),
    ]  # fmt: skip


def _leaving_calls(i: int) -> list[Call]:
    prompt = PROMPTS[i % len(PROMPTS)]
    long = {"max_tokens": 30, "stream": True, "logit_bias": NO_END}
    return [
        Call("/v1/completions", {"prompt": prompt, **long}, True, leave_early=True),
        Call("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], **long},
             True, leave_early=True),
    ]  # fmt: skip


BAD_CALLS = [
    Call("/v1/completions", b'{"prompt": "Hi", "max_tokens": ', good=False),
    Call("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, good=False),
    Call("/v1/completions", {"prompt": "Hi", "max_tokens": 40000}, good=False),
    Call("/v1/completions", {"prompt": "Hi", "seed": 10**25}, good=False),
    Call("/v1/completions", {"prompt": "", "max_tokens": 2}, good=False),
    Call("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, good=False),
    Call("/v1/chat/completions", {"messages": [], "max_tokens": 2}, good=False),
    Call("/v1/chat/completions", {"messages": "Hi", "temperature": -1}, good=False),
    Call("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}]}, good=False),
    Call("/v1/responses", {"input": 5, "max_output_tokens": 2}, good=False),
    Call("/v1/nowhere", {"prompt": "Hi"}, good=False),
]


def mixed_calls() -> list[Call]:
    """200 calls: 8 good, 2 leaving and 2 bad in each dozen, the kinds interleaved."""
    calls: list[Call] = []
    i = 0
    while len(calls) < REQUESTS:
        calls += _good_calls(i) + _leaving_calls(i)
        calls += [BAD_CALLS[(2 * i) % len(BAD_CALLS)], BAD_CALLS[(2 * i + 1) % len(BAD_CALLS)]]
        i += 1
    return calls[:REQUESTS]


@dataclass(frozen=True)
class Outcome:
    call: Call
    status: int
    text: str


def perform(client: httpx.Client, base: str, call: Call) -> Outcome:
    if isinstance(call.body, bytes):
        content, headers = call.body, {"Content-Type": "application/json"}
    else:
        content, headers = json.dumps(call.body).encode(), {"Content-Type": "application/json"}
    request = client.build_request("POST", base + call.path, content=content, headers=headers)
    reply = client.send(request, stream=True)
    try:
        if call.leave_early and reply.status_code == 200:
            next(reply.iter_lines())
            return Outcome(call, reply.status_code, "")
        return Outcome(call, reply.status_code, reply.read().decode())
    finally:
        reply.close()


def _check(outcome: Outcome) -> str | None:
    """What is wrong with an outcome, or None."""
    call, status, text = outcome.call, outcome.status, outcome.text
    if status >= 500:
        return f"{status} from {call.path}: {text[:300]}"
    if not call.good:
        return None if 400 <= status < 500 and "error" in text else f"{status}: {text[:300]}"
    if status != 200:
        return f"{status} from good {call.path}: {text[:300]}"
    if call.leave_early:
        return None
    if call.stream:
        return None if any(end in text for end in call.ends) else text[-300:]
    body = json.loads(text)
    answered = body.get("choices") or body.get("content") or body.get("output")
    return None if answered else text[:300]


def run_calls(server: LiveServer, calls: list[Call]) -> list[str]:
    """The calls, CONCURRENCY at a time (each worker its own keep-alive client); the
    problems found."""
    local = threading.local()

    def one(call: Call) -> Outcome:
        if not hasattr(local, "client"):
            local.client = httpx.Client(timeout=120)
            opened.append(local.client)
        return perform(local.client, server.base, call)

    opened: list[httpx.Client] = []
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            outcomes = list(pool.map(one, calls))
    finally:
        for client in opened:
            client.close()
    return [problem for outcome in outcomes if (problem := _check(outcome)) is not None]


def test_200_mixed_requests(server: LiveServer) -> None:
    calls = mixed_calls()
    assert len(calls) == REQUESTS
    assert {call.path for call in calls if call.good} >= {
        "/v1/completions", "/v1/chat/completions", "/v1/messages", "/v1/responses"
    }  # fmt: skip
    problems = run_calls(server, calls[:WARM_UP])
    warm = server.rss_bytes()
    problems += run_calls(server, calls[WARM_UP:])
    grown = server.rss_bytes() / warm - 1
    assert not problems, problems[:5]
    assert grown < 0.05, f"resident memory grew {grown:.1%} after the warm-up"
    stats = httpx.get(f"{server.base}/stats").json()
    assert stats["requests"] >= sum(call.good and not call.leave_early for call in calls)
