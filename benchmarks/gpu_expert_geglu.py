"""The experts' GeGLU without a launch of its own, two ways, at 26B-A4B's decode shapes (128
experts, top 8, gate/up 1408 x 2816, down 2816 x 704, one token), on the GPU:

* in the down projection, which reads gelu_tanh(gate) * up straight from the gate/up
  output (`float_expert_matmul(..., geglu=True)`; each program recomputes its pair's 704);
* in the gate/up projection, whose programs pair gate and up rows and store the GeGLU of
  their dots (`float_expert_matmul(..., geglu_out=True)`).

Checks on fresh random draws, at each launch the autotuner may pick: each against the GeGLU
kernel plus the plain gathered GEMV at the same launch, bit for bit or the count of elements
that differ; the down-side output also against an fp64 oracle of the GeGLU kernel's product
(bound: an output ulp + 4 sqrt(K) eps32 of sum |x w|). Timing: CUDA graphs of 20 calls of
gate/up, GeGLU and down, taking 16 disjoint expert sets in turn (a set comes back after 15
others, 480 MB later: read from memory, not L2), median of 20 replays.

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


def check(launch: dict, seed: int) -> tuple[int, int, bool]:
    """(down-side elements that differ from GeGLU kernel + gathered GEMV, gate-side ones,
    down-side output within the fp64 bound)."""
    torch.manual_seed(seed)
    bf16 = torch.bfloat16
    gate_up_w = torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, device="cuda", dtype=bf16) * 0.03
    down = torch.randn(EXPERTS, HIDDEN, WIDTH, device="cuda", dtype=bf16) * 0.03
    x = torch.randn(1, HIDDEN, device="cuda", dtype=bf16)
    ids = torch.randperm(EXPERTS, device="cuda")[:TOP_K].view(1, TOP_K)
    gate_up = am.float_expert_matmul_triton(x, gate_up_w, ids, config=launch)
    product = gelu_tanh_mul(gate_up)
    stored = am.float_expert_matmul_triton(x, gate_up_w, ids, config=launch, geglu_out=True)
    fused = am.float_expert_matmul_triton(gate_up, down, ids, config=launch, geglu=True)
    apart = am.float_expert_matmul_triton(product, down, ids, config=launch)
    chosen = down[ids[0]].double()
    oracle = torch.einsum("sk,snk->sn", product[0].double(), chosen)
    magnitude = torch.einsum("sk,snk->sn", product[0].double().abs(), chosen.abs())
    bound = 2**-8 * oracle.abs() + 4 * math.sqrt(WIDTH) * 2**-23 * magnitude
    within = bool(((fused[0].double() - oracle).abs() <= bound).all())
    return int((fused != apart).sum()), int((stored != product).sum()), within


def main() -> None:
    rows = []
    for launch in LAUNCHES:
        checks = [check(launch, seed) for seed in range(DRAWS)]
        down_differ = sum(c[0] for c in checks)
        gate_differ = sum(c[1] for c in checks)
        within = all(c[2] for c in checks)
        rows.append(
            f"| N{launch['BLOCK_N']} K{launch['BLOCK_K']} w{launch['num_warps']} | "
            f"{down_differ} of {DRAWS * TOP_K * HIDDEN} | {'ok' if within else 'FAILED'} | "
            f"{gate_differ} of {DRAWS * TOP_K * WIDTH} |"
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

    def in_down(i: int) -> object:
        ids = expert_sets[i % SETS]
        gate_up = am.float_expert_matmul(x, gate_up_w, ids)
        return am.float_expert_matmul(gate_up, down, ids, geglu=True)

    def in_gate_up(i: int) -> object:
        ids = expert_sets[i % SETS]
        hidden = am.float_expert_matmul(x, gate_up_w, ids, geglu_out=True)
        return am.float_expert_matmul(hidden, down, ids)

    times = [replay_micros(step) for step in (apart, in_down, in_gate_up)]
    write_table(
        "gpu_expert_geglu.md",
        "The experts' GeGLU inside their gathered GEMVs",
        [
            f"26B-A4B decode shapes: {EXPERTS} experts, top {TOP_K}, gate/up {2 * WIDTH} x "
            f"{HIDDEN}, down {HIDDEN} x {WIDTH}. {DRAWS} fresh draws per launch: elements "
            "that differ from the GeGLU kernel with the plain gathered GEMV at that launch; "
            "the down-side output vs an fp64 oracle of the GeGLU kernel's product.",
            "",
            "| launch | GeGLU in down: differ | vs fp64 | GeGLU stored by gate/up: differ |",
            "|---|---|---|---|",
            *rows,
            "",
            f"µs per gate/up + down (autotuned launches; CUDA-graph replay of {CALLS} calls over "
            f"{SETS} disjoint expert sets in turn, median of 20): GeGLU launch between "
            f"{times[0]:.2f}, GeGLU in down {times[1]:.2f} ({times[0] / times[1]:.2f}x), "
            f"stored by gate/up {times[2]:.2f} ({times[0] / times[2]:.2f}x).",
        ],
    )


if __name__ == "__main__":
    main()
