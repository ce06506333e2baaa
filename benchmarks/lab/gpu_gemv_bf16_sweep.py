"""Launch sweep of the bf16 Triton GEMV (`hearth.ops.gemv`) as decode runs it, in CUDA graphs.

The GEMV is autotuned, and Triton's autotuner times each config alone. The 4-bit GEMV's
launches ranked differently when timed as decode runs them, back to back in a CUDA graph
(results/gpu_gemv_affine_sweep-2026-12-03.md). This times every config of the autotuner's
space that way (`gpu_gemv_affine_sweep.time_graph`: one call on each of several distinct
weights, together past L2) beside the autotuner's own pick, at the shapes that take this
GEMV at a decode step (o_proj, down after GeGLU; K is a constexpr, so each shape compiles
every config: six shapes keep the run near four minutes). Each config
is first checked against cuBLAS on the same weight (bf16 output: within 2 ulps of |y| plus
fp32 accumulation error).

    OUT=/tmp/out PYTHONPATH=src python benchmarks/lab/gpu_gemv_bf16_sweep.py

`--wide` sweeps the projections with many outputs (qkv, gate/up), which decode runs on
cuBLAS, and times cuBLAS (`F.linear`) in the same graphs: its JSON keeps only the shapes
where the fastest GEMV launch beats cuBLAS by more than WIDE_MARGIN, the launches to pin in
`gemv.GEMV_LAUNCHES` (a pinned shape is what routes a wide projection to the GEMV).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import torch.nn.functional as F
import triton

from gpu_gemv_affine_sweep import L2_BYTES, time_graph, write_report
from gpu_kernels_affine import COPY_BANDWIDTH
from hearth.ops import gemv

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


# Projections with many outputs (N x K), swept with --wide against cuBLAS.
WIDE_SHAPES = [
    (8192, 3840, "12B qkv"),
    (30720, 3840, "12B gate/up"),
    (3072, 2560, "E4B qkv (sliding)"),
    (6144, 2560, "E4B qkv (global)"),
    (2048, 2560, "E4B q (shared KV, sliding)"),
    (4096, 2560, "E4B q (shared KV, global)"),
    (20480, 2560, "E4B gate/up"),
    (10752, 2560, "E4B per-layer model projection"),
    (8192, 2816, "26B-A4B qkv (sliding)"),
    (9216, 2816, "26B-A4B qkv (global)"),
    (4224, 2816, "26B-A4B dense gate/up"),
    (16384, 5376, "31B qkv (sliding)"),
    (18432, 5376, "31B qkv (global)"),
    (43008, 5376, "31B gate/up"),
]
# Many row blocks fill the GPU without a K split: unsplit tiles only.
WIDE_TILES = ((8, 512, 4), (8, 1024, 4), (16, 512, 8), (4, 1024, 4), (16, 256, 4))
WIDE_STAGES = (1, 3, 4)
# A GEMV launch must beat cuBLAS by more than this to be pinned: a graph timing's replays
# vary by ~1-2% between runs on the H200, so smaller leads may be noise.
WIDE_MARGIN = 0.03

# (BLOCK_N, BLOCK_K, warps) x SPLIT_K x LOOP_STAGES for --pipelined.
PIPELINED_TILES = ((8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 512, 8), (4, 1024, 4))
PIPELINED_SPLITS = (1, 2)
PIPELINED_STAGES = (1, 2, 3, 4)


def sweep_configs(pipelined: bool, k: int, wide: bool = False) -> list[dict]:
    """Launch configs (tiles, split, stages, num_warps) that fit this K."""
    if wide:
        configs = [
            {"BLOCK_N": n, "BLOCK_K": bk, "SPLIT_K": 1, "LOOP_STAGES": stages, "num_warps": w}
            for n, bk, w in WIDE_TILES
            for stages in WIDE_STAGES
        ]
    elif pipelined:
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


@dataclass
class Case:
    """One shape's timing inputs: distinct weights past L2, one x, cuBLAS's output and the
    bound a launch's output must keep to (bf16: 2 ulps of |y| plus fp32 accumulation)."""

    weights: list[torch.Tensor]
    x: torch.Tensor
    want: torch.Tensor
    bound: float

    @classmethod
    def of(cls, n: int, k: int) -> Case:
        device = torch.device("cuda")
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5]
        while len(weights) * weights[0].numel() * 2 < 4 * L2_BYTES and len(weights) < 64:
            weights.append(torch.randn_like(weights[0]))
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        want = F.linear(x, weights[0]).float()
        bound = 2 * torch.finfo(torch.bfloat16).eps * want.abs().max().item() + 1e-3
        return cls(weights, x, want, bound)

    def share(self, micros: float) -> str:
        """The weight bytes per call over `micros`, as a share of copy bandwidth."""
        moved = self.weights[0].numel() * 2
        return f"{moved / (micros * 1e-6) / COPY_BANDWIDTH:.0%}"

    def time(self, call) -> float:
        """µs of `call(x, w)` over the distinct weights in a CUDA graph."""
        return time_graph([lambda w=w: call(self.x, w) for w in self.weights])

    def time_launch(self, config: dict) -> float | str:
        """µs of the GEMV at `config`, or why its output failed the check."""

        def launch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return gemv.gemv_triton(x, w, False, config)

        error = (launch(self.x, self.weights[0]).float() - self.want).abs().max().item()
        if error > self.bound:
            return f"FAIL ({error:.3g} > {self.bound:.3g})"
        return self.time(launch)


def config_name(config: dict) -> str:
    tiles = " ".join(f"{key}={v}" for key, v in config.items() if key != "num_warps")
    return f"{tiles} w{config['num_warps']}"


def time_configs(
    case: Case, label: str, configs: list[dict], rows: list[list[str]], tuned: dict | None = None
) -> list[tuple[float, str, dict]]:
    """(µs, name, config) of each launch that passes its check; a report row for every one
    (the `tuned` config marked as the autotuner's pick)."""
    timed = []
    for config in configs:
        autotuned = {"LOOP_STAGES": 1, **config} == tuned  # 1: the kernel's default
        name = config_name(config) + (" (autotuned)" if autotuned else "")
        micros = case.time_launch(config)
        if isinstance(micros, str):
            rows.append([label, name, "-", "-", micros])
            continue
        timed.append((micros, name, config))
        rows.append([label, name, f"{micros:.1f}", case.share(micros), "ok"])
        print(label, name, f"{micros:.1f} µs {case.share(micros)}", flush=True)
    return timed


def compile_share(shapes: list, configs_of, warm: str, autotuned: bool = False) -> None:
    """--warm I/N: compile every N-th launch of the sweep (parallel processes fill the cache)."""
    warm_index, warm_count = map(int, warm.split("/"))
    device = torch.device("cuda")
    for shape, (n, k, _) in enumerate(shapes):
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        for index, config in enumerate(configs_of(k)):
            if index % warm_count == warm_index:
                gemv.gemv_triton(x, w, False, config)
        if autotuned and shape % warm_count == warm_index:
            gemv.gemv_triton(x, w)  # the autotuner compiles its own configs too


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pipelined", action="store_true", help="sweep LOOP_STAGES and tiles")
    parser.add_argument("--wide", action="store_true", help="qkv and gate/up against cuBLAS")
    parser.add_argument(
        "--wide-check", action="store_true", help="pinned wide launches' error vs cuBLAS's"
    )
    parser.add_argument("--warm", default="", help="I/N: only compile every N-th config")
    args = parser.parse_args()
    if args.wide_check:
        check_wide()
        return
    if args.wide:
        configs_of = partial(sweep_configs, True, wide=True)
        if args.warm:
            compile_share(WIDE_SHAPES, configs_of, args.warm)
        else:
            sweep_wide(configs_of)
        return
    shapes = SHAPES + (MORE_SHAPES if args.pipelined else [])
    if args.warm:
        compile_share(shapes, partial(sweep_configs, args.pipelined), args.warm, autotuned=True)
        return
    rows, best = [], []
    fastest_configs: dict[str, dict] = {}
    for n, k, label in shapes:
        case = Case.of(n, k)
        gemv.gemv_triton(case.x, case.weights[0])  # the autotuner picks its config for this shape
        key_config = next(
            (c for key, c in gemv._gemv_tuned.cache.items() if key[0] == n and key[1] == k),
            None,
        )
        # The autotuner's pick as a swept config.
        tuned = (
            {"LOOP_STAGES": 1, **key_config.kwargs, "num_warps": key_config.num_warps}
            if key_config is not None
            else None
        )
        timed = time_configs(case, label, sweep_configs(args.pipelined, k), rows, tuned)
        auto = case.time(gemv.gemv_triton)
        if not timed:
            continue
        fastest, name, fastest_config = min(timed, key=lambda t: t[0])
        fastest_configs[f"{n}x{k}"] = fastest_config
        best.append(
            [
                f"{label} {n}x{k}",
                f"{auto:.1f} ({case.share(auto)})",
                f"{name}: {fastest:.1f} ({case.share(fastest)})",
                f"{auto / fastest:.2f}x",
            ]
        )
    name = "gpu_gemv_bf16_sweep_pipelined" if args.pipelined else "gpu_gemv_bf16_sweep"
    # The fastest launch per shape, for benchmarks/lab/ab_decode.py's `gemv-bf16-json` variant.
    write_json(f"{name}.json", fastest_configs)
    write_report(
        f"{name}.md",
        "bf16 GEMV launch sweep in CUDA graphs",
        "M=1. µs per call: a graph of back-to-back calls on distinct weights (past L2), "
        "replayed; % of 4.2 TB/s over the weight bytes.",
        (["shape", "autotuned: µs (%)", "fastest: µs (%)", "autotuned / fastest"], best),
        rows,
    )


def out_dir() -> Path:
    out = Path(os.environ.get("OUT", "benchmarks/results/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(name: str, launches: dict[str, dict]) -> None:
    (out_dir() / name).write_text(json.dumps(launches, indent=1))


def check_wide(draws: int = 4) -> None:
    """--wide-check: at each wide shape with a pinned launch, the largest error against an
    fp64 product of the GEMV (as decode dispatches it) and of cuBLAS, on fresh random draws."""
    device = torch.device("cuda")
    rows = []
    for n, k, label in WIDE_SHAPES:
        if (n, k) not in gemv.GEMV_LAUNCHES:
            continue
        worst = {"GEMV": 0.0, "cuBLAS": 0.0}
        largest = 0.0
        for draw in range(draws):
            generator = torch.Generator(device=device).manual_seed(draw)
            w = torch.randn(n, k, device=device, generator=generator) * k**-0.5
            w = w.to(torch.bfloat16)
            x = torch.randn(1, k, device=device, generator=generator).to(torch.bfloat16)
            exact = x.double() @ w.double().T
            largest = max(largest, exact.abs().max().item())
            for name, y in (("GEMV", gemv.gemv(x, w)), ("cuBLAS", F.linear(x, w))):
                worst[name] = max(worst[name], (y.double() - exact).abs().max().item())
        rows.append(
            [
                f"{label} {n}x{k}",
                config_name(gemv.GEMV_LAUNCHES[(n, k)]),
                f"{worst['GEMV']:.4f}",
                f"{worst['cuBLAS']:.4f}",
                f"{largest:.2f}",
            ]
        )
        print(*rows[-1], flush=True)
    header = "# Pinned wide GEMV launches: error against fp64, beside cuBLAS's"
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    lines = [
        f"{header} ({time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, {versions})",
        "",
        f"M=1, bf16 x and W (W ~ N(0, 1/K)), {draws} draws a shape; largest |y - y_fp64|. "
        "Both round the output to bf16 once (half an ulp: 2^-9 |y|).",
        "",
        "| shape | launch | GEMV max error | cuBLAS max error | max |y| |",
        "|---|---|---|---|---|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
    (out_dir() / "gpu_gemv_bf16_wide_check.md").write_text("\n".join(lines) + "\n")


def sweep_wide(configs_of) -> None:
    """--wide: every launch of WIDE_SHAPES and cuBLAS in the same graph harness."""
    rows, best, pinned = [], [], {}
    for n, k, label in WIDE_SHAPES:
        case = Case.of(n, k)
        cublas = case.time(F.linear)
        rows.append([label, "cuBLAS (F.linear)", f"{cublas:.1f}", case.share(cublas), "-"])
        timed = time_configs(case, label, configs_of(k), rows)
        if not timed:
            continue
        fastest, name, config = min(timed, key=lambda t: t[0])
        wins = fastest * (1 + WIDE_MARGIN) < cublas
        if wins:
            pinned[f"{n}x{k}"] = config
        best.append(
            [
                f"{label} {n}x{k}",
                f"{cublas:.1f} ({case.share(cublas)})",
                f"{name}: {fastest:.1f} ({case.share(fastest)})",
                f"{cublas / fastest:.2f}x",
                "GEMV" if wins else "cuBLAS",
            ]
        )
    write_json("gpu_gemv_bf16_sweep_wide.json", pinned)
    write_report(
        "gpu_gemv_bf16_sweep_wide.md",
        "bf16 GEMV against cuBLAS on the wide decode projections, in CUDA graphs",
        "M=1. µs per call: a graph of back-to-back calls on distinct weights (past L2), "
        "replayed; % of 4.2 TB/s over the weight bytes. Pinned: the GEMV beats cuBLAS by more "
        f"than {WIDE_MARGIN:.0%}.",
        (["shape", "cuBLAS: µs (%)", "fastest GEMV: µs (%)", "cuBLAS / GEMV", "pinned"], best),
        rows,
    )


if __name__ == "__main__":
    main()
