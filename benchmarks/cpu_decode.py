"""CPU speed on a GGUF model: Hearth against llama.cpp (and HF transformers) on the same file.

The model is the embedded Gemma 3 270M unless `--model` names a GGUF file, e.g. a random
Gemma 4 E2B at real shapes (benchmarks/write_random_gguf.py --config e2b --type Q8_0).
Each engine runs in its own subprocess (so peak RSS is its own) on the same prompt: load time,
prefill tok/s (time to first token), decode tok/s over greedy tokens, peak RSS. The roofline
column is the measured memory bandwidth divided by the weight bytes one decode step must read
in that engine's format (not the rows only looked up, nor idle experts).

    python benchmarks/cpu_decode.py [--out benchmarks/results/cpu_270m-DATE.md]
    python benchmarks/cpu_decode.py --model e2b-q8_0.gguf --prompt-tokens 128 --decode-tokens 32 \
        --engines "hearth bf16 + int8 weights" "llama.cpp (llama-cpp-python)"
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hearth.bench.llama_peer import cpu_has_amx

PROMPT_TOKENS = 400
DECODE_TOKENS = 64
# This VM's speed drifts by up to 25% from minute to minute: each engine is timed this many
# times in a row and its best run is reported.
REPEATS = 3
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "winemaking. Within fifty years, presses had spread to more than two hundred cities. "
) * 20

ENGINES = {
    # The default for a GGUF file on the CPU: its blocks as stored, the weights exact; the
    # Q4_K/Q6_K decode GEMV on AVX512-BF16 rounds its activations to bf16 where the CPU has it
    # (`ExecutionPlan.gguf_bf16_gemv_types`), fp32 activations elsewhere.
    "hearth + GGUF blocks as stored (default)": (
        "hearth",
        {"dtype": None, "quantize": "auto"},
    ),
    # The same with fp32 activations everywhere (exact up to the order of fp32 sums).
    "hearth + GGUF blocks as stored, fp32 activations (HEARTH_GGUF_BF16=0)": (
        "hearth",
        {"dtype": None, "quantize": "auto", "gguf_bf16": False},
    ),
    # The same with the per-module decode step (no native layer call): the baseline the
    # native layer step is measured against in one run.
    "hearth + GGUF blocks as stored, module path": (
        "hearth",
        {"dtype": None, "quantize": "auto", "native_layers": False},
    ),
    "hearth fp32": ("hearth", {"dtype": "float32", "quantize": "none"}),
    "hearth bf16": ("hearth", {"dtype": "bfloat16", "quantize": "none"}),
    "hearth bf16 + int8 weights": ("hearth", {"dtype": "bfloat16", "quantize": "int8"}),
    # The int8 opt-in with its streamed weights in transparent huge pages (hearth.ops.native).
    "hearth bf16 + int8 weights, huge pages": (
        "hearth",
        {"dtype": "bfloat16", "quantize": "int8", "huge_pages": True},
    ),
    # The int8 opt-in with Hearth's native CPU kernels off (hearth.ops.native): torch ops only.
    "hearth bf16 + int8 weights, torch kernels only": (
        "hearth",
        {"dtype": "bfloat16", "quantize": "int8", "native": False},
    ),
    "hearth bf16 + int4 weights": ("hearth", {"dtype": "bfloat16", "quantize": "int4"}),
    "HF transformers fp32": ("hf", {"dtype": "float32"}),
    "HF transformers bf16": ("hf", {"dtype": "bfloat16"}),
    "llama.cpp (llama-cpp-python)": ("llama_cpp", {}),
}


def model_path(given: str | None) -> Path:
    from hearth.embedded import embedded_model_path

    return Path(given) if given else embedded_model_path()


def prompt_ids(path: Path, tokens: int) -> list[int]:
    from hearth.checkpoint import open_checkpoint

    ids = open_checkpoint(path).tokenizer().encode(TEXT)
    return ids[:tokens]


def gguf_decode_bytes(path: Path) -> int:
    """Bytes of a GGUF file one decode step reads, as `hearth.bench.measure.decode_bytes`
    counts a model's: not the per-layer table (rows looked up) nor idle experts."""
    from hearth.checkpoint.gguf import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(path)
    config = checkpoint.config
    share = config.get("top_k_experts", 1) / config.get("num_experts", 1)
    total = 0.0
    for name, (_, nbytes, _) in checkpoint.tensor_storage().items():
        if "embed_tokens_per_layer" in name:
            continue
        if name == "embed_tokens.weight" and not config["tie_word_embeddings"]:
            continue
        total += nbytes * (share if ".experts." in name else 1.0)
    return int(total)


def peak_rss_mib() -> float:
    from hearth.runtime.generate import peak_resident_bytes

    return peak_resident_bytes() / 2**20


def run_hearth(
    options: dict[str, Any], path: Path, ids: list[int], decode: int
) -> dict[str, float]:
    if not options.get("native", True):
        os.environ["HEARTH_NATIVE"] = "0"  # read when the kernels are first asked for
    if options.get("huge_pages", False):
        os.environ["HEARTH_HUGE_PAGES"] = "1"  # read when the model loads
    if "gguf_bf16" in options:
        os.environ["HEARTH_GGUF_BF16"] = "1" if options["gguf_bf16"] else "0"  # read at load
    import hearth
    from hearth.bench.measure import decode_bytes
    from hearth.runtime.generate import GenerationStats, generate_tokens
    from hearth.runtime.sampling import Sampler, SamplingParams

    started = time.perf_counter()
    engine = hearth.load(
        path, dtype=options["dtype"], device="cpu", progress=False, quantize=options["quantize"]
    )
    load = time.perf_counter() - started
    runner = engine.runner
    if not options.get("native_layers", True):
        from dataclasses import replace

        from hearth.runtime.runner import ModelRunner

        runner = ModelRunner(engine.model, replace(runner.plan, native_layers=False))
    sampler = Sampler(SamplingParams())
    list(generate_tokens(runner, ids[:16], sampler, 4, GenerationStats()))  # warm up
    runs = []
    for _ in range(REPEATS):
        stats = GenerationStats()
        list(generate_tokens(runner, ids, sampler, decode + 1, stats))
        runs.append((stats.prefill_tokens_per_second, stats.decode_tokens_per_second))
    return {
        "load_s": load,
        "prefill": max(r[0] for r in runs),
        "decode": max(r[1] for r in runs),
        "weight_bytes": decode_bytes(engine.model),
    }


def run_hf(options: dict[str, Any], path: Path, ids: list[int], decode: int) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, options["dtype"])
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
    load = time.perf_counter() - started
    prompt = torch.tensor([ids])

    def timed(new_tokens: int) -> float:
        begin = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
        return time.perf_counter() - begin

    timed(2)  # warm up
    first = min(timed(1) for _ in range(REPEATS))
    total = min(timed(decode + 1) for _ in range(REPEATS))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "load_s": load,
        "prefill": len(ids) / first,
        "decode": decode / (total - first),
        "weight_bytes": weight_bytes,
    }


def run_llama_cpp(
    options: dict[str, Any], path: Path, ids: list[int], decode: int
) -> dict[str, float]:
    import numpy as np

    from hearth.bench.llama_peer import open_llama

    started = time.perf_counter()
    threads = int(os.environ.get("HEARTH_BENCH_THREADS", "2"))
    llm = open_llama(
        path, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False, logits_all=False
    )
    load = time.perf_counter() - started
    llm.eval(ids[:16])  # warm up
    prefill, seconds = float("inf"), float("inf")
    for _ in range(REPEATS):
        llm.reset()
        begin = time.perf_counter()
        llm.eval(ids)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        prefill = min(prefill, time.perf_counter() - begin)
        begin = time.perf_counter()
        for _ in range(decode):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        seconds = min(seconds, time.perf_counter() - begin)
    return {
        "load_s": load,
        "prefill": len(ids) / prefill,
        "decode": decode / seconds,
        "weight_bytes": gguf_decode_bytes(path),
    }


def one(name: str, path: Path, prompt_tokens: int, decode: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("HEARTH_BENCH_THREADS", "2")))
    kind, options = ENGINES[name]
    ids = prompt_ids(path, prompt_tokens)
    runner = {"hearth": run_hearth, "hf": run_hf, "llama_cpp": run_llama_cpp}[kind]
    result = runner(options, path, ids, decode)
    result["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(result))


def memory_bandwidth_gbs() -> float:
    """Copy bandwidth (read + write bytes / s) on a buffer far larger than the caches."""
    import torch

    source = torch.ones(256 * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    begin = time.perf_counter()
    for _ in range(10):
        target.copy_(source)
    return 2 * source.nbytes * 10 / (time.perf_counter() - begin) / 1e9


def cpu_model() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    parser.add_argument("--engines", nargs="*", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--model", help="a GGUF file (default: the embedded Gemma 3 270M)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument(
        "--threads", type=int, default=2, help="threads of every engine (torch's, llama.cpp's)"
    )
    args = parser.parse_args()
    os.environ["HEARTH_BENCH_THREADS"] = str(args.threads)  # the engines' subprocesses read it
    path = model_path(args.model)
    if args.one:
        one(args.one, path, args.prompt_tokens, args.decode_tokens)
        return
    sizes = ["--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]
    bandwidth = memory_bandwidth_gbs()
    rows = []
    for name in args.engines:
        result = subprocess.run(
            [sys.executable, __file__, "--one", name, "--model", str(path), *sizes],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["failed"])[-1]
            rows.append(f"| {name} | skipped: {last[:80]} | | | | |")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        roofline = bandwidth * 1e9 / r["weight_bytes"]
        shown = name
        if ENGINES[name][0] == "llama_cpp" and cpu_has_amx():
            shown += " (plain buffers, see hearth.bench.llama_peer)"
        rows.append(
            f"| {shown} | {r['load_s']:.1f} | {r['prefill']:.0f} | {r['decode']:.1f} | "
            f"{r['decode'] / roofline:.0%} of {roofline:.0f} | {r['peak_rss_mib']:.0f} |"
        )
        print(rows[-1], flush=True)
    import torch

    header = [
        f"# CPU, {path.name} — {datetime.date.today().isoformat()}",
        "",
        f"Machine: {cpu_model()}, {args.threads} "
        f"threads, torch {torch.__version__}, Python {platform.python_version()}; "
        f"copy bandwidth {bandwidth:.1f} GB/s. Prompt {args.prompt_tokens} tokens, "
        f"{args.decode_tokens} greedy decode tokens; best of {REPEATS} runs per engine.",
        "",
        "| engine | load s | prefill tok/s | decode tok/s | decode vs bandwidth roofline "
        "| peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    table = "\n".join(header + rows) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)


if __name__ == "__main__":
    main()
