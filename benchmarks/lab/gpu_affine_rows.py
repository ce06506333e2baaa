"""MLX affine matmuls at batched-decode row counts (M = 1..64) on Gemma 3 12B's shapes, by path.

For each weight (4-bit, or 8-bit with --bits 8; group 64; bf16 x, scales and biases) and each
M, times from CUDA graphs of back-to-back calls on distinct weight copies (at least 256 MB a
replay, past L2), as batched decode replays them:

* ``mma``: the tensor-core kernel (`affine_mma_triton`, its `mma_config` launch), every M;
* ``gemv``: the unrolled GEMV at M <= 4, the tile GEMV at 5..16 (`affine_gemv_triton`);
* ``dequant+cuBLAS``: the dequantize kernel then bf16 `F.linear` (the path past 16 rows
  before the tensor-core kernel, and past MMA_MAX_ROWS now);
* ``bf16 cuBLAS``: `F.linear` on a bf16 weight of the same shape (its own bytes);
* ``dispatch``: `affine_linear`, what the runtime runs at that M.

GB/s is the weight's bytes one call must read (packed + scales + biases; bf16: N * K * 2) over
its time, and % its share of the copy bandwidth measured here (1 GiB device-to-device copy,
read + write). Before timing, the mma kernel is checked at every shape and M against an
fp64 product of the unrounded weights (`ok (max error / bound)`; bound: one bf16 ulp of the
output plus 4 sqrt(K) eps32 of sum |x w|, the CPU tests' bound).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_affine_rows.py [--bits 4,8]
    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_affine_rows.py --sweep

`--sweep` instead times mma launches one field away from `mma_config`'s (columns a program,
warps, pipeline stages, K splits) at M = 16 and 64 on q/k/v, gate/up and down, for --budget
seconds at most, and prints each shape's fastest beside the heuristic's. The tables go to
$OUT (`gpu_affine_rows.md`, `gpu_affine_rows_sweep.md`) when it is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch
import torch.nn.functional as F

from hearth.ops import affine_matmul as am
from hearth.quant.mlx import pack_codes

DEVICE = torch.device("cuda")
BF16 = torch.bfloat16
EPS32 = torch.finfo(torch.float32).eps
GROUP = 64
ROWS = (1, 4, 8, 16, 32, 64)
# (N, K): Gemma 3 12B's stacked q/k/v (16 query heads and 2 x 8 key/value heads of 256), o,
# stacked gate/up, down, and the tied 262144-token head.
SHAPES = [
    (8192, 3840, "qkv"),
    (3840, 4096, "o"),
    (30720, 3840, "gate/up"),
    (3840, 15360, "down"),
    (262144, 3840, "head"),
]
REPLAY_BYTES = 1 << 28  # weight bytes a graph replay reads at least: L2 (50-60 MB) holds none


def packed_weight(n: int, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes, scales in [0.001, 0.021) and biases near -scale * 2**(bits-1), bf16."""
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(n, k // GROUP, device=DEVICE) * 0.02 + 0.001).to(BF16)
    noise = 0.001 * torch.randn(n, k // GROUP, device=DEVICE)
    biases = (-scales.float() * (1 << (bits - 1)) + noise).to(BF16)
    return pack_codes(codes, bits), scales, biases


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), best of 10."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    b.copy_(a)
    best = math.inf
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    return 2 * a.numel() / best


def time_graph(calls: list[Callable[[], object]]) -> float:
    """Seconds per call: the calls (at least 20) captured into one CUDA graph, replayed;
    median of 5 timings of 10 replays."""
    calls = calls * -(-20 // len(calls))
    for call in calls[:2]:
        call()  # compiled (and the tile GEMV autotuned) outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
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
        samples.append(start.elapsed_time(end) * 1e-3 / (10 * len(calls)))
    return sorted(samples)[2]


def copies(tensors: tuple[torch.Tensor, ...]) -> list[tuple[torch.Tensor, ...]]:
    """`tensors` and clones of them, enough that one pass over all reads REPLAY_BYTES."""
    count = max(1, -(-REPLAY_BYTES // nbytes(*tensors)))
    return [tensors] + [tuple(t.clone() for t in tensors) for _ in range(count - 1)]


def check(x: torch.Tensor, weight: tuple, bits: int, config: am.MmaConfig | None = None) -> str:
    """The mma kernel against fp64 of the unrounded weights: 'ok (ratio)' or 'FAIL (ratio)'."""
    packed, scales, biases = weight
    got = am.affine_mma_triton(x, packed, scales, biases, bits, GROUP, config).double()
    codes = torch.stack(
        [(packed.view(torch.int32) >> (j * bits)) & ((1 << bits) - 1) for j in range(32 // bits)],
        dim=-1,
    ).flatten(-2)
    w = codes.double().unflatten(-1, (-1, GROUP))
    w = (w * scales.double()[..., None] + biases.double()[..., None]).flatten(-2)
    want = x.double() @ w.T
    magnitude = x.double().abs() @ w.abs().T
    k = x.shape[-1]
    bound = torch.finfo(BF16).eps * want.abs() + 4 * math.sqrt(k) * EPS32 * magnitude
    ratio = ((got - want).abs() / (bound + 1e-30)).max().item()
    return f"{'ok' if ratio <= 1 else 'FAIL'} ({ratio:.2f})"


def paths(m: int, bits: int) -> dict[str, Callable | None]:
    """Each path's call on (x, packed, scales, biases), or None where it does not apply."""
    return {
        "mma": partial(_mma, bits=bits),
        "gemv": partial(_gemv, bits=bits) if m <= am.GEMV_MAX_ROWS else None,
        "dequant+cuBLAS": partial(_dequant_cublas, bits=bits),
        "dispatch": partial(_dispatch, bits=bits),
    }


def _mma(x, packed, scales, biases, bits, config=None):
    return am.affine_mma_triton(x, packed, scales, biases, bits, GROUP, config)


def _gemv(x, packed, scales, biases, bits):
    return am.affine_gemv_triton(x, packed, scales, biases, bits, GROUP)


def _dequant_cublas(x, packed, scales, biases, bits):
    weight = am.affine_dequantize_triton(packed, scales, biases, bits, GROUP, x.dtype)
    return F.linear(x, weight)


def _dispatch(x, packed, scales, biases, bits):
    return am.affine_linear(x, packed, scales, biases, bits, GROUP)


def measure(bits_list: list[int], bandwidth: float, save: Callable[[list[str]], None]) -> list[str]:
    lines = [
        "| weight | bits | M | path | launch | check | µs | GB/s | % copy | vs dequant+cuBLAS |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for bits in bits_list:
        for n, k, name in SHAPES:
            weight = packed_weight(n, k, bits)
            weights = copies(weight)
            moved = nbytes(*weight)
            dense = torch.randn(n, k, device=DEVICE).to(BF16)
            denses = copies((dense,))
            sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
            for m in ROWS:
                x = torch.randn(m, k, device=DEVICE).to(BF16)
                verdict = check(x, weight, bits) if n * k <= 15360 * 15360 else "-"
                times: dict[str, float] = {}
                for path, fn in paths(m, bits).items():
                    if fn is not None:
                        times[path] = time_graph([partial(fn, x, *w) for w in weights])
                times["bf16 cuBLAS"] = time_graph([partial(F.linear, x, d) for (d,) in denses])
                base = times["dequant+cuBLAS"]
                for path, seconds in times.items():
                    size = nbytes(dense) if path == "bf16 cuBLAS" else moved
                    launch = str(am.mma_config(m, n, k, bits, GROUP, sms)) if path == "mma" else ""
                    lines.append(
                        f"| {name} {n}x{k} | {bits} | {m} | {path} | {launch} | "
                        f"{verdict if path == 'mma' else ''} | {seconds * 1e6:.1f} | "
                        f"{size / seconds / 1e9:.0f} | {100 * size / seconds / bandwidth:.0f} | "
                        f"{base / seconds:.2f}x |"
                    )
                print("\n".join(lines[-len(times) :]), flush=True)
                save(lines)  # what is measured so far survives a timeout
            del weights, denses
            torch.cuda.empty_cache()
    return lines


def sweep_configs(m: int, n: int, k: int, bits: int, sms: int) -> list[am.MmaConfig]:
    """The heuristic's launch first, then its neighbours one field away: 64 or 256 columns a
    program, the other warp count, 2 or 4 pipeline stages, half or twice the K splits (at
    most 8, each split at least 2 groups)."""
    chosen = am.mma_config(m, n, k, bits, GROUP, sms)
    neighbours = [dataclasses.replace(chosen, block_n=b) for b in (64, 256)]
    neighbours.append(dataclasses.replace(chosen, warps=12 - chosen.warps))
    neighbours += [dataclasses.replace(chosen, stages=s) for s in (2, 4)]
    splits = (chosen.split_k // 2, chosen.split_k * 2)
    neighbours += [
        dataclasses.replace(chosen, split_k=s)
        for s in splits
        if 1 <= s <= am.MAX_SPLIT_K and k // GROUP >= 2 * s
    ]
    return [chosen, *(c for c in neighbours if c != chosen)]


def sweep(
    bits_list: list[int], bandwidth: float, budget: float, save: Callable[[list[str]], None]
) -> list[str]:
    lines = [
        "| weight | bits | M | launch | check | µs | % copy | vs heuristic |",
        "|---|---|---|---|---|---|---|---|",
    ]
    summary = [
        "| weight | bits | M | heuristic | µs | fastest | µs |",
        "|---|---|---|---|---|---|---|",
    ]
    deadline = time.monotonic() + budget
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for bits in bits_list:
        for n, k, name in [SHAPES[0], SHAPES[2], SHAPES[3]]:
            weight = packed_weight(n, k, bits)
            weights = copies(weight)
            moved = nbytes(*weight)
            for m in (16, 64):
                x = torch.randn(m, k, device=DEVICE).to(BF16)
                results: list[tuple[float, am.MmaConfig]] = []
                for config in sweep_configs(m, n, k, bits, sms):
                    if time.monotonic() > deadline:
                        break
                    try:
                        verdict = check(x, weight, bits, config)
                        calls = [partial(_mma, x, *w, bits=bits, config=config) for w in weights]
                        seconds = time_graph(calls)
                    except Exception as error:  # a launch that does not compile or fit
                        lines.append(f"| {name} | {bits} | {m} | {config} | {error!r:.60} | | | |")
                        continue
                    results.append((seconds, config))
                    lines.append(
                        f"| {name} {n}x{k} | {bits} | {m} | {config} | {verdict} | "
                        f"{seconds * 1e6:.1f} | {100 * moved / seconds / bandwidth:.0f} | "
                        f"{results[0][0] / seconds:.2f}x |"
                    )
                    print(lines[-1], flush=True)
                    save([*summary, "", *lines])
                if results:
                    best = min(results, key=lambda r: r[0])
                    summary.append(
                        f"| {name} | {bits} | {m} | {results[0][1]} | {results[0][0] * 1e6:.1f} | "
                        f"{best[1]} | {best[0] * 1e6:.1f} |"
                    )
            del weights
            torch.cuda.empty_cache()
    return [*summary, "", *lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", default="4", help="comma-separated widths (4, 8)")
    parser.add_argument("--sweep", action="store_true", help="mma launches around the heuristic")
    parser.add_argument("--budget", type=float, default=240.0, help="sweep seconds at most")
    args = parser.parse_args()
    bits_list = [int(b) for b in args.bits.split(",")]
    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    gpu = torch.cuda.get_device_name(DEVICE)
    driver = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    head = [
        f"# MLX affine matmuls at batched-decode rows, {time.strftime('%Y-%m-%d')}",
        "",
        f"{gpu} (driver {driver}), copy bandwidth {bandwidth / 1e12:.2f} TB/s; torch "
        f"{torch.__version__}. Group {GROUP}, bf16 x / scales / biases; CUDA graphs of "
        "back-to-back calls past L2. GB/s: the weight's bytes (packed + scales + biases; "
        "bf16 cuBLAS: N x K x 2) over the time.",
        "",
    ]
    name = "gpu_affine_rows_sweep.md" if args.sweep else "gpu_affine_rows.md"

    def save(lines: list[str]) -> None:
        if os.environ.get("OUT"):
            out = Path(os.environ["OUT"])
            out.mkdir(parents=True, exist_ok=True)
            (out / name).write_text("\n".join(head + lines) + "\n")

    if args.sweep:
        lines = sweep(bits_list, bandwidth, args.budget, save)
    else:
        lines = measure(bits_list, bandwidth, save)
    save(lines)
    print("\n".join(head + lines))


if __name__ == "__main__":
    main()
