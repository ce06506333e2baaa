"""Launch sweep of the unrolled affine GEMV over gathered MoE experts (decode), at Gemma 4
26B-A4B's shapes: one token, top-8 of 128 experts, gate/up [1408, 2816] (x shared by the
slots) and down [2816, 704] (a row a slot), MLX 4- and 8-bit, group 64.

Each launch (rows per program, groups per step, warps, prefetching loop, x codes-major) is
timed as decode runs it: 16 back-to-back calls, each on 8 experts of its own (past L2),
replayed from a CUDA graph; median of triton.testing.do_bench over the replays. Every launch's
output is checked against the torch reference (max |diff| over max |reference|).

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_gathered_gemv_sweep.py
"""

from __future__ import annotations

import itertools
import os
import sys
from datetime import date
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton

from gpu_kernels_affine import bench_graph
from hearth.ops import affine_matmul as am
from hearth.quant.mlx import quantize_affine

DEVICE = torch.device("cuda")
EXPERTS, HIDDEN, WIDTH, TOP_K, GROUP = 128, 2816, 704, 8, 64


def launches(bits: int) -> list[am.GemvConfig]:
    out = []
    for block_n, block_g, warps, prefetch, ordered in itertools.product(
        (16, 32, 64), (4, 8, 16), (4, 8), (False, True), (False, True)
    ):
        if ordered and bits != 4:
            continue
        words = block_g * GROUP * bits // 32
        if block_n * words > 8192:  # registers: at most 64 words a thread on 4 warps
            continue
        out.append(am.GemvConfig(block_n, block_g, warps, 1, prefetch, ordered))
    return out


def main() -> None:
    torch.manual_seed(0)
    sets = torch.randperm(EXPERTS, device=DEVICE).view(-1, 1, TOP_K)  # 16 disjoint choices
    rows = []
    for bits in (4, 8):
        for label, n, k, per_slot in (("gate/up", 2 * WIDTH, HIDDEN, False),
                                      ("down", HIDDEN, WIDTH, True)):  # fmt: skip
            weight = torch.randn(EXPERTS, n, k, device=DEVICE) / k**0.5
            packed, scales, biases = quantize_affine(weight, bits, GROUP)
            scales, biases = scales.bfloat16(), biases.bfloat16()
            x = torch.randn(1, *((TOP_K,) if per_slot else ()), k, device=DEVICE).bfloat16()
            operands = (x, packed, scales, biases)
            want = am.affine_expert_matmul_reference(*operands, sets[0], bits, GROUP).float()
            default = am.gathered_gemv_config(k, bits, GROUP)
            timed = []
            for config in launches(bits):
                run = partial(am.affine_expert_matmul_triton, *operands, bits=bits,
                              group_size=GROUP, gemv=config)  # fmt: skip
                try:
                    got = run(expert_ids=sets[0]).float()
                except Exception as error:  # a launch that does not compile: listed, skipped
                    print(f"{label} {bits}-bit {config}: {type(error).__name__}", flush=True)
                    continue
                error = ((got - want).abs().max() / want.abs().max()).item()
                seconds = bench_graph([partial(run, expert_ids=each) for each in sets])
                timed.append((seconds, config, error))
            timed.sort(key=lambda t: t[0])
            default_s = next(s for s, c, _ in timed if c == default)
            moved = TOP_K * n * (k * bits // 8 + 2 * 2 * k // GROUP)
            for seconds, config, error in timed[:6]:
                mark = " (default)" if config == default else ""
                rows.append(
                    f"| {label} {bits}-bit | {config}{mark} | {seconds * 1e6:.1f} | "
                    f"{moved / seconds / 1e9:.0f} | {default_s / seconds:.2f}x | {error:.1e} |"
                )
            rows.append(
                f"| {label} {bits}-bit | {default} (default) | {default_s * 1e6:.1f} | "
                f"{moved / default_s / 1e9:.0f} | 1.00x | |"
            )
            print("\n".join(rows[-7:]), flush=True)
    props = torch.cuda.get_device_properties(DEVICE)
    text = (
        f"# Gathered affine GEMV launches, 26B-A4B experts ({date.today()}, {props.name}, "
        f"torch {torch.__version__}, triton {triton.__version__})\n\n"
        "Per call: 8 experts of one token, 16 calls on distinct experts replayed from a CUDA "
        "graph. The six fastest launches per case, then the default; GB/s counts the chosen "
        "experts' words, scales and biases.\n\n"
        "| case | launch | µs | GB/s | vs default | max error / max |ref| |\n"
        "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
    )
    out = Path(os.environ.get("OUT", "."))
    (out / f"gpu_gathered_gemv_sweep-{date.today()}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
