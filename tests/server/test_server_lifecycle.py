"""`hearth serve` as a process (issue 41): a taken port refused before the model loads, the
startup log, cancellations logged once and counted (and completed requests not), a client
that leaves mid-body, `/health` while huge prompts are refused, and the two-stage shutdown.

A live server on the embedded model, one for the module: the last test shuts it down (the
second-signal test starts its own).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving import LiveServer, start_server
from test_cli import assert_usage_error

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Germany is"
# Gemma's <eos> and <end_of_turn>, never sampled: a reply runs to max_tokens.
NO_END = {"1": -100, "106": -100}
CONTEXT = 32768  # the embedded model's positions


GRACE = 1  # --shutdown-timeout of the module's server, seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    live = start_server(log, "--log-level", "INFO", "--shutdown-timeout", str(GRACE))
    yield live
    live.stop()


def test_startup_logs_model_format_dtype_device_load_time_and_url(server: LiveServer) -> None:
    log = server.wait_for_log("listening on")  # logged once uvicorn has started
    loaded = (
        r"model \S+/gemma-3-270m-q4_k_m\.gguf \(gguf, as-stored GGUF weights, computing "
        r"in float32 "
    )
    assert re.search(loaded + r"on cpu\), loaded in \d+\.\d s", log), log
    assert f"listening on http://127.0.0.1:{server.port}" in log
    # The embedded model has no chat template of its own (issue 41, item 9).
    assert "gemma-3-270m-q4_k_m.gguf has no chat template of its own: it is a base model" in log
    # What prompts may hold, and that media URLs are not fetched without --allow-fetch.
    assert "inputs: text; image and audio URLs not fetched" in log


def test_a_taken_port_is_refused_at_once_before_the_model_loads(server: LiveServer) -> None:
    """One line and exit 2, not a server that loads the model, fails to bind and runs on
    with nothing listening (a timeout here)."""
    command = [sys.executable, "-m", "hearth.cli", "serve", "--port", str(server.port)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert_usage_error(result, f"cannot listen on 127.0.0.1:{server.port}", "in use")


def _completion(client: httpx.Client, base: str, **fields: object) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 3, **fields}
    return client.post(f"{base}/v1/completions", json=body, timeout=60)


def _settled(server: LiveServer) -> str:
    """The log once the generation thread has said what it will about finished requests."""
    time.sleep(0.3)
    return server.log()


def test_completed_requests_are_not_logged_as_cancelled(server: LiveServer) -> None:
    before = server.log().count("cancelled")
    with httpx.Client() as keep_alive:
        for _ in range(6):
            assert _completion(keep_alive, server.base).status_code == 200
        for _ in range(2):
            with keep_alive.stream(
                "POST",
                f"{server.base}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 3,
                    "stream": True,
                },
            ) as stream:
                assert stream.status_code == 200 and stream.read().endswith(b"data: [DONE]\n\n")
    for _ in range(4):  # a connection each, as curl makes
        with httpx.Client(headers={"Connection": "close"}) as once:
            assert _completion(once, server.base).status_code == 200
    assert _settled(server).count("cancelled") == before


def _stats(server: LiveServer) -> dict:
    return httpx.get(f"{server.base}/stats").json()


def test_a_stream_left_midway_is_logged_once_and_counted(server: LiveServer) -> None:
    cancelled = _stats(server)["cancelled"]
    lines_before = server.log().count("generation cancelled")
    body = {"prompt": PROMPT, "max_tokens": 2000, "stream": True, "logit_bias": NO_END}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60) as stream:
        events = stream.iter_lines()
        assert next(events).startswith("data: ")  # generation has started; now leave
    deadline = time.monotonic() + 30
    while _stats(server)["cancelled"] == cancelled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _stats(server)["cancelled"] == cancelled + 1
    metrics = httpx.get(f"{server.base}/metrics").text
    assert f"\nhearth_cancelled_total {cancelled + 1}\n" in metrics
    log = _settled(server)
    assert log.count("generation cancelled") == lines_before + 1
    assert "INFO - generation cancelled while generating" in log


def test_a_client_leaving_mid_body_logs_one_line_and_no_traceback(server: LiveServer) -> None:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
        "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port)) as raw:
        raw.sendall(head.encode() + b'{"prompt": "The capital of')
        time.sleep(0.2)  # the body's start has been read: the route waits for the rest
    log = server.wait_for_log("the client left before sending its whole request")
    assert "Traceback" not in log and "ERROR" not in log


def test_health_stays_fast_while_huge_prompts_are_refused(server: LiveServer) -> None:
    """A 10 MB prompt, refused from its length before tokenizing, and one of 0.9 M
    characters, tokenized (with the GIL released) and refused for its ~200k tokens: /health,
    polled throughout, answers each time within 200 ms (issue 41's acceptance)."""
    huge = json.dumps({"prompt": "hello world " * 833_000, "max_tokens": 1}).encode()
    assert 9.9e6 < len(huge) <= 10 * 2**20  # just under the server's body limit
    long = json.dumps({"prompt": "the quick brown fox " * 45_000, "max_tokens": 1}).encode()
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                started = time.perf_counter()
                try:
                    answered = client.get(f"{server.base}/health").status_code == 200
                except httpx.HTTPError:
                    answered = False
                # A failed poll counts as forever: a thread's exception would go unseen.
                latencies.append(time.perf_counter() - started if answered else float("inf"))
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        time.sleep(0.2)
        replies = []
        for body in (huge, long):
            replies.append(
                httpx.post(
                    f"{server.base}/v1/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=120,
                )
            )
    finally:
        done.set()
        poller.join()
    assert len(latencies) >= 10
    assert max(latencies) <= 0.2, sorted(latencies)[-5:]
    for reply in replies:
        assert reply.status_code == 400, reply.text
        assert f"this model's context holds {CONTEXT}" in reply.json()["error"]["message"]
    assert "at least" in replies[0].json()["error"]["message"]  # refused from its length


def _stream_in_background(server: LiveServer) -> tuple[threading.Thread, threading.Event]:
    """A long streamed completion read on a thread; the event is set at its first event."""
    started = threading.Event()

    def read() -> None:
        body = {"prompt": PROMPT, "max_tokens": 3000, "stream": True, "logit_bias": NO_END}
        try:
            with httpx.stream("POST", f"{server.base}/v1/completions", json=body) as stream:
                for _ in stream.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass  # cut off by the shutdown: what the test expects
        finally:
            started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(120)
    return reader, started


def _refused(server: LiveServer, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{server.base}/health", timeout=0.5)
        except httpx.ConnectError:
            return True
        except httpx.TimeoutException:
            pass
        time.sleep(0.05)
    return False


def test_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    """While draining (for up to 600 s here), a second Ctrl-C exits at once: status 130, not
    the drained exit's 0."""
    live = start_server(tmp_path / "serve.log", "--shutdown-timeout", "600")
    try:
        reader, _ = _stream_in_background(live)
        live.process.send_signal(signal.SIGINT)
        live.wait_for_log("draining")
        interrupted = time.monotonic()
        live.process.send_signal(signal.SIGINT)
        assert live.process.wait(timeout=30) == 128 + signal.SIGINT
        assert time.monotonic() - interrupted < 10
        reader.join(timeout=30)
    finally:
        live.stop()


def test_the_first_signal_drains_then_cancels_after_the_grace(server: LiveServer) -> None:
    """Last in the module: it shuts the module's server down."""
    reader, _ = _stream_in_background(server)
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    server.wait_for_log(f"shutting down: 1 request(s) draining, cancelled after {GRACE} s")
    assert _refused(server, within=2)  # admits nothing new
    assert server.process.wait(timeout=60) == 0
    took = time.monotonic() - signalled
    reader.join(timeout=30)
    assert GRACE <= took < 30
    assert "generation cancelled while generating" in server.log()
