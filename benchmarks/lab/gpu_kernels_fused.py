"""The fused elementwise kernels on a GPU: agreement with the torch reference at real shapes
(bf16, batch-1 decode and a 512-token prefill) and time per call against the eager ops.

    OUT=/tmp/out python benchmarks/lab/gpu_kernels_fused.py

Writes $OUT/gpu_kernels_fused.md (default benchmarks/results/).
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hearth.kv.cache import EMPTY_POSITION
from hearth.ops import activation, kv_write, norm, rope

EPS = 1e-6
DTYPE = torch.bfloat16


def max_error(got: object, expected: object) -> float:
    """Largest |difference| relative to the row's largest |value|, over tensors or tuples."""
    pairs = zip(got, expected, strict=True) if isinstance(got, tuple) else [(got, expected)]
    worst = 0.0
    for a, b in pairs:
        if a is None or b is None:
            continue
        scale = b.abs().float().amax(dim=-1, keepdim=True).clamp_min(1e-3)
        worst = max(worst, ((a.float() - b.float()).abs() / scale).max().item())
    return worst


def row(
    name: str,
    shape: str,
    kernel: Callable[..., object],
    reference: Callable[..., object],
    *args: object,
) -> str:
    error = max_error(kernel(*args), reference(*args))
    kernel_us = do_bench(lambda: kernel(*args), return_mode="median") * 1e3
    eager_us = do_bench(lambda: reference(*args), return_mode="median") * 1e3
    return f"| {name} | {shape} | {error:.2e} | {kernel_us:.1f} | {eager_us:.1f} |"


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for tokens in (1, 512):
        hidden = 3840
        x = torch.randn(tokens, hidden, device=device, dtype=DTYPE) * 3
        residual = torch.randn_like(x)
        w, w2 = (torch.rand(hidden, device=device) + 0.5 for _ in range(2))
        shape = f"{tokens}x{hidden}"
        rows.append(
            row(
                "rms_norm",
                shape,
                norm.rms_norm_triton,
                norm.rms_norm_reference,
                x,
                w,
                EPS,
            )
        )
        rows.append(
            row(
                "add_rms_norm + next norm",
                shape,
                norm.add_rms_norm_triton,
                norm.add_rms_norm_reference,
                *(residual, x, w, EPS, w2, True),
            )
        )
        gate_up = torch.randn(tokens, 2 * 15360, device=device, dtype=DTYPE) * 2
        rows.append(
            row(
                "gelu_tanh_mul",
                f"{tokens}x2x15360",
                activation.gelu_tanh_mul_triton,
                activation.gelu_tanh_mul_reference,
                gate_up,
            )
        )
        for q_heads, kv_heads, dim, mode in (
            (16, 8, 256, rope.ValueMode.RAW),  # Gemma 3 12B
            (32, 4, 512, rope.ValueMode.UNIT_NORM_OF_K),  # Gemma 4 31B full layer
            (32, 16, 256, rope.ValueMode.UNIT_NORM),  # Gemma 4 31B sliding layer
        ):
            qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, device=device, dtype=DTYPE)
            qw, kw = (torch.rand(dim, device=device) + 0.5 for _ in range(2))
            angles = torch.rand(tokens, dim, device=device) * 6
            cos, sin = angles.cos().to(DTYPE), angles.sin().to(DTYPE)
            args = (q_heads, kv_heads, dim, qw, kw, cos, sin, EPS, mode)
            rows.append(
                row(
                    f"norm_rope {mode.name}",
                    f"{tokens}x{q_heads}+{kv_heads}x{dim}",
                    rope.norm_rope_triton,
                    rope.norm_rope_reference,
                    qkv,
                    *args,
                )
            )
    capacity, heads, dim = 32768, 8, 256
    buffers = [torch.zeros(1, heads, capacity, dim, device=device, dtype=DTYPE) for _ in range(2)]
    positions = torch.full((capacity,), EMPTY_POSITION, device=device)
    counter = torch.zeros((), dtype=torch.long, device=device)
    k, v = (torch.randn(1, heads, 1, dim, device=device, dtype=DTYPE) for _ in range(2))
    where = torch.tensor([1234], device=device)
    state = (where, k, v, *buffers, positions, counter)
    kv_write.append_token_triton(*state)
    written = [b[:, :, 1234].clone() for b in buffers]
    error = max(max_error(written[0], k[:, :, 0]), max_error(written[1], v[:, :, 0]))
    kernel_us = do_bench(lambda: kv_write.append_token_triton(*state), return_mode="median") * 1e3
    eager_us = do_bench(lambda: kv_write.append_token_reference(*state), return_mode="median")
    rows.append(
        f"| append_token | {heads}x{dim} into {capacity} | {error:.2e} | {kernel_us:.1f} | "
        f"{eager_us * 1e3:.1f} |"
    )
    header = (
        f"# Fused elementwise kernels — {datetime.date.today()}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__}\n\n"
        "Error: max |kernel − reference| over the row's max |value| (bf16: one ulp ≤ 2^-7).\n"
        "Times: median µs per call (triton.testing.do_bench), eager = the torch reference.\n\n"
        "| kernel | shape | error | kernel µs | eager µs |\n|---|---|---|---|---|"
    )
    table = "\n".join([header, *rows]) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels_fused.md").write_text(table)


if __name__ == "__main__":
    main()
