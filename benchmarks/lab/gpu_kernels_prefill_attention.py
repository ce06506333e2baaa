"""Prefill (flash) attention on a GPU: correctness, speed against SDPA, and a small tile sweep.

1. Correctness: the Triton kernel vs the fp32 torch reference on fresh random bf16 inputs
   at Gemma 3 12B / Gemma 4 31B / Gemma 4 E4B shapes (causal, sliding window, chunked
   prefill, a rotated ring with empty slots, strided q/k/v), plus fp16 and fp32 once.
   SDPA with the bool mask (the model's current path) is measured against the same reference
   to show what error the current path already has.
2. Speed at M = S = 512 and 4096 (and 16384 for D=256): the kernel, SDPA with the bool mask,
   and for D <= 256 SDPA is_causal (flash; causal only, so it ignores the window and does more
   work there). TFLOP/s count only visible (query, key) pairs: 4·D flops per pair per head.
3. Tile sweep at M = S = 4096 for the D=256 sliding and D=512 full layers.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_kernels_prefill_attention.py \
        [--no-sweep] [--no-16k]

Writes $OUT/gpu_kernels_prefill_attention.md (default benchmarks/results/) and prints it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.nn.functional as F
import triton
import triton.testing

from hearth.kv.cache import EMPTY_POSITION
from hearth.ops.prefill_attention import (
    LaunchConfig,
    default_config,
    prefill_attention_reference,
    prefill_attention_triton,
    visible_keys,
)

PEAK_BF16 = 790e12  # dense bf16 tensor-core FLOP/s of the H200
# (name, Hq, Hkv, D, window, scale); scale 1.0 is Gemma 4's (q, k are RMS-normed there;
# here q is shrunk by D^-0.5 instead so random scores stay O(1)).
LAYERS = [
    ("gemma3-12b sliding", 16, 8, 256, 1024, 256**-0.5),
    ("gemma3-12b full", 16, 8, 256, None, 256**-0.5),
    ("gemma4-31b sliding", 32, 16, 256, 1024, 1.0),
    ("gemma4-31b full", 32, 4, 512, None, 1.0),
    ("gemma4-e4b sliding", 8, 2, 256, 512, 1.0),
    ("gemma4-e4b full", 8, 2, 512, None, 1.0),
]
# bf16 output vs the fp32 reference: rounding the output to bf16 is 2^-9 relative, and the
# kernel rounds softmax weights to bf16 for P·V (2^-9 each, averaging out over keys), so
# relative RMS ~3e-3; the max |error| of outputs |o| < ~4 is a few bf16 ulps (2^-7 at 2..4).
RELATIVE_RMS_BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
MAX_ERROR_BOUND = {torch.bfloat16: 6e-2, torch.float16: 8e-3, torch.float32: 1e-4}
SWEEP = {
    256: [
        LaunchConfig(128, 64, 8, 2),
        LaunchConfig(128, 32, 8, 3),
        LaunchConfig(64, 64, 4, 2),
        LaunchConfig(128, 64, 8, 2, value_splits=2),
    ],
    512: [
        LaunchConfig(64, 32, 8, 2),
        LaunchConfig(64, 16, 8, 3),
        LaunchConfig(32, 64, 4, 2),
        LaunchConfig(64, 32, 8, 2, value_splits=2),
        LaunchConfig(128, 32, 8, 2, value_splits=2),
    ],
}


def inputs(
    batch: int, heads: int, kv_heads: int, queries: int, keys: int, dim: int, scale: float,
    dtype: torch.dtype = torch.bfloat16, strided: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Fresh N(0, 1) q/k/v; `strided` makes them [B, M, H, D] views as the model has them."""

    def make(h: int, n: int) -> torch.Tensor:
        if strided:
            return torch.randn(batch, n, h, dim, device="cuda").transpose(1, 2)
        return torch.randn(batch, h, n, dim, device="cuda")

    q = make(heads, queries)
    if scale == 1.0:
        q = q * dim**-0.5
    return q.to(dtype), make(kv_heads, keys).to(dtype), make(kv_heads, keys).to(dtype)


def sdpa_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor,
    window: int | None, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The model's current prefill path: SDPA with a boolean mask."""
    mask = visible_keys(qpos, kpos, window)
    grouped = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)


def errors(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    diff = got.float() - expected.float()
    rms = diff.pow(2).mean().sqrt() / expected.float().pow(2).mean().sqrt().clamp_min(1e-30)
    return diff.abs().max().item(), rms.item()


def correctness_rows() -> tuple[list[str], bool]:
    rows, ok = [], True
    cases = []
    for name, heads, kv_heads, dim, window, scale in LAYERS:
        cases.append((f"{name} M=S=1100", 1, heads, kv_heads, dim, window, scale,
                      torch.arange(1100), torch.arange(1100), torch.bfloat16, False))  # fmt: skip
    cases.append(("gemma4-31b full chunk 2048..2559 / 2560 keys", 1, 32, 4, 512, None, 1.0,
                  torch.arange(2048, 2560), torch.arange(2560), torch.bfloat16, False))  # fmt: skip
    ring = torch.roll(torch.arange(2232, 3256), 3256 % 1024)
    ring[torch.randperm(1024)[:40]] = EMPTY_POSITION
    cases.append(("ring 1024 slots, 40 empty, w=1024, q 3000..3255", 1, 16, 8, 256, 1024,
                  256**-0.5, torch.arange(3000, 3256), ring, torch.bfloat16, False))  # fmt: skip
    cases.append(("batch 2, strided [B,M,H,D] views, w=300", 2, 16, 8, 256, 300, 256**-0.5,
                  torch.arange(700), torch.arange(700), torch.bfloat16, True))  # fmt: skip
    cases.append(("fp16 gemma4-31b full M=S=600", 1, 32, 4, 512, None, 1.0,
                  torch.arange(600), torch.arange(600), torch.float16, False))  # fmt: skip
    cases.append(("fp32 gemma3-12b sliding w=256 M=S=600", 1, 16, 8, 256, 256, 256**-0.5,
                  torch.arange(600), torch.arange(600), torch.float32, False))  # fmt: skip
    for label, batch, heads, kv_heads, dim, window, scale, qpos, kpos, dtype, strided in cases:
        qpos, kpos = qpos.cuda(), kpos.cuda()
        q, k, v = inputs(batch, heads, kv_heads, len(qpos), len(kpos), dim, scale, dtype, strided)
        args = (q, k, v, qpos, kpos, window, scale)
        expected = prefill_attention_reference(*args)
        try:
            got = prefill_attention_triton(*args)
            max_error, rms = errors(got, expected)
            passed = max_error <= MAX_ERROR_BOUND[dtype] and rms <= RELATIVE_RMS_BOUND[dtype]
            finite = bool(torch.isfinite(got).all())
            passed &= finite
            kernel = f"{max_error:.2e} | {rms:.2e} | {'ok' if passed else 'FAIL'}"
        except Exception as error:  # report and go on
            traceback.print_exc()
            passed, kernel = False, f"error: {type(error).__name__} | | FAIL"
        ok &= passed
        try:
            sdpa = "{:.2e} | {:.2e}".format(*errors(sdpa_masked(*args), expected))
        except Exception as error:
            sdpa = f"{type(error).__name__} |"
        rows.append(f"| {label} | {str(dtype)[6:]} | {kernel} | {sdpa} |")
    return rows, ok


def bench(fn: Callable[[], object]) -> float | None:
    """Median µs (do_bench flushes L2 before each call); None when it fails."""
    try:
        return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median") * 1e3
    except Exception as error:  # out of memory / resources
        print(f"  skipped: {type(error).__name__}: {str(error)[:160]}")
        torch.cuda.empty_cache()
        return None


def rate(flops: float, micros: float | None) -> str:
    if micros is None:
        return "n/a | n/a | n/a"
    tflops = flops / micros / 1e6
    return f"{micros:,.0f} | {tflops:.0f} | {100 * tflops * 1e12 / PEAK_BF16:.0f}%"


def visible_pairs(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> int:
    return int(visible_keys(qpos, kpos, window).sum())


def speed_rows(lengths: list[int]) -> list[str]:
    rows = []
    for name, heads, kv_heads, dim, window, scale in LAYERS:
        for length in lengths:
            if length > 4096 and dim > 256:
                continue
            first = len(rows)
            positions = torch.arange(length, device="cuda")
            q, k, v = inputs(1, heads, kv_heads, length, length, dim, scale)
            args = (q, k, v, positions, positions, window, scale)
            flops = 4 * dim * heads * visible_pairs(positions, positions, window)
            kernel = bench(lambda a=args: prefill_attention_triton(*a))
            masked = bench(lambda a=args: sdpa_masked(*a))
            line = f"| {name} | {length} | triton | {rate(flops, kernel)} | |"
            rows.append(line)
            speedup = f"{masked / kernel:.2f}x" if kernel and masked else ""
            rows.append(f"| | | sdpa bool mask | {rate(flops, masked)} | {speedup} |")
            if dim <= 256:
                causal_flops = 4 * dim * heads * visible_pairs(positions, positions, None)
                flash = bench(
                    lambda a=args, g=heads != kv_heads: F.scaled_dot_product_attention(
                        *a[:3], is_causal=True, scale=a[6], enable_gqa=g
                    )
                )
                note = f"{flash / kernel:.2f}x" if kernel and flash else ""
                note += " (causal only: no window)" if window else ""
                rows.append(f"| | | sdpa is_causal | {rate(causal_flops, flash)} | {note} |")
            del q, k, v, args
            torch.cuda.empty_cache()
            print("\n".join(rows[first:]), flush=True)
    return rows


def sweep_rows() -> list[str]:
    rows = []
    length = 4096
    for name, heads, kv_heads, dim, window, scale in (LAYERS[0], LAYERS[3]):
        positions = torch.arange(length, device="cuda")
        q, k, v = inputs(1, heads, kv_heads, length, length, dim, scale)
        args = (q, k, v, positions, positions, window, scale)
        expected = prefill_attention_triton(*args)
        flops = 4 * dim * heads * visible_pairs(positions, positions, window)
        default = default_config(dim, q.dtype)
        for config in SWEEP[dim]:
            label = (
                f"{config.block_m}x{config.block_n} w{config.num_warps} s{config.num_stages}"
                f" v{config.value_splits or 1}"
            )
            try:
                got = prefill_attention_triton(*args, config=config)
                agrees = errors(got, expected)[0] <= MAX_ERROR_BOUND[torch.bfloat16]
            except Exception as error:  # out of shared memory / registers
                rows.append(f"| {name} | {label} | {type(error).__name__} | | | |")
                continue
            micros = bench(lambda a=args, c=config: prefill_attention_triton(*a, config=c))
            resolved = dataclasses.replace(config, value_splits=config.value_splits or 1)
            mark = " (default)" if resolved == default else ""
            rows.append(
                f"| {name} | {label}{mark} | {rate(flops, micros)} | {'ok' if agrees else 'DIFF'} |"
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-16k", action="store_true", help="skip M=S=16384 (D=256)")
    options = parser.parse_args()
    torch.manual_seed(0)
    start = time.time()
    device = torch.cuda.get_device_name()
    lines = [
        f"# Prefill attention (Triton flash, position masks) — {device}",
        "",
        f"{datetime.date.today()}, torch {torch.__version__}, triton {triton.__version__}. "
        "bf16, batch 1 unless noted. TFLOP/s count visible (q, k) pairs only "
        f"(4·D flops each per head); % of {PEAK_BF16 / 1e12:.0f} TFLOP/s bf16 peak.",
        "",
        "## Correctness vs the fp32 torch reference",
        "",
        "| case | dtype | triton max err | triton rel RMS | ok | sdpa(mask) max err "
        "| sdpa rel RMS |",
        "|---|---|---|---|---|---|---|",
    ]
    rows, ok = correctness_rows()
    lines += rows
    print("\n".join(lines), flush=True)
    lengths = [512, 4096] + ([] if options.no_16k else [16384])
    speed = speed_rows(lengths)
    lines += [
        "",
        "## Speed (median µs, CUDA events via triton.testing.do_bench, L2 flushed)",
        "",
        "| layer | M=S | path | µs | TFLOP/s | % peak | triton speedup |",
        "|---|---|---|---|---|---|---|",
        *speed,
    ]
    if not options.no_sweep:
        lines += [
            "",
            "## Tile sweep at M=S=4096 (BLOCK_M x BLOCK_N, warps, stages, value splits)",
            "",
            "| layer | tiles | µs | TFLOP/s | % peak | agrees |",
            "|---|---|---|---|---|---|",
            *sweep_rows(),
        ]
    lines += ["", f"Correctness: {'all ok' if ok else 'FAILURES'}; {time.time() - start:.0f} s."]
    table = "\n".join(lines) + "\n"
    out = Path(os.environ.get("OUT", Path(__file__).resolve().parent / "results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels_prefill_attention.md").write_text(table)
    print(table)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
