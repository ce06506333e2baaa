"""Load on a live `hearth serve`: N streaming clients at once over HTTP, as users would be.

Each client sends `--requests` streaming chat completions one after another (its own prompt,
at most `max_tokens` new tokens, greedy). Reported per level of clients:
completed requests/s, aggregate generated tok/s, time to first token and inter-token latency
percentiles (p50 / p90 / p99), measured at the client from the server-sent events.

    hearth serve --port 8000 &
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --clients 1,4,8 --out t.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx


@dataclass
class Timings:
    requests: int = 0
    tokens: int = 0
    first_token: list[float] = field(default_factory=list)
    between_tokens: list[float] = field(default_factory=list)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)] if ordered else float("nan")


def stream_one(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> Timings:
    """One streaming request; each content delta's arrival time at the client."""
    body = {
        "model": "hearth",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timings = Timings(requests=1)
    sent = time.perf_counter()
    last = None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                timings.tokens = event["usage"]["completion_tokens"]
            if not any(choice["delta"].get("content") for choice in event.get("choices", [])):
                continue
            now = time.perf_counter()
            if last is None:
                timings.first_token.append(now - sent)
            else:
                timings.between_tokens.append(now - last)
            last = now
    return timings


def run_level(url: str, clients: int, requests: int, max_tokens: int) -> tuple[Timings, float]:
    def client_loop(index: int) -> Timings:
        total = Timings()
        with httpx.Client() as client:
            for turn in range(requests):
                prompt = f"Client {index}, request {turn}: write a long story about the sea."
                one = stream_one(client, url, prompt, max_tokens)
                total.requests += one.requests
                total.tokens += one.tokens
                total.first_token += one.first_token
                total.between_tokens += one.between_tokens
        return total

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(client_loop, range(clients)))
    elapsed = time.perf_counter() - started
    merged = Timings()
    for result in results:
        merged.requests += result.requests
        merged.tokens += result.tokens
        merged.first_token += result.first_token
        merged.between_tokens += result.between_tokens
    return merged, elapsed


def cell(values: list[float]) -> str:
    return " / ".join(f"{percentile(values, f) * 1e3:,.0f}" for f in (0.5, 0.9, 0.99))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", default="1,4,8", help="levels of concurrent clients")
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()

    stats = httpx.get(f"{args.url}/stats", timeout=10).json()
    device = stats.get("plan", {}).get("device")
    run_level(args.url, 1, 1, 4)  # warm-up
    lines = [
        f"# `hearth serve` under load, {datetime.date.today().isoformat()}",
        "",
        f"Client on {platform.machine()}; server `/stats`: model {stats.get('model')}, "
        f"device {device}, max_concurrent {stats.get('max_concurrent')}. "
        f"{args.requests} streaming chat requests per client, {args.max_tokens} new tokens each.",
        "",
        "| clients | requests/s | tok/s | first token p50 / p90 / p99 ms "
        "| inter-token p50 / p90 / p99 ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for clients in (int(level) for level in args.clients.split(",")):
        timings, elapsed = run_level(args.url, clients, args.requests, args.max_tokens)
        row = (
            f"| {clients} | {timings.requests / elapsed:.2f} | {timings.tokens / elapsed:,.1f} | "
            f"{cell(timings.first_token)} | {cell(timings.between_tokens)} |"
        )
        lines.append(row)
        print(row, flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
