"""Decode-step time of the batching scheduler at N running requests on the embedded Gemma 3
270M (loaded as `hearth serve` loads it): N requests of 128 random prompt tokens are admitted
and prefilled, then 10 decode steps of all N are timed; the median is printed.

Run it against two source trees, interleaved, to compare them (the scheduler's constructor
takes `runner, tokenizer, max_running` in both):

    PYTHONPATH=OLD/src python benchmarks/lab/paged_decode_step.py old 1,4,8
    PYTHONPATH=NEW/src python benchmarks/lab/paged_decode_step.py new 1,4,8
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import hearth
from hearth.embedded import embedded_model_path
from hearth.runtime.generate import GenerationRequest
from hearth.runtime.scheduler import Scheduler

PROMPT_TOKENS, STEPS = 128, 10


def main(label: str, levels: list[int]) -> None:
    engine = hearth.load(embedded_model_path(), device="cpu", progress=False)
    for count in levels:
        scheduler = Scheduler(engine.runner, engine.tokenizer, max_running=count)
        for index in range(count):
            generator = torch.Generator().manual_seed(index)
            ids = torch.randint(10, 20_000, (PROMPT_TOKENS,), generator=generator).tolist()
            request = GenerationRequest(ids, max_tokens=STEPS + 8, stop_ids=())
            scheduler.submit(request, lambda chunk: None, lambda: False)
        while len(scheduler.running) < count:
            scheduler.step()
        scheduler.step()  # a warm-up step
        times = []
        for _ in range(STEPS):
            started = time.perf_counter()
            scheduler.step()
            times.append(time.perf_counter() - started)
        median = statistics.median(times)
        print(f"{label} n={count} step_ms={median * 1000:.1f} tok_s={count / median:.1f}")


if __name__ == "__main__":
    main(sys.argv[1], [int(level) for level in sys.argv[2].split(",")])
