"""A packed token table's rows from the dequantize kernel gathering them (`affine_embed`), on
the GPU, against the torch reference (the rows gathered, then `dequantize_affine`), bit for
bit: bf16 scales and biases, 4 and 8 bits, groups 32/64/128, fresh tables and ids (repeated,
out of order, a decode step's [1, 1] and a prefill's [1, 4096]). The interpreter tests cannot
check bf16 (it truncates where the GPU rounds).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_embed_rows.py
"""

from __future__ import annotations

import torch

from gpu_gemv_bf16 import write_table
from hearth.ops import affine_matmul as am
from hearth.quant.mlx import quantize_affine

VOCAB, WIDTH, DRAWS = 4096, 2560, 3


def main() -> None:
    rows = []
    for bits in am.KERNEL_BITS:
        for group in (32, 64, 128):
            differ = total = 0
            for seed in range(DRAWS):
                torch.manual_seed(seed)
                weight = torch.randn(VOCAB, WIDTH, device="cuda")
                packed, scales, biases = quantize_affine(weight, bits, group)
                scales, biases = scales.bfloat16(), biases.bfloat16()
                for ids in (
                    torch.randint(0, VOCAB, (1, 1), device="cuda"),
                    torch.randint(0, VOCAB, (1, 4096), device="cuda"),
                ):
                    args = (ids, packed, scales, biases, bits, group)
                    got = am.affine_embed(*args, torch.bfloat16)
                    want = am.affine_embed_reference(*args).to(torch.bfloat16)
                    differ += int((got != want).sum())
                    total += want.numel()
            rows.append(f"| {bits} | {group} | {differ} of {total} |")
            print(rows[-1], flush=True)
    write_table(
        "gpu_embed_rows.md",
        "A packed token table's rows by one kernel against the torch reference",
        [
            f"Tables {VOCAB} x {WIDTH}, bf16 scales and biases, {DRAWS} draws, ids [1, 1] and "
            "[1, 4096]: elements that differ from the reference.",
            "",
            "| bits | group | differing |",
            "|---|---|---|",
            *rows,
        ],
    )


if __name__ == "__main__":
    main()
