"""TurboQuant append on the GPU: does the kernel path store what `codec.encode` stores, and
what does one append cost (kernel path vs the torch reference), per scheme and head size.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_turbo_append.py
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import torch
import triton

from hearth.ops.kv_quantize import (
    turbo_append_reference,
    turbo_append_triton,
    turbo_kernel_mismatch,
)
from hearth.quant.mlx import unpack_codes
from hearth.quant.turbo import TurboCodec


def planes_for(codec: TurboCodec, kv_heads: int, dim: int, slots: int) -> list[torch.Tensor]:
    sample = torch.zeros(1, kv_heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    return [p.new_zeros((*p.shape[:2], slots, *p.shape[3:])) for p in codec.encode(sample, sample)]


def compare(codec: TurboCodec, dim: int) -> str:
    generator = torch.Generator(device="cuda").manual_seed(1)
    keys, values = (
        torch.randn(1, 8, 1, dim, device="cuda", generator=generator).mul(2).bfloat16()
        for _ in range(2)
    )
    results = []
    for append in (turbo_append_triton, turbo_append_reference):
        planes = planes_for(codec, 8, dim, 4)
        slots = torch.zeros(4, dtype=torch.long, device="cuda")
        counter = torch.zeros((), dtype=torch.long, device="cuda")
        append(torch.tensor([1], device="cuda"), keys, values, planes, slots, counter, codec)
        results.append(planes)
    cells = []
    for got, want in zip(*results, strict=True):
        if got.dtype == torch.uint32:
            bits = got.shape[-1] * 32 // dim
            same = (unpack_codes(got, bits) == unpack_codes(want, bits)).float().mean().item()
            cells.append(f"codes {same:.4f} equal")
        else:
            diff = (got.float() - want.float()).abs().max().item()
            cells.append(f"{got.dtype} max diff {diff:.3g}")
    return "; ".join(cells)


def append_micros(append, codec: TurboCodec, dim: int) -> float:
    keys = torch.randn(1, 8, 1, dim, device="cuda").bfloat16()
    planes = planes_for(codec, 8, dim, 64)
    slots = torch.zeros(64, dtype=torch.long, device="cuda")
    counter = torch.zeros((), dtype=torch.long, device="cuda")
    position = torch.tensor([1], device="cuda")
    for _ in range(3):
        append(position, keys, keys, planes, slots, counter, codec)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        append(position, keys, keys, planes, slots, counter, codec)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 50 * 1e6


def main() -> None:
    rows = []
    for scheme in ("k8v3", "k4v3", "t4v3"):
        codec = TurboCodec.parse(scheme)
        for dim in (256, 512):
            agrees = turbo_kernel_mismatch(codec, dim, torch.bfloat16, "cuda:0") or "ok"
            detail = compare(codec, dim)
            kernel = append_micros(turbo_append_triton, codec, dim)
            reference = append_micros(turbo_append_reference, codec, dim)
            rows.append(
                f"| {scheme} | {dim} | {agrees} | {detail} | {kernel:.0f} | {reference:.0f} |"
            )
            print(rows[-1], flush=True)
    table = "\n".join(
        [
            f"# TurboQuant append on the GPU — {datetime.date.today()}, "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"triton {triton.__version__}",
            "",
            "Kernel path vs `codec.encode` (8 KV heads, one token, bf16); µs per append are host"
            " wall time of eager calls (launch overhead included).",
            "",
            "| scheme | D | self-check | planes (kernel vs encode) | kernel µs | reference µs |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_turbo_append.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
