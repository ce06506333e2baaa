"""The prompt cache, /stats, /metrics and --memory-budget.

End to end against two real `hearth serve` processes on the embedded Gemma 3 270M: one with the
prompt cache and a memory budget, one without either (the reference a reused cache must match).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

import hearth
from hearth.kv.paged import DEFAULT_BLOCK_SIZE
from hearth.kv.prompt_cache import PromptCache
from hearth.server.app import ServerLimits, create_app
from test_server import _free_port, _wait_until_healthy
from test_server_tools import engine  # noqa: F401  (a fixture: the scripted Gemma 4)
from tiny import save_tiny_with_tokenizer

BUDGET_GB = 0.3  # the 270M model's weights (~0.25 GB as stored) plus ~6k tokens of fp32 KV


def _hand_derived_capacity(budget_bytes: int, weight_bytes: int, element_bytes: int = 2) -> int:
    """Gemma 3 270M: 15 sliding layers hold a ring of 512 slots (K and V of one KV head of 256
    dims, and an int64 position a slot); 3 full layers hold every token, grown 256 at a time."""
    slot = 2 * 256 * element_bytes + 8
    left = budget_bytes - weight_bytes - 15 * 512 * slot
    return left // (3 * slot) // 256 * 256


slow = pytest.mark.slow
QUESTION = (
    "You are a terse geography tutor. Answer with one word only. What is the capital of France?"
)


# --- the LRU itself ----------------------------------------------------------------------


@dataclass
class _FakeCache:
    """Stands in for a layer cache: only its size and offset matter to the LRU."""

    nbytes: int
    offset: int = 32

    def trim(self, tokens: int) -> None:
        self.offset -= tokens


def test_lru_evicts_least_recently_used_entries_to_fit_the_byte_cap() -> None:
    cache = PromptCache(max_bytes=250, max_entries=10)
    prompts = [[index] * 32 for index in range(3)]
    for prompt in prompts:
        cache.put(prompt, [_FakeCache(100)])
    assert (cache.entries, cache.nbytes) == (2, 200)  # the oldest went to make room
    assert cache.take(prompts[0]).cached_tokens == 0
    assert cache.take(prompts[1]).cached_tokens == 31  # one token left to prefill
    cache.put([9] * 32, [_FakeCache(300)])  # bigger than the whole cap: not kept
    assert (cache.entries, cache.nbytes, cache.hits, cache.misses) == (1, 100, 1, 1)


def test_lru_keeps_at_most_max_entries() -> None:
    cache = PromptCache(max_bytes=10**9, max_entries=2)
    for index in range(3):
        cache.put([index] * 32, [_FakeCache(1)])
    assert cache.entries == 2
    assert cache.take([0] * 32).cached_tokens == 0


# --- end to end --------------------------------------------------------------------------


def _launch(*flags: str) -> tuple[str, subprocess.Popen[bytes]]:
    port = _free_port()
    command = [sys.executable, "-m", "hearth.cli", "serve", "--port", str(port), *flags]
    process = subprocess.Popen([*command, "--log-level", "WARNING"], stderr=subprocess.DEVNULL)
    return f"http://127.0.0.1:{port}", process


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[str, str]]:
    """(with the cache and a budget, without either), started side by side."""
    launched = [_launch("--memory-budget", str(BUDGET_GB)), _launch("--prompt-cache-size", "0")]
    try:
        for base, process in launched:
            _wait_until_healthy(base, process)
        yield launched[0][0], launched[1][0]
    finally:
        for _, process in launched:
            process.kill()  # as `serving.LiveServer.stop`; signals are test_server_lifecycle's
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def cached(servers: tuple[str, str]) -> str:
    return servers[0]


@pytest.fixture(scope="module")
def uncached(servers: tuple[str, str]) -> str:
    return servers[1]


def _chat(base: str, messages: list[dict[str, str]], max_tokens: int = 6) -> dict[str, Any]:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _cached_tokens(reply: dict[str, Any]) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@slow
def test_next_turn_reuses_the_conversation_and_matches_an_uncached_server(
    cached: str, uncached: str
) -> None:
    first_turn = [{"role": "user", "content": QUESTION}]
    first = _chat(cached, first_turn)
    answer = first["choices"][0]["message"]["content"]
    next_turn = [
        *first_turn,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the capital of Germany?"},
    ]
    reused, fresh = _chat(cached, next_turn), _chat(uncached, next_turn)
    # The pool shares whole blocks: at most a block's worth of the first turn is recomputed.
    assert _cached_tokens(reused) >= first["usage"]["prompt_tokens"] - (DEFAULT_BLOCK_SIZE - 1)
    assert _cached_tokens(fresh) == 0
    assert reused["choices"][0]["message"] == fresh["choices"][0]["message"]


@slow
def test_a_conversation_past_the_sliding_window_reuses_the_previous_prompt(
    cached: str, uncached: str
) -> None:
    long_turn = [{"role": "user", "content": "Paris is in France. " * 110 + QUESTION}]
    first = _chat(cached, long_turn)
    assert first["usage"]["prompt_tokens"] > 512  # past Gemma 3 270M's window
    next_turn = [
        *long_turn,
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And the capital of Germany?"},
    ]
    reused, fresh = _chat(cached, next_turn), _chat(uncached, next_turn)
    # The first turn's blocks serve the next although its sliding windows moved on: the
    # sliding layers' blocks within the window before the hit point are still cached. Whole
    # blocks only: at most a block's worth of the first turn is recomputed.
    assert _cached_tokens(reused) >= first["usage"]["prompt_tokens"] - (DEFAULT_BLOCK_SIZE - 1)
    assert reused["choices"][0]["message"] == fresh["choices"][0]["message"]


@slow
def test_an_unrelated_prompt_reuses_nothing(cached: str) -> None:
    reply = _chat(cached, [{"role": "user", "content": "Write one line about the sea at night."}])
    assert _cached_tokens(reply) == 0


@slow
def test_anthropic_and_responses_report_cached_tokens(cached: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    _chat(cached, messages, max_tokens=1)  # leaves this prompt in the cache
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}
    message = httpx.post(f"{cached}/v1/messages", json=body, timeout=120).json()
    usage = message["usage"]
    # Anthropic's split: input_tokens are only the prompt tokens that were not cached.
    assert usage["cache_read_input_tokens"] > 0 and usage["input_tokens"] >= 1
    body = {"model": "m", "input": QUESTION, "max_output_tokens": 4, "temperature": 0}
    response = httpx.post(f"{cached}/v1/responses", json=body, timeout=120).json()
    assert response["usage"]["input_tokens_details"]["cached_tokens"] > 0


@slow
def test_stats_and_metrics_count_requests_tokens_and_the_cache(cached: str) -> None:
    _chat(cached, [{"role": "user", "content": QUESTION}], max_tokens=1)  # so the next one hits
    before = httpx.get(f"{cached}/stats").json()
    reply = _chat(cached, [{"role": "user", "content": QUESTION}], max_tokens=3)
    after = httpx.get(f"{cached}/stats").json()
    assert after["requests"] == before["requests"] + 1
    assert after["prompt_tokens"] == before["prompt_tokens"] + reply["usage"]["prompt_tokens"]
    assert after["generated_tokens"] - before["generated_tokens"] == 3
    assert after["queue_depth"] == 0
    cache = after["prompt_cache"]
    assert cache["enabled"] and cache["entries"] >= 1 and cache["bytes"] > 0
    assert cache["hits"] == before["prompt_cache"]["hits"] + 1
    pool = after["kv_pool"]  # the CPU default: 8 requests at once on the paged pool
    assert pool["enabled"] and pool["block_size"] == DEFAULT_BLOCK_SIZE
    assert pool["blocks_used"] == 0 < pool["blocks_cached"] <= pool["blocks_total"]
    assert pool["prefix_hit_tokens"] >= before["kv_pool"]["prefix_hit_tokens"] + 16
    admission = after["admission"]
    assert admission["budget_bytes"] == BUDGET_GB * 10**9
    # The GGUF's default CPU path computes in fp32 (its blocks as stored): 4-byte K/V.
    capacity = _hand_derived_capacity(
        admission["budget_bytes"], admission["weight_bytes"], element_bytes=4
    )
    assert admission["max_context_tokens"] == capacity > 4000
    # The pool is what the budget leaves beside the weights, to a block of each group.
    room = admission["budget_bytes"] - admission["weight_bytes"]
    assert room - 2 * 18 * DEFAULT_BLOCK_SIZE * 2 * 256 * 4 < pool["bytes"] <= room

    metrics = httpx.get(f"{cached}/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    lines = metrics.text.splitlines()
    assert "# TYPE hearth_requests_total counter" in lines
    assert "# TYPE hearth_queue_depth gauge" in lines
    assert any(line.startswith("# HELP hearth_prompt_cache_bytes ") for line in lines)
    values = dict(line.split() for line in lines if not line.startswith("#"))
    assert int(values["hearth_requests_total"]) >= after["requests"]
    assert int(values["hearth_prompt_cache_hits_total"]) >= cache["hits"]
    assert int(values["hearth_kv_pool_blocks_total"]) == pool["blocks_total"]
    assert int(values["hearth_preemptions_total"]) == 0
    assert int(values["hearth_prefix_hit_tokens_total"]) >= pool["prefix_hit_tokens"]


@slow
def test_memory_budget_refuses_what_cannot_fit_and_accepts_what_can(cached: str) -> None:
    body = {"model": "m", "prompt": "Hello", "max_tokens": 20_000}
    refused = httpx.post(f"{cached}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert f"memory budget of {BUDGET_GB} GB" in error["message"]
    assert (error["code"], error["param"]) == ("context_over_budget", "max_tokens")
    accepted = httpx.post(f"{cached}/v1/completions", json=body | {"max_tokens": 2}, timeout=120)
    assert accepted.status_code == 200, accepted.text


def test_memory_budget_caps_a_gpu_decoders_slots(
    engine: Any,  # noqa: F811  (test_server_tools' scripted Gemma 4)
) -> None:
    """What the budget leaves beside the weights, in tokens of K/V (hand-derived), is
    the slot limit the app gives the engine runner's graph decoders."""
    from hearth.kv.footprint import KVFootprint, LayerBytes
    from hearth.server import create_app
    from hearth.server.admission import MemoryBudget
    from hearth.server.app import ServerLimits

    # One full layer of 10^6 - 8 bytes a token and 8 of position, grown 256 tokens at a time:
    # 6 GB hold 23 steps.
    full_layer = KVFootprint((LayerBytes(10**6 - 8, 10**6 - 8, None),))
    assert MemoryBudget(10 * 10**9, 4 * 10**9, full_layer, 10**5).kv_token_capacity() == 5888
    assert MemoryBudget(10**9, 2 * 10**9, full_layer, 10**5).kv_token_capacity() == 0
    assert MemoryBudget(10**12, 0, full_layer, 4096).kv_token_capacity() == 4096  # positions
    limits = ServerLimits(prompt_cache_bytes=0, memory_budget_gb=1.0)
    create_app(engine, limits=limits)
    budget = MemoryBudget.for_engine(engine, 1.0)
    assert engine.runner.slot_limit == budget.kv_token_capacity() > 0
    create_app(engine, limits=ServerLimits(prompt_cache_bytes=0))
    assert engine.runner.slot_limit is None


def test_a_budget_counts_sliding_layers_at_their_window(hearth_270m: Any) -> None:
    """The 270M model's caches (fp32 here) with 30 MB beside the weights, hand-derived: a
    context that the dense bound of every layer at every token would refuse fits, and one
    token more, which takes another step of 256, does not."""
    from hearth.server.admission import BYTES_PER_GB, MemoryBudget
    from hearth.server.errors import RequestError

    assert hearth_270m.model.compute_dtype == torch.float32
    weights = hearth_270m.weight_bytes_per_token()
    budget = MemoryBudget.for_engine(hearth_270m, (weights + 30 * 10**6) / BYTES_PER_GB)
    capacity = _hand_derived_capacity(budget.budget_bytes, weights, element_bytes=4)
    assert budget.kv_token_capacity() == capacity > 2000
    budget.check(100, capacity - 100)
    assert weights + capacity * 18 * 2 * 256 * 4 > budget.budget_bytes  # the old bound
    with pytest.raises(RequestError, match=f"at most {capacity} tokens fit"):
        budget.check(100, capacity - 100 + 1)


def test_a_budget_under_the_weights_stops_the_server_at_start() -> None:
    """A budget that could admit nothing is a usage error, not a server refusing every
    request: exit 2 with one line, before it listens."""
    command = [sys.executable, "-m", "hearth.cli", "serve", "--memory-budget", "0.1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "--memory-budget 0.1 GB leaves no room for a KV cache" in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_kv_pool_that_holds_no_request_stops_the_server_at_start(tmp_path: Path) -> None:
    """--kv-cache-memory too small for a block of every layer group: the app is not made (the
    CLI turns the ValueError into exit 2 and one line, as for --memory-budget)."""
    tiny = hearth.load(save_tiny_with_tokenizer(tmp_path / "tiny"), device="cpu", progress=False)
    limits = ServerLimits(max_concurrent=2, kv_cache_memory_gb=0.000001)
    with pytest.raises(ValueError, match="holds no request: give --kv-cache-memory"):
        create_app(tiny, limits=limits)


def test_a_request_the_kv_pool_can_never_hold_is_a_400(tmp_path: Path) -> None:
    """Tiny Gemma 3 (fp32; 2 sliding and 2 full layers of 2 KV heads of 32 dims: 1 KiB a token
    a group, 16 KiB a block) in 0.0008 GB: the sliding group takes what one sequence holds at
    most, its window and a prefill chunk of 512 (34 blocks) but no more than the model's 512
    positions (32 blocks), the full group the 16 blocks left, 256 tokens. A prompt plus
    max_tokens past them is refused up front; a shorter one runs."""
    model = save_tiny_with_tokenizer(tmp_path / "tiny")
    tiny = hearth.load(model, dtype="float32", device="cpu", progress=False)
    limits = ServerLimits(max_concurrent=2, kv_cache_memory_gb=0.0008)
    with TestClient(create_app(tiny, limits=limits)) as client:
        pool = client.get("/stats").json()["kv_pool"]
        longest = pool["max_context_tokens"]
        assert longest == 16 * DEFAULT_BLOCK_SIZE
        words = " ".join(f"t{4 + i}" for i in range(longest))
        body = {"model": "m", "prompt": words, "max_tokens": 8, "temperature": 0}
        refused = client.post("/v1/completions", json=body)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert "can never fit the K/V pool" in error["message"]
        assert (error["code"], error["param"]) == ("context_over_kv_pool", "max_tokens")
        body["prompt"] = " ".join(words.split()[: longest - 20])
        assert client.post("/v1/completions", json=body).status_code == 200
