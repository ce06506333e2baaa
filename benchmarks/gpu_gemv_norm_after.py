"""The GEMV whose last program runs the residual add-norm after it (`gemv_norm_after`), against
the GEMV then the `add_rms_norm` kernel, at the decode shapes that take it (o_proj and down of
Gemma 3 12B and Gemma 4 31B, E4B's o_proj and per-layer projection), on the GPU.

Checks on fresh random draws: the GEMV's output y bit for bit; h (the new residual) and
norm(h) against the add-norm kernel's, as the share of elements that differ and the largest
difference in ulps (the RMS's fp32 sums run in another order, so a rounding may flip by an
ulp). Timing: CUDA graphs of 20 calls on distinct weights, median of 20 replays.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/gpu_gemv_norm_after.py
"""

from __future__ import annotations

import torch

from gpu_gemv_bf16 import CALLS, replay_micros, write_table
from hearth.kernels.gemv import NormAfter, gemv_norm_after, gemv_triton

# name: (N, K, per-layer GeGLU input with a separate up, layer scalar)
SHAPES = {
    "12B o_proj": (3840, 4096, False, False),
    "12B down": (3840, 15360, False, False),
    "E4B o_proj (sliding)": (2560, 2048, False, False),
    "E4B per-layer projection": (2560, 256, True, True),
    "31B down": (5376, 21504, False, True),
}
DRAWS = 10
EPS = 1e-6


def _operands(n: int, k: int, geglu: bool, scaled: bool, seed: int) -> tuple:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    bf16 = torch.bfloat16

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(*shape, device="cuda", generator=generator) * scale
        return values.to(bf16)

    x = draw(1, k, scale=2.0)
    up = draw(1, k) if geglu else None
    after = NormAfter(
        draw(1, n),
        torch.rand(n, device="cuda", generator=generator) + 0.5,
        EPS,
        torch.rand(n, device="cuda", generator=generator) + 0.5,
        draw(1, scale=0.5) if scaled else None,
    )
    return x, up, after


def _ulps(got: torch.Tensor, want: torch.Tensor) -> tuple[int, float]:
    diff = (got.float() - want.float()).abs()
    ulps = torch.where(diff == 0, 0.0, diff / (want.float().abs() * 2**-8))
    return int((diff != 0).sum()), float(ulps.max())


def check(n: int, k: int, geglu: bool, scaled: bool, seed: int) -> tuple[bool, tuple, tuple]:
    """(y bit-identical, (h elements differing, max ulps), (norm(h) the same))."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x, up, after = _operands(n, k, geglu, scaled, seed)
    summed, normed = torch.empty_like(after.residual), torch.empty_like(after.residual)
    y = gemv_triton(x, weight, geglu, up=up, norm_after=(after, summed, normed))
    plain = gemv_triton(x, weight, geglu, up=up)
    want_sum, want_norm = after.apply(plain)
    return bool(torch.equal(y, plain)), _ulps(summed, want_sum), _ulps(normed, want_norm)


def main() -> None:
    rows = []
    for name, (n, k, geglu, scaled) in SHAPES.items():
        checks = [check(n, k, geglu, scaled, seed) for seed in range(DRAWS)]
        same_y = all(c[0] for c in checks)
        h_differ, h_ulps = sum(c[1][0] for c in checks), max(c[1][1] for c in checks)
        z_differ, z_ulps = sum(c[2][0] for c in checks), max(c[2][1] for c in checks)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(CALLS)]
        x, up, after = _operands(n, k, geglu, scaled, DRAWS)

        def apart(i: int, x=x, up=up, after=after, weights=weights, geglu=geglu) -> object:
            return after.apply(gemv_triton(x, weights[i], geglu, up=up))

        def fused(i: int, x=x, up=up, after=after, weights=weights, geglu=geglu) -> object:
            return gemv_norm_after(x, weights[i], after, geglu, up)

        before, fused_micros = replay_micros(apart), replay_micros(fused)
        elements = DRAWS * n
        rows.append(
            f"| {name} {n}x{k} | {'same' if same_y else 'DIFFERENT'} | "
            f"{h_differ} of {elements} ({h_ulps:.2f} ulp at most) | "
            f"{z_differ} of {elements} ({z_ulps:.2f} ulp at most) | {before:.2f} | "
            f"{fused_micros:.2f} | {before / fused_micros:.3f}x |"
        )
        print(rows[-1], flush=True)
    write_table(
        "gpu_gemv_norm_after.md",
        "GEMV with the add-norm after it in its last program",
        [
            f"{DRAWS} fresh draws per shape: y against the plain GEMV's; h and norm(h) against "
            "the `add_rms_norm` kernel's on that y. µs per call: CUDA-graph replay of "
            f"{CALLS} calls on distinct weights (GEMV + add_rms_norm, or the one launch).",
            "",
            "| shape | y | h vs add_rms_norm | norm(h) vs add_rms_norm | apart µs | fused µs "
            "| speedup |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
