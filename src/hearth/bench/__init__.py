"""`hearth bench`: batch-1 decode/prefill speed against the bandwidth and compute rooflines.

random_model: random weights at preset shapes (bf16 or MLX-packed), built on the device.
measure: timings and roofline arithmetic. hf: the HF transformers peer. report: the table.
random_gguf: random-weight Gemma 3 GGUF files, for Hearth and llama.cpp on the same file.
concurrency: `--concurrency`, many streams at once through the scheduler.
"""

from hearth.bench.concurrency import ConcurrencyReport, render_concurrency
from hearth.bench.report import BenchReport, Row, render
from hearth.bench.runner import BenchOptions, run_bench, run_concurrency_bench

__all__ = [
    "BenchOptions",
    "BenchReport",
    "ConcurrencyReport",
    "Row",
    "render",
    "render_concurrency",
    "run_bench",
    "run_concurrency_bench",
]
