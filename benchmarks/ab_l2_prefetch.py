"""A/B of the L2 prefetch branch (hearth.kernels.l2_prefetch) in CUDA-graph decode.

For each model (random weights at real shapes), times batch-1 decode with the prefetch off
and on, alternating for several rounds in one process, then profiles graph replays with it
on (the kernels of a captured step, the prefetch branch running beside the attention):

    OUT=/tmp/out python benchmarks/ab_l2_prefetch.py --models gemma3-12b,e4b --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from datetime import date
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton

from hearth.bench.measure import copy_bandwidth, decode_bytes, kv_bytes, time_decode
from hearth.bench.random_model import PRESETS, build_random_model
from hearth.cuda_graph import GraphDecoder
from hearth.kernels import l2_prefetch

PROFILED_STEPS = 5


@torch.inference_mode()
def profile_replays(model: torch.nn.Module, context: int) -> list[str]:
    """Kernel table of PROFILED_STEPS graph replays at `context`, with the GPU span per step."""
    decoder = GraphDecoder(model, max_context=context + 64)
    ids = torch.randint(0, model.config.vocab_size, (1, context - 1), device="cuda")
    token = decoder.prefill(ids).argmax(-1, keepdim=True)
    token = decoder.step(token).argmax(-1, keepdim=True)  # captures
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_STEPS):
            token = decoder.step(token).argmax(-1, keepdim=True)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    starts, ends = [], []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name[:60]
            totals[name] += event.device_time_total
            counts[name] += 1
            starts.append(event.time_range.start)
            ends.append(event.time_range.end)
    busy = sum(totals.values()) / PROFILED_STEPS
    span = (max(ends) - min(starts)) / PROFILED_STEPS if starts else 0.0
    lines = [
        f"kernel time per step {busy / 1e3:.2f} ms (overlapping branches count twice); "
        f"GPU span per step {span / 1e3:.2f} ms; kernels per step "
        f"{sum(counts.values()) / PROFILED_STEPS:.0f}",
        "",
        "| kernel | launches/step | µs/step | µs each |",
        "|---|---|---|---|",
    ]
    for name, micros in sorted(totals.items(), key=lambda item: -item[1])[:16]:
        launches, per_step = counts[name] / PROFILED_STEPS, micros / PROFILED_STEPS
        each = micros / counts[name]
        lines.append(f"| `{name}` | {launches:.0f} | {per_step:.0f} | {each:.1f} |")
    return lines


@torch.inference_mode()
def graph_logits(model: torch.nn.Module, context: int) -> torch.Tensor:
    """Logits of 3 graph-decoded greedy steps after a fixed random prompt."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context - 1), device="cuda", generator=generator)
    decoder = GraphDecoder(model, max_context=context + 64)
    token = decoder.prefill(ids).argmax(-1, keepdim=True)
    steps = []
    for _ in range(3):
        logits = decoder.step(token)
        steps.append(logits)
        token = logits.argmax(-1, keepdim=True)
    return torch.stack(steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gemma3-12b")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    lines = [
        f"# L2 prefetch of o_proj during attention: A/B ({date.today()}, "
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__})",
        "",
        f"Batch-1 CUDA-graph decode at context {args.context}, {args.steps} steps a timing, "
        f"{args.quant} weights, off/on alternating for {args.rounds} rounds in one process. "
        f"Roofline: (weights + KV bytes) / {bandwidth / 1e12:.2f} TB/s (measured copy).",
        "",
        "| model | prefetch | tok/s (each round) | median | % of roofline |",
        "|---|---|---|---|---|",
    ]
    profiles: list[str] = []
    for name in args.models.split(","):
        model = build_random_model(PRESETS[name], device, quant=args.quant)
        step_bytes = decode_bytes(model) + kv_bytes(model.config, args.context, 2)
        rates: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for enabled in (False, True):
                l2_prefetch.ENABLED = enabled
                seconds, _ = time_decode(model, args.context, args.steps)
                rates[enabled].append(1.0 / seconds)
        for enabled in (False, True):
            median = statistics.median(rates[enabled])
            each = ", ".join(f"{r:.1f}" for r in rates[enabled])
            share = median * step_bytes / bandwidth
            lines.append(
                f"| {name} | {'on' if enabled else 'off'} | {each} | {median:.1f} | {share:.1%} |"
            )
        logits = {}
        for enabled in (False, True):
            l2_prefetch.ENABLED = enabled
            logits[enabled] = graph_logits(model, args.context)
        same = torch.equal(logits[False], logits[True])
        lines.append(f"| {name} | logits on vs off | bit-identical: {same} | | |")
        for enabled in () if args.no_profile else (False, True):
            l2_prefetch.ENABLED = enabled
            state = "on" if enabled else "off"
            profiles += ["", f"## {name}, graph replays, prefetch {state}", ""]
            profiles += profile_replays(model, args.context)
        del model
        torch.cuda.empty_cache()
    table = "\n".join(lines + profiles) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ab_l2_prefetch_{args.quant}.md").write_text(table)


if __name__ == "__main__":
    main()
