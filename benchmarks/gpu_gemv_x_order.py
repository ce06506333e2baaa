"""The affine GEMV with x in input order against x codes-major (`affine_matmul.codes_major`).

Nsight Compute on the 4-bit GEMV at Gemma 3 12B's gate/up shape (ncu_gemv_affine-2026-12-03)
showed L1/TEX throughput at 92% with a 91% L1 hit rate while DRAM ran at 21%: the kernel is
bound by L1 requests, and most of them are x loads (one 2-byte load per word and code
position). Codes-major x makes each such load one vector per thread. This times, at M=1
(median of `triton.testing.do_bench`, L2 flushed): the library GEMV both ways, the
reordering copy alone, and checks both against the torch reference.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/gpu_gemv_x_order.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import date
from functools import partial
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton

from gpu_kernels_affine import COPY_BANDWIDTH, DEVICE, packed_weight
from hearth.kernels import affine_matmul as am

# (N, K, name): Gemma 3 12B's fused gate/up, down, fused q/k/v, o; the tied head.
SHAPES = [
    (30720, 3840, "12B gate/up"),
    (3840, 15360, "12B down"),
    (12288, 3840, "12B q/k/v"),
    (3840, 4096, "12B o"),
    (262144, 3840, "tied head"),
]


def median_ms(fn: Callable[..., object], *args: object) -> float:
    return triton.testing.do_bench(partial(fn, *args), return_mode="median")


def main() -> None:
    rows = []
    for bits in (4, 8):
        for n, k, name in SHAPES:
            packed, scales, biases = packed_weight(n, k, bits, 64)
            x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
            reference = am.affine_matmul_reference(x, packed, scales, biases, bits, 64).float()
            moved = packed.numel() * 4 + 2 * scales.numel() * 2 + 2 * (k + n)
            times = {}
            for order in (False, True):
                with mock.patch.object(am, "GEMV_CODES_MAJOR_X", order):
                    out = am.affine_gemv_triton(x, packed, scales, biases, bits, 64).float()
                    error = (out - reference).abs().max().item() / reference.abs().max().item()
                    assert error < 2e-2, (name, bits, order, error)  # bf16 output rounding
                    times[order] = median_ms(
                        am.affine_gemv_triton, x, packed, scales, biases, bits, 64
                    )
            copy = median_ms(am.codes_major, x, bits)
            # The kernel alone, on x already reordered (as a fused producer would write it).
            config = am.gemv_config(
                n, k, bits, 64, torch.cuda.get_device_properties(0).multi_processor_count
            )
            ordered = am.codes_major(x, bits)
            out = torch.empty(1, n, device=DEVICE, dtype=torch.bfloat16)
            kernel = median_ms(
                am._launch_gemv, ordered, packed, scales, biases, out, bits, 64, config, True
            )
            before, after, kernel = times[False] * 1e3, times[True] * 1e3, kernel * 1e3
            rows.append(
                f"| {name} {n}x{k} | {bits} | {before:.1f} | {after:.1f} | {copy * 1e3:.1f} | "
                f"{kernel:.1f} | {before / kernel:.2f}x | "
                f"{moved / (kernel * 1e-6) / COPY_BANDWIDTH:.0%} |"
            )
            print(rows[-1], flush=True)
    table = "\n".join(
        [
            f"# Affine GEMV: x in input order vs codes-major ({date.today()}, "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
            f"{triton.__version__})",
            "",
            "M=1, group 64, median of do_bench (L2 flushed). Both times include the launcher "
            "(the codes-major one its reordering copy, also timed alone); the kernel column "
            "launches the kernel on x already reordered, as a producer writing that order "
            "would. % is of the 4.2 TB/s copy bandwidth over packed + scales + biases + x + out.",
            "",
            "| shape | bits | input order µs | codes-major µs | the copy alone µs | "
            "kernel on ordered x µs | kernel speed-up | kernel % of 4.2 TB/s |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gemv_x_order.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
