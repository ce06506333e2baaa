"""Where a short prefill's host time goes, without a profiler's overhead.

An E4B prefill of 512 tokens ran 61-71 ms of wall time for 7-12 ms of GPU time, while one
launch alone costs the host 9-14 µs (`gpu_launch_overhead.py`). This times the forward as
`hearth bench` runs it, then again with a perf_counter around each call of the few functions
that launch work (cuBLAS linear, every Triton launch, SDPA, the static cache's update), and
reports each one's calls and inclusive host time; the rest is the model's own Python.

    OUT=/tmp/out python benchmarks/lab/gpu_host_breakdown.py --model e4b --quant 4bit
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hearth.kv.static import StaticCache

from hearth.bench.measure import PrefillRun
from hearth.bench.random_model import PRESETS, build_random_model

seconds: dict[str, float] = defaultdict(float)
calls: dict[str, int] = defaultdict(int)
depth = [0]


def timed_wrapper(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - begin
            calls[name] += 1

    return wrapper


def instrument() -> None:
    F.linear = timed_wrapper("F.linear (cuBLAS)", F.linear)
    F.scaled_dot_product_attention = timed_wrapper(
        "F.scaled_dot_product_attention", F.scaled_dot_product_attention
    )
    JITFunction.run = timed_wrapper("triton JITFunction.run (every Triton launch)", JITFunction.run)
    Autotuner.run = timed_wrapper("triton Autotuner.run (outer)", Autotuner.run)
    StaticCache.update_and_fetch = timed_wrapper(
        "StaticCache.update_and_fetch", StaticCache.update_and_fetch
    )


def host_and_wall(run: Callable[[], object]) -> tuple[float, float]:
    torch.cuda.synchronize()
    begin = time.perf_counter()
    run()
    queued = time.perf_counter()
    torch.cuda.synchronize()
    return (queued - begin) * 1e3, (time.perf_counter() - begin) * 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="e4b")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--loop", type=int, default=0, help="then N plain prefills (to sample)")
    parser.add_argument("--sample", type=int, default=0, help="then N prefills, stacks sampled")
    parser.add_argument("--ab-launch", action="store_true", help="host ms, fast launch on/off")
    args = parser.parse_args()
    model = build_random_model(PRESETS[args.model], torch.device("cuda"), quant=args.quant)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device="cuda")
    run = PrefillRun(model, ids)
    run()
    if args.ab_launch:
        print(ab_launch(run), flush=True)
    plain = [host_and_wall(run) for _ in range(5)]
    host = statistics.median(p[0] for p in plain)
    wall = statistics.median(p[1] for p in plain)
    instrument()
    run()
    seconds.clear()
    calls.clear()
    repeats = 3
    instrumented = statistics.median(host_and_wall(run)[0] for _ in range(repeats))
    name = f"{args.model} {args.quant}"
    lines = [
        f"# Host time of one prefill: {name}, {args.tokens} tokens, {torch.cuda.get_device_name()}",
        "",
        f"{time.strftime('%Y-%m-%d')} · torch {torch.__version__} · median of 5: "
        f"{wall:.2f} ms wall, of which the host returns after {host:.2f} ms "
        f"(instrumented: {instrumented:.2f} ms)",
        "",
        "| function | calls/forward | host ms/forward (inclusive) | µs a call |",
        "|---|---|---|---|",
    ]
    for key, total in sorted(seconds.items(), key=lambda item: -item[1]):
        count, micros = calls[key] / repeats, total / calls[key] * 1e6
        lines.append(f"| {key} | {count:.0f} | {total / repeats * 1e3:.2f} | {micros:.1f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    slug = name.replace(" ", "_")
    (out / f"gpu_host_breakdown_{slug}_{args.tokens}.md").write_text(table)
    for _ in range(args.loop):  # for a sampling profiler (py-spy) attached from outside
        run()
    torch.cuda.synchronize()
    if args.sample:
        report = sample_stacks(run, args.sample)
        print(report)
        (out / f"gpu_host_samples_{slug}_{args.tokens}.md").write_text(report)


def ab_launch(run: Callable[[], object], rounds: int = 7) -> str:
    """Host and wall ms of the prefill with the fast Triton launch on and off, alternating."""
    from hearth.ops import launch

    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(rounds):
        for fast in (True, False):
            launch.FAST_LAUNCH = fast
            run()
            times[fast].append(host_and_wall(run))
    launch.FAST_LAUNCH = True
    rows = ["| Triton launch | host ms (median) | wall ms (median) | each round's host ms |"]
    rows.append("|---|---|---|---|")
    for fast in (True, False):
        host = [t[0] for t in times[fast]]
        wall = [t[1] for t in times[fast]]
        each = ", ".join(f"{h:.1f}" for h in host)
        name = "fast (hearth.ops.launch)" if fast else "Triton's own"
        rows.append(
            f"| {name} | {statistics.median(host):.2f} | {statistics.median(wall):.2f} | {each} |"
        )
    return "\n".join(rows)


def sample_stacks(run: Callable[[], object], runs: int) -> str:
    """Function-level shares of the host's time in `runs` prefills, sampled in process: a
    thread reads the main thread's stack every ~100 µs (the switch interval is lowered so it
    gets the GIL; a sample lands at the next bytecode, so a long C call counts to its caller)."""
    main_id = threading.get_ident()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    taken = [0]
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            frame = sys._current_frames().get(main_id)
            names = []
            while frame is not None:
                code = frame.f_code
                names.append(f"{Path(code.co_filename).name}:{code.co_name}")
                frame = frame.f_back
            if any(name.endswith(":prefill") for name in names):
                taken[0] += 1
                own[names[0]] += 1
                for name in set(names):
                    inclusive[name] += 1
            time.sleep(0.0001)

    sys.setswitchinterval(0.0001)
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    for _ in range(runs):
        run()
    torch.cuda.synchronize()
    stop.set()
    thread.join()
    sys.setswitchinterval(0.005)
    total = max(taken[0], 1)
    lines = [f"# Host samples in {runs} prefills: {taken[0]}", ""]
    for title, counter in (("self", own), ("inclusive", inclusive)):
        lines += ["", f"| function ({title}) | samples | share |", "|---|---|---|"]
        for name, count in counter.most_common(45):
            lines.append(f"| `{name}` | {count} | {count / total:.1%} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
