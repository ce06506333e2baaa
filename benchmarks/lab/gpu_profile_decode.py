"""Where a batch-1 decode step's (or a prefill's) GPU time goes, by kernel name.

Profiles eager decode steps of a random-weight model at real shapes (the CUDA-graph replay
runs the same kernels), or with --prefill N one N-token prefill as `hearth bench` times it,
and groups the GPU time by kernel name.

    OUT=/tmp/out python benchmarks/lab/gpu_profile_decode.py --model gemma3-12b --context 512
    OUT=/tmp/out python benchmarks/lab/gpu_profile_decode.py --model 26b-a4b --prefill 4096
    OUT=/tmp/out python benchmarks/lab/gpu_profile_decode.py --model gemma3-12b --quant 4bit
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hearth.bench.measure import PrefillRun, timed
from hearth.bench.random_model import PRESETS, build_random_model
from hearth.runtime.graphs import GraphDecoder

STEPS = 5


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma3-12b")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=0, help="profile an N-token prefill")
    parser.add_argument("--quant", default="bf16", help="bf16, 4bit or 8bit weights")
    args = parser.parse_args()
    model = build_random_model(PRESETS[args.model], torch.device("cuda"), quant=args.quant)
    name = args.model if args.quant == "bf16" else f"{args.model}_{args.quant}"
    if args.prefill:
        profile_prefill(model, name, args.prefill)
        return
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
    title = f"Decode step profile: {name}, context {args.context}"
    write_table(prof, STEPS, title, f"gpu_profile_{name}.md", "step")


@torch.inference_mode()
def profile_prefill(model: torch.nn.Module, name: str, tokens: int) -> None:
    """One prefill as `hearth bench` times it (static caches on a GPU, the engine's chunks)."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), device="cuda")
    run = PrefillRun(model, ids)
    run()
    torch.cuda.synchronize()
    # Wall time apart from the profiler's: beside the GPU time it tells a host-bound prefill.
    wall = statistics.median(timed(ids.device, run) for _ in range(3))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    title = f"Prefill profile: {name}, {tokens} tokens as `hearth bench` runs them"
    note = f"wall time per forward (median of 3, unprofiled): {wall * 1e3:.2f} ms"
    filename = f"gpu_profile_{name}_prefill{tokens}.md"
    write_table(prof, 1, title, filename, "forward", note)
    # Where the host's time goes, by Python function: a host-bound prefill shows it here.
    host = cProfile.Profile()
    host.enable()
    run()
    torch.cuda.synchronize()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
    pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(40)
    report = "\n## Host time by Python function (cProfile, one forward)\n\n```\n"
    report += text.getvalue() + "```\n"
    print(report)
    path = Path(os.environ.get("OUT", "benchmarks/results")) / filename
    path.write_text(path.read_text() + report)


def write_table(
    prof: profile, steps: int, title: str, filename: str, unit: str, note: str = ""
) -> None:
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            totals[name] += event.device_time_total if hasattr(event, "device_time_total") else 0
            counts[name] += 1
    total = sum(totals.values())
    lines = [
        f"# {title}, {torch.cuda.get_device_name()}",
        "",
        f"kernels per {unit}: {sum(counts.values()) / steps:.0f}; GPU time per {unit}: "
        f"{total / steps / 1e3:.2f} ms" + (f"; {note}" if note else ""),
        "",
        f"| kernel | launches/{unit} | µs/{unit} | share |",
        "|---|---|---|---|",
    ]
    for name, micros in sorted(totals.items(), key=lambda item: -item[1])[:25]:
        lines.append(
            f"| `{name}` | {counts[name] / steps:.0f} | {micros / steps:.0f} | "
            f"{micros / total:.1%} |"
        )
    # With CPU events recorded: which torch ops launched that GPU time.
    ops = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    ops = [e for e in ops if e.key.startswith("aten::") and e.device_time_total > 0]
    if ops:
        lines += ["", f"| torch op | calls/{unit} | GPU µs/{unit} (with its children) |"]
        lines.append("|---|---|---|")
        for op in sorted(ops, key=lambda e: -e.device_time_total)[:20]:
            calls, micros = op.count / steps, op.device_time_total / steps
            lines.append(f"| `{op.key}` | {calls:.0f} | {micros:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / filename).write_text(table)


if __name__ == "__main__":
    main()
