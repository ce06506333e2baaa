"""The GGUF block kernels (`hearth.ops.gguf_matmul`) at Gemma 3 12B's decode shapes, on a GPU.

Per block type and shape: the GEMV at one row for each launch (rows a program, warps, K
slices, loop stages; `default` is the launch `gguf_gemv_triton` picks itself), timed
as decode runs it (back-to-back calls on distinct weights, together past L2, in a CUDA graph),
in µs and its share of the device's copy bandwidth over the bytes it reads (the blocks); beside
it cuBLAS's bf16 GEMV of the same shape (2 bytes a weight). Each launch is first checked against
fp64 on the torch reference's weights (the fp32 sum bound plus the output's bf16 rounding,
tests/ops/test_gguf_matmul.py). Then the prefill's dequantize kernel (blocks to bf16) in GB/s
of bytes moved. For Q4_0, Q8_0, Q4_K and Q6_K, a second row: the same weights repacked into
their planar layout (`hearth.quant.gguf_blocks.to_planar`) through the planar GEMV, its
default launch and rows a program (`--planar-rows`) x K slices x prefetching, checked the
same way, its
share over the planar bytes. Writes $OUT/gpu_gguf_gemv.md.

    OUT=/tmp/out PYTHONPATH=src python benchmarks/lab/gpu_gguf_gemv.py [--types Q4_K,Q6_K]
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

from hearth.ops import gguf_matmul as gm
from hearth.quant import gguf_blocks as gb
from hearth.quant.gguf_blocks import BLOCK_FORMATS, dequantize_blocks

TYPE_IDS = {block.name: type_id for type_id, block in BLOCK_FORMATS.items()}
# Byte offsets of each type's fp16 fields: set to weight-sized values in random blocks.
HALVES = {2: (0,), 3: (0, 2), 6: (0,), 7: (0, 2), 8: (0,), 10: (80, 82), 11: (108,)}
HALVES |= {12: (0, 2), 13: (0, 2), 14: (208,)}
L2_BYTES = 50 << 20
SHAPES = [
    (8192, 3840, "12B qkv"),
    (3840, 4096, "12B o"),
    (30720, 3840, "12B gate/up"),
    (3840, 15360, "12B down"),
    (262144, 3840, "tied head"),
]


def random_blocks(type_id: int, n: int, k: int) -> torch.Tensor:
    """Random valid blocks on the GPU: random codes and packed scales, small fp16 scales."""
    block = BLOCK_FORMATS[type_id]
    raw = torch.randint(0, 256, (n, k // block.values, block.nbytes), dtype=torch.uint8)
    raw = raw.cuda()
    for offset in HALVES[type_id]:
        halves = (torch.rand(n, k // block.values, device="cuda") * 1e-3).half()
        raw[..., offset : offset + 2] = halves[..., None].view(torch.uint8)
    return raw.view(n, -1)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (time.perf_counter() - start)


def time_graph(calls: list) -> float:
    """µs per call: the calls captured once into a graph, replayed; median of 5 timings."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (10 * len(calls)))
    return sorted(samples)[2]


def checked(
    x: torch.Tensor, type_id: int, blocks: torch.Tensor, y: torch.Tensor, extra: int = 0
) -> str:
    """The fp32 sum bound of tests/ops/test_gguf_matmul.py (`extra` roundings more a term: 1
    for the planar symmetric types' group scale) plus the output's bf16 rounding."""
    weight = dequantize_blocks(type_id, blocks).double()
    exact = x.double() @ weight.T
    k = x.shape[-1] + (extra if type_id != 12 else 0)
    summed = k * 2.0**-24 / (1 - k * 2.0**-24) * (x.double().abs() @ weight.abs().T)
    allowed = summed + 2.0**-8 * (exact.abs() + summed)
    return "ok" if bool(((y.double() - exact).abs() <= allowed).all()) else "WRONG"


def launches(k: int, args: argparse.Namespace) -> list[dict]:
    """The launches to time at K: the default (empty), then the grid of the options given
    (none with --file-default-only)."""
    found: list[dict] = [{}]
    if args.file_default_only:
        return found
    grid = itertools.product(
        _ints(args.rows), _ints(args.warps), _ints(args.splits), _ints(args.stages)
    )
    for rows, warps, split, stages in grid:
        if rows * 256 // (32 * warps) > 128 or k // 256 < 2 * split:
            continue  # the accumulator alone past 128 registers a thread; slices of one step
        found.append({"block_n": rows, "num_warps": warps, "split_k": split})
        found[-1]["loop_stages"] = stages
    return found


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",")]


def sweep_shape(
    name: str, shape: tuple[int, int, str], bandwidth: float, every: list[str], args: Any
) -> str:
    """Time every launch of the GEMV at one shape; the summary row of the fastest."""
    n, k, label = shape
    type_id = TYPE_IDS[name]
    block = BLOCK_FORMATS[type_id]
    moved = n * k // block.values * block.nbytes
    count = max(1, min(8, 4 * L2_BYTES // moved + 1))
    weights = [random_blocks(type_id, n, k) for _ in range(count)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
    results = []
    for launch in launches(k, args):
        calls = [
            partial(gm.gguf_gemv_triton, x, type_id, w, o, **launch)
            for w, o in zip(weights, outs, strict=True)
        ]
        calls[0]()
        check = checked(x, type_id, weights[0], outs[0]) if n <= 65536 else "-"
        micros = time_graph(calls)
        share = moved / (micros * 1e-6) / bandwidth * 100
        described = ", ".join(f"{key} {value}" for key, value in launch.items()) or "default"
        results.append((micros, described))
        every.append(f"| {name} | {label} | {described} | {micros:.1f} | {share:.0f}% | {check} |")
    default = results[0][0]
    micros, described = min(results)
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    cublas = time_graph([partial(torch.nn.functional.linear, x, dense)])
    share = moved / (micros * 1e-6) / bandwidth * 100
    row = f"| {name} | {label} ({n}x{k}) | {default:.1f} | {described} | {micros:.1f} | "
    summary = [row + f"{share:.0f}% | {cublas:.1f} |"]
    if type_id in gb.PLANAR_TYPES:  # the same weights repacked (lossless)
        layout = gb.planar_layout(type_id)
        planar = [gb.to_planar(type_id, w) for w in weights]
        planar_moved = planar[0].numel()
        results = []
        for launch in planar_launches(k, args):
            calls = [
                partial(gm.gguf_gemv_triton, x, layout, r, o, **launch)
                for r, o in zip(planar, outs, strict=True)
            ]
            calls[0]()
            check = checked(x, type_id, weights[0], outs[0], 1) if n <= 65536 else "-"
            micros = time_graph(calls)
            share = planar_moved / (micros * 1e-6) / bandwidth * 100
            described = ", ".join(f"{key} {value}" for key, value in launch.items()) or "default"
            results.append((micros, described))
            every.append(
                f"| {name} planar | {label} | {described} | {micros:.1f} | {share:.0f}% | {check} |"
            )
        default = results[0][0]
        micros, described = min(results)
        share = planar_moved / (micros * 1e-6) / bandwidth * 100
        row = f"| {name} planar | {label} ({n}x{k}) | {default:.1f} | {described} | "
        summary.append(row + f"{micros:.1f} | {share:.0f}% | {cublas:.1f} |")
        del planar
    return summary


def planar_launches(k: int, args: argparse.Namespace) -> list[dict]:
    """The planar GEMV's launches: its default, then rows a program x K slices x loading a
    step ahead or not."""
    found: list[dict] = [{}]
    grid = itertools.product(_ints(args.planar_rows), _ints(args.splits), (False, True))
    for rows, split, prefetch in grid:
        if k // 256 >= 2 * split:
            found.append({"block_n": rows, "split_k": split, "prefetch": prefetch})
    return found


def dequantize_row(name: str, bandwidth: float) -> str:
    type_id = TYPE_IDS[name]
    blocks = random_blocks(type_id, 30720, 3840)
    micros = time_graph([partial(gm.gguf_dequantize_triton, type_id, blocks, 3840, torch.bfloat16)])
    share = (blocks.numel() + 30720 * 3840 * 2) / (micros * 1e-6) / bandwidth * 100
    text = f"| {name} | dequantize 30720x3840 to bf16 | {micros:.1f} | - | - | {share:.0f}% | - |"
    if type_id in gb.PLANAR_TYPES:
        rows = gb.to_planar(type_id, blocks)
        layout = gb.planar_layout(type_id)
        call = partial(gm.gguf_dequantize_triton, layout, rows, 3840, torch.bfloat16)
        micros = time_graph([call])
        share = (rows.numel() + 30720 * 3840 * 2) / (micros * 1e-6) / bandwidth * 100
        text += f"\n| {name} planar | dequantize 30720x3840 to bf16 | {micros:.1f} | - | - | "
        text += f"{share:.0f}% | - |"
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--rows", default="8,16", help="rows a program, comma-separated")
    parser.add_argument("--warps", default="4", help="warps a program, comma-separated")
    parser.add_argument("--splits", default="1,2,4", help="K slices")
    parser.add_argument("--stages", default="1,3", help="software-pipelined loop stages")
    parser.add_argument("--planar-rows", default="16,32,64", help="planar GEMV rows a program")
    parser.add_argument(
        "--file-default-only", action="store_true", help="time only the file kernel's default"
    )
    parser.add_argument("--no-head", action="store_true")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    shapes = SHAPES[:-1] if args.no_head else SHAPES
    lines = ["| type | shape | default µs | best launch | µs | % of copy BW | cuBLAS bf16 µs |"]
    lines.append("|---|---|---|---|---|---|---|")
    every = ["| type | shape | launch | µs | % of copy BW | check |", "|---|---|---|---|---|---|"]
    for name in args.types.split(","):
        for shape in shapes:
            for line in sweep_shape(name, shape, bandwidth, every, args):
                lines.append(line)
                print(line, flush=True)
        lines.append(dequantize_row(name, bandwidth))
        print(lines[-1], flush=True)
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    device = torch.cuda.get_device_name()
    head = f"# GGUF block GEMV ({time.strftime('%Y-%m-%d')}, {device}, {versions})"
    note = f"Copy bandwidth measured: {bandwidth / 1e12:.2f} TB/s."
    out = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join([head, "", note, "", *lines, "", "## Every launch", "", *every]) + "\n"
    (out / "gpu_gguf_gemv.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
