"""Throughput under concurrency: c requests at once through the Scheduler (continuous
batching) against the same c requests one after another (Hearth's batch-1 path, what the
server did before it batched), on one model and device.

Each request has its own prompt of `--prompt-tokens` tokens and makes exactly `--max-tokens`
tokens (no end-of-sequence stop), greedy. Reported per concurrency level: aggregate tokens/s
over the whole run (prefills included), the mean time to first token, and each request's own
decode rate. The roofline column is the bandwidth bound of a decode step that reads the
weights once for all c rows: c x (copy bandwidth / weight bytes), K/V reads left out.

    python benchmarks/concurrency.py --levels 1,2,4,8 --out benchmarks/results/x.md
    python benchmarks/concurrency.py --model /models/gemma-3-12b-it --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from hearth import Engine
from hearth.bench.measure import copy_bandwidth
from hearth.runtime.generate import GenerationChunk, GenerationRequest
from hearth.runtime.sampling import SamplingParams


def prompts(engine: Engine, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of `length` tokens each (text repeated, a number in front)."""
    out = []
    for index in range(count):
        text = f"Request {index}: " + "the quick brown fox jumps over the lazy dog. " * length
        ids = engine.tokenizer.encode(text)[:length]
        out.append(ids)
    return out


def request(ids: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(ids, max_tokens, SamplingParams(temperature=0.0), stop_ids=())


def run_sequential(engine: Engine, batch: list[list[int]], max_tokens: int) -> dict[str, float]:
    started = time.perf_counter()
    first_tokens, decode_rates, generated = [], [], 0
    for ids in batch:
        begun = time.perf_counter()
        last = None
        for chunk in engine.run(request(ids, max_tokens)):
            last = chunk
        assert last is not None and last.stats is not None
        stats = last.stats
        first_tokens.append(time.perf_counter() - begun - stats.decode_seconds)
        decode_rates.append(stats.decode_tokens_per_second)
        generated += stats.generated_tokens
    return summary(time.perf_counter() - started, generated, first_tokens, decode_rates)


def run_batched(engine: Engine, batch: list[list[int]], max_tokens: int) -> dict[str, float]:
    scheduler = engine.scheduler(max_running=len(batch))
    finals: list[GenerationChunk] = []
    first_at: dict[int, float] = {}
    started = time.perf_counter()

    def deliver_to(index: int):
        def deliver(chunk: GenerationChunk | BaseException) -> None:
            if isinstance(chunk, BaseException):
                raise chunk
            first_at.setdefault(index, time.perf_counter() - started)
            if chunk.stats is not None:
                finals.append(chunk)

        return deliver

    for index, ids in enumerate(batch):
        scheduler.submit(request(ids, max_tokens), deliver_to(index), lambda: False)
    while not scheduler.idle:
        scheduler.step()
    elapsed = time.perf_counter() - started
    stats = [chunk.stats for chunk in finals if chunk.stats is not None]
    generated = sum(s.generated_tokens for s in stats)
    rates = [s.decode_tokens_per_second for s in stats]
    return summary(elapsed, generated, list(first_at.values()), rates)


def summary(
    elapsed: float, generated: int, first_tokens: list[float], decode_rates: list[float]
) -> dict[str, float]:
    return {
        "aggregate": generated / elapsed,
        "ttft": statistics.mean(first_tokens),
        "per_request": statistics.mean(decode_rates),
        "seconds": elapsed,
    }


def weight_bytes(engine: Engine) -> int:
    model = engine.runner.model
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="GGUF file or HF directory (default: the embedded 270M)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--levels", default="1,2,4,8")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()

    engine = Engine.load(args.model, device=args.device, quantize=args.quantize, progress=False)
    device = engine.runner.device
    bandwidth = copy_bandwidth(device)
    weights = weight_bytes(engine)
    levels = [int(level) for level in args.levels.split(",")]
    # One short warm-up of each path (native kernels, allocator, first-call compiles).
    warm = prompts(engine, 2, 16)
    run_sequential(engine, warm[:1], 4)
    run_batched(engine, warm, 4)

    rows = []
    for level in levels:
        batch = prompts(engine, level, args.prompt_tokens)
        alone = run_sequential(engine, batch, args.max_tokens)
        together = run_batched(engine, batch, args.max_tokens)
        roofline = level * bandwidth / weights
        rows.append(
            f"| {level} | {alone['aggregate']:.1f} | {together['aggregate']:.1f} | "
            f"{together['aggregate'] / alone['aggregate']:.2f}x | {roofline:.0f} | "
            f"{alone['ttft'] * 1e3:.0f} / {together['ttft'] * 1e3:.0f} | "
            f"{alone['per_request']:.1f} / {together['per_request']:.1f} |"
        )
        print(rows[-1], flush=True)

    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = (
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        )
    lines = [
        f"# Throughput under concurrency, {datetime.date.today()}",
        "",
        f"Model: {args.model or 'embedded Gemma 3 270M Q4_K_M'} ({args.quantize}), "
        f"device {device} ({hardware}), torch {torch.__version__}. "
        f"Prompts of {args.prompt_tokens} tokens, {args.max_tokens} tokens made each, greedy. "
        f"Weights {weights / 1e9:.2f} GB; copy bandwidth {bandwidth / 1e9:.0f} GB/s.",
        "",
        "One after another: Hearth's batch-1 path (`Engine.run`), the c requests in turn. "
        "Together: the Scheduler, all c admitted at once. Aggregate tokens/s over the "
        "whole run, prefills included; roofline: c x bandwidth / weight bytes.",
        "",
        "| c | one after another tok/s | together tok/s | speed-up | roofline tok/s | "
        "TTFT ms (after / together) | per-request decode tok/s (after / together) |",
        "|---|---|---|---|---|---|---|",
        *rows,
    ]
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
