"""CPU: one batched decode step of B sequences (`runner.decode_batch`) against B batch-1 steps
(`runner.decode`, the native step), interleaved, with a per-module profile of the batched one.

With `--paged`, the scheduler's case instead: B sequences on one paged pool, a batched step
reading K/V through block tables (`PagedLayerCache.decode_blocks`) against the same step
through the copy it replaced (each context copied out of its blocks, `decode_slot`, and the
token written back, `flush`), interleaved; the median of each.

    python benchmarks/lab/cpu_batched_decode.py --batch 4 --threads 1
    python benchmarks/lab/cpu_batched_decode.py --paged --batch 8 --context 160
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hearth import Engine
from hearth.kv.paged import DEFAULT_BLOCK_SIZE, KVPool, cache_groups
from hearth.ops import native
from hearth.runtime import native_step
from hearth.runtime.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--paged", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, progress=False)
    runner = engine.runner
    if args.paged:
        paged_against_copies(runner, args.batch, args.context, args.rounds)
        return
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


def paged_against_copies(runner: ModelRunner, batch: int, context: int, rounds: int) -> None:
    """Batched steps of `batch` sequences (prompts of `context` tokens and a few more each)
    on one pool: through block tables, then through copies, alternately."""
    model = runner.model
    specs, policy = model.cache_specs(), runner.kv_policy
    per_sequence = -(-(context + batch + 2 * rounds + 2) // DEFAULT_BLOCK_SIZE)
    blocks = [batch * per_sequence + 1] * len(cache_groups(specs, policy))
    pool = KVPool(specs, policy, model.compute_dtype, blocks)
    sequences = [pool.sequence() for _ in range(batch)]
    lengths = [context + index for index in range(batch)]
    with torch.inference_mode():
        for index, (sequence, length) in enumerate(zip(sequences, lengths, strict=True)):
            ids = list(range(10 + index, 10 + index + length))
            assert sequence.reserve(length)
            runner.prefill(torch.tensor([ids]), sequence.caches)
            sequence.after_forward(ids)

        def step() -> float:
            for sequence in sequences:
                assert sequence.reserve(1)
            started = time.perf_counter()
            runner.decode_batch([7] * batch, [s.caches for s in sequences],
                                [s.stored for s in sequences])  # fmt: skip
            for sequence in sequences:
                sequence.after_forward([])
            return time.perf_counter() - started

        def copied(cache, sample, tables):  # type: ignore[no-untyped-def]
            slot = cache.decode_slot(sample)
            return native.ContiguousKV(slot.keys, slot.values, slot.slot, slot.length)

        block_tables = native_step._row_kv
        tables, copies = [], []
        step()
        for _ in range(rounds):
            tables.append(step())
            native_step._row_kv = copied
            copies.append(step())
            native_step._row_kv = block_tables
    t, c = statistics.median(tables), statistics.median(copies)
    print(
        f"B={batch}, contexts {lengths[0]}-{lengths[-1]}: through copies {c * 1e3:.1f} ms, "
        f"through block tables {t * 1e3:.1f} ms a step ({c / t:.2f}x)"
    )


if __name__ == "__main__":
    main()
