"""How fast a GEMV's weight access pattern can stream from DRAM: load-only kernels, no math.

Each launch XORs an int32 weight of a real 4-bit shape (Gemma 3 12B gate/up and down, Gemma 4
E4B gate/up) in tiles of `rows x bytes a step` and stores one word a row, walking the weight
as a GEMV does; a flat contiguous read is the reference. Timed like `gpu_gemv_affine_sweep.py`
(CUDA graphs of back-to-back calls on distinct copies past L2). The fastest tile is a floor
for any GEMV that reads the weight where it lies, so a GEMV's time over that floor is what
its arithmetic and latency add.

    OUT=/tmp/out python benchmarks/lab/gpu_gemv_load_patterns.py
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import triton
import triton.language as tl

from gpu_gemv_affine_sweep import time_graph

# (rows, int32 words of a row, label): the packed words of 4-bit weights.
WEIGHTS = ((30720, 480, "12B gate/up"), (3840, 1920, "12B down"), (20480, 320, "E4B gate/up"))
# (rows a program, words a row a step)
TILES = ((64, 32), (32, 64), (16, 128), (8, 256), (4, 512), (128, 32), (64, 64), (32, 128))
FLAT_BLOCK, FLAT_STEPS = 2048, 8


@triton.jit
def _load_rows(w_ptr, out_ptr, row_words, BN: tl.constexpr, KW: tl.constexpr, STEPS: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    at = w_ptr + rows[:, None] * row_words + tl.arange(0, KW)[None, :]
    acc = tl.zeros([BN, KW], tl.int32)
    for step in range(STEPS):
        acc ^= tl.load(at + step * KW)
    tl.store(out_ptr + rows, tl.xor_sum(acc, axis=1))


@triton.jit
def _load_flat(w_ptr, out_ptr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    base = tl.program_id(0) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.int32)
    for step in range(STEPS):
        acc ^= tl.load(w_ptr + base + step * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), acc)


def time_weight(n: int, row_words: int, label: str) -> list[str]:
    """Table rows for one weight: every tile at 4 and 8 warps, then the flat read."""
    nbytes = n * row_words * 4
    copies = max(2, (200 << 20) // nbytes)
    weights = [
        torch.randint(0, 1 << 30, (n, row_words), dtype=torch.int32, device="cuda")
        for _ in range(copies)
    ]
    out = torch.empty(n, dtype=torch.int32, device="cuda")
    lines = []

    def row(pattern: str, micros: float) -> None:
        lines.append(f"| {label} | {pattern} | {micros:.1f} | {nbytes / micros / 1e3:.0f} |")
        print(lines[-1], flush=True)

    for warps in (4, 8):
        for rows, step_words in TILES:
            if row_words % step_words:
                continue
            launch = (n // rows,)
            args = (out, row_words, rows, step_words, row_words // step_words)
            calls = [
                (lambda w=w, g=launch, a=args, v=warps: _load_rows[g](w, *a, num_warps=v))
                for w in weights
            ]
            row(f"{rows} rows x {step_words * 4} B a step, {warps} warps", time_graph(calls))
    flat_out = torch.empty(n * row_words, dtype=torch.int32, device="cuda")
    launch = (n * row_words // (FLAT_BLOCK * FLAT_STEPS),)
    calls = [
        (lambda w=w: _load_flat[launch](w, flat_out, FLAT_BLOCK, FLAT_STEPS, num_warps=8))
        for w in weights
    ]
    row("flat contiguous", time_graph(calls))
    return lines


def main() -> None:
    lines = [
        f"# Load-only weight access patterns ({time.strftime('%Y-%m-%d')}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})",
        "",
        "| packed words | pattern | µs | GB/s |",
        "|---|---|---|---|",
    ]
    for n, row_words, label in WEIGHTS:
        lines += time_weight(n, row_words, label)
    out_dir = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_gemv_load_patterns.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
