"""What the GGUF block GEMV (`hearth.ops.gguf_matmul`) costs per weight, read from its sm_90
SASS: no GPU.

Compiles `_gguf_gemv_kernel` for Hopper with Triton's own compiler (one activation row unless
`--rows`), as
`gguf_gemv_triton` launches it (16-byte aligned operands, PDL on), per block type, and prints
registers, shared memory, the main loop's length, its instructions per weight and its mix.
Registers set how many programs share an SM (65536 registers an SM); loop instructions per
weight bound the GEMV when it is issue-bound rather than memory-bound (a 4-warp program's
step is BLOCK_N x 256 weights; an H100 SM issues 4 warp-instructions a cycle).

    python benchmarks/lab/inspect_gguf_sass.py [--types Q4_K,Q6_K] [--block-n 16] [--k 3840]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hearth.ops import gguf_matmul as gm
from hearth.quant.gguf_blocks import BLOCK_FORMATS
from inspect_gemv_sass import sass_stats

THREADS = 4 * 32
SHOWN = ("FFMA", "FADD", "FMUL", "LOP3", "PRMT", "SHF", "I2F", "LDG", "LDS", "STS", "BAR")
TYPE_IDS = {block.name: type_id for type_id, block in BLOCK_FORMATS.items()}


def compile_gemv(type_id: int, block_n: int, k: int, split: int, stages: int, rows: int = 1):
    names = list(gm._gguf_gemv_kernel.arg_names)
    pointers = {
        "x_ptr": "*bf16",
        "w_ptr": "*u8",
        "out_ptr": "*bf16",
        "partial_ptr": "*fp32",
        "counter_ptr": "*i32",
    }
    constants = dict(
        K=k, TYPE=type_id, G=gm.GROUPS[type_id], BLOCK_M=rows, BLOCK_N=block_n, PDL=True,
        SPLIT_K=split, LOOP_STAGES=stages,
    )  # fmt: skip
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32") for name in names
    }
    aligned = [i for i, name in enumerate(names) if name not in constants and name != "M"]
    source = ASTSource(
        gm._gguf_gemv_kernel,
        signature,
        constants,
        {(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": THREADS // 32, "launch_pdl": True}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def compile_planar_gemv(
    type_id: int, block_n: int, k: int, split: int, rows: int = 1, prefetch: bool = False
):
    """The planar rows' GEMV (`_planar_gemv_kernel`), launched as `_planar_gemv` does."""
    kernel = gm._planar_gemv_kernel
    names = list(kernel.arg_names)
    pointers = {
        "x_ptr": "*bf16",
        "words_ptr": "*i32",
        "bytes_ptr": "*u8",
        "halves_ptr": "*fp16",
        "out_ptr": "*bf16",
        "partial_ptr": "*fp32",
        "counter_ptr": "*i32",
    }
    constants = dict(
        K=k, TYPE=type_id, M=rows, BLOCK_N=block_n, BLOCK_G=gm.PLANAR_BLOCK_G, PDL=True,
        SPLIT_K=split, PREFETCH=prefetch, **gm._planes(type_id, k),
    )  # fmt: skip
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32") for name in names
    }
    # Pointers and the x row stride are 16-byte aligned; the planar row strides are only
    # multiples of 16 bytes (the kernel says so of the word rows with tl.multiple_of).
    aligned = [i for i, name in enumerate(names) if name in pointers or name == "stride_xm"]
    source = ASTSource(
        kernel, signature, constants, {(i,): [["tt.divisibility", 16]] for i in aligned}
    )
    options = {"num_warps": THREADS // 32, "launch_pdl": True}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--types", default="Q4_0,Q5_0,Q8_0,Q4_K,Q5_K,Q6_K")
    parser.add_argument("--block-n", type=int, default=16)
    parser.add_argument("--k", type=int, default=3840)
    parser.add_argument("--split", type=int, default=1)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1, help="activation rows (BLOCK_M)")
    parser.add_argument("--planar", action="store_true", help="the planar rows' GEMV")
    parser.add_argument("--prefetch", action="store_true", help="planar: a step ahead")
    args = parser.parse_args()
    for name in args.types.split(","):
        type_id = TYPE_IDS[name]
        if args.planar:
            compiled = compile_planar_gemv(
                type_id, args.block_n, args.k, args.split, args.rows, args.prefetch
            )
            step_values = gm.PLANAR_BLOCK_G * 32
        else:
            compiled = compile_gemv(
                type_id, args.block_n, args.k, args.split, args.stages, args.rows
            )
            step_values = gm.STEP_VALUES
        stats = sass_stats(compiled.asm["cubin"])
        loop = stats["loop"]
        weights = args.block_n * step_values // THREADS  # per thread per step
        programs = 65536 // (stats["registers"] * THREADS)
        print(
            f"{name} M{args.rows} N{args.block_n} K{args.k} split{args.split}: "
            f"regs {stats['registers']} "
            f"({programs} programs/SM) shared {compiled.metadata.shared} B stack "
            f"{stats['stack']}; loop {sum(loop.values())} instr, "
            f"{sum(loop.values()) / weights:.1f} a weight: "
            + " ".join(f"{op} {loop[op]}" for op in SHOWN if loop[op])
        )


if __name__ == "__main__":
    main()
