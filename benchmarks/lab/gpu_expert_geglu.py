"""The experts' GeGLU stored by their gate/up gathered GEMV (`float_expert_matmul(...,
geglu_out=True)`: each program pairs gate and up rows and stores the GeGLU of their dots),
against the plain gathered GEMV then the GeGLU kernel, at 26B-A4B's decode shapes (128
experts, top 8, gate/up 1408 x 2816, down 2816 x 704, one token), on the GPU.

Checks on fresh random draws, at each launch the autotuner may pick: the stored GeGLU
against the two launches' at the same launch, bit for bit or the count of elements that
differ (the plain gathered GEMV is checked against fp64 in gpu_kernels_affine.py). Timing:
CUDA graphs of 20 calls of gate/up (+ GeGLU) + down, taking 16 disjoint expert sets in turn
(a set comes back after 15 others, 480 MB later: read from memory, not L2), median of 20.
(`results/gpu_expert_geglu_h100-2026-12-05.md` also has a variant since dropped: the down
GEMV forming the GeGLU from gate/up itself.)

    OUT=/tmp/out PYTHONPATH=$PWD/src python benchmarks/lab/gpu_expert_geglu.py
"""

from __future__ import annotations

import torch

from gpu_gemv_bf16 import CALLS, replay_micros, write_table
from hearth.ops import affine_matmul as am
from hearth.ops.activation import gelu_tanh_mul_triton as gelu_tanh_mul

EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2816, 704
DRAWS = 10
SETS = EXPERTS // TOP_K  # disjoint expert sets, taken in turn by a graph's calls
LAUNCHES = [  # the autotuner's choices for the gathered GEMV (affine_matmul._float_gather_tuned)
    {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4},
    {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4},
    {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 8},
]


def differing(launch: dict, seed: int) -> int:
    """Elements of the stored GeGLU that differ from the gathered GEMV + GeGLU kernel's."""
    torch.manual_seed(seed)
    bf16 = torch.bfloat16
    gate_up_w = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda", dtype=bf16) * 0.03
    x = torch.randn(1, HIDDEN, device="cuda", dtype=bf16)
    ids = torch.randperm(EXPERTS, device="cuda")[:TOP_K].view(1, TOP_K)
    product = gelu_tanh_mul(am.float_expert_matmul_triton(x, gate_up_w, ids, config=launch))
    stored = am.float_expert_matmul_triton(x, gate_up_w, ids, config=launch, geglu_out=True)
    return int((stored != product).sum())


def main() -> None:
    rows = []
    for launch in LAUNCHES:
        differ = sum(differing(launch, seed) for seed in range(DRAWS))
        rows.append(
            f"| N{launch['BLOCK_N']} K{launch['BLOCK_K']} w{launch['num_warps']} | "
            f"{differ} of {DRAWS * TOP_K * WIDTH} |"
        )
        print(rows[-1], flush=True)
    bf16 = torch.bfloat16
    gate_up_w = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda", dtype=bf16)
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda", dtype=bf16)
    x = torch.randn(1, HIDDEN, device="cuda", dtype=bf16)
    expert_sets = torch.randperm(EXPERTS, device="cuda").view(SETS, 1, TOP_K)

    def apart(i: int) -> object:
        ids = expert_sets[i % SETS]
        gate_up = am.float_expert_matmul(x, gate_up_w, ids)
        return am.float_expert_matmul(gelu_tanh_mul(gate_up), down, ids)

    def stored(i: int) -> object:
        ids = expert_sets[i % SETS]
        hidden = am.float_expert_matmul(x, gate_up_w, ids, geglu_out=True)
        return am.float_expert_matmul(hidden, down, ids)

    before, after = replay_micros(apart), replay_micros(stored)
    write_table(
        "gpu_expert_geglu.md",
        "The experts' GeGLU stored by their gate/up gathered GEMV",
        [
            f"26B-A4B decode shapes: {EXPERTS} experts, top {TOP_K}, gate/up {2 * WIDTH} x "
            f"{HIDDEN}, down {HIDDEN} x {WIDTH}. {DRAWS} fresh draws per launch: elements of "
            "the stored GeGLU that differ from the gathered GEMV then the GeGLU kernel at that "
            "launch.",
            "",
            "| launch | differ |",
            "|---|---|",
            *rows,
            "",
            f"µs per gate/up + down (autotuned launches; CUDA-graph replay of {CALLS} calls over "
            f"{SETS} disjoint expert sets in turn, median of 20): with the GeGLU launch "
            f"{before:.2f}, stored by gate/up {after:.2f} ({before / after:.2f}x).",
        ],
    )


if __name__ == "__main__":
    main()
