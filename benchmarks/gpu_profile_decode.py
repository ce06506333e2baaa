"""Where a batch-1 decode step's GPU time goes: kernels per step and time per kernel family.

Profiles eager decode steps of a random-weight model at real shapes (the CUDA-graph replay
runs the same kernels) and groups the GPU time by kernel name.

    OUT=/tmp/out python benchmarks/gpu_profile_decode.py --model gemma3-12b --context 512
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hearth.bench.random_model import PRESETS, build_random
from hearth.cuda_graph import GraphDecoder

STEPS = 5


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma3-12b")
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    model = build_random(PRESETS[args.model], torch.device("cuda"))
    decoder = GraphDecoder(model, max_context=args.context + 64)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), device="cuda")
    token = decoder.prefill(ids).argmax(-1, keepdim=True)
    position = args.context

    def eager_step() -> None:
        nonlocal position, token
        decoder._set_view(position + 1)
        decoder._position.fill_(position)
        logits = model(token, decoder.caches, start=decoder._position, last_only=True)[:, -1]
        token = logits.argmax(-1, keepdim=True)
        position += 1

    eager_step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            eager_step()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            totals[name] += event.device_time_total if hasattr(event, "device_time_total") else 0
            counts[name] += 1
    total = sum(totals.values())
    lines = [
        f"# Decode step profile: {args.model}, context {args.context}, "
        f"{torch.cuda.get_device_name()}",
        "",
        f"kernels per step: {sum(counts.values()) / STEPS:.0f}; GPU time per step: "
        f"{total / STEPS / 1e3:.2f} ms",
        "",
        "| kernel | launches/step | µs/step | share |",
        "|---|---|---|---|",
    ]
    for name, micros in sorted(totals.items(), key=lambda item: -item[1])[:25]:
        lines.append(
            f"| `{name}` | {counts[name] / STEPS:.0f} | {micros / STEPS:.0f} | "
            f"{micros / total:.1%} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_profile_{args.model}.md").write_text(table)


if __name__ == "__main__":
    main()
