"""What a launch of the library's affine GEMV costs per code, read from its sm_90 SASS: no GPU.

Compiles `hearth.ops.affine_matmul._affine_gemv_kernel` for the H200 with Triton's own
compiler (ptxas ships with Triton) at the launches given, as `_launch_gemv` specialises it
(16-byte aligned operands, PDL on), and prints registers, stack (spills), the main loop's
length and its instruction mix. Registers set how many programs share an SM (65536 per SM),
hence how many bytes are in flight: why a launch that wins on a split weight can lose on
a weight with many row blocks (results/gpu_gemv_affine_sweep-2026-12-03.md).

    python benchmarks/lab/inspect_gemv_sass.py                       # the 12B launches
    python benchmarks/lab/inspect_gemv_sass.py --launch 64,4,1,32 --maxnreg 80
    python benchmarks/lab/inspect_gemv_sass.py --stages 3 --steps 3  # the pipelined loop

With `--stages`, shared memory (the pipelined loop's buffers) also bounds the programs an SM
holds (227 KiB a block on sm_90, 228 KiB an SM).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hearth.ops import affine_matmul as am

GROUP, THREADS = 64, 4 * 32
SHARED_PER_SM = 228 * 1024
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHOWN = ("FFMA", "FADD", "LOP3", "SHF", "IMAD", "LDG", "LDS", "STS", "BAR", "SHFL")
# (BLOCK_N, BLOCK_G, SPLIT_K, X_BLOCK): what gemv_config launches on Gemma 3 12B, 4-bit g64.
LAUNCHES = ((64, 4, 1, am.X_BLOCK_WORDS), (32, 16, 2, 0), (64, 4, 4, 0), (32, 4, 2, 0))


def sass_stats(cubin: bytes) -> dict:
    """Registers, stack bytes, all instructions and the first loop's (the backward branch's
    span) instruction counts of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run(
            [TOOLS / "cuobjdump", "-sass", file.name], capture_output=True, text=True
        ).stdout
        usage = subprocess.run(
            [TOOLS / "cuobjdump", "-res-usage", file.name], capture_output=True, text=True
        ).stdout
    instructions = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)(.*)", sass)
    loop: collections.Counter = collections.Counter()
    for address, op, rest in instructions:
        target = re.match(r"\S*\s+0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target[1], 16) < int(address, 16):
            start, end = int(target[1], 16), int(address, 16)
            loop = collections.Counter(o for a, o, _ in instructions if start <= int(a, 16) <= end)
            break
    return {
        "registers": int(re.search(r"REG:(\d+)", usage)[1]),
        "stack": int(re.search(r"STACK:(\d+)", usage)[1]),
        "all": collections.Counter(op for _, op, _ in instructions),
        "loop": loop,
    }


def compile_gemv(
    block_n: int,
    block_g: int,
    split: int,
    x_block: int,
    maxnreg: int = 0,
    fold: bool = True,
    stages: int = 1,
    steps: int = 0,
):
    names = list(am._affine_gemv_kernel.arg_names)
    pointers = {
        "x_ptr": "*fp32" if x_block and am.CODES_MAJOR_DTYPE is torch.float32 else "*bf16",
        "packed_ptr": "*i32",
        "scales_ptr": "*bf16",
        "biases_ptr": "*bf16",
        "out_ptr": "*bf16",
        "partial_ptr": "*fp32",
        "counter_ptr": "*i32",
    }
    constants = dict(
        M=1, BITS=4, GROUP=GROUP, BLOCK_N=block_n, BLOCK_G=block_g, SPLIT_K=split,
        PREFETCH=True, X_BLOCK=x_block, FOLD=fold, PDL=True,
        STAGED_STEPS=steps if stages > 1 else 0, LOOP_STAGES=stages,
    )  # fmt: skip
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, "i32") for name in names
    }
    aligned = [i for i, name in enumerate(names) if name not in constants and name != "two23"]
    source = ASTSource(
        am._affine_gemv_kernel,
        signature,
        constants,
        {(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": THREADS // 32, "launch_pdl": True} | (
        {"maxnreg": maxnreg} if maxnreg else {}
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launch", action="append", help="BLOCK_N,BLOCK_G,SPLIT_K,X_BLOCK")
    parser.add_argument("--maxnreg", type=int, default=0)
    parser.add_argument(
        "--exact-codes", action="store_true", help="codes minus their offset (no FOLD)"
    )
    parser.add_argument("--stages", type=int, default=1, help="GemvConfig.loop_stages")
    parser.add_argument("--steps", type=int, default=3, help="whole steps of the staged loop")
    args = parser.parse_args()
    launches = [tuple(map(int, text.split(","))) for text in args.launch or []] or LAUNCHES
    for block_n, block_g, split, x_block in launches:
        compiled = compile_gemv(
            block_n, block_g, split, x_block, args.maxnreg, not args.exact_codes,
            args.stages, args.steps,
        )  # fmt: skip
        stats = sass_stats(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        codes = block_n * block_g * GROUP // THREADS  # codes per thread per step
        loop = stats["loop"]
        per_code = sum(loop.values()) / codes
        programs = 65536 // (stats["registers"] * THREADS)
        if shared:
            programs = min(programs, SHARED_PER_SM // shared)
        print(
            f"N{block_n} G{block_g} split{split} x{'codes-major' if x_block else 'input'}"
            f"{f' stages{args.stages}' if args.stages > 1 else ''}: "
            f"regs {stats['registers']} shared {shared} B ({programs} programs/SM) "
            f"stack {stats['stack']}; "
            f"loop {sum(loop.values())} instr, {per_code:.2f} a code: "
            + " ".join(f"{op} {loop[op]}" for op in SHOWN if loop[op])
        )


if __name__ == "__main__":
    main()
