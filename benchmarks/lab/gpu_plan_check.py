"""The MoE prefill plan on the GPU: the counting-sort kernels against the argsort plan at the
26B-A4B's routing shape (128 experts, top 8), and the time of each (graph-free, do_bench).

    OUT=/tmp/out python benchmarks/lab/gpu_plan_check.py
"""

from __future__ import annotations

import os
import sys
from datetime import date
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton
import triton.testing

from hearth.ops import grouped_matmul as gm

EXPERTS, TOP_K = 128, 8


def routing(tokens: int, skew: bool, generator: torch.Generator) -> torch.Tensor:
    """Distinct experts per token; `skew`: most pairs on a few experts (a hot-expert load)."""
    weights = torch.ones(EXPERTS)
    if skew:
        weights[:4] = 200.0
    ids = torch.multinomial(weights.expand(tokens, -1), TOP_K, generator=generator)
    return ids.cuda()  # int64, as the router returns them


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    lines = [
        f"# MoE plan: counting sort vs argsort ({date.today()}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__})",
        "",
        "| tokens | routing | block_m | equal | counting sort µs | argsort plan µs |",
        "|---|---|---|---|---|---|",
    ]
    for tokens in (1, 7, 512, 4096, 16384):
        for skew in (False, True):
            ids = routing(tokens, skew, generator)
            for block_m in (None, 128):
                plan = gm.plan_experts(ids, EXPERTS, block_m)
                reference = gm.plan_experts_reference(ids, EXPERTS, block_m)
                equal = (
                    torch.equal(plan.rows, reference.rows)
                    and torch.equal(plan.tile_experts, reference.tile_experts)
                    and plan.block_m == reference.block_m
                )
                ours = triton.testing.do_bench(partial(gm.plan_experts, ids, EXPERTS, block_m))
                theirs = triton.testing.do_bench(
                    partial(gm.plan_experts_reference, ids, EXPERTS, block_m)
                )
                lines.append(
                    f"| {tokens} | {'skewed' if skew else 'uniform'} | {plan.block_m} | "
                    f"{'ok' if equal else 'FAIL'} | {ours * 1e3:.0f} | {theirs * 1e3:.0f} |"
                )
                print(lines[-1], flush=True)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_plan_check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
