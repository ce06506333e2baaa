"""Decode-shaped matmul x[1, in] @ Wᵀ on CPU: fp32, bf16, int8 and int4 (group 32) weights.

Decode reads every weight once per token, so "GB/s effective" (weight bytes / time) shows how
close each format gets to memory bandwidth. bf16 is timed on torch's matmul and on Hearth's
native kernel (hearth/ops/native/kernels.c); int8 three ways: torch's weight-only kernel
(aten._weight_int8pack_mm), the native one (which Int8Linear uses for one row where it
builds), and the native one on weights in transparent huge pages, as
Hearth's loader holds them. The 168 MB head streams from memory on every call; the layer shapes
are small enough to stay in cache when called back to back, so they show compute and call
overhead rather than bandwidth. ``--cold`` times the native int8 kernel as a decode step meets
it: each call reads the next of enough copies of the weight to fill COLD_BYTES, so every call
streams from memory.

    python benchmarks/lab/cpu_quant_matmul.py [--cold]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hearth.layers.int8 import Int4Linear, Int8Linear
from hearth.ops import native
from hearth.ops.native.huge_pages import move_into_huge_pages

# (out, in): the tied Gemma 3 270M head, then MLP up/gate, MLP down, q_proj.
SHAPES = [(262144, 640), (2048, 640), (640, 2048), (1024, 640)]
WARMUP_CALLS = 3
MIN_CALLS = 10
MIN_SECONDS = 0.5
# Weight copies per shape in --cold: more than the last-level cache this VM reports (480 MiB).
COLD_BYTES = 768 * 2**20
COLD_PASSES = 3


def median_ms(call: Callable[[], torch.Tensor]) -> float:
    for _ in range(WARMUP_CALLS):
        call()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < MIN_CALLS or time.perf_counter() - started < MIN_SECONDS:
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def formats(weight: torch.Tensor) -> list[tuple[str, int, Callable[[], torch.Tensor]]]:
    """(name, weight bytes, one decode-step call) per format; built lazily to bound memory."""
    in_features = weight.shape[1]
    x32 = torch.randn(1, in_features)
    x16 = x32.to(torch.bfloat16)
    w16 = weight.to(torch.bfloat16)
    int8 = Int8Linear.from_float(weight)
    int4 = Int4Linear.from_float(weight, group_size=32)

    rows = [
        ("fp32", weight.nbytes, lambda: F.linear(x32, weight)),
        ("bf16", w16.nbytes, lambda: F.linear(x16, w16)),
        (
            "int8, torch kernel",
            int8.nbytes,
            lambda: torch.ops.aten._weight_int8pack_mm(x16, int8.qweight, int8.scales),
        ),
    ]
    kernels = native.kernels()
    if kernels is not None:
        rows.append(("bf16, native kernel", w16.nbytes, lambda: kernels.bf16_rows_matmul(x16, w16)))
        rows.append(
            (
                "int8, native kernel",
                int8.nbytes,
                lambda: kernels.int8_rows_matmul(x16, int8.qweight, int8.scales),
            )
        )
        # As Hearth's loader holds them: the int8 weights in transparent huge pages.
        paged = Int8Linear(int8.qweight.clone(), int8.scales)
        if move_into_huge_pages([(paged, "qweight")]):
            rows.append(
                (
                    "int8, native kernel, huge pages",
                    paged.nbytes,
                    lambda: kernels.int8_rows_matmul(x16, paged.qweight, paged.scales),
                )
            )
    rows.append(("int4 g32", int4.nbytes, lambda: int4(x16)))
    return rows


def cold_rows() -> None:
    """The native int8 kernel on weights read from memory: ms per call, median of passes."""
    kernels = native.kernels()
    if kernels is None:
        raise SystemExit("--cold times the native kernel, which does not build here")
    print("| W [out, in] | copies | ms/call | weight MB | GB/s effective |")
    print("|---|---:|---:|---:|---:|")
    for out_features, in_features in SHAPES:
        int8 = Int8Linear.from_float(torch.randn(out_features, in_features) * 0.02)
        copies = [
            (int8.qweight.clone(), int8.scales.clone())
            for _ in range(max(2, -(-COLD_BYTES // int8.nbytes)))
        ]
        x16 = torch.randn(1, in_features).to(torch.bfloat16)
        passes = []
        for _ in range(COLD_PASSES + 1):  # the first pass warms up
            begin = time.perf_counter()
            for qweight, scales in copies:
                kernels.int8_rows_matmul(x16, qweight, scales)
            passes.append((time.perf_counter() - begin) / len(copies))
        ms = statistics.median(passes[1:]) * 1e3
        print(
            f"| {out_features}x{in_features} | {len(copies)} | {ms:.3f} | "
            f"{int8.nbytes / 1e6:.1f} | {int8.nbytes / ms / 1e6:.1f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cold", action="store_true", help="weights streamed from memory")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if parser.parse_args().cold:
        with torch.inference_mode():
            cold_rows()
        return
    print("| W [out, in] | format | ms/call | weight MB | GB/s effective |")
    print("|---|---|---:|---:|---:|")
    with torch.inference_mode():
        for out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features) * 0.02
            for name, nbytes, call in formats(weight):
                ms = median_ms(call)
                print(
                    f"| {out_features}x{in_features} | {name} | {ms:.3f} | {nbytes / 1e6:.1f} "
                    f"| {nbytes / ms / 1e6:.1f} |"
                )


if __name__ == "__main__":
    main()
