"""The bf16 MLP's GeGLU stored by its gate/up GEMV (`gemv.gemv_geglu_out`: each program pairs
gate and up rows and stores the GeGLU of their dots), against the gate/up product then the
GeGLU kernel, at the decode shapes of Gemma 3 12B, Gemma 4 31B, E4B and 26B-A4B's dense MLP.

Checks on fresh random draws: the stored GeGLU against the same pinned GEMV then the GeGLU
kernel (elements that differ: 0 expected, the same sums and roundings), and against cuBLAS
then the GeGLU kernel (the largest difference, over the largest |value|: the sums' order
differs, so a bf16 ulp or two). Timing: CUDA graphs of 20 MLP tails (gate/up, GeGLU, down
through the model's GEMV) on distinct weights, median of 20 replays, three ways: cuBLAS's
gate/up + the GeGLU kernel (12B's and 31B's path before), the pinned GEMV + the GeGLU kernel
(E4B's and 26B-A4B's before), the GEMV storing the GeGLU (now).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/gpu_gemv_geglu_out.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_gemv_bf16 import CALLS, replay_micros, write_table
from hearth.kernels import gemv
from hearth.kernels.activation import gelu_tanh_mul_triton as gelu_tanh_mul

SHAPES = {  # hidden, MLP width
    "Gemma 3 12B": (3840, 15360),
    "Gemma 4 31B": (5376, 21504),
    "Gemma 4 E4B": (2560, 10240),
    "26B-A4B dense": (2816, 2112),
}
DRAWS = 5


def check(hidden: int, width: int) -> tuple[int, float]:
    """(elements differing from the GEMV + GeGLU kernel, largest difference from cuBLAS +
    GeGLU over the largest |value|) over DRAWS draws."""
    differ, worst = 0, 0.0
    launch = gemv.geglu_out_launch(1, 2 * width, hidden)
    for seed in range(DRAWS):
        torch.manual_seed(seed)
        weight = torch.randn(2 * width, hidden, device="cuda", dtype=torch.bfloat16) * 0.03
        x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        stored = gemv.gemv_geglu_out(x, weight)
        apart = gelu_tanh_mul(gemv.gemv_triton(x, weight, config=launch))
        cublas = gelu_tanh_mul(F.linear(x, weight)).float()
        differ += int((stored != apart).sum())
        worst = max(worst, ((stored.float() - cublas).abs().max() / cublas.abs().max()).item())
    return differ, worst


def time_paths(hidden: int, width: int, launch: dict) -> list[float]:
    """µs per MLP tail: cuBLAS + GeGLU kernel, pinned GEMV + GeGLU kernel, GEMV storing it."""
    gate_up = [
        torch.randn(2 * width, hidden, device="cuda", dtype=torch.bfloat16) * 0.03
        for _ in range(CALLS)
    ]
    down = [
        torch.randn(hidden, width, device="cuda", dtype=torch.bfloat16) * 0.03 for _ in range(CALLS)
    ]
    x = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)

    def cublas(i: int) -> object:
        return gemv.gemv(gelu_tanh_mul(F.linear(x, gate_up[i])), down[i])

    def apart(i: int) -> object:
        product = gemv.gemv_triton(x, gate_up[i], config=launch)
        return gemv.gemv(gelu_tanh_mul(product), down[i])

    def stored(i: int) -> object:
        return gemv.gemv(gemv.gemv_geglu_out(x, gate_up[i]), down[i])

    return [replay_micros(path) for path in (cublas, apart, stored)]


def main() -> None:
    rows = []
    for name, (hidden, width) in SHAPES.items():
        launch = gemv.geglu_out_launch(1, 2 * width, hidden)
        differ, worst = check(hidden, width)
        times = time_paths(hidden, width, launch)
        rows.append(
            f"| {name} | {2 * width}x{hidden} | {launch['BLOCK_N']}x{launch['BLOCK_K']} "
            f"s{launch['LOOP_STAGES']} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | "
            f"{differ} of {DRAWS * width} | {worst:.1e} |"
        )
        print(rows[-1], flush=True)
    write_table(
        "gpu_gemv_geglu_out.md",
        "The bf16 MLP's GeGLU stored by its gate/up GEMV",
        [
            f"µs per MLP tail (gate/up, GeGLU, down), CUDA graphs of {CALLS} on distinct "
            f"weights, median of 20 replays. {DRAWS} fresh draws per shape: elements of the "
            "stored GeGLU that differ from the pinned GEMV then the GeGLU kernel, and the "
            "largest difference from cuBLAS then the GeGLU kernel over the largest |value|.",
            "",
            "| model | gate/up | launch | cuBLAS + GeGLU | GEMV + GeGLU | GEMV storing GeGLU "
            "| differing | vs cuBLAS |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
