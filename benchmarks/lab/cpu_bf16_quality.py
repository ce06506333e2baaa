"""Whether the bf16 block GEMV (`ExecutionPlan.gguf_bf16_gemv_types`) may become the CPU default
for GGUF files: on the embedded Gemma 3 270M Q4_K_M, mean KL(fp32 || decode path) over the
first 1024 tokens of GPL-3, teacher-forced one decode step at a time (the path the GEMV runs
on; a long prefill runs fp32 GEMMs), against HF transformers' bf16 on the same file (one
forward), and the 40 greedy tokens of issue 44's five prompts against HF fp32's argmax.

    python benchmarks/lab/cpu_bf16_quality.py --threads 2
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hearth import Engine
from hearth.embedded import embedded_model_path
from hearth.layers.gguf import GGUFLinear
from hearth.ops.plan import BF16_GEMV_TYPES
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import Sampler, SamplingParams

TEXT = Path("/usr/share/common-licenses/GPL-3")
TOKENS = 1024
GREEDY_TOKENS = 40
# tests/models/test_gguf_as_stored.py's prompts: (text, through the chat template).
PROMPTS = [
    ("In July 1969, Neil Armstrong", False),
    ("The three primary colors are:\n1.", False),
    ("def fibonacci(n):", False),
    ("The capital of France is Paris. The capital of Germany is", False),
    ("What is the capital of France?", True),
]
ALL_TYPES = (2, 6, 8, 12, 14)


def kl(reference: torch.Tensor, ours: torch.Tensor) -> float:
    return (reference.exp() * (reference - ours)).sum(-1).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = embedded_model_path()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    engine = Engine.load(path, device="cpu", progress=False)
    ids = engine.tokenizer.encode(TEXT.read_text())[:TOKENS]
    with torch.inference_mode():
        reference = hf(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
        hf_prompts = {}
    layers = [m for m in engine.model.modules() if isinstance(m, GGUFLinear)]
    fp32_plan = replace(engine.runner.plan, gguf_bf16_gemv_types=())
    variants = {
        "fp32 GEMV (the default)": (),
        f"bf16 GEMV {BF16_GEMV_TYPES}": BF16_GEMV_TYPES,
        f"bf16 GEMV {ALL_TYPES} (every type it has)": ALL_TYPES,
    }
    rows = []
    for name, types in variants.items():
        for layer in layers:
            layer.bf16_gemv_types = frozenset(types)
        runner = ModelRunner(engine.model, replace(fp32_plan, gguf_bf16_gemv_types=types))
        caches = runner.new_caches()
        with torch.inference_mode():
            steps = [runner.prefill(torch.tensor([ids[:1]]), caches).reshape(-1)]
            for position in range(1, len(ids)):
                steps.append(runner.decode(ids[position], caches, position).reshape(-1))
        ours = torch.stack(steps).float().log_softmax(-1)
        agree = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
        greedy_equal = 0
        for text, chat in PROMPTS:
            prompt = engine.encode(text, chat=chat)
            sampler = Sampler(SamplingParams(temperature=0))
            produced = list(
                generate_tokens(runner, prompt, sampler, GREEDY_TOKENS, GenerationStats())
            )
            key = (text, tuple(produced))
            if key not in hf_prompts:
                with torch.inference_mode():
                    logits = hf(input_ids=torch.tensor([prompt + produced])).logits[0]
                hf_prompts[key] = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
            greedy_equal += produced == hf_prompts[key]
        rows.append(f"| {name} | {kl(reference, ours):.2e} | {agree:.1%} | {greedy_equal} / 5 |")
    with torch.inference_mode():
        hf_bf16 = hf.to(torch.bfloat16)(input_ids=torch.tensor([ids])).logits[0]
    bf16_kl = kl(reference, hf_bf16.float().log_softmax(-1))
    rows.append(f"| HF transformers bf16 (one forward) | {bf16_kl:.2e} | | |")
    print(f"threads {args.threads}; {TOKENS} tokens of GPL-3, teacher-forced; KL vs HF fp32")
    print("| decode path | mean KL (nats) | top-1 agreement | greedy 40 = HF fp32 |")
    print("|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
