"""Time to first token of a fresh prompt as the server runs it, before and after prefill graphs.

A prompt-cache miss used to prefill into new dynamic caches, which the graph decoder then
copied into its static ones (`adopt`); now it prefills straight into the reused decoder's
static caches, from a prefill graph once its bucket has been seen twice. Each request is a
new random prompt (no prompt-cache effects); a few warm-up requests per length come first.

    OUT=/tmp/out python benchmarks/gpu_fresh_prompt_ttft.py --models e4b,gemma3-12b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import date
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton

from hearth import cuda_graph
from hearth.bench.random_model import PRESETS, build_random_model
from hearth.generate import GenerationStats, generate_tokens
from hearth.kv import KVPolicy
from hearth.sampling import Sampler, SamplingParams

WARM_UP = 3  # eager, capture, one replay: the graph path's steady state
TIMED = 7


def first_token_seconds(model, tokens: int, dynamic: bool, seed: int) -> float:
    """Seconds from a `tokens`-long random prompt to its first sampled token on the host."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, 1000, (tokens,), generator=generator).tolist()
    caches = KVPolicy().make_caches(model.config) if dynamic else None
    stats = GenerationStats()
    sampler = Sampler(SamplingParams(), device=model.device)
    next(iter(generate_tokens(model, prompt, sampler, 1, stats, caches=caches)))
    return stats.prefill_seconds


def hit_seconds(model, cached: int, new: int, seed: int, continued: bool) -> float:
    """Seconds to the first token of a prompt-cache hit: `cached` tokens already in dynamic
    caches (prefilled beforehand, as the server's entry holds them); then either `new`
    prefilled eagerly and all copied into the graph decoder (`adopt`), or (`continued`) the
    hit copied first and `new` prefilled after it from a continuation graph."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(4, 1000, (cached + new,), generator=generator).tolist()
    caches = KVPolicy().make_caches(model.config)
    with torch.inference_mode():
        ids = torch.tensor([prompt[:cached]], device=model.device)
        model(ids, caches, last_only=True)
    torch.cuda.synchronize()
    stats = GenerationStats()
    sampler = Sampler(SamplingParams(), device=model.device)
    with mock.patch.object(cuda_graph, "CONTINUATION_GRAPHS", continued):
        run = generate_tokens(model, prompt, sampler, 1, stats, caches=caches, cached_tokens=cached)
        next(iter(run))
    return stats.prefill_seconds


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
    seed = 10_000
    for name in models:
        model = build_random_model(PRESETS[name], torch.device("cuda"), quant=quant)
        for cached, new in pairs:
            times: list[list[float]] = [[], [], []]
            for attempt in range(WARM_UP + TIMED):
                seed += 1
                runs = (
                    hit_seconds(model, cached, new, seed, continued=False),
                    hit_seconds(model, cached, new, seed, continued=True),
                    first_token_seconds(model, cached + new, False, seed),
                )
                if attempt >= WARM_UP:
                    for column, seconds in zip(times, runs, strict=True):
                        column.append(seconds)
            cells = " | ".join(f"{statistics.median(column) * 1e3:.1f}" for column in times)
            lines.append(f"| {name} | {cached} + {new} | {cells} |")
            print(lines[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="e4b,gemma3-12b")
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument(
        "--hits", default="", help="cached+new pairs (e.g. 1024+128,3968+128): hits vs fresh"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    lines = [
        f"# Fresh-prompt time to first token, server path ({date.today()}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})",
        "",
        f"Random weights at real shapes, {args.quant}; median of {TIMED} requests after "
        f"{WARM_UP} warm-ups, each a new random prompt. *dynamic*: prefill into new dynamic "
        "caches, then copied into the graph decoder's (the server before); *graphs*: straight "
        "into the reused decoder's static caches, from a prefill graph.",
        "",
        "| model | prompt tokens | dynamic (ms) | graphs (ms) | speed-up |",
        "|---|---|---|---|---|",
    ]
    seed = 0
    for name in args.models.split(","):
        model = build_random_model(PRESETS[name], device, quant=args.quant)
        for tokens in (int(t) for t in args.lengths.split(",")):
            medians = []
            for dynamic in (True, False):
                times = []
                for attempt in range(WARM_UP + TIMED):
                    seed += 1
                    seconds = first_token_seconds(model, tokens, dynamic, seed)
                    if attempt >= WARM_UP:
                        times.append(seconds)
                medians.append(statistics.median(times))
            before, after = medians
            lines.append(
                f"| {name} | {tokens} | {before * 1e3:.1f} | {after * 1e3:.1f} | "
                f"{before / after:.2f}x |"
            )
            print(lines[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    if args.hits:
        pairs = [tuple(int(n) for n in pair.split("+")) for pair in args.hits.split(",")]
        lines += hits_table(args.models.split(","), pairs, args.quant)  # type: ignore[arg-type]
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu_fresh_prompt_ttft-{date.today()}.md"
    path.write_text("\n".join(lines) + "\n")
    print(path)


if __name__ == "__main__":
    main()
