"""Host time of the batched paged decode step's bookkeeping (`runtime.batch_graphs`), no model:
writing the changed table entries, tokens and positions into the host buffers and telling the
sequences' caches their new offsets, for B sequences of Gemma 3 12B's cache layout (48 layers,
1 in 6 full, window 1024; head sizes do not matter here) at a 512-token context, over 128 steps.

    PYTHONPATH=src python benchmarks/lab/batch_step_host.py --rows 16,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hearth.kv import KVPolicy
from hearth.kv.cache import CacheSpec
from hearth.kv.paged import KVPool
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.batch_graphs import BatchDecoder


class _Shapes(torch.nn.Module):
    """What a batch decoder reads of a model when it makes its buffers."""

    device = torch.device("cpu")

    class config:  # a stand-in for a ModelConfig
        max_position_embeddings = 131072


def measure(rows: int, prompt: int = 512, steps: int = 128) -> tuple[float, float]:
    """Median and worst host seconds per step of `rows` sequences."""
    specs = [CacheSpec(i, "x", 1, 16, None if i % 6 == 5 else 1024) for i in range(48)]
    pool = KVPool(specs, KVPolicy(), torch.float32, [8192, 8192], 16)
    decoder = BatchDecoder(_Shapes(), pool, ExecutionPlan.for_device("cpu"), rows, graphs=False)
    sequences = [pool.sequence() for _ in range(rows)]
    for sequence in sequences:
        sequence.reserve(prompt)
    spent = []
    for step in range(steps):
        for sequence in sequences:
            sequence.reserve(1)
        positions = [prompt + step] * rows
        started = time.perf_counter()
        tables = decoder._tables_of(decoder.width(sequences))
        decoder._fill(tables, sequences, [1] * rows, positions, rows)
        for sequence in sequences:
            for cache in sequence.caches:
                cache.offset = prompt + step + 1
        spent.append(time.perf_counter() - started)
        for sequence in sequences:
            sequence.after_forward([])
    return statistics.median(spent), max(spent[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64", help="batch sizes, comma-separated")
    args = parser.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        median, worst = measure(rows)
        print(f"{rows} rows: median {median * 1e6:,.0f} us, worst {worst * 1e6:,.0f} us per step")


if __name__ == "__main__":
    main()
