"""Time to first token of a fresh prompt as the server runs it, before and after prefill graphs.

A prompt-cache miss used to prefill into new dynamic caches, which the graph decoder then
copied into its static ones (`adopt`); now it prefills straight into the reused decoder's
static caches, from a prefill graph once its bucket has been seen twice. Each request is a
new random prompt (no prompt-cache effects); a few warm-up requests per length come first.

    OUT=/tmp/out python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b

`--hits` times prompt-cache hits against fresh prompts; `--chat N` times each turn of an
N-turn conversation with graph decoders replaced at their request's size (as before) or grown.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton

from hearth.bench.random_model import PRESETS, build_random_model
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import Sampler, SamplingParams

WARM_UP = 3  # eager, capture, one replay: the graph path's steady state
TIMED = 7


def first_token_seconds(runner: ModelRunner, tokens: int, eager: bool, seed: int) -> float:
    """Seconds from a `tokens`-long random prompt to its first sampled token on the host."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, 1000, (tokens,), generator=generator).tolist()
    caches = runner.new_caches() if eager else None
    stats = GenerationStats()
    sampler = Sampler(SamplingParams(), device=runner.device)
    next(iter(generate_tokens(runner, prompt, sampler, 1, stats, caches=caches)))
    return stats.prefill_seconds


def hit_seconds(
    runner: ModelRunner, cached: int, new: int, seed: int, max_tokens: int = 1
) -> float:
    """Seconds to the first token of a prompt-cache hit: `cached` tokens already in eager
    caches (prefilled beforehand, as the server's entry holds them); then, by the runner's
    plan, either `new` prefilled eagerly and all copied into the graph decoder (`adopt`), or
    (`continuation_graphs`) the hit copied first and `new` prefilled after it from a
    continuation graph. No `cached` tokens: a fresh prompt (the miss path). `max_tokens`
    sizes the request (the decoder it needs), though only the first token is made."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, 1000, (cached + new,), generator=generator).tolist()
    caches = None
    if cached:
        caches = runner.new_caches()
        with torch.inference_mode():
            runner.prefill(torch.tensor([prompt[:cached]], device=runner.device), caches)
        torch.cuda.synchronize()
    stats = GenerationStats()
    sampler = Sampler(SamplingParams(), device=runner.device)
    run = generate_tokens(
        runner, prompt, sampler, max_tokens, stats, caches=caches, cached_tokens=cached
    )
    next(run)
    run.close()  # gives the decoder back, as a finished request does
    return stats.prefill_seconds


def per_model(names: list[str], quant: str, rows_of: Callable[[str, Any], list[str]]) -> list[str]:
    """`rows_of(name, model)` for each preset's random model, one on the GPU at a time (each
    row builds the runners of the plans it compares)."""
    rows = []
    for name in names:
        model = build_random_model(PRESETS[name], torch.device("cuda"), quant=quant)
        rows += rows_of(name, model)
        del model
        torch.cuda.empty_cache()
    return rows


def shown(row: str) -> str:
    print(row, flush=True)
    return row


def fresh_table(models: list[str], lengths: list[int], quant: str) -> list[str]:
    """A fresh prompt's first token, prefilled into eager caches then copied into the graph
    decoder's, or from a prefill graph into the reused decoder's pinned caches."""
    lines = [
        "",
        "*eager*: prefill into new eager caches, then copied into the graph decoder's; "
        "*graphs*: straight into the reused decoder's pinned caches, from a prefill graph.",
        "",
        "| model | prompt tokens | eager (ms) | graphs (ms) | speed-up |",
        "|---|---|---|---|---|",
    ]
    seeds = itertools.count(1)

    def rows(name: str, model) -> list[str]:
        found = []
        runner = ModelRunner(model)
        for tokens in lengths:
            medians = []
            for eager in (True, False):
                times = []
                for attempt in range(WARM_UP + TIMED):
                    seconds = first_token_seconds(runner, tokens, eager, next(seeds))
                    if attempt >= WARM_UP:
                        times.append(seconds)
                medians.append(statistics.median(times))
            before, after = medians
            found.append(
                shown(
                    f"| {name} | {tokens} | {before * 1e3:.1f} | {after * 1e3:.1f} | "
                    f"{before / after:.2f}x |"
                )
            )
        return found

    return lines + per_model(models, quant, rows)


# A conversation's turns: the first prompt, then each turn's reply and next user message.
CHAT_FIRST, CHAT_REPLY, CHAT_MESSAGE, CHAT_MAX_TOKENS = 200, 300, 60, 512


def chat_seconds(runner: ModelRunner, turns: int) -> list[float]:
    """First-token seconds of each turn of one conversation, as the server runs it: each turn
    after the first a hit of the previous prompt plus a reply and a message (one seed: the
    tokens do not change the timing), each request sized by the default max_tokens."""
    times, held = [], 0
    for turn in range(turns):
        new = CHAT_FIRST if turn == 0 else CHAT_REPLY + CHAT_MESSAGE
        times.append(hit_seconds(runner, held, new, 20_000, CHAT_MAX_TOKENS))
        held += new
    return times


def chat_table(models: list[str], turns: int, quant: str) -> list[str]:
    """Each turn's first token with decoders replaced at their request's size (the plan's
    `decoder_growth` 1) or grown (2, the default), after a warm-up conversation."""
    lines = [
        "",
        f"## A {turns}-turn conversation",
        "",
        f"First prompt {CHAT_FIRST} tokens; each later turn a prompt-cache hit of the previous "
        f"prompt plus {CHAT_REPLY} + {CHAT_MESSAGE} new tokens; max_tokens {CHAT_MAX_TOKENS} "
        "(the server's default). First token in ms per turn; a warm-up conversation first.",
        "",
        "| model | growth | " + " | ".join(f"turn {t + 1}" for t in range(turns)) + " | sum |",
        "|---|---|" + "---|" * (turns + 1),
    ]

    def rows(name: str, model) -> list[str]:
        found = []
        plan = ExecutionPlan.for_device(model.device)
        for timed, growth in ((False, 2), (True, 1), (True, 2)):
            runner = ModelRunner(model, replace(plan, decoder_growth=growth))
            times = chat_seconds(runner, turns)
            if timed:
                cells = " | ".join(f"{t * 1e3:.1f}" for t in times)
                found.append(shown(f"| {name} | {growth} | {cells} | {sum(times) * 1e3:.1f} |"))
        return found

    return lines + per_model(models, quant, rows)


def hits_table(models: list[str], pairs: list[tuple[int, int]], quant: str) -> list[str]:
    """A hit's first token against a fresh prefill of the whole prompt from a graph."""
    lines = [
        "",
        "## Prompt-cache hits against a fresh prefill of the same prompt",
        "",
        "*hit*: the cached tokens in dynamic caches, the new ones prefilled eagerly, then copied "
        "into the graph decoder (the server's hit path); *hit, graphs*: the hit copied first, "
        "the new tokens from a continuation graph (`CONTINUATION_GRAPHS`); *fresh*: the whole "
        "prompt from a prefill graph (the miss path).",
        "",
        "| model | cached + new tokens | hit (ms) | hit, graphs (ms) | fresh (ms) |",
        "|---|---|---|---|---|",
    ]
    seeds = itertools.count(10_000)

    def rows(name: str, model) -> list[str]:
        found = []
        continuing = ModelRunner(model)  # the device's plan: continuation graphs on
        plan = replace(continuing.plan, continuation_graphs=False)
        adopting = ModelRunner(model, plan)
        for cached, new in pairs:
            times: list[list[float]] = [[], [], []]
            for attempt in range(WARM_UP + TIMED):
                seed = next(seeds)
                runs = (
                    hit_seconds(adopting, cached, new, seed),
                    hit_seconds(continuing, cached, new, seed),
                    first_token_seconds(continuing, cached + new, False, seed),
                )
                if attempt >= WARM_UP:
                    for column, seconds in zip(times, runs, strict=True):
                        column.append(seconds)
            cells = " | ".join(f"{statistics.median(column) * 1e3:.1f}" for column in times)
            found.append(shown(f"| {name} | {cached} + {new} | {cells} |"))
        return found

    return lines + per_model(models, quant, rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="e4b,gemma3-12b")
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument(
        "--hits", default="", help="cached+new pairs (e.g. 1024+128,3968+128): hits vs fresh"
    )
    parser.add_argument("--chat", type=int, default=0, help="turns of a growing conversation")
    args = parser.parse_args()
    lines = [
        f"# Fresh-prompt time to first token, server path ({date.today()}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})",
        "",
        f"Random weights at real shapes, {args.quant}; medians of {TIMED} requests after "
        f"{WARM_UP} warm-ups, each a new random prompt, unless a table says otherwise.",
    ]
    models = args.models.split(",")
    lengths = [int(t) for t in args.lengths.split(",") if t]
    if lengths:
        lines += fresh_table(models, lengths, args.quant)
    if args.hits:
        pairs = [tuple(int(n) for n in pair.split("+")) for pair in args.hits.split(",")]
        lines += hits_table(models, pairs, args.quant)  # type: ignore[arg-type]
    if args.chat:
        lines += chat_table(models, args.chat, args.quant)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu_fresh_prompt_ttft-{date.today()}.md"
    path.write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    main()
