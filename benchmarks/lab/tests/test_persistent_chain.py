"""The persistent GEMV chain of benchmarks/lab/gpu_persistent_chain.py, without a GPU.

In Triton's interpreter programs run one after another, so a grid barrier can only be passed
by a grid of one program: the chain's arithmetic, its offsets and its counter reset are
checked there (fp16 stands in for bf16, which the interpreter rounds otherwise than the GPU).
That the barriers and hints reach the machine code is checked by compiling the kernel for
the H200 (sm_90) and reading its PTX. On a GPU the script checks every phase itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hearth.ops import HAS_TRITON

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON,
    reason="interpreter and compiler checks; on a GPU the script checks the kernel itself",
)
SHAPES = ((48, 32), (16, 40), (32, 16))  # K of each phase <= N of the one before


@pytest.fixture(scope="module")
def script():
    import gpu_persistent_chain

    return gpu_persistent_chain


def test_every_phase_of_two_layers_matches_fp64_and_the_counters_end_at_zero(script) -> None:
    chain = script.Chain(SHAPES, 2, torch.device("cpu"), torch.float16)
    tiles = script.Tiles(per_sm=1, block_n=4, block_k=16, stages=2, warps=4)
    for seed in (1, 2):  # the second launch passes its barriers only if the first reset them
        chain.reset(seed)
        assert chain.phases_within_bound() == [False] * 6  # outputs start NaN
        chain.launch(1, tiles)
        assert chain.phases_within_bound() == [True] * 6
        assert (chain.counters == 0).all()


def test_the_check_sees_an_output_two_ulps_off(script) -> None:
    chain = script.Chain(SHAPES, 1, torch.device("cpu"), torch.float16)
    chain.reset(3)
    chain.launch(1, script.Tiles(per_sm=1, block_n=8, block_k=32, stages=1, warps=4))
    output = chain.view(2, 2)  # the last phase's: no later phase read it
    output[5] += 2 * torch.finfo(torch.float16).eps * output[5].abs().clamp(min=1)
    assert chain.phases_within_bound() == [True, True, False]


def test_a_phase_cannot_read_more_than_the_one_before_wrote(script) -> None:
    with pytest.raises(ValueError, match="K=40 cannot follow one of N=32"):
        script.Chain(((32, 16), (16, 40)), 2, torch.device("cpu"))


# Compiles the chain kernel at E4B's shapes for sm_90 and counts what its PTX issues.
COMPILER = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import gpu_persistent_chain as script

barriers, lines = bool(int(sys.argv[1])), int(sys.argv[2])
constants = {"SHAPES": script.MODELS["e4b"], "LAYERS": 4, "PROGRAMS": 132, "BLOCK_N": 8,
             "BLOCK_K": 512, "LOOP_STAGES": 3, "PREFETCH_LINES": lines, "BARRIERS": barriers,
             "COUNTER_BLOCK": 32}
signature = {"weights_ptr": "*bf16", "acts_ptr": "*bf16", "meta_ptr": "*i64",
             "counters_ptr": "*i32", **{name: "constexpr" for name in constants}}
aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # as torch's tensors launch
source = ASTSource(script._chain_kernel, signature, constants, attrs=aligned)
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
patterns = ("atom.global.gpu.release.add", "ld.global.gpu.acquire", "atom.global.gpu.acq_rel.add",
            "prefetch.global.L2", "cp.async.cg.shared.global")
print(*(ptx.count(pattern) for pattern in patterns))
"""


@pytest.mark.parametrize(
    ("barriers", "lines"), [(1, 8), (1, 0), (0, 0)], ids=["hints", "barriers", "streaming"]
)
def test_the_kernel_compiles_for_hopper_with_its_barriers(
    barriers: int, lines: int, compiler_environment: dict[str, str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", COMPILER, str(barriers), str(lines)],
        capture_output=True,
        text=True,
        env=compiler_environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    release, acquire, done, hints, copies = (int(count) for count in result.stdout.split())
    # An arrival and a spin (Triton makes the polling add of 0 an acquire load) per phase of a
    # layer (the layer loop is not unrolled), and the last program out counted once.
    assert (release, acquire, done) == ((6, 6, 1) if barriers else (0, 0, 0))
    assert (hints > 0) == (lines > 0)
    # The weights' loads are pipelined (cp.async into shared memory, 16 bytes each): the
    # offsets read from memory are declared aligned. Without that the loop lost its stages.
    assert copies > 0
