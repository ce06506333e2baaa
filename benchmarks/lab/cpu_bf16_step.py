"""CPU decode steps on GGUF blocks as stored with the fp32 block GEMV against the AVX512-BF16
one (`ExecutionPlan.gguf_bf16_gemv_types`: activations rounded to bf16, weights exact), and
llama.cpp's own step on the same file, interleaved in one process (one step of each per
round) so that a shared machine's drift hits them alike; medians over the rounds.

One load of the model serves both plans: each runner builds its native layers' operands from
its own plan's types, and the GGUF layers the modules run (the head) are switched to that
plan's types before its step.

    python benchmarks/lab/cpu_bf16_step.py --model /tmp/e2b-q4km.gguf --threads 2 --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from hearth import Engine
from hearth.bench.llama_peer import open_llama
from hearth.embedded import embedded_model_path
from hearth.layers.gguf import GGUFLinear
from hearth.ops.native import kernels
from hearth.ops.plan import BF16_GEMV_TYPES
from hearth.runtime.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--types", type=int, nargs="*", help=f"GGML ids in bf16 (default {BF16_GEMV_TYPES})"
    )
    parser.add_argument("--no-llama", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    built = kernels()
    if built is None or not built.bf16_gemv_types:
        raise SystemExit("no native kernels with the bf16 GEMV here (it needs AVX512-BF16)")
    types = tuple(args.types or BF16_GEMV_TYPES)
    model_path = args.model or embedded_model_path()
    engine = Engine.load(model_path, device="cpu", progress=False)
    fp32_plan = replace(engine.runner.plan, gguf_bf16_gemv_types=())
    plans = {
        "fp32 GEMV": fp32_plan,
        f"bf16 GEMV {types}": replace(fp32_plan, gguf_bf16_gemv_types=types),
    }
    layers = [m for m in engine.model.modules() if isinstance(m, GGUFLinear)]
    runners = {name: ModelRunner(engine.model, plan) for name, plan in plans.items()}
    llama = None
    if not args.no_llama:
        llama = open_llama(
            model_path, n_ctx=4096, n_threads=args.threads, n_threads_batch=args.threads,
            verbose=False,
        )  # fmt: skip
        llama.eval(list(range(10, 10 + args.context)))
    prompt = torch.arange(10, 10 + args.context).reshape(1, -1)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        caches = {}
        for name, runner in runners.items():
            _use(layers, plans[name].gguf_bf16_gemv_types)
            caches[name] = runner.new_caches()
            runner.prefill(prompt, caches[name])
        for step in range(args.rounds):
            for name, runner in runners.items():
                _use(layers, plans[name].gguf_bf16_gemv_types)
                started = time.perf_counter()
                runner.decode(7, caches[name], args.context + step)
                times.setdefault(name, []).append(time.perf_counter() - started)
            if llama is not None:
                started = time.perf_counter()
                llama.eval([7])
                times.setdefault("llama.cpp eval", []).append(time.perf_counter() - started)
    print(f"{model_path}: threads {args.threads}, context {args.context}, {args.rounds} rounds")
    print("| variant | ms per step (median) | tok/s |")
    print("|---|---:|---:|")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {median * 1e3:.1f} | {1 / median:.2f} |")


def _use(layers: list[GGUFLinear], types: tuple[int, ...]) -> None:
    for layer in layers:
        layer.bf16_gemv_types = frozenset(types)


if __name__ == "__main__":
    main()
