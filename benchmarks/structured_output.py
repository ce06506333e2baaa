"""Structured output's cost: the per-token overhead of grammar-constrained decoding against
unconstrained decoding on the same prompt, and the grammar compile time of each of the 20 test
schemas (tests/data/structured_output_schemas.json).

Overhead: the same prompt decoded `--tokens` tokens with no end-of-sequence stop, free and
under a grammar that cannot end before then (a JSON object with one long string), runs
interleaved (free, constrained, free, ...) so a busy machine slows both alike; the median of
each side's decode rate, and the overhead as the median over the pairs of free rate /
constrained rate. The per-step parts of the constraint are timed on their own too:
xgrammar filling the token bitmask, and the mask applied to the logits.

    python benchmarks/structured_output.py --out benchmarks/results/structured_output-DATE.md
    python benchmarks/structured_output.py --random gemma3-12b --device cuda  # graphs, bf16
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from hearth import Engine
from hearth.runtime.constraints import (
    OutputConstraint,
    apply_bitmask,
    compile_constraint,
    matcher_for,
)
from hearth.runtime.generate import GenerationRequest

SCHEMAS = Path(__file__).resolve().parents[1] / "tests" / "data" / "structured_output_schemas.json"
PROMPT = "Here is the record as JSON:"


def decode_rate(
    engine: Engine, constraint: OutputConstraint | None, tokens: int
) -> tuple[float, float]:
    """One run of exactly `tokens` tokens (no end-of-sequence stop): its decode tokens/s, and
    the process's CPU milliseconds per token (the short prompt's prefill included), which
    other processes on a shared machine disturb far less than the wall clock."""
    ids = engine.tokenizer.encode(PROMPT)
    request = GenerationRequest(ids, tokens, stop_ids=(), constraint=constraint)
    cpu_started = time.process_time()
    chunks = list(engine.run(request))
    cpu_ms = (time.process_time() - cpu_started) / tokens * 1e3
    stats = chunks[-1].stats
    assert stats is not None and stats.generated_tokens == tokens, "the run ended early"
    return stats.decode_tokens_per_second, cpu_ms


def overhead(engine: Engine, tokens: int, repeats: int) -> dict[str, Any]:
    # One string longer than the run: the grammar never lets it end before `tokens`.
    long_string = {"type": "string", "minLength": 8 * tokens, "maxLength": 16 * tokens}
    schema = {"type": "object", "properties": {"text": long_string}, "required": ["text"]}
    constraint = OutputConstraint.json_schema(schema)
    decode_rate(engine, constraint, 4)  # compiled and warm before timing
    runs = [
        (decode_rate(engine, None, tokens), decode_rate(engine, constraint, tokens))
        for _ in range(repeats)
    ]
    # Each pair ran back to back: the median of their ratios shrugs off a pair another
    # process slowed, which the ratio of the two medians would not.
    return {
        "free": statistics.median(free for (free, _), _ in runs),
        "constrained": statistics.median(rate for _, (rate, _) in runs),
        "overhead": statistics.median(free / rate for (free, _), (rate, _) in runs) - 1,
        "free_cpu": statistics.median(cpu for (_, cpu), _ in runs),
        "constrained_cpu": statistics.median(cpu for _, (_, cpu) in runs),
        "cpu_overhead": statistics.median(b / a for (_, a), (_, b) in runs) - 1,
        "runs": runs,
        **step_parts(engine, constraint),
    }


def step_parts(engine: Engine, constraint: OutputConstraint, steps: int = 200) -> dict[str, float]:
    """Milliseconds per step of xgrammar's bitmask fill and of the mask's application."""
    vocab = engine.model.config.vocab_size
    matcher = matcher_for(constraint, engine.tokenizer, vocab, engine.tokenizer.eos_ids)
    device = engine.model.device
    logits = torch.randn(1, vocab, device=device)
    allowed_text = engine.tokenizer.encode('{"text": "', add_special_tokens=False)
    for token in allowed_text:
        matcher.advance(token)
    fill = apply = 0.0
    for _ in range(steps):
        started = time.perf_counter()
        bitmask = matcher.fill_bitmask()
        filled = time.perf_counter()
        apply_bitmask(logits, bitmask)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        apply += time.perf_counter() - filled
        fill += filled - started
    return {"fill_ms": fill / steps * 1e3, "apply_ms": apply / steps * 1e3}


def compile_times(engine: Engine) -> list[tuple[int, float, int]]:
    """(schema index, compile seconds, schema bytes) for each test schema, each compiled
    fresh (the per-tokenizer setup already done)."""
    vocab = engine.model.config.vocab_size
    compile_constraint(OutputConstraint.any_json(), engine.tokenizer, vocab)  # the setup
    rows = []
    for index, schema in enumerate(json.loads(SCHEMAS.read_text())):
        constraint = OutputConstraint.json_schema(schema)
        started = time.perf_counter()
        compile_constraint(constraint, engine.tokenizer, vocab)
        rows.append((index, time.perf_counter() - started, len(json.dumps(schema))))
    return rows


def setup_seconds(engine: Engine) -> float:
    compile_constraint.cache_clear()
    from hearth.runtime import constraints

    constraints._compiler.cache_clear()
    started = time.perf_counter()
    compile_constraint(
        OutputConstraint.regex("a"), engine.tokenizer, engine.model.config.vocab_size
    )
    return time.perf_counter() - started


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")]
    return names[0] if names else platform.processor()


def report(args: argparse.Namespace, engine: Engine) -> str:
    setup = setup_seconds(engine)
    parts = overhead(engine, args.tokens, args.repeats)
    compiled = compile_times(engine)
    lines = [
        f"# Structured output cost, {datetime.date.today()}",
        "",
        f"Hardware: {cpu_name()}, {torch.get_num_threads()} torch threads"
        + (f", {torch.cuda.get_device_name()}" if engine.model.device.type == "cuda" else "")
        + "; "
        f"model: {engine.path.name} ({engine.model.compute_dtype}), device {engine.model.device}.",
        "Command: `python benchmarks/structured_output.py "
        + (f"--random {args.random} --device {args.device} " if args.random else "")
        + f"--tokens {args.tokens} "
        f"--repeats {args.repeats}" + (f" --threads {args.threads}`" if args.threads else "`"),
        "",
        "## Per-token overhead (batch 1)",
        "",
        f"{args.tokens} tokens per run, median of {args.repeats} interleaved runs each; the "
        "overhead is the median of the pairs' ratios (runs in "
        f"[the raw log](#raw-runs) below).",
        "",
        "| decoding | decode tok/s (wall) | overhead | CPU ms / token | overhead |",
        "|---|---|---|---|---|",
        f"| free | {parts['free']:.1f} | | {parts['free_cpu']:.2f} | |",
        f"| JSON schema | {parts['constrained']:.1f} | {parts['overhead']:+.1%} | "
        f"{parts['constrained_cpu']:.2f} | {parts['cpu_overhead']:+.1%} |",
        "",
        f"Per step: xgrammar bitmask fill {parts['fill_ms']:.3f} ms, mask applied to the "
        f"logits {parts['apply_ms']:.3f} ms.",
        "",
        "## Grammar compile time per schema",
        "",
        f"The tokenizer's one-off setup (vocabulary to xgrammar): {setup:.2f} s. Then each of "
        "tests/data/structured_output_schemas.json compiled fresh:",
        "",
        "| schema | bytes | compile ms |",
        "|---|---|---|",
        *(f"| {index} | {size} | {seconds * 1e3:.1f} |" for index, seconds, size in compiled),
        "",
        f"Median {statistics.median(s for _, s, _ in compiled) * 1e3:.1f} ms, "
        f"max {max(s for _, s, _ in compiled) * 1e3:.1f} ms.",
        "",
        "## Raw runs",
        "",
        "| pair | free tok/s | constrained tok/s | free CPU ms/token | constrained CPU ms/token |",
        "|---|---|---|---|---|",
        *(
            f"| {i} | {a:.1f} | {b:.1f} | {a_cpu:.2f} | {b_cpu:.2f} |"
            for i, ((a, a_cpu), (b, b_cpu)) in enumerate(parts["runs"])
        ),
    ]
    return "\n".join(lines) + "\n"


def random_engine(preset: str, device: str) -> Engine:
    """An engine over random weights at `preset`'s shapes, with the embedded model's tokenizer
    (as `hearth bench --random` reads text)."""
    from hearth.bench.random_model import build_random_model, resolve_config
    from hearth.checkpoint import open_checkpoint
    from hearth.embedded import embedded_model_path
    from hearth.runtime.runner import ModelRunner

    model = build_random_model(resolve_config(preset), torch.device(device), "bf16")
    tokenizer = open_checkpoint(embedded_model_path()).tokenizer()
    return Engine(model, tokenizer, Path(preset), ModelRunner(model), "random")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file or HF directory (default: the embedded 270M)")
    parser.add_argument(
        "--random", help="random weights at a preset's shapes (e.g. gemma3-12b), bf16, instead"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each kind")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = random_engine(args.random, args.device) if args.random else None
    engine = engine or Engine.load(args.model, device=args.device, progress=False)
    text = report(args, engine)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
