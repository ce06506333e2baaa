"""KV-cache quantization vs quality on the embedded Gemma 3 270M, fp32, against the dense cache.

Teacher-forced over the first 1024 tokens of the GPL-3 text (Debian's common-licenses): a
128-token prefill, then chunks of 64 tokens, each attending over the cache (quantized K/V of
every earlier token and of its own). Reports mean KL(dense || kind) in nats per token over the
positions after the prefill, top-1 agreement, perplexity, and K+V bytes per token per
full-attention layer (sliding layers hold at most their window of 512).

    nice -n 19 python benchmarks/kv_quality.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

import hearth
from hearth.kv import KVPolicy, make_caches, parse_kv_quant

TEXT = Path("/usr/share/common-licenses/GPL-3")
TOKENS, PREFILL, CHUNK = 1024, 128, 64
KINDS = ["8", "4", "turbo:k8v4", "turbo:k8v3", "turbo:k4v3", "turbo:t4v3", "turbo:k8v2"]


def teacher_forced(
    model: torch.nn.Module, policy: KVPolicy, ids: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """Log-probs at positions PREFILL-1 .. TOKENS-2, and full-layer KV bytes per token."""
    caches = make_caches(model.cache_specs(), policy)
    pieces = [model(ids[:, :PREFILL], caches)[:, -1:]]
    for start in range(PREFILL, TOKENS - 1, CHUNK):
        chunk = ids[:, start : min(start + CHUNK, TOKENS - 1)]
        pieces.append(model(chunk, caches, start=start))
    full = [cache for cache in caches if cache.window is None]
    per_token = sum(cache.nbytes for cache in full) // (TOKENS - 1) // len(full)
    return torch.cat(pieces, dim=1).float().log_softmax(-1)[0], per_token


def perplexity(logprobs: torch.Tensor, ids: torch.Tensor) -> float:
    targets = ids[0, PREFILL : PREFILL + logprobs.shape[0], None]
    return logprobs.gather(-1, targets).mean().neg().exp().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    engine = hearth.load(dtype="float32", quantize="none", device="cpu", progress=False)
    ids = torch.tensor([engine.tokenizer.encode(TEXT.read_text())[:TOKENS]])
    with torch.inference_mode():
        reference, dense_bytes = teacher_forced(engine.model, KVPolicy(), ids)
        rows = [f"| dense fp32 | 0 | 100% | {perplexity(reference, ids):.3f} | {dense_bytes} |"]
        for kind in KINDS:
            ours, per_token = teacher_forced(engine.model, parse_kv_quant(kind), ids)
            kl = (reference.exp() * (reference - ours)).sum(-1).mean().item()
            agree = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
            row = f"| {kind} | {kl:.5f} | {agree:.1%} | {perplexity(ours, ids):.3f} | {per_token} |"
            print(row, flush=True)
            rows.append(row)
    table = "\n".join(
        [
            f"# KV cache quantization vs quality, Gemma 3 270M (fp32) — {datetime.date.today()}",
            "",
            f"Teacher-forced, first {TOKENS} tokens of GPL-3: {PREFILL}-token prefill, then "
            f"{CHUNK}-token chunks through the cache; torch {torch.__version__}, CPU.",
            "Quantized K/V are dequantized on read (the torch reference path); affine group 64.",
            "",
            "| KV cache | mean KL vs dense (nats) | top-1 agreement | perplexity "
            "| K+V bytes/token/full layer |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
