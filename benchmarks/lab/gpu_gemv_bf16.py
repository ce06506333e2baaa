"""bf16 matrix-vector products at Gemma 3 12B decode shapes: cuBLAS (F.linear) against
Hearth's Triton GEMV (kernels/gemv.py), batch 1, each timed as a CUDA-graph replay (how the
decode step runs them, so Python launch overhead is not counted) of 20 calls in a row on
distinct weights (so L2 holds none of them, as in a real step).

"down+geglu" is the MLP's tail: cuBLAS needs the GeGLU kernel first (timed with it); the
Triton GEMV computes gelu_tanh(gate)·up while loading its input.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_gemv_bf16.py
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from hearth.ops.activation import gelu_tanh_mul
from hearth.ops.gemv import gemv_reference, gemv_triton

SHAPES = {  # (out, in) of the 12B decode step's projections
    "qkv": (8192, 3840, False),
    "o_proj": (3840, 4096, False),
    "gate_up": (30720, 3840, False),
    "down": (3840, 15360, False),
    "down+geglu": (3840, 15360, True),
}
BANDWIDTH = 4.2e12
CALLS = 20


def replay_micros(step: Callable[[int], object]) -> float:
    """µs per call: a graph of CALLS calls (call i on weight i), median of 20 replays."""
    for i in range(CALLS):  # warm up (autotuning) outside the capture
        step(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            step(i)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[len(times) // 2]


def write_table(file_name: str, title: str, lines: list[str]) -> None:
    """Print a table titled with the date, GPU, torch and triton, and write it to $OUT."""
    table = "\n".join(
        [
            f"# {title} — {datetime.date.today()}, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}",
            "",
            *lines,
        ]
    )
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / file_name).write_text(table + "\n")


def main() -> None:
    rows = []
    for name, (n, k, geglu) in SHAPES.items():
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(CALLS)
        ]
        x = torch.randn(1, 2 * k if geglu else k, device="cuda", dtype=torch.bfloat16)
        reference = gemv_reference(x, weights[0], geglu).float()
        got = gemv_triton(x, weights[0], geglu).float()
        error = ((got - reference).norm() / reference.norm()).item()

        def cublas(i: int, x=x, geglu=geglu, weights=weights) -> object:
            return F.linear(gelu_tanh_mul(x) if geglu else x, weights[i])

        def kernel(i: int, x=x, geglu=geglu, weights=weights) -> object:
            return gemv_triton(x, weights[i], geglu)

        base, ours = replay_micros(cublas), replay_micros(kernel)
        floor = weights[0].nbytes / BANDWIDTH * 1e6
        rows.append(
            f"| {name} | {n}x{k} | {base:.1f} ({floor / base:.0%}) | "
            f"{ours:.1f} ({floor / ours:.0%}) | {base / ours:.2f}x | {error:.1e} |"
        )
        print(rows[-1], flush=True)
        del weights
    write_table(
        "gpu_gemv_bf16.md",
        "bf16 GEMV, batch 1",
        [
            f"µs per call (CUDA-graph replay of {CALLS} calls on distinct weights, median of 20)"
            " and share of the 4.2 TB/s floor (weight bytes); rel. error = relative L2 vs the"
            " torch reference (bf16 output rounding is ~2e-3).",
            "",
            "| projection | shape | cuBLAS µs | Triton µs | speedup | rel. error |",
            "|---|---|---|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
