"""The per-layer input gate's GEMV with the add-norm before it folded in (`gemv_add_norm`),
against `add_rms_norm` then the GEMV, at E4B's decode shape (256 x 2560, one row), on the GPU.

Checks on fresh random draws: h (the residual sum the fused launch stores) against the
add-norm kernel's h, bit for bit or the share of elements that differ (the RMS's fp32 sum runs
in another order; at most an ulp where a rounding flips); the product against an fp64 oracle
of the h the kernel stored (bound: an output ulp + 4 sqrt(K) eps32 of sum |h w|). Timing: CUDA
graphs of 20 calls on distinct weights, median of 20 replays.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_gemv_add_norm.py
"""

from __future__ import annotations

import math

import torch

from gpu_gemv_bf16 import CALLS, replay_micros, write_table
from hearth.ops.gemv import gemv_add_norm, gemv_triton
from hearth.ops.norm import add_rms_norm

SHAPES = {"E4B per-layer gate": (256, 2560), "E2B per-layer gate": (256, 1536)}
DRAWS = 10
EPS = 1e-6


def check(n: int, k: int, seed: int) -> tuple[int, float, bool]:
    """(elements of h that differ from the add-norm kernel's, largest |diff| in ulps of h,
    product within its bound)."""
    torch.manual_seed(seed)
    bf16 = torch.bfloat16
    weight = torch.randn(n, k, device="cuda", dtype=bf16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=bf16) * 4
    residual = torch.randn(1, k, device="cuda", dtype=bf16)
    norm_weight = torch.rand(k, device="cuda") + 0.5
    out, summed = gemv_add_norm(x, weight, residual, norm_weight, EPS)
    expected = add_rms_norm(residual, x, norm_weight, EPS)[0]
    differ = int((summed != expected).sum())
    diff = (summed.float() - expected.float()).abs()
    ulps = torch.where(diff == 0, 0.0, diff / (expected.float().abs() * 2**-8)).max()
    oracle = summed.double() @ weight.double().T
    bound = 2**-8 * oracle.abs() + 4 * math.sqrt(k) * 2**-23 * (
        summed.double().abs() @ weight.double().abs().T
    )
    return differ, float(ulps), bool(((out.double() - oracle).abs() <= bound).all())


def main() -> None:
    rows = []
    for name, (n, k) in SHAPES.items():
        checks = [check(n, k, seed) for seed in range(DRAWS)]
        differ = sum(c[0] for c in checks)
        worst = max(c[1] for c in checks)
        within = all(c[2] for c in checks)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        x, residual = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        norm_weight = torch.rand(k, device="cuda") + 0.5

        def apart(i: int, x=x, residual=residual, w=norm_weight, weights=weights) -> object:
            return gemv_triton(add_rms_norm(residual, x, w, EPS)[0], weights[i])

        def fused(i: int, x=x, residual=residual, w=norm_weight, weights=weights) -> object:
            return gemv_add_norm(x, weights[i], residual, w, EPS)

        before, after = replay_micros(apart), replay_micros(fused)
        rows.append(
            f"| {name} {n}x{k} | {differ} of {DRAWS * k} ({worst:.2f} ulp at most) | "
            f"{'ok' if within else 'FAILED'} | {before:.2f} | {after:.2f} | {before / after:.2f}x |"
        )
        print(rows[-1], flush=True)
    write_table(
        "gpu_gemv_add_norm.md",
        "GEMV with the add-norm folded in",
        [
            f"{DRAWS} fresh draws per shape: h elements that differ from `add_rms_norm`'s; the "
            "product vs an fp64 oracle of the stored h. µs per call: CUDA-graph replay of "
            f"{CALLS} calls on distinct weights (add_rms_norm + GEMV, or the fused GEMV).",
            "",
            "| shape | h vs add_rms_norm | product vs fp64 | apart µs | fused µs | speedup |",
            "|---|---|---|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
