"""bf16 matrix-vector products at Gemma 3 12B shapes: cuBLAS (F.linear) against Hearth's
Triton GEMV (the float gathered-expert kernel with one expert), batch 1.

    OUT=/tmp/out python benchmarks/gpu_gemv_bf16.py
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from hearth.kernels.affine_matmul import float_expert_matmul_triton

SHAPES = {  # (out, in) of the 12B decode step's projections
    "qkv": (8192, 3840),
    "o_proj": (3840, 4096),
    "gate_up": (30720, 3840),
    "down": (3840, 15360),
    "head": (262144, 3840),
}
BANDWIDTH = 4.2e12


def main() -> None:
    rows = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ids = torch.zeros((1, 1), dtype=torch.long, device="cuda")
        stacked = weight[None]
        reference = F.linear(x, weight)
        triton_out = float_expert_matmul_triton(x, stacked, ids).reshape(1, n)
        error = (triton_out.float() - reference.float()).abs().max() / reference.abs().max()
        cublas = do_bench(lambda w=weight, x=x: F.linear(x, w), return_mode="median") * 1e-3
        kernel = (
            do_bench(
                lambda s=stacked, x=x, i=ids: float_expert_matmul_triton(x, s, i),
                return_mode="median",
            )
            * 1e-3
        )
        floor = weight.nbytes / BANDWIDTH
        rows.append(
            f"| {name} | {n}x{k} | {cublas * 1e6:.1f} ({floor / cublas:.0%}) | "
            f"{kernel * 1e6:.1f} ({floor / kernel:.0%}) | {error:.1e} |"
        )
        print(rows[-1], flush=True)
    table = "\n".join(
        [
            f"# bf16 GEMV, batch 1 — {datetime.date.today()}, {torch.cuda.get_device_name()}, "
            f"torch {torch.__version__}, triton {triton.__version__}",
            "",
            "µs per call (median, do_bench) and share of the 4.2 TB/s floor (weight bytes).",
            "",
            "| projection | shape | cuBLAS µs | Triton µs | rel. error |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_gemv_bf16.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
