"""The default CPU path for a GGUF file (blocks kept as stored, fp32 activations) on the embedded
Gemma 3 270M Q4_K_M against HF transformers reading the same file in fp32 (the oracle).

HF dequantizes every tensor with the `gguf` package and runs in fp32; Hearth computes on the
file's blocks, whose values are the same numbers bit for bit (tests/layers/test_gguf_linear.py),
so the two differ only in the order of fp32 sums. Measured: at most 1.5e-4 on logits up to ~98
over these prompts. Tolerance 5e-4, 3x that; the int8 re-grid (`--quantize int8`) is shown to
lie far outside it, so the tolerance tells the exact path from the re-rounded one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from decoding import count_kernel_calls
from hearth.engine import Engine
from hearth.layers.gguf import GGUFEmbeddingHead, GGUFLinear
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.sampling import Sampler, SamplingParams

ATOL = 5e-4
GREEDY_TOKENS = 40
# (text, through the chat template): the first two are the issue's, where the int8 re-grid
# answered otherwise (" became the first man...", " red, orange, and yellow").
PROMPTS = [
    ("In July 1969, Neil Armstrong", False),
    ("The three primary colors are:\n1.", False),
    ("def fibonacci(n):", False),
    ("The capital of France is Paris. The capital of Germany is", False),
    ("What is the capital of France?", True),
]


@pytest.fixture(scope="module")
def default_engine(embedded_gguf: Path) -> Engine:
    return Engine.load(embedded_gguf, device="cpu", progress=False)


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids])).logits[0]


def test_the_default_cpu_load_computes_on_the_files_blocks(default_engine: Engine) -> None:
    model = default_engine.model
    assert model.compute_dtype == torch.float32
    assert isinstance(model.embed_tokens, GGUFEmbeddingHead)
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.proj, GGUFLinear)
    qkv = layer.self_attn.qkv_proj.proj
    assert (qkv.type_ids, qkv.part_rows) == ([6, 8], [1024 + 256, 256])  # q, k Q5_0; v Q8_0
    assert isinstance(layer.mlp.down_proj, GGUFLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_logits_equal_hf_fp32_on_the_same_file(
    default_engine: Engine, hf_270m: Any, embedded_gguf: Path
) -> None:
    ids = default_engine.encode("In July 1969, Neil Armstrong landed on the moon with", chat=False)
    reference = _hf_logits(hf_270m, ids)
    with torch.inference_mode():
        ours = default_engine.model(torch.tensor([ids]))[0]
    assert (ours - reference).abs().max() <= ATOL
    regrid = Engine.load(embedded_gguf, device="cpu", progress=False, quantize="int8")
    with torch.inference_mode():
        rounded_twice = regrid.model(torch.tensor([ids]))[0].float()
    assert (rounded_twice - reference).abs().max() > 100 * ATOL


@pytest.mark.parametrize(("text", "chat"), PROMPTS, ids=[p[0][:16] for p in PROMPTS])
def test_greedy_tokens_equal_hf(
    default_engine: Engine, hf_270m: Any, text: str, chat: bool
) -> None:
    """40 greedy tokens, each HF's argmax given the ones before (one HF forward per prompt)."""
    prompt = default_engine.encode(text, chat=chat)
    sampler = Sampler(SamplingParams(temperature=0))
    stats = GenerationStats()
    produced = list(generate_tokens(default_engine.runner, prompt, sampler, GREEDY_TOKENS, stats))
    reference = _hf_logits(hf_270m, prompt + produced)
    assert produced == reference[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    if text.startswith("In July 1969"):
        assert default_engine.tokenizer.decode(produced).startswith(" landed on the moon.")


def test_native_decode_steps_equal_hf_fp32(
    default_engine: Engine, hf_270m: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps run as one native call per layer over the blocks (`gemma3_blocks_layer`),
    alone and four sequences at once: their logits within ATOL of HF's on the same tokens."""
    runner = default_engine.runner
    calls = count_kernel_calls(monkeypatch, "gemma3_blocks_layer")
    prompts = [default_engine.encode(text, chat=chat) for text, chat in PROMPTS[:4]]
    steps = 6
    with torch.inference_mode():
        caches = [runner.new_caches() for _ in prompts]
        last = [
            runner.prefill(torch.tensor([ids]), own)
            for ids, own in zip(prompts, caches, strict=True)
        ]
        tokens = [[*ids, int(logits.argmax())] for ids, logits in zip(prompts, last, strict=True)]
        got: list[list[torch.Tensor]] = [[] for _ in prompts]
        for step in range(steps):
            positions = [len(ids) - 1 for ids in tokens]
            if step % 2:  # alone, then together
                rows = [runner.decode(ids[-1], own, at) for ids, own, at in
                        zip(tokens, caches, positions, strict=True)]  # fmt: skip
            else:
                rows = list(runner.decode_batch([ids[-1] for ids in tokens], caches, positions))
            for index, logits in enumerate(rows):
                got[index].append(logits.reshape(-1))
                tokens[index].append(int(logits.argmax()))
    assert len(calls) == (steps // 2 + steps // 2 * len(prompts)) * len(runner.model.layers)
    for index, ids in enumerate(tokens):
        reference = _hf_logits(hf_270m, ids)
        first = len(prompts[index])
        for step, logits in enumerate(got[index]):
            assert (logits - reference[first + step]).abs().max() <= ATOL, (index, step)


def test_bf16_compute_on_stored_blocks_falls_back_from_the_native_layer_step(
    embedded_gguf: Path,
) -> None:
    """`--dtype bfloat16` keeps the blocks as stored (the products still fp32 on exact
    weights); the native bf16 layer step, which reads int8 or bf16 weights only, declines
    every step without changing anything, and the modules run it."""
    from hearth.runtime.native_step import NativeDecodeStep

    engine = Engine.load(embedded_gguf, device="cpu", progress=False, dtype="bfloat16")
    assert engine.model.compute_dtype == torch.bfloat16
    assert isinstance(engine.model.layers[0].mlp.down_proj, GGUFLinear)
    caches = engine.new_caches()
    step = NativeDecodeStep(engine.model)
    ids = torch.tensor([[2]])
    with torch.inference_mode():
        assert step.applies(ids, caches)
        assert step(ids, caches, 0) is None
    prompt = engine.encode("In July 1969, Neil Armstrong", chat=False)
    sampler = Sampler(SamplingParams(temperature=0))
    produced = list(generate_tokens(engine.runner, prompt, sampler, 4, GenerationStats()))
    assert len(produced) == 4
