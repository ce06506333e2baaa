"""HTTP overhead of `hearth serve`: time to first token and decode speed through the OpenAI
streaming API, against the engine called directly on the same model, prompt and settings.

    python benchmarks/server_overhead.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

import hearth
from hearth.runtime.sampling import SamplingParams

PROMPT = "The history of the printing press begins in the fifteenth century, when " * 8
MAX_TOKENS = 64
REPEATS = 7
SETTLE_SECONDS = 0.5


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def direct(engine: hearth.Engine) -> tuple[float, float]:
    """(prefill seconds, decode tok/s) from the engine's own statistics."""
    stats = None
    for chunk in engine.stream(PROMPT, MAX_TOKENS, SamplingParams(), (), chat=False):
        stats = chunk.stats or stats
    assert stats is not None
    return stats.prefill_seconds, stats.decode_tokens_per_second


def through_http(client: httpx.Client, base: str) -> tuple[float, float]:
    """(time to first token, decode tok/s) as a streaming client sees them.

    The client is made once and reused (as OpenAI's SDK and agents do): making an httpx client
    builds a TLS context, ~20 ms here, which a per-request client would count as server time.
    """
    body = {
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                last = time.perf_counter() - started
                first = first or last
    return first, (tokens - 1) / (last - first)


def client_setup_seconds() -> float:
    """What a new httpx client costs before its first request (best of 3)."""
    costs = []
    for _ in range(3):
        started = time.perf_counter()
        httpx.Client().close()
        costs.append(time.perf_counter() - started)
    return min(costs)


def best(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return min(r[0] for r in runs), max(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engine = hearth.load(progress=False)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hearth.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            "--prompt-cache-size",
            "0",
        ],
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        # Alternated, so the machine's drift from minute to minute hits both paths alike.
        direct_runs, http_runs = [], []
        with httpx.Client(timeout=300) as client:
            for _ in range(REPEATS):
                # A pause before each path: the previous one's teardown (freeing its caches,
                # idle torch threads spinning down) must not overlap the next one's prefill.
                time.sleep(SETTLE_SECONDS)
                direct_runs.append(direct(engine))
                time.sleep(SETTLE_SECONDS)
                http_runs.append(through_http(client, base))
        setup = client_setup_seconds()
        (prefill, engine_decode), (ttft, http_decode) = best(direct_runs), best(http_runs)
    finally:
        server.terminate()
        server.wait(30)
    table = (
        "\n".join(
            [
                f"# Server overhead, embedded Gemma 3 270M — {datetime.date.today()}",
                "",
                f"{platform.machine()}, Python {platform.python_version()}; completions endpoint, "
                f"streaming, {MAX_TOKENS} greedy tokens, prompt cache off; best of {REPEATS}, "
                "the two paths alternated; one httpx client for all requests (a new client per "
                f"request would add {setup * 1000:.0f} ms of its own setup to each TTFT).",
                "",
                "| path | time to first token (ms) | decode tok/s |",
                "|---|---|---|",
                f"| engine, direct | {prefill * 1000:.0f} (prefill) | {engine_decode:.1f} |",
                f"| HTTP, streaming | {ttft * 1000:.0f} | {http_decode:.1f} |",
                f"| overhead | {(ttft - prefill) * 1000:+.0f} ms | "
                f"{1 - http_decode / engine_decode:+.1%} |",
            ]
        )
        + "\n"
    )
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
