"""What the tensor-core affine kernel costs per code, read from its sm_90 SASS: no GPU.

Compiles `hearth.ops.affine_matmul._affine_mma_kernel` for Hopper with Triton's own compiler
(ptxas ships with Triton) as `affine_mma_triton` launches it on a GPU (bf16 x, 16-byte aligned
operands, PDL on, the dots in bf16), at `mma_config`'s launch for Gemma 3 12B's shapes or at
the launches given, and prints registers, shared memory, the programs an SM holds, and the
main loop (one group a step): its length, instructions a code per thread and per warp, and
its mix. At 4 bits an H100 must take ~29 codes a cycle an SM to read at 3.35 TB/s (an SM
issues 4 warp instructions a cycle), at 8 bits half that.

    python benchmarks/lab/inspect_affine_mma_sass.py
    python benchmarks/lab/inspect_affine_mma_sass.py --launch 4,64,16,128,4,3
    (--launch bits,group,M,BLOCK_N,warps,stages: K 3840, unsplit)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hearth.ops import affine_matmul as am
from inspect_gemv_sass import SHARED_PER_SM, sass_stats

SHOWN = ("HGMMA", "HMMA", "FFMA", "FADD", "FMUL", "LOP3", "SHF", "PRMT", "IMAD", "LDS", "STS")
SHAPES = ((8192, 3840, "qkv"), (3840, 4096, "o"), (30720, 3840, "gate/up"), (3840, 15360, "down"))


def compile_mma(bits: int, group: int, k: int, config: am.MmaConfig):
    names = list(am._affine_mma_kernel.arg_names)
    pointers = {
        "x_ptr": "*bf16",
        "packed_ptr": "*i32",
        "scales_ptr": "*bf16",
        "biases_ptr": "*bf16",
        "out_ptr": "*bf16",
        "partial_ptr": "*fp32",
    }
    constants = dict(
        K=k, BITS=bits, GROUP=group, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        SPLIT_K=config.split_k, STAGES=config.stages, DOT_FP32=False,
        OFFSET_CODES=bits == 4, PDL=True,
    )  # fmt: skip
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32") for name in names
    }
    aligned = [i for i, name in enumerate(names) if name not in constants and name != "M"]
    source = ASTSource(
        am._affine_mma_kernel,
        signature,
        constants,
        {(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": config.warps, "launch_pdl": True}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def launches(args: argparse.Namespace) -> list[tuple[str, int, int, int, am.MmaConfig]]:
    if args.launch:
        found = []
        for text in args.launch:
            bits, group, m, block_n, warps, stages = map(int, text.split(","))
            tile = max(16, 1 << (m - 1).bit_length())
            found.append(("-", bits, group, 3840, am.MmaConfig(tile, block_n, 1, warps, stages)))
        return found
    return [
        (f"{name} M={m}", bits, 64, k, am.mma_config(m, n, k, bits, 64))
        for bits in (4, 8)
        for n, k, name in SHAPES
        for m in (16, 32, 64)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launch", action="append", help="bits,group,M,BLOCK_N,warps,stages")
    args = parser.parse_args()
    print(
        "| weight | bits | launch | regs | shared KiB | programs/SM | loop instr | "
        "a code (thread) | a code (warp) | mix |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, bits, group, k, config in launches(args):
        compiled = compile_mma(bits, group, k, config)
        stats = sass_stats(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        threads = 32 * config.warps
        programs = min(65536 // (stats["registers"] * threads), SHARED_PER_SM // max(shared, 1))
        loop = stats["loop"]
        length = sum(loop.values())
        codes = config.block_n * group // threads  # codes a thread unpacks a step
        print(
            f"| {name} | {bits} | {config} | {stats['registers']} | {shared / 1024:.0f} | "
            f"{programs} | {length} | {length / codes:.2f} | {length / codes / 32:.3f} | "
            + " ".join(f"{op} {loop[op]}" for op in SHOWN if loop[op])
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
