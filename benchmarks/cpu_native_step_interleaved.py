"""Decode step time on a GGUF file, the native layer step against the per-module step and
llama.cpp, their steps interleaved in one process: on a shared, loaded machine each round
times one step of each engine back to back, so all see the same load; the best and the median
round per engine are reported.

    python benchmarks/cpu_native_step_interleaved.py /tmp/e2b-q4km.gguf --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import hearth
from hearth.bench.llama_peer import open_llama
from hearth.runtime.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = hearth.load(args.model, device="cpu", progress=False)
    native = engine.runner
    modules = ModelRunner(engine.model, replace(native.plan, native_layers=False))
    assert native.native is not None and modules.native is None
    llama = open_llama(
        args.model, n_ctx=1024, n_threads=args.threads, n_batch=512, verbose=False,
        logits_all=False,
    )  # fmt: skip
    prompt = list(range(10, 10 + args.prompt_tokens))
    ids = torch.tensor([prompt])
    states = {}
    with torch.inference_mode():
        for name, runner in (("hearth native layer step", native), ("hearth module path", modules)):
            caches = runner.new_caches()
            token = int(runner.prefill(ids, caches).argmax(dim=-1))
            states[name] = (runner, caches, token)
    llama.eval(prompt)
    llama_token = int(np.argmax(llama.scores[llama.n_tokens - 1]))
    times: dict[str, list[float]] = {name: [] for name in (*states, "llama.cpp")}
    position = len(prompt)
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, (runner, caches, token) in states.items():
                begin = time.perf_counter()
                logits = runner.decode(token, caches, position)
                times[name].append(time.perf_counter() - begin)
                states[name] = (runner, caches, int(logits.argmax(dim=-1)))
            begin = time.perf_counter()
            llama.eval([llama_token])
            llama_token = int(np.argmax(llama.scores[llama.n_tokens - 1]))
            times["llama.cpp"].append(time.perf_counter() - begin)
            position += 1
    print("| engine | best step ms (tok/s) | median step ms (tok/s) |")
    print("|---|---|---|")
    for name, steps in times.items():
        best, median = min(steps), statistics.median(steps)
        shown = f"{best * 1e3:.0f} ({1 / best:.2f}) | {median * 1e3:.0f} ({1 / median:.2f})"
        print(f"| {name} | {shown} |")
    llama_best, llama_median = min(times["llama.cpp"]), statistics.median(times["llama.cpp"])
    for name in states:
        print(
            f"{name} vs llama.cpp: best {llama_best / min(times[name]):.2f}x, "
            f"median {llama_median / statistics.median(times[name]):.2f}x"
        )


if __name__ == "__main__":
    main()
