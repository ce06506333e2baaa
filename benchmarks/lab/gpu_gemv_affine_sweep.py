"""Launch sweep of the 4-bit affine GEMV as decode runs it: back-to-back calls in a CUDA graph.

`gemv_config` was fitted to `do_bench` timings of single calls with L2 flushed between them.
In a decode step the GEMV follows other kernels in a CUDA graph, with programmatic dependent
launch. This times each launch config that way: per shape, a graph of one call on each of
several distinct weights (together past the 50 MB L2, so every call reads DRAM), replayed;
µs per call and its share of the 4.2 TB/s copy bandwidth over the bytes one call moves
(packed words, scales, biases). Each config's output is first checked against the torch
reference (bound as benchmarks/lab/gpu_kernels_affine.py).

Nsight Compute put the 4-bit GEMV at 1.8 active warps per scheduler with 0.4 eligible (12B
down, split 2; results/ncu_gemv_x_order-2026-12-03.txt): latency bound, too few bytes in
flight. More row blocks, K splits, groups per step and warps all add bytes in flight. (A
loop loading two steps ahead was also timed on 2026-12-03 and won nowhere: dropped.)

    OUT=/tmp/out PYTHONPATH=src python benchmarks/lab/gpu_gemv_affine_sweep.py [--bits 8] \
        [--no-head]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton

from gpu_kernels_affine import COPY_BANDWIDTH, packed_weight, within_bound
from hearth.ops import affine_matmul as am
from hearth.quant.mlx import dequantize_affine

GROUP = 64
L2_BYTES = 50 << 20
# Gemma 3 12B's decode GEMVs (q/k/v fused, o, gate/up fused, down) and the tied head.
SHAPES = [
    (8192, 3840, "12B qkv"),
    (3840, 4096, "12B o"),
    (30720, 3840, "12B gate/up"),
    (3840, 15360, "12B down"),
    (262144, 3840, "tied head"),
]
# Gemma 4 E4B's (`--shapes e4b`): q/k/v, o (sliding), gate/up, down, the per-layer input's
# gate and projection.
E4B_SHAPES = [
    (3072, 2560, "E4B qkv"),
    (2560, 2048, "E4B o"),
    (20480, 2560, "E4B gate/up"),
    (2560, 10240, "E4B down"),
    (256, 2560, "E4B PLE gate"),
    (2560, 256, "E4B PLE projection"),
]

# Gemma 4 26B-A4B's dense ones (`--shapes 26b`), a sliding layer's: q/k/v, o, the dense MLP's
# gate/up and down; all split K under `gemv_config`.
A26B_SHAPES = [
    (8192, 2816, "26B qkv"),
    (2816, 4096, "26B o"),
    (4224, 2816, "26B gate/up"),
    (2816, 2112, "26B down"),
]


def configs(
    k: int, bits: int, block_rows: tuple[int, ...] = (32, 64), unsplit_orders: bool = False
) -> list[am.GemvConfig]:
    """4-bit: rows (`block_rows`), groups per step, splits, warps, with the prefetching loop
    and x codes-major where unsplit (as `gemv_config` launches 4-bit). 8-bit: rows, groups,
    splits, with and without the prefetching loop, x in input order. `unsplit_orders` (4-bit):
    unsplit launches only, with and without the prefetching loop, x in either order (the
    gathered experts' sweep found input order and no prefetch fastest there)."""
    if bits == 4 and unsplit_orders:
        grid = itertools.product(block_rows, (4, 8, 16), (4, 8), (False, True), (False, True))
        return [
            am.GemvConfig(n, g, warps, 1, prefetch, ordered)
            for n, g, warps, prefetch, ordered in grid
            if k // GROUP >= g
        ]
    if bits == 4:
        grid = itertools.product(block_rows, (4, 8, 16), (1, 2, 4, 8), (4, 8), (True,))
    else:
        grid = itertools.product((16, 32), (4, 8, 16), (1, 2, 4, 8), (4,), (False, True))
    found = []
    for n, g, split, warps, prefetch in grid:
        if k // GROUP < g * split:  # each split needs at least one whole step
            continue
        codes_major = bits == 4 and split == 1
        found.append(am.GemvConfig(n, g, warps, split, prefetch, codes_major))
        if bits == 4 and (n, g, split, warps) == (64, 4, 1, 4):
            # 96 registers leave room for 5 programs an SM; capped, 6 or 7 (inspect_gemv_sass.py)
            found += [
                am.GemvConfig(n, g, warps, split, prefetch, codes_major, cap) for cap in (72, 80)
            ]
    return found


def write_report(
    name: str,
    title: str,
    note: str,
    summary: tuple[list[str], list[list[str]]],
    rows: list[list[str]],
) -> Path:
    """Write the markdown report `name` to $OUT (summary table, then every config), print its
    summary; returns $OUT."""

    def table(header: list[str], body: list[list[str]]) -> list[str]:
        return [
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in body),
        ]

    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    head = [f"# {title} ({time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, {versions})"]
    head += ["", note, "", *table(*summary)]
    every = ["", "## Every config", ""]
    every += table(["shape", "config", "µs", "% of 4.2 TB/s", "check"], rows)
    out = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text("\n".join(head + every) + "\n")
    print("\n".join(head))
    return out


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
    replays, samples = 20, []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / (replays * len(calls)))
    return sorted(samples)[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bits", type=int, default=4, choices=am.KERNEL_BITS)
    parser.add_argument("--no-head", action="store_true", help="skip the 262144-row head")
    parser.add_argument("--shapes", choices=("12b", "e4b", "26b"), default="12b")
    parser.add_argument("--only", help="comma-separated shape labels to sweep (e.g. '12B qkv')")
    parser.add_argument(
        "--rows", default="32,64", help="4-bit: rows a program, comma-separated (e.g. 8,16,32)"
    )
    parser.add_argument(
        "--unsplit-orders", action="store_true", help="4-bit: unsplit, x in either order"
    )
    args = parser.parse_args()
    bits = args.bits
    shapes = {"e4b": E4B_SHAPES, "26b": A26B_SHAPES}.get(
        args.shapes, SHAPES[:-1] if args.no_head else SHAPES
    )
    if args.only:
        wanted = set(args.only.split(","))
        shapes = [shape for shape in shapes if shape[2] in wanted]
    block_rows = tuple(int(r) for r in args.rows.split(","))
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows, best = [], []
    fastest_configs: dict[str, dict] = {}
    for n, k, label in shapes:
        weights = [packed_weight(n, k, bits, GROUP)]
        moved = sum(t.numel() * t.element_size() for t in weights[0])
        while len(weights) * moved < 4 * L2_BYTES and len(weights) < 16:
            weights.append(packed_weight(n, k, bits, GROUP))
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        check = None
        if n <= 65536:
            packed, scales, biases = weights[0]
            weight = dequantize_affine(packed, scales, biases, bits, GROUP).to(torch.bfloat16)
            want = torch.nn.functional.linear(x, weight)
            check = (want, x.double().abs() @ weight.double().abs().T)
            del weight
        chosen = am.gemv_config(n, k, bits, GROUP, sms)
        timed = []
        swept = configs(k, bits, block_rows, args.unsplit_orders)
        for config in swept + ([] if chosen in swept else [chosen]):  # the heuristic's too
            verdict = "-"
            if check is not None:
                got = am.affine_gemv_triton(x, *weights[0], bits, GROUP, config)
                verdict = within_bound(got, check[0], check[1], k)
                if not verdict.startswith("ok"):
                    rows.append([label, str(config), "-", "-", verdict])
                    continue
            calls = [
                (lambda w=w, c=config, x=x: am.affine_gemv_triton(x, *w, bits, GROUP, c))
                for w in weights
            ]
            micros = time_graph(calls)
            share = moved / (micros * 1e-6) / COPY_BANDWIDTH
            timed.append((micros, config))
            mark = " (heuristic)" if config == chosen else ""
            rows.append([label, f"{config}{mark}", f"{micros:.1f}", f"{share:.0%}", verdict])
            print(label, config, f"{micros:.1f} µs {share:.0%}", verdict, flush=True)
        timed.sort(key=lambda t: t[0])
        fastest_configs[f"{bits}bit {n}x{k}"] = dataclasses.asdict(timed[0][1])
        mine = next((m for m, c in timed if c == chosen), float("nan"))
        fastest, config = timed[0]
        best.append(
            [
                f"{label} {n}x{k}",
                f"{chosen}: {mine:.1f}",
                f"{config}: {fastest:.1f}",
                f"{moved / (fastest * 1e-6) / COPY_BANDWIDTH:.0%}",
                f"{mine / fastest:.2f}x",
            ]
        )
    summary = ["shape", "heuristic: µs", "fastest: µs", "% of 4.2 TB/s", "heuristic / fastest"]
    out = write_report(
        f"gpu_gemv_affine_sweep_{bits}bit.md",
        f"{bits}-bit affine GEMV launch sweep in CUDA graphs",
        f"MLX {bits}-bit g64, M=1. µs per call: a graph of back-to-back calls on distinct "
        "weights (past L2), replayed; % of 4.2 TB/s over the packed words, scales and biases.",
        (summary, best),
        rows,
    )
    # The fastest launch per shape, for benchmarks/lab/ab_decode.py's `gemv-json` variant.
    fastest = out / f"gpu_gemv_affine_sweep_{bits}bit.json"
    fastest.write_text(json.dumps(fastest_configs, indent=1))


if __name__ == "__main__":
    main()
