"""The tensor-core 4-bit GEMV of benchmarks/lab/gpu_gemv_affine_mma_gluon.py, without a GPU.

Gluon kernels do not run in Triton's interpreter, so the kernel is checked in two halves:

* its arithmetic, replayed in torch: the x permutation kernel (`_prep_kernel`, in the
  interpreter) and the kernel's own reshapes and permutes of the unpacked words (A) and of x
  (B), multiplied as ``mma.sync`` multiplies its operands (C = A @ B per column), must give
  every group's ``sum(x * (128 + code))`` in its own column: compared with codes unpacked
  from the words by hearth.quant.mlx, exact in float64 (integers times bf16 values, few terms);
* its layouts: both kernels compile for the H200 (sm_90) with every conversion to the MMA's
  operand layouts asserted trivial (no data moved between lanes), and issue `mma.sync`
  (and TMA copies, where the words come that way).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hearth.ops import HAS_TRITON
from hearth.quant.mlx import quantize_affine, unpack_codes

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON,
    reason="interpreter and compiler checks; on a GPU the script checks the kernel itself",
)
GROUP, G, ROWS = 64, 4, 16


@pytest.fixture(scope="module")
def script():
    pytest.importorskip("triton.experimental.gluon")
    import gpu_gemv_affine_mma_gluon

    return gpu_gemv_affine_mma_gluon


def _unpacked_pairs(words: torch.Tensor) -> torch.Tensor:
    """What `_unpack_pairs` makes of int32 words, as values: ``[..., j0, j1, h]`` =
    128 + the code at nibble ``j0 + 2 j1 + 4 h``."""
    nibble = torch.arange(8).view(2, 2, 2).permute(2, 1, 0)  # [j0, j1, h] -> j0 + 2 j1 + 4 h
    return 128 + ((words[..., None, None, None].long() >> (4 * nibble)) & 15)


def test_one_step_of_the_kernel_sums_each_group_in_its_column(script) -> None:
    steps = 3
    k = steps * G * GROUP
    packed, _, _ = quantize_affine(torch.randn(ROWS, k), 4, GROUP)
    words = packed.view(torch.int32)
    x = torch.randn(k, dtype=torch.bfloat16)
    xperm = torch.empty_like(x)
    xsum = torch.empty(k // GROUP)
    script._prep_kernel[(k // GROUP // 4,)](x, xperm, xsum, GROUP, 4, False)
    codes = unpack_codes(packed, 4).double()
    groups_x = x.double().view(-1, GROUP)
    torch.testing.assert_close(xsum.double(), groups_x.sum(1), rtol=1e-6, atol=1e-6)

    quarter, lane_words, step_codes = GROUP // 4, GROUP // 32, G * GROUP
    for step in range(steps):
        # A as the kernel forms it: [rows, g, q, lw, j0, j1, h] -> [rows, step's k]
        step_words = words[:, step * G * GROUP // 8 : (step + 1) * G * GROUP // 8]
        pairs = _unpacked_pairs(step_words.reshape(ROWS, G, 4, lane_words))
        a = pairs.permute(0, 1, 3, 5, 4, 2, 6).reshape(ROWS, step_codes).double()
        # B as the kernel loads it: lane (n, q) reads quarter q of group n, zero elsewhere
        r = torch.arange(G * quarter)
        at = step * step_codes + (r // quarter) * GROUP + torch.arange(4)[:, None] * quarter
        at = at + r % quarter
        own_group = (r // quarter)[None, None, :] == torch.arange(8)[:, None, None]
        xv = torch.where(own_group, xperm.double()[at][None], 0.0)  # [n, q, regs]
        b = xv.reshape(8, 4, G, quarter // 4, 2, 2).permute(2, 3, 4, 1, 5, 0)
        c = a @ b.reshape(step_codes, 8)
        first = step * G
        want = torch.einsum(
            "rgk,gk->rg",
            codes.view(ROWS, -1, GROUP)[:, first : first + G] + 128,
            groups_x[first : first + G],
        )
        torch.testing.assert_close(c[:, :G], want, rtol=0, atol=1e-9)
        assert torch.all(c[:, G:] == 0)


# Compiles a kernel of the script for sm_90 and prints what its PTX issues.
COMPILER = """
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
import gpu_gemv_affine_mma_gluon as script

warps, reps, split, stages = (int(a) for a in sys.argv[1:])
rows, word_layout, x_layout = script.layouts(warps, reps, 64, 4)
pointers = ["*bf16", "*fp32", "*i32", "*bf16", "*bf16", "*bf16", "*fp32", "*i32"]
names = ["xperm_ptr", "xsum_ptr", "packed_ptr", "scales_ptr", "biases_ptr", "out_ptr",
         "partial_ptr", "counter_ptr"]
scalars = ["N", "row_words", "groups", "split_groups", "bf16_128_pair"]
constants = {"WARPS": warps, "ROWS": rows, "GROUP": 64, "G": 4, "WORD_LAYOUT": word_layout,
             "X_LAYOUT": x_layout, "SPLIT": split, "PDL": True}
kernel = script._mma_gemv_kernel
if stages:
    kernel = script._mma_gemv_tma_kernel
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    packed = torch.zeros(4096, 480, dtype=torch.int32)
    pointers[2] = mangle_type(TensorDescriptor.from_tensor(packed, [rows, 32], layout))
    names[2] = "w_desc"
    scalars.remove("row_words")
    constants["STAGES"] = stages
signature = {**dict(zip(names, pointers)), **{name: "i32" for name in scalars}}
signature.update({name: "constexpr" for name in constants})
aligned = [i for i, name in enumerate(signature) if name not in ("w_desc", "N", "split_groups",
           "bf16_128_pair") and signature[name] != "constexpr"]
source = GluonASTSource(kernel, signature, constants,
                        attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
options = {"num_warps": warps}
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
print(ptx.count("mma.sync.aligned.m16n8k16"), ptx.count("cp.async.bulk.tensor"))
"""


@pytest.mark.parametrize(
    "launch",
    [(4, 1, 1, 0), (8, 2, 4, 0), (4, 1, 2, 4)],
    ids=["registers", "registers-split", "tma-split"],
)
def test_the_kernels_compile_for_hopper(
    script, launch: tuple[int, int, int, int], compiler_environment: dict[str, str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", COMPILER, *map(str, launch)],
        capture_output=True,
        text=True,
        env=compiler_environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    mma, tma = (int(count) for count in result.stdout.split())
    assert mma > 0
    assert (tma > 0) == (launch[3] > 0)
