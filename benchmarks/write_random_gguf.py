"""Write a random-weight Gemma 3 GGUF at real shapes, loadable by Hearth and llama.cpp.

The tokenizer (262144 tokens) is copied from the embedded Gemma 3 270M, so the vocabulary
is Gemma 3's; weights are drawn tensor by tensor (on a GPU when there is one), already in
the stored type, and written as they come. Then time both engines on the same file:

    python benchmarks/write_random_gguf.py /data/gemma3-12b-q4_k_m.gguf --type Q4_K_M
    hearth bench /data/gemma3-12b-q4_k_m.gguf --contexts 512,8192 --prefill 512,4096
    llama-bench -m /data/gemma3-12b-q4_k_m.gguf -ngl 99 -p 512,4096 -n 32 -d 0,8192

Q4_K_M is llama.cpp's mix (Q4_K, Q6_K for the head and some v/down projections). Sizes (12B):
F16/BF16 23.5 GB, Q8_0 12.5 GB, Q4_0 6.6 GB, Q4_K_M ~7.3 GB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hearth.bench.random_gguf import GGUF_TYPES, embedded_tokenizer, write_random_gguf
from hearth.bench.random_model import resolve_config
from hearth.errors import HearthError


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the .gguf file to write")
    parser.add_argument(
        "--config", default="gemma3-12b", help="a Gemma 3 preset or config.json (gemma3-12b)"
    )
    parser.add_argument("--type", choices=GGUF_TYPES, default="F16", help="matrix type (F16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where to draw"
    )
    args = parser.parse_args()
    begin = time.perf_counter()
    try:
        config = resolve_config(args.config)
        path, written = write_random_gguf(
            args.out, config, embedded_tokenizer(), args.type, args.seed, args.device
        )
    except (HearthError, ValueError) as error:
        print(f"write_random_gguf: error: {error}", file=sys.stderr)
        return 2
    size = path.stat().st_size
    print(
        f"wrote {path}: {args.config} ({written['num_hidden_layers']} layers, vocab "
        f"{written['vocab_size']}), {args.type}, {size / 1e9:.2f} GB in "
        f"{time.perf_counter() - begin:.0f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
