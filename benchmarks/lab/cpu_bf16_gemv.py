"""The GGUF block GEMV with fp32 activations against the AVX512-BF16 one (activations rounded
to bf16, the weights exact), per block type, at a decode step's shapes: interleaved in one
process (one call of each variant per round) so that a shared machine's drift hits both alike;
medians over the rounds, in weights per second.

    python benchmarks/lab/cpu_bf16_gemv.py --threads 2 --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "quant"))

from gguf_blocks_data import random_blocks
from hearth.ops import native
from hearth.quant.gguf_blocks import BLOCK_FORMATS

# (rows, row length): Gemma 4 E2B's gate/up and down projections, and an eighth of its tied
# head (larger than any cache, as the whole head is).
SHAPES = ((12288, 1536), (1536, 6144), (32768, 1536))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--rows", type=int, default=1, help="input rows (a batch of decodes)")
    parser.add_argument("--types", type=int, nargs="*", help="GGML type ids (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.kernels()
    if kernels is None or not kernels.bf16_gemv_types:
        sys.exit("no native kernels with the bf16 GEMV on this CPU (it needs AVX512-BF16)")
    types = args.types or sorted(kernels.bf16_gemv_types)
    print(f"threads {args.threads}, input rows {args.rows}, medians of {args.rounds} rounds")
    print("| type | rows x k | fp32 G weights/s | bf16 G weights/s | bf16 / fp32 |")
    print("|---|---|---|---|---|")
    for type_id in types:
        for rows, k in SHAPES:
            blocks = torch.from_numpy(random_blocks(type_id, rows=rows, cols=k, seed=type_id))
            x = torch.randn(args.rows, k)
            out = torch.empty(args.rows, rows)
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for bf16 in (False, True):
                    start = time.perf_counter()
                    kernels.blocks_gemv(type_id, x, blocks, out, bf16=bf16)
                    times[bf16].append(time.perf_counter() - start)
            fp32, bf16 = (rows * k / statistics.median(times[b]) / 1e9 for b in (False, True))
            name = BLOCK_FORMATS[type_id].name
            print(f"| {name} | {rows} x {k} | {fp32:.2f} | {bf16:.2f} | {bf16 / fp32:.2f} |")


if __name__ == "__main__":
    main()
