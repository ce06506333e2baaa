"""Gemma 3 decode layers over GGUF blocks kept as stored (fp32), one native call each
(`gemma3_blocks_layer`, hearth/runtime/native_step.py), against the module path they replace,
on this CPU's library and on the AVX2 one.

The native layer runs the module path's own kernels for the projections (the block GEMV), the
norms and RoPE, in its order; attention (the module path's is torch's SDPA) and GELU (torch's
vectorised tanh, libm's here) sum in another order. So the two differ only by fp32
reassociation, which the module path itself shows against HF transformers on the same file:
the tolerance is the one tests/models/test_gguf_types_as_stored.py holds it to, 2e-5 of the
largest logit (measured here: ~1e-6 of it). A weight, norm or cache slot taken wrongly moves
logits by far more.

Several sequences in one call (`decode_rows`) must give each sequence's logits bit for bit as
it alone: the block GEMV forms each input row's sums in the one-row order, and every other op
runs row by row.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decoding import count_kernel_calls, greedy_after, random_prompt
from hearth.checkpoint.gguf_writer import write_gguf
from hearth.engine import Engine
from hearth.kv.paged import KVPool, cache_groups
from hearth.layers.gguf import GGUFLinear
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.native_step import NativeDecodeStep
from hearth.runtime.runner import ModelRunner
from native_builds import kernels_build  # noqa: F401 (a fixture)
from tiny import TINY_VOCAB, tiny_gemma3_model

RTOL = 2e-5
DECODE_STEPS = 12


@pytest.fixture(scope="module", params=["Q5_0", "Q8_0"])
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 (sliding window 8) whose matrices the `gguf` package quantized."""
    hf = tiny_gemma3_model(seed=5)
    tensors = {
        name.removeprefix("model."): tensor
        for name, tensor in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    path = tmp_path_factory.mktemp("blocks") / f"{request.param}.gguf"
    return write_gguf(path, hf.config.to_dict(), tensors, TINY_VOCAB, request.param)


@functools.cache
def _runners(path: Path) -> tuple[ModelRunner, ModelRunner]:
    """A native and a module runner of one load of `path` (loaded once per file). The head
    stays the block GEMV at every row count (a CPU with AMX takes 6+ rows on AMX tiles with
    bf16 inputs, tests/runtime/test_native_paged_blocks.py): the layers are what is compared."""
    plan = replace(ExecutionPlan.for_device("cpu"), gguf_amx_head_rows=0)
    engine = Engine.load(path, device="cpu", progress=False, plan=plan)
    model = engine.model
    assert model.compute_dtype == torch.float32
    assert isinstance(model.layers[0].mlp.down_proj, GGUFLinear)
    return ModelRunner(model, plan), ModelRunner(model, replace(plan, native_layers=False))


@pytest.mark.usefixtures("kernels_build")
@pytest.mark.parametrize(
    # Within the window of 8, and wrapping the sliding layers' ring during decode.
    "prompt_length",
    [3, 20],
)
def test_native_blocks_layers_match_the_module_path(
    gguf_file: Path, prompt_length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_runner, module_runner = _runners(gguf_file)
    calls = count_kernel_calls(monkeypatch, "gemma3_blocks_layer")
    prompt = random_prompt(prompt_length, prompt_length)
    expected, expected_caches = greedy_after(module_runner, prompt, DECODE_STEPS)
    assert not calls
    got, got_caches = greedy_after(native_runner, prompt, DECODE_STEPS)
    assert len(calls) == DECODE_STEPS * len(native_runner.model.layers)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert (a - b).abs().max() <= RTOL * a.abs().max(), f"step {step}"
        assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))
    for a, b in zip(expected_caches, got_caches, strict=True):
        assert a.offset == b.offset
        for plane_a, plane_b in zip(
            a.contents().stored.planes, b.contents().stored.planes, strict=True
        ):
            assert torch.allclose(plane_a, plane_b, rtol=0, atol=RTOL * plane_a.abs().max())


@pytest.mark.usefixtures("kernels_build")
def test_sequences_together_equal_each_alone(gguf_file: Path) -> None:
    """Three sequences of different lengths (one past the window) decoded together, natively,
    give each one's logits and caches bit for bit as decoding it alone."""
    runner, _ = _runners(gguf_file)
    prompts = [random_prompt(length, length) for length in (3, 11, 6)]
    alone = [greedy_after(runner, prompt, DECODE_STEPS) for prompt in prompts]
    caches = [runner.new_caches() for _ in prompts]
    with torch.inference_mode():
        last = [runner.prefill(prompt, own) for prompt, own in zip(prompts, caches, strict=True)]
        for step in range(DECODE_STEPS):
            tokens = [int(logits.argmax(dim=-1)) for logits in last]
            positions = [prompt.shape[1] + step for prompt in prompts]
            rows = runner.decode_batch(tokens, caches, positions)
            assert rows.shape == (len(prompts), len(TINY_VOCAB))
            for index, (logits, _) in enumerate(alone):
                assert torch.equal(rows[index], logits[step + 1][0]), f"step {step}, seq {index}"
            last = list(rows)
    for (_, own_alone), own in zip(alone, caches, strict=True):
        for a, b in zip(own_alone, own, strict=True):
            planes = zip(a.contents().stored.planes, b.contents().stored.planes, strict=True)
            assert all(torch.equal(plane_a, plane_b) for plane_a, plane_b in planes)


@pytest.mark.usefixtures("kernels_build")
def test_sequences_on_paged_caches_equal_each_alone(tmp_path: Path) -> None:
    """The scheduler's case: three sequences on one paged pool, decoded together natively,
    give each one's logits bit for bit as decoding it alone on `LayerCache`s. One KV head (as
    the 270M has) and blocks of 4 tokens, so a run of consecutive blocks is read as a view of
    the pool itself, which the native kernel must not write through."""
    hf = tiny_gemma3_model(seed=5, num_key_value_heads=1)
    tensors = {
        name.removeprefix("model."): tensor
        for name, tensor in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    path = write_gguf(tmp_path / "one_head.gguf", hf.config.to_dict(), tensors, TINY_VOCAB, "Q8_0")
    runner = ModelRunner(Engine.load(path, device="cpu", progress=False).model)
    model = runner.model
    prompts = [random_prompt(length, length) for length in (3, 11, 6)]
    alone = [greedy_after(runner, prompt, DECODE_STEPS) for prompt in prompts]
    specs, policy = model.cache_specs(), runner.kv_policy
    blocks = [64] * len(cache_groups(specs, policy))
    pool = KVPool(specs, policy, model.compute_dtype, blocks, 4)
    sequences = [pool.sequence() for _ in prompts]
    histories = [prompt[0].tolist() for prompt in prompts]
    with torch.inference_mode():
        last = []
        for prompt, sequence, history in zip(prompts, sequences, histories, strict=True):
            assert sequence.reserve(prompt.shape[1])
            last.append(runner.prefill(prompt, sequence.caches))
            sequence.after_forward(history)
        for step in range(DECODE_STEPS):
            tokens = [int(logits.argmax(dim=-1)) for logits in last]
            positions = [prompt.shape[1] + step for prompt in prompts]
            for sequence in sequences:
                assert sequence.reserve(1)
            caches = [sequence.caches for sequence in sequences]
            rows = runner.decode_batch(tokens, caches, positions)
            for sequence, history, token in zip(sequences, histories, tokens, strict=True):
                history.append(token)
                sequence.after_forward(history)
            for index, (logits, _) in enumerate(alone):
                assert torch.equal(rows[index], logits[step + 1][0]), f"step {step}, seq {index}"
            last = list(rows)


def test_more_sequences_than_one_call_takes(gguf_file: Path) -> None:
    """18 sequences: the native step runs them 16 and 2 at a time, each as it alone."""
    runner, _ = _runners(gguf_file)
    prompts = [random_prompt(2 + index % 5, index) for index in range(18)]
    caches = [runner.new_caches() for _ in prompts]
    alone_caches = [runner.new_caches() for _ in prompts]
    with torch.inference_mode():
        for prompt, own, other in zip(prompts, caches, alone_caches, strict=True):
            runner.prefill(prompt, own)
            runner.prefill(prompt, other)
        positions = [prompt.shape[1] for prompt in prompts]
        rows = runner.decode_batch(list(range(4, 22)), caches, positions)
        for index, own in enumerate(alone_caches):
            alone = runner.decode(4 + index, own, positions[index])
            assert torch.equal(rows[index], alone[0])


def test_a_model_not_on_blocks_keeps_the_module_path(gguf_file: Path) -> None:
    """bf16 compute on the same blocks: `decode_rows` declines, nothing is written."""
    engine = Engine.load(gguf_file, device="cpu", progress=False, dtype="bfloat16")
    step = NativeDecodeStep(engine.model)
    caches = [engine.new_caches(), engine.new_caches()]
    with torch.inference_mode():
        assert step.decode_rows([5, 6], caches, [0, 0]) is None
    assert all(cache.offset == 0 for own in caches for cache in own)
