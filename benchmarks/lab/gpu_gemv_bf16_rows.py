"""The bf16 GEMV at 1-4 rows against cuBLAS (`F.linear`), at Gemma 3 12B and Gemma 4 E4B shapes.

The GEMV takes up to `GEMV_MAX_ROWS` rows; its launch configs were tuned at one row. This
times both at each row count (CUDA graph of 20 back-to-back calls, best of 5 replays) to see
where cuBLAS should take over.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_gemv_bf16_rows.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F

from hearth.ops.gemv import gemv_triton

SHAPES = {  # name: (out features, in features)
    "12B qkv": (16 * 256 + 2 * 8 * 256, 3840),
    "12B gate/up": (2 * 15360, 3840),
    "12B down": (3840, 15360),
    "12B head": (262144, 3840),
    "E4B gate/up": (2 * 10240, 2560),
    "E4B down": (2560, 10240),
    "E4B head": (262144, 2560),
}
CALLS = 20


def _time(fn: object) -> float:
    """Microseconds per call."""
    for _ in range(3):
        fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()  # type: ignore[operator]
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / CALLS)
    return best


def main() -> None:
    device = torch.device("cuda")
    lines = [
        f"# bf16 GEMV against cuBLAS at 1-4 rows ({torch.cuda.get_device_name()})",
        "",
        "| shape | rows | GEMV µs | cuBLAS µs | GEMV / cuBLAS |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for rows in (1, 2, 3, 4):
            x = torch.randn(1, rows, k, device=device, dtype=torch.bfloat16)
            ours = _time(lambda x=x, weight=weight: gemv_triton(x, weight))
            theirs = _time(lambda x=x, weight=weight: F.linear(x, weight))
            lines.append(f"| {name} | {rows} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f} |")
            print(lines[-1], flush=True)
        del weight
    text = "\n".join(lines) + "\n"
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_gemv_bf16_rows.md").write_text(text)


if __name__ == "__main__":
    main()
