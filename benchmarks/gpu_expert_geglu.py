"""The experts' down projection reading gelu_tanh(gate) * up straight from the gate/up GEMV's
output (`float_expert_matmul(..., geglu=True)`), against the GeGLU kernel then the plain
gathered GEMV, at 26B-A4B's decode shape (128 experts, top 8, 2816 x 704, one token), on the GPU.

Checks on fresh random draws, at each launch the autotuner may pick: the fused output
against the two launches' at the same launch, bit for bit or the count of elements that
differ; and against an fp64 oracle of the GeGLU kernel's product (bound: an output ulp +
4 sqrt(K) eps32 of sum |x w|). Timing: CUDA graphs of 20 calls taking 16 disjoint expert sets
in turn (a set comes back after 15 others, 480 MB later: read from memory, not L2), median of
20 replays.

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/gpu_expert_geglu.py
"""

from __future__ import annotations

import math

import torch

from gpu_gemv_bf16 import CALLS, replay_micros, write_table
from hearth.kernels import affine_matmul as am
from hearth.kernels.activation import gelu_tanh_mul_triton as gelu_tanh_mul

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2816, 704
DRAWS = 10
SETS = EXPERTS // TOP_K  # disjoint expert sets, taken in turn by a graph's calls
LAUNCHES = [  # the autotuner's choices for the gathered GEMV (affine_matmul._float_gather_tuned)
    {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4},
    {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8},
]


def check(launch: dict, seed: int) -> tuple[int, bool]:
    """(output elements that differ from GeGLU kernel + gathered GEMV, within the bound)."""
    torch.manual_seed(seed)
    bf16 = torch.bfloat16
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda", dtype=bf16) * 0.03
    gate_up = torch.randn(1, TOP_K, 2 * WIDTH, device="cuda", dtype=bf16) * 2
    ids = torch.randperm(EXPERTS, device="cuda")[:TOP_K].view(1, TOP_K)
    fused = am.float_expert_matmul_triton(gate_up, down, ids, config=launch, geglu=True)
    product = gelu_tanh_mul(gate_up)
    apart = am.float_expert_matmul_triton(product, down, ids, config=launch)
    chosen = down[ids[0]].double()
    oracle = torch.einsum("sk,snk->sn", product[0].double(), chosen)
    magnitude = torch.einsum("sk,snk->sn", product[0].double().abs(), chosen.abs())
    bound = 2**-8 * oracle.abs() + 4 * math.sqrt(WIDTH) * 2**-23 * magnitude
    within = bool(((fused[0].double() - oracle).abs() <= bound).all())
    return int((fused != apart).sum()), within


def main() -> None:
    rows = []
    for launch in LAUNCHES:
        checks = [check(launch, seed) for seed in range(DRAWS)]
        differ = sum(c[0] for c in checks)
        within = all(c[1] for c in checks)
        rows.append(
            f"| N{launch['BLOCK_N']} K{launch['BLOCK_K']} w{launch['num_warps']} | "
            f"{differ} of {DRAWS * TOP_K * HIDDEN} | {'ok' if within else 'FAILED'} |"
        )
        print(rows[-1], flush=True)
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(1, TOP_K, 2 * WIDTH, device="cuda", dtype=torch.bfloat16)
    expert_sets = torch.randperm(EXPERTS, device="cuda").view(SETS, 1, TOP_K)

    def apart(i: int) -> object:
        return am.float_expert_matmul(gelu_tanh_mul(gate_up), down, expert_sets[i % SETS])

    def fused(i: int) -> object:
        return am.float_expert_matmul(gate_up, down, expert_sets[i % SETS], geglu=True)

    before, after = replay_micros(apart), replay_micros(fused)
    write_table(
        "gpu_expert_geglu.md",
        "The experts' GeGLU inside their down projection's gathered GEMV",
        [
            f"26B-A4B decode shape: {EXPERTS} experts, top {TOP_K}, down {HIDDEN} x {WIDTH}. "
            f"{DRAWS} fresh draws per launch: output elements that differ from the GeGLU "
            "kernel then the gathered GEMV at that launch; the output vs an fp64 oracle of the "
            "GeGLU kernel's product.",
            "",
            "| launch | differ from apart | vs fp64 |",
            "|---|---|---|",
            *rows,
            "",
            f"µs per call (autotuned launches; CUDA-graph replay of {CALLS} calls over {SETS} "
            "disjoint expert sets in turn, median of 20): GeGLU + gathered GEMV "
            f"{before:.2f}, fused {after:.2f} ({before / after:.2f}x).",
        ],
    )


if __name__ == "__main__":
    main()
