"""CPU: B prompts of T tokens prefilled one forward each (`runner.prefill`, what the scheduler
did before) against one ragged forward of all of them (`runner.prefill_ragged`), and, as the
ceiling, one prompt of B·T tokens in one forward; interleaved (each round one of each), on a
paged pool; the median of each and the prefill tok/s.

    python benchmarks/lab/cpu_ragged_prefill.py --batch 4 --tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hearth import Engine
from hearth.kv.paged import KVPool, PagedSequence
from hearth.runtime.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.load(args.model, progress=False)
    runner = engine.runner
    model = runner.model
    blocks = 4 * args.batch * (-(-args.tokens // 16) + 1) + 64
    pool = KVPool(
        model.cache_specs(), runner.kv_policy, model.compute_dtype, [blocks] * 2, device="cpu"
    )
    prompts = [
        torch.randint(4, 200_000, (args.tokens,), generator=torch.Generator().manual_seed(i))
        for i in range(args.batch)
    ]
    joined = [torch.cat(prompts)]
    alone, ragged, long = [], [], []
    with torch.inference_mode():
        for _ in range(args.rounds + 1):  # the first round warms up, not counted
            alone.append(_timed(lambda s: _one_by_one(runner, s, prompts), pool, args.batch))
            ragged.append(_timed(lambda s: _together(runner, s, prompts), pool, args.batch))
            long.append(_timed(lambda s: _one_by_one(runner, s, joined), pool, 1))
    tokens = args.batch * args.tokens
    for name, times in (
        ("one forward each", alone[1:]),
        ("one ragged forward", ragged[1:]),
        ("one prompt of all their tokens", long[1:]),
    ):
        median = statistics.median(times)
        print(f"{name}: {median * 1e3:,.0f} ms, {tokens / median:,.0f} tok/s")
    print(f"speed-up: {statistics.median(alone[1:]) / statistics.median(ragged[1:]):.2f}x")


def _timed(run: object, pool: KVPool, batch: int) -> float:
    sequences = [pool.sequence() for _ in range(batch)]
    started = time.perf_counter()
    run(sequences)  # type: ignore[operator]
    seconds = time.perf_counter() - started
    for sequence in sequences:
        sequence.free()
    return seconds


def _one_by_one(
    runner: ModelRunner, sequences: list[PagedSequence], prompts: list[torch.Tensor]
) -> None:
    for sequence, prompt in zip(sequences, prompts, strict=True):
        assert sequence.reserve(prompt.shape[0])
        runner.prefill(prompt[None], sequence.caches, 0, prompt.shape[0])
        sequence.after_forward([])


def _together(
    runner: ModelRunner, sequences: list[PagedSequence], prompts: list[torch.Tensor]
) -> None:
    for sequence, prompt in zip(sequences, prompts, strict=True):
        assert sequence.reserve(prompt.shape[0])
    runner.prefill_ragged(
        [prompt.tolist() for prompt in prompts],
        [sequence.caches for sequence in sequences],
        [0] * len(prompts),
        [True] * len(prompts),
    )
    for sequence in sequences:
        sequence.after_forward([])


if __name__ == "__main__":
    main()
