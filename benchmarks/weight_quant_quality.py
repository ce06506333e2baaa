"""Quality of Hearth's CPU precisions on the embedded Gemma 3 270M, against exact fp32.

Teacher-forced over the first 1024 tokens of the GPL-3 text (Debian's common-licenses): mean
KL(fp32 || mode) in nats per token, top-1 agreement with fp32, and perplexity.

    python benchmarks/weight_quant_quality.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

import hearth

TEXT = Path("/usr/share/common-licenses/GPL-3")
TOKENS = 1024
# (dtype, quantize): "auto" is the default for a GGUF file on the CPU, its blocks as stored.
MODES = [
    ("float32", "auto"),
    ("bfloat16", "auto"),
    ("bfloat16", "none"),
    ("bfloat16", "int8"),
    ("bfloat16", "int4"),
]


def log_probs(engine: hearth.Engine, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return engine.model(ids).float().log_softmax(-1)[0]


def perplexity(logprobs: torch.Tensor, ids: torch.Tensor) -> float:
    targets = ids[0, 1:, None]
    return logprobs[:-1].gather(-1, targets).mean().neg().exp().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    exact = hearth.load(dtype="float32", quantize="none", device="cpu", progress=False)
    ids = torch.tensor([exact.tokenizer.encode(TEXT.read_text())[:TOKENS]])
    reference = log_probs(exact, ids)
    rows = [f"| fp32 (exact) | 0 | 100% | {perplexity(reference, ids):.2f} |"]
    for dtype, quantize in MODES:
        engine = hearth.load(dtype=dtype, quantize=quantize, device="cpu", progress=False)
        ours = log_probs(engine, ids)
        kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
        agree = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
        weights = "GGUF blocks as stored" if quantize == "auto" else f"{quantize} weights"
        name = dtype if quantize == "none" else f"{dtype} + {weights}"
        shown = f"{kl:.4f}" if kl >= 1e-4 else f"{kl:.1e}"  # the exact path's is ~1e-6
        rows.append(f"| {name} | {shown} | {agree:.1%} | {perplexity(ours, ids):.2f} |")
    table = (
        "\n".join(
            [
                f"# Weight precision vs quality, Gemma 3 270M Q4_K_M — {datetime.date.today()}",
                "",
                f"Teacher-forced, first {TOKENS} tokens of GPL-3; torch {torch.__version__}, CPU.",
                "",
                "| precision | mean KL vs fp32 (nats) | top-1 agreement | perplexity |",
                "|---|---|---|---|",
                *rows,
            ]
        )
        + "\n"
    )
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
