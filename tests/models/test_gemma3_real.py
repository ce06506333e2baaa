"""The real Gemma 3 270M (Q4_K_M GGUF): Hearth against HF transformers on the same file."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hearth.kv import make_caches
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.sampling import Sampler, SamplingParams

LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from winemaking. "
    "Within fifty years, presses had spread to more than two hundred cities across Europe, and "
    "the price of books fell sharply. Scholars could now compare identical copies of a text, "
    "which changed how knowledge was checked and shared. In the centuries that followed,"
)
GREEDY_PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


def test_prefill_and_decode_logits_match_hf(hearth_270m: Any, hf_270m: Any) -> None:
    """fp32 logits through Hearth's cached prefill and 16 decode steps vs HF's full forward.

    Tolerance 2e-3 absolute on logits up to ~50: both sides dequantize the same GGUF to fp32
    (the weights are identical) and run fp32 math; only summation order differs (the cache and
    SDPA), about 1e-6 relative per op over 18 layers. A wrong norm, mask or scale moves them >1.
    """
    ids = hearth_270m.tokenizer.encode(LONG_PROMPT)
    assert len(ids) >= 64
    model = hearth_270m.model
    caches = make_caches(model.cache_specs())
    decode_steps = 16
    prompt = torch.tensor([ids[:-decode_steps]])
    with torch.inference_mode():
        pieces = [model(prompt, caches)]
        for position in range(len(ids) - decode_steps, len(ids)):
            step = torch.tensor([[ids[position]]])
            pieces.append(model(step, caches, start=position))
        ours = torch.cat(pieces, dim=1)
        theirs = hf_270m(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=0)


@pytest.mark.parametrize("prompt", GREEDY_PROMPTS)
def test_greedy_40_tokens_identical_to_hf(hearth_270m: Any, hf_270m: Any, prompt: str) -> None:
    """Hearth's 40 greedy tokens are HF's: each is HF's argmax given the ones before, so HF's
    own greedy loop would make the same 40 (one HF forward over them, not 40 steps)."""
    ids = hearth_270m.tokenizer.encode(prompt)
    sampler = Sampler(SamplingParams(temperature=0.0))
    ours = list(generate_tokens(hearth_270m.model, ids, sampler, 40, GenerationStats()))
    with torch.inference_mode():
        logits = hf_270m(torch.tensor([ids + ours])).logits[0]
    assert ours == logits[len(ids) - 1 : -1].argmax(dim=-1).tolist()


def test_engine_generates_the_known_completion(hearth_270m: Any) -> None:
    """The greedy answer HF, llama.cpp and mlx-lm all give for this prompt (DESIGN.md)."""
    text = hearth_270m.generate(GREEDY_PROMPTS[0], max_tokens=8)
    assert text.startswith(" Berlin")
