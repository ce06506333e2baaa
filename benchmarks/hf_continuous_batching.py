"""HF transformers' own continuous batching (`generate_batch`) at the shapes of `hearth bench
--concurrency`: the peer of issue 43's table.

At each level c, c prompts of `--prompt-tokens` random ids (the same ids `hearth bench` draws)
go to `model.generate_batch` together, greedy, each making `--new-tokens` tokens (no end of
sequence: `eos_token_id` unset). The aggregate rate is counted as Hearth counts it: every token
made over the whole run's wall time, prefills included. The model has HF's own random init in
bf16 at a preset's shapes (`hearth.bench.hf.build_hf_model`), its attention what HF chooses for
continuous batching (SDPA here: no flash-attn package on the machine).

    python benchmarks/hf_continuous_batching.py --random gemma3-12b --concurrency 1,4,16,64
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

from hearth.bench.concurrency import random_prompts
from hearth.bench.hf import HFUnavailable, build_hf_model
from hearth.bench.random_model import resolve_config


def run_level(model: object, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, float]:
    """Wall seconds of one `generate_batch` over `prompts`, the tokens it made, and the
    seconds from the first token made to the last (its decode, without start-up and the
    first prefills)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    results = model.generate_batch(  # type: ignore[attr-defined]
        prompts, generation_config=config, progress_bar=False, record_timestamps=True
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    made = sum(len(result.generated_tokens) for result in results.values())
    stamps = [t for result in results.values() for t in (result.timestamps or [])]
    decode = max(stamps) - min(stamps) if len(stamps) > 1 else float("nan")
    return seconds, made, decode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--random", default="gemma3-12b", help="a preset name or a config.json")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="write the table (markdown) here")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = resolve_config(args.random)
    try:
        model = build_hf_model(config, device)
    except HFUnavailable as error:
        print(f"hf_continuous_batching: {error}", file=sys.stderr)
        return 2
    import transformers

    vocab = model.config.vocab_size
    run_level(model, random_prompts(vocab, 2, 16, seed=1), 4)  # warm-up (graphs, allocator)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"# HF transformers {transformers.__version__} generate_batch, {args.random} bf16 random",
        "",
        f"{datetime.date.today()}, {name}. {args.prompt_tokens}-token prompts, "
        f"{args.new_tokens} new tokens, greedy; aggregate = tokens made / wall time of "
        "`generate_batch` (its start-up included, as a user calls it); the last column leaves "
        "out the start-up and the first prefills.",
        "",
        "| streams | aggregate tok/s | tokens made | seconds | first to last token tok/s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for streams in (int(level) for level in args.concurrency.split(",")):
        prompts = random_prompts(vocab, streams, args.prompt_tokens)
        seconds, made, decode = run_level(model, prompts, args.new_tokens)
        # Tokens after each stream's first, over the span from the first token to the last.
        line = (
            f"| {streams} | {made / seconds:,.1f} | {made} | {seconds:.2f} | "
            f"{(made - streams) / decode:,.1f} |"
        )
        print(line, flush=True)
        lines.append(line)
    table = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
