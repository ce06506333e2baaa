"""The GGUF prefill GEMM on the embedded Gemma 3 270M's own layer-0 weights (the file's block
types): the tiled fp32 GEMM (dequantize a tile, torch's fp32 matmul) against the AMX bf16-tile
kernel with inputs split into bf16 hi + lo (b, the default) and rounded to one bf16 (a).
Interleaved in one process (one call of each variant per round) so that a shared machine's
drift hits all alike; medians over the rounds, in GFLOP/s (2·m·n·k).

    python benchmarks/lab/cpu_amx_prefill.py --threads 2 --rounds 9
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import torch

from hearth.embedded import embedded_model_path
from hearth.engine import Engine
from hearth.ops import native
from hearth.quant.gguf_blocks import BLOCK_FORMATS


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--rows", type=int, nargs="*", default=[128, 512, 1024])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.kernels()
    if kernels is None or not kernels.amx_gemm_types:
        sys.exit("no native kernels with the AMX GEMM on this CPU (it needs AMX-BF16)")
    engine = Engine.load(embedded_model_path(), device="cpu", progress=False)
    layer = engine.model.layers[0]
    linears = {
        "q/k/v": layer.self_attn.qkv_proj.proj,
        "o": layer.self_attn.o_proj,
        "gate/up": layer.mlp.gate_up_proj.proj,
        "down": layer.mlp.down_proj,
    }
    print(f"threads {args.threads}, medians of {args.rounds} rounds, GFLOP/s")
    print("| layer | type | k -> n | rows | fp32 tiled | AMX hi+lo (b) | AMX bf16 (a) | b / fp32 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, linear in linears.items():
        for type_id, blocks in linear.parts():
            k, n = linear.in_features, blocks.shape[0]
            for m in args.rows:
                x = torch.randn(m, k)
                out = torch.empty(m, n)
                variants: dict[str, Callable[[], None]] = {
                    "fp32": functools.partial(linear._tiled_matmul, type_id, x, blocks, out),
                    "b": functools.partial(kernels.blocks_gemm_amx, type_id, x, blocks, out, True),
                    "a": functools.partial(kernels.blocks_gemm_amx, type_id, x, blocks, out, False),
                }
                times: dict[str, list[float]] = {v: [] for v in variants}
                for _ in range(args.rounds):
                    for variant, run in variants.items():
                        start = time.perf_counter()
                        run()
                        times[variant].append(time.perf_counter() - start)
                rate = {v: 2 * m * n * k / statistics.median(t) / 1e9 for v, t in times.items()}
                print(
                    f"| {name} | {BLOCK_FORMATS[type_id].name} | {k} -> {n} | {m} "
                    f"| {rate['fp32']:.0f} | {rate['b']:.0f} | {rate['a']:.0f} "
                    f"| {rate['b'] / rate['fp32']:.2f} |"
                )


if __name__ == "__main__":
    main()
