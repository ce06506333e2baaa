"""`hearth bench --concurrency`: throughput of c requests at once through the scheduler.

At each level c, c requests with prompts of random token ids start together, each makes
exactly `new_tokens` tokens (greedy, no end-of-sequence stop), and the scheduler runs them as
the server does: prompt chunks alternate with one decode step of every running request.
Reported per level: the aggregate rate (all tokens made over the whole run, prefills
included, the one-off captures of CUDA graphs left out), the decode rate of all c streams
together over the steps where all c decode (tokens over those steps' time: what
llama-batched-bench reports as S_TG), each stream's own decode rate, time to first token (p50,
p99; captures included), and the decode roofline at batch c: one step reads the weights once
plus each stream's K/V, at the copy bandwidth, so c streams can make at most c / (that time)
tokens a second.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hearth.bench.measure import decode_bytes, kv_bytes
from hearth.config import ModelConfig
from hearth.runtime.generate import GenerationChunk, GenerationRequest
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from hearth.runtime.scheduler import Scheduler
from hearth.tokenizer import Tokenizer


@dataclass(frozen=True)
class ConcurrencyRow:
    streams: int
    aggregate: float  # tokens/s over the whole run, all streams together
    decode: float  # tokens/s of the decode steps where all the streams decode together
    per_stream: float  # mean of each stream's own decode tokens/s
    ttft_p50: float  # seconds from the start to a stream's first token
    ttft_p99: float
    roofline: float  # aggregate decode tokens/s at the copy bandwidth


@dataclass
class ConcurrencyReport:
    model: str
    date: str
    device: str
    settings: str
    rows: list[ConcurrencyRow] = field(default_factory=list)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value with `fraction` of them at or below."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (count, length), generator=generator)
    return ids.tolist()


@dataclass
class LevelRun:
    """One level's run: the wall time, each stream's time to first token and decode rate,
    the decode rate of the steps where all of them decode together, and what explains a
    level where they never did (the most rows a step had, preemptions, the pool)."""

    seconds: float
    first_tokens: list[float]
    rates: list[float]
    together: float
    most_rows: int
    preemptions: int
    pool: str


def run_level(
    runner: ModelRunner, tokenizer: Tokenizer, prompts: list[list[int]], new_tokens: int
) -> LevelRun:
    """Run `prompts` together (see `LevelRun`)."""
    scheduler = Scheduler(runner, tokenizer, max_running=len(prompts))
    scheduler.decode_log = []
    captured = runner.capture_seconds
    first_token: dict[int, float] = {}
    rates: list[float] = []
    started = time.perf_counter()

    def deliver_to(index: int) -> Callable[[GenerationChunk | BaseException], None]:
        def deliver(chunk: GenerationChunk | BaseException) -> None:
            if isinstance(chunk, BaseException):
                raise chunk
            first_token.setdefault(index, time.perf_counter() - started)
            if chunk.stats is not None:
                rates.append(chunk.stats.decode_tokens_per_second)

        return deliver

    greedy = SamplingParams(temperature=0.0)
    for index, ids in enumerate(prompts):
        request = GenerationRequest(ids, new_tokens, greedy, stop_ids=())
        scheduler.submit(request, deliver_to(index), lambda: False)
    while not scheduler.idle:
        scheduler.step()
    seconds = time.perf_counter() - started - (runner.capture_seconds - captured)
    full = [(rows, spent) for rows, spent in scheduler.decode_log if rows == len(prompts)]
    together = sum(r for r, _ in full) / sum(t for _, t in full) if full else 0.0
    most = max((rows for rows, _ in scheduler.decode_log), default=0)
    return LevelRun(
        seconds, list(first_token.values()), rates, together, most, scheduler.preemptions,
        scheduler.pool.describe(),
    )  # fmt: skip


def _release_pools(runner: ModelRunner) -> None:
    """Free the last run's pool (held in reference cycles) before the next one is sized from
    the free memory: else it gets half of what that pool left."""
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()


def measure_concurrency(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    config: ModelConfig,
    levels: Sequence[int],
    prompt_tokens: int,
    new_tokens: int,
    bandwidth: float,
    progress: Callable[[str], None],
) -> list[ConcurrencyRow]:
    element = torch.empty((), dtype=runner.model.compute_dtype).element_size()
    # A stream's K/V read per step, at its mean context over the decode.
    kv_per_stream = kv_bytes(config, prompt_tokens + new_tokens // 2, element, runner.kv_policy)
    # Warm-up: first-call costs (native kernels, allocator, compiles) stay out of the table.
    run_level(runner, tokenizer, random_prompts(config.vocab_size, 2, prompt_tokens, seed=1), 4)
    rows = []
    for streams in levels:
        _release_pools(runner)
        # Warm-up at this level's rows and prompt length: kernels compiled (and autotuned) for
        # its decode batch and its ragged prefill's shapes (the MoE experts' token counts)
        # stay out of the table.
        warm_up = random_prompts(config.vocab_size, streams, prompt_tokens, seed=1)
        run_level(runner, tokenizer, warm_up, 4)
        _release_pools(runner)
        prompts = random_prompts(config.vocab_size, streams, prompt_tokens)
        run = run_level(runner, tokenizer, prompts, new_tokens)
        step_seconds = (decode_bytes(runner.model, streams) + streams * kv_per_stream) / bandwidth
        row = ConcurrencyRow(
            streams=streams,
            aggregate=streams * new_tokens / run.seconds,
            decode=run.together,
            per_stream=statistics.mean(run.rates),
            ttft_p50=percentile(run.first_tokens, 0.5),
            ttft_p99=percentile(run.first_tokens, 0.99),
            roofline=streams / step_seconds,
        )
        rows.append(row)
        progress(
            f"bench: {streams} streams: {row.aggregate:,.1f} tok/s together "
            f"({row.decode:,.1f} in decode steps of all {streams}), "
            f"{row.per_stream:,.1f} per stream, first token p50 {row.ttft_p50 * 1e3:,.0f} ms; "
            f"at most {run.most_rows} rows a step, {run.preemptions} preemptions, pool of "
            f"{run.pool}"
        )
    return rows


def render_concurrency(report: ConcurrencyReport) -> str:
    lines = [
        f"# {report.model}",
        "",
        f"{report.date}, {report.device}. {report.settings}",
        "",
        "| streams | aggregate tok/s | x 1 stream | decode tok/s, all streams | "
        "per-stream decode tok/s | first token p50 / p99 ms | roofline tok/s | "
        "decode of roofline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    single = next((row.aggregate for row in report.rows if row.streams == 1), None)
    for row in report.rows:
        gain = f"{row.aggregate / single:.2f}x" if single else "-"
        lines.append(
            f"| {row.streams} | {row.aggregate:,.1f} | {gain} | {row.decode:,.1f} | "
            f"{row.per_stream:,.1f} | "
            f"{row.ttft_p50 * 1e3:,.0f} / {row.ttft_p99 * 1e3:,.0f} | {row.roofline:,.0f} | "
            f"{row.decode / row.roofline:.0%} |"
        )
    return "\n".join(lines) + "\n"
