"""CPU decode steps on GGUF blocks as stored (the fp32 default), interleaved in one process so
that a shared machine's drift hits every variant alike: per round, one step of each variant;
medians over the rounds.

Variants: the module path (`native_layers` off), the native layer step (one call per layer),
and llama.cpp's own decode of one token on the same file (llama-cpp-python, `Llama.eval`), at
batch 1; then B sequences: B native batch-1 steps, one native B-row step (`decode_batch`), and
the module path's B-row step.

    python benchmarks/lab/cpu_blocks_step.py --threads 2 --batch 8 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from hearth import Engine
from hearth.bench.llama_peer import open_llama
from hearth.embedded import embedded_model_path
from hearth.runtime.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--no-llama", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, device="cpu", progress=False)
    native = engine.runner
    modules = ModelRunner(native.model, replace(native.plan, native_layers=False))
    llama = None
    if not args.no_llama:
        llama = open_llama(
            args.model or embedded_model_path(),
            n_ctx=4096,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
        )
        llama.eval(list(range(10, 10 + args.context)))
    batch = args.batch
    prompt = torch.arange(10, 10 + args.context).reshape(1, -1)
    times: dict[str, list[float]] = {}

    def timed(name: str, step: Callable[..., object], *args: object) -> None:
        started = time.perf_counter()
        step(*args)
        times.setdefault(name, []).append(time.perf_counter() - started)

    with torch.inference_mode():
        one = {runner: runner.new_caches() for runner in (native, modules)}
        many = {runner: [runner.new_caches() for _ in range(batch)] for runner in (native, modules)}
        for runner in (native, modules):
            runner.prefill(prompt, one[runner])
            for caches in many[runner]:
                runner.prefill(prompt, caches)
        lone = [native.new_caches() for _ in range(batch)]
        for caches in lone:
            native.prefill(prompt, caches)
        position = args.context
        for _ in range(args.rounds):
            timed("1 row: modules", modules.decode, 7, one[modules], position)
            timed("1 row: native layer step", native.decode, 7, one[native], position)
            if llama is not None:
                timed("1 row: llama.cpp eval", llama.eval, [7])
            tokens, positions = [7] * batch, [position] * batch
            timed(f"{batch} rows: {batch} native 1-row steps", each_alone, native, lone, position)
            timed(
                f"{batch} rows: one native {batch}-row step",
                native.decode_batch, tokens, many[native], positions,
            )  # fmt: skip
            timed(
                f"{batch} rows: one module {batch}-row step",
                modules.decode_batch, tokens, many[modules], positions,
            )  # fmt: skip
            position += 1
    print(f"threads {args.threads}, context {args.context}, {args.rounds} rounds (medians)")
    print("| variant | ms per step | tok/s |")
    print("|---|---:|---:|")
    for name, samples in times.items():
        median = statistics.median(samples)
        rows = batch if name.startswith(f"{batch} rows") else 1
        print(f"| {name} | {median * 1e3:.1f} | {rows / median:.1f} |")


def each_alone(runner: ModelRunner, caches: list, position: int) -> None:
    for own in caches:
        runner.decode(7, own, position)


if __name__ == "__main__":
    main()
