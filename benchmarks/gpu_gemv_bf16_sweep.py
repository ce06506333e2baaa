"""Launch sweep of the bf16 Triton GEMV (`hearth.kernels.gemv`) as decode runs it, in CUDA graphs.

The GEMV is autotuned, and Triton's autotuner times each config alone. The 4-bit GEMV's
launches ranked differently when timed as decode runs them, back to back in a CUDA graph
(results/gpu_gemv_affine_sweep-2026-12-03.md). This times every config of the autotuner's
space that way (`gpu_gemv_affine_sweep.time_graph`: one call on each of several distinct
weights, together past L2) beside the autotuner's own pick, at the shapes that take this
GEMV at a decode step (o_proj, down after GeGLU; K is a constexpr, so each shape compiles
every config: six shapes keep the run near four minutes). Each config
is first checked against cuBLAS on the same weight (bf16 output: within 2 ulps of |y| plus
fp32 accumulation error).

    OUT=/tmp/out PYTHONPATH=src python benchmarks/gpu_gemv_bf16_sweep.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import torch.nn.functional as F

from gpu_gemv_affine_sweep import L2_BYTES, time_graph, write_report
from gpu_kernels_affine import COPY_BANDWIDTH
from hearth.kernels import gemv

SHAPES = [
    (3840, 4096, "12B o"),
    (3840, 15360, "12B down"),
    (2560, 2048, "E4B o (sliding)"),
    (2560, 10240, "E4B down"),
    (2816, 4096, "26B-A4B o (sliding)"),
    (2816, 2112, "26B-A4B dense down"),
]
# More decode shapes of this GEMV, swept with --pipelined.
MORE_SHAPES = [
    (2560, 4096, "E4B o (global)"),
    (256, 2560, "E4B per-layer gate"),
    (2816, 8192, "26B-A4B o (global)"),
    (5376, 8192, "31B o (sliding)"),
    (5376, 21504, "31B down"),
]


# (BLOCK_N, BLOCK_K, warps) x SPLIT_K x LOOP_STAGES for --pipelined.
PIPELINED_TILES = ((8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 512, 8), (4, 1024, 4))
PIPELINED_SPLITS = (1, 2)
PIPELINED_STAGES = (1, 2, 3, 4)


def sweep_configs(pipelined: bool, k: int) -> list[dict]:
    """Launch configs (tiles, split, stages, num_warps) that fit this K."""
    if pipelined:
        configs = [
            {"BLOCK_N": n, "BLOCK_K": bk, "SPLIT_K": split, "LOOP_STAGES": stages, "num_warps": w}
            for n, bk, w in PIPELINED_TILES
            for split in PIPELINED_SPLITS
            for stages in PIPELINED_STAGES
        ]
    else:
        configs = [{**c.kwargs, "num_warps": c.num_warps} for c in gemv._CONFIGS]
    return [
        c
        for c in configs
        if k >= 2 * c["SPLIT_K"] * c["BLOCK_K"] and c["BLOCK_N"] * c["BLOCK_K"] <= 8192
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipelined", action="store_true", help="sweep LOOP_STAGES and tiles")
    parser.add_argument("--warm", default="", help="I/N: only compile every N-th config")
    args = parser.parse_args()
    warm_index, warm_count = map(int, args.warm.split("/")) if args.warm else (0, 0)
    device = torch.device("cuda")
    rows, best = [], []
    fastest_configs: dict[str, dict] = {}
    for shape, (n, k, label) in enumerate(SHAPES + (MORE_SHAPES if args.pipelined else [])):
        if warm_count:
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
            for index, config in enumerate(sweep_configs(args.pipelined, k)):
                if index % warm_count == warm_index:
                    gemv.gemv_triton(x, w, False, config)
            if shape % warm_count == warm_index:
                gemv.gemv_triton(x, w)  # the autotuner compiles its own configs too
            continue
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5]
        moved = weights[0].numel() * 2
        while len(weights) * moved < 4 * L2_BYTES and len(weights) < 64:
            weights.append(torch.randn_like(weights[0]))
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        want = F.linear(x, weights[0]).float()
        bound = 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item() + 1e-3
        gemv.gemv_triton(x, weights[0])  # the autotuner picks its config for this shape
        key_config = next(
            (c for key, c in gemv._gemv_tuned.cache.items() if key[0] == n and key[1] == k),
            None,
        )
        tuned = (
            {**key_config.kwargs, "warps": key_config.num_warps} if key_config is not None else {}
        )
        timed = []
        for config in sweep_configs(args.pipelined, k):
            tiles = {key: v for key, v in config.items() if key != "num_warps"}
            name = " ".join(f"{key}={v}" for key, v in tiles.items()) + f" w{config['num_warps']}"

            def launch(w: torch.Tensor, config: dict = config, x=x) -> torch.Tensor:
                return gemv.gemv_triton(x, w, False, config)

            error = (launch(weights[0]).float() - want).abs().max().item()
            if error > bound:
                rows.append([label, name, "-", "-", f"FAIL ({error:.3g} > {bound:.3g})"])
                continue
            micros = time_graph([lambda w=w: launch(w) for w in weights])
            timed.append((micros, name, config))
            share = moved / (micros * 1e-6) / COPY_BANDWIDTH
            plain = {**tiles, "warps": config["num_warps"]}
            if plain.get("LOOP_STAGES") == 1:  # the autotuned kernel's default
                del plain["LOOP_STAGES"]
            mine = " (autotuned)" if plain == tuned else ""
            rows.append([label, name + mine, f"{micros:.1f}", f"{share:.0%}", "ok"])
            print(label, name + mine, f"{micros:.1f} µs {share:.0%}", flush=True)
        auto = time_graph([lambda w=w, x=x: gemv.gemv_triton(x, w) for w in weights])
        if not timed:
            continue
        timed.sort(key=lambda t: t[0])
        fastest, name, fastest_config = timed[0]
        fastest_configs[f"{n}x{k}"] = fastest_config
        best.append(
            [
                f"{label} {n}x{k}",
                f"{auto:.1f} ({moved / (auto * 1e-6) / COPY_BANDWIDTH:.0%})",
                f"{name}: {fastest:.1f} ({moved / (fastest * 1e-6) / COPY_BANDWIDTH:.0%})",
                f"{auto / fastest:.2f}x",
            ]
        )
    if warm_count:
        return
    name = "gpu_gemv_bf16_sweep_pipelined" if args.pipelined else "gpu_gemv_bf16_sweep"
    # The fastest launch per shape, for benchmarks/ab_decode.py's `gemv-bf16-json` variant.
    out = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(fastest_configs, indent=1))
    write_report(
        f"{name}.md",
        "bf16 GEMV launch sweep in CUDA graphs",
        "M=1. µs per call: a graph of back-to-back calls on distinct weights (past L2), "
        "replayed; % of 4.2 TB/s over the weight bytes.",
        (["shape", "autotuned: µs (%)", "fastest: µs (%)", "autotuned / fastest"], best),
        rows,
    )


if __name__ == "__main__":
    main()
