"""GET /stats (JSON) and GET /metrics (Prometheus text): what the server has done and holds."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from hearth.server.state import ServerState, state_of
from hearth.server.worker import GenerationWorker

router = APIRouter()

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    return server_stats(state_of(request))


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    text = prometheus_text(server_stats(state_of(request)))
    return PlainTextResponse(text, media_type=PROMETHEUS_CONTENT_TYPE)


def server_stats(state: ServerState) -> dict[str, Any]:
    worker = state.worker
    counters = worker.counters
    budget = state.memory_budget
    return {
        "model": state.model_id,
        "requests": counters.requests,
        "prompt_tokens": counters.prompt_tokens,
        "cached_tokens": counters.cached_tokens,
        "generated_tokens": counters.generated_tokens,
        "cancelled": counters.cancelled,
        "queue_depth": worker.queue_depth,
        "running": counters.running,
        "max_concurrent": worker.max_concurrent,
        "prompt_cache": _prompt_cache_stats(worker),
        "kv_pool": _pool_stats(worker),
        "admission": {
            "budget_bytes": budget.budget_bytes if budget else None,
            "weight_bytes": budget.weight_bytes if budget else None,
            "max_context_tokens": budget.kv_token_capacity() if budget else None,
        },
        "plan": asdict(state.engine.plan),
    }


def _prompt_cache_stats(worker: GenerationWorker) -> dict[str, Any]:
    """The prompt cache in use: the scheduler's block prefix cache (entries are blocks), or
    the one-at-a-time path's snapshots (entries are prompts)."""
    scheduler = worker.scheduler
    if scheduler is not None:
        pool = scheduler.pool
        return {
            "enabled": scheduler.prefix_cache,
            "kind": "blocks",
            "entries": pool.cached_blocks,
            "bytes": pool.cached_bytes,
            "max_bytes": pool.nbytes,
            "max_entries": pool.total_blocks,
            "hits": scheduler.prefix_hits,
            "misses": scheduler.prefix_misses,
        }
    cache = worker.prompt_cache
    return {
        "enabled": cache is not None,
        "kind": "snapshots",
        "entries": cache.entries if cache else 0,
        "bytes": cache.nbytes if cache else 0,
        "max_bytes": cache.max_bytes if cache else 0,
        "max_entries": cache.max_entries if cache else 0,
        "hits": cache.hits if cache else 0,
        "misses": cache.misses if cache else 0,
    }


def _pool_stats(worker: GenerationWorker) -> dict[str, Any]:
    """The paged K/V pool of the batching scheduler (zeros on the one-at-a-time path)."""
    scheduler = worker.scheduler
    if scheduler is None:
        return {
            "enabled": False,
            "block_size": 0,
            "blocks_total": 0,
            "blocks_used": 0,
            "blocks_cached": 0,
            "bytes": 0,
            "max_context_tokens": 0,
            "preemptions": 0,
            "prefix_hit_tokens": 0,
        }
    pool = scheduler.pool
    return {
        "enabled": True,
        "block_size": pool.block_size,
        "blocks_total": pool.total_blocks,
        "blocks_used": pool.used_blocks,
        "blocks_cached": pool.cached_blocks,
        "bytes": pool.nbytes,
        "max_context_tokens": scheduler.max_context,
        "preemptions": scheduler.preemptions,
        "prefix_hit_tokens": pool.hit_tokens,
    }


# (name, type, help, where in the /stats object): what /metrics exports.
_METRICS = (
    ("hearth_requests_total", "counter", "Generations finished.", ("requests",)),
    (
        "hearth_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished generations.",
        ("prompt_tokens",),
    ),
    (
        "hearth_cached_prompt_tokens_total",
        "counter",
        "Prompt tokens reused from the prompt cache instead of prefilled.",
        ("cached_tokens",),
    ),
    ("hearth_generated_tokens_total", "counter", "Tokens generated.", ("generated_tokens",)),
    (
        "hearth_cancelled_total",
        "counter",
        "Requests that ended before their generation did (client gone, or shutdown).",
        ("cancelled",),
    ),
    ("hearth_queue_depth", "gauge", "Requests waiting or running.", ("queue_depth",)),
    ("hearth_running", "gauge", "Requests admitted: prefilling or decoding.", ("running",)),
    (
        "hearth_kv_pool_blocks_used",
        "gauge",
        "Blocks of the paged K/V pool held by requests (every layer group).",
        ("kv_pool", "blocks_used"),
    ),
    (
        "hearth_kv_pool_blocks_total",
        "gauge",
        "Blocks in the paged K/V pool (every layer group).",
        ("kv_pool", "blocks_total"),
    ),
    (
        "hearth_kv_pool_blocks_cached",
        "gauge",
        "Pool blocks named in the prefix cache (held or free to evict).",
        ("kv_pool", "blocks_cached"),
    ),
    (
        "hearth_preemptions_total",
        "counter",
        "Requests preempted (K/V freed, recomputed later) because the pool ran out.",
        ("kv_pool", "preemptions"),
    ),
    (
        "hearth_prefix_hit_tokens_total",
        "counter",
        "Tokens whose K/V came from cached blocks instead of being computed.",
        ("kv_pool", "prefix_hit_tokens"),
    ),
    (
        "hearth_prompt_cache_hits_total",
        "counter",
        "Requests that reused a cached prefix.",
        ("prompt_cache", "hits"),
    ),
    (
        "hearth_prompt_cache_misses_total",
        "counter",
        "Requests that found no cached prefix.",
        ("prompt_cache", "misses"),
    ),
    (
        "hearth_prompt_cache_entries",
        "gauge",
        "Entries in the prompt cache.",
        ("prompt_cache", "entries"),
    ),
    (
        "hearth_prompt_cache_bytes",
        "gauge",
        "KV bytes held by the prompt cache.",
        ("prompt_cache", "bytes"),
    ),
)


def prometheus_text(stats: dict[str, Any]) -> str:
    lines = []
    for name, kind, description, path in _METRICS:
        value: Any = stats
        for key in path:
            value = value[key]
        lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}", f"{name} {value}"]
    return "\n".join(lines) + "\n"
