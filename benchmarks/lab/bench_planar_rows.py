"""`hearth bench` with the planar GGUF GEMV's rows a program pinned for one block type at one
activation row: a launch choice (`hearth.ops.gguf_matmul.planar_block_n`) A/B'd end to end,
inside the CUDA-graph decode step, without changing the library.

    PYTHONPATH=src python benchmarks/lab/bench_planar_rows.py Q4_K 32 bench FILE --contexts 512
"""

from __future__ import annotations

import sys

from hearth import cli
from hearth.ops import gguf_matmul as gm
from hearth.quant.gguf_blocks import BLOCK_FORMATS


def main() -> int:
    name, rows, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    type_id = next(t for t, block in BLOCK_FORMATS.items() if block.name == name)
    chosen = gm.planar_block_n

    def pinned(m: int, t: int, n: int, multiprocessors: int) -> int:
        return rows if m == 1 and t == type_id else chosen(m, t, n, multiprocessors)

    gm.planar_block_n = pinned  # `_planar_gemv` looks it up at each launch
    print(f"planar {name} GEMV at one row: {rows} rows a program", flush=True)
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
