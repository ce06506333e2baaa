"""CPU: one batched decode step of B sequences (`runner.decode_batch`) against B batch-1 steps
(`runner.decode`, the native step), interleaved, with a per-module profile of the batched one.

    python benchmarks/lab/cpu_batched_decode.py --batch 4 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hearth import Engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, progress=False)
    runner = engine.runner
    batch = args.batch
    with torch.inference_mode():
        caches = []
        for index in range(batch):
            cache = runner.new_caches()
            ids = torch.arange(10 + index, 10 + index + args.context).reshape(1, -1)
            runner.prefill(ids, cache, 0, runner.plan.prefill_chunk)
            caches.append(cache)
        position = args.context
        alone, together = [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for cache in caches:
                runner.decode(7, cache, position)
            alone.append(time.perf_counter() - started)
            started = time.perf_counter()
            runner.decode_batch([7] * batch, caches, [position + 1] * batch)
            together.append(time.perf_counter() - started)
            position += 2
        a, t = statistics.median(alone), statistics.median(together)
        print(
            f"B={batch}: {batch} batch-1 steps {a * 1e3:.1f} ms, one batched step "
            f"{t * 1e3:.1f} ms, speed-up {a / t:.2f}x"
        )
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    runner.decode_batch([7] * batch, caches, [position] * batch)
                    position += 1
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
