"""Gemma 4 dense decode layers over GGUF blocks kept as stored (fp32), one native call each
(`gemma4_blocks_layer`, hearth/runtime/native_step.py), against the module path they replace,
on this CPU's library and on the AVX2 one.

The tiny model has every part of the layer the call must get right: sliding and full layers
(head_dim 16 and 32, the full ones with proportional RoPE), KV-sharing layers of both kinds
reading their donor's planes, k_eq_v full layers (V the normed raw K, one KV head), per-layer
inputs (width 32: whole Q8_0/Q5_0 blocks, so the gate and projection are blocks too), random
norms and layer scalars. The `gguf` package quantized its matrices.

The native layer runs the module path's own kernels for the projections (the block GEMV) and
its fp32 norms, RoPE and adds in its order; attention (the module path's is torch's SDPA) and
GELU (torch's vectorised tanh; the native one a logistic form) sum in another order. So the two
differ only by fp32 reassociation: the tolerance is the one the Gemma 3 blocks step and
tests/models/test_gguf_types_as_stored.py hold logits to, 2e-5 of the largest logit (measured
here: ~3e-7 of it). A weight, norm, scalar, value mode or cache plane taken wrongly moves the
logits by far more (the last test shows one such slip is seen).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decoding import count_kernel_calls, greedy_after, random_prompt
from hearth.checkpoint import open_checkpoint
from hearth.checkpoint.gguf_writer import write_gguf
from hearth.engine import Engine
from hearth.layers.gguf import GGUFLinear
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.native_step import NativeDecodeStep
from hearth.runtime.runner import ModelRunner
from native_builds import kernels_build  # noqa: F401 (a fixture)
from tiny import FULL, MOE, SLIDING, TINY_VOCAB, save_hf, tiny_gemma4_model

RTOL = 2e-5
DECODE_STEPS = 10
CONFIG = {
    "hidden_size_per_layer_input": 32,
    "num_hidden_layers": 6,
    "num_kv_shared_layers": 2,
    "layer_types": [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL],
    "attention_k_eq_v": True,
    "num_global_key_value_heads": 1,
}


@pytest.fixture(scope="module", params=["Q8_0", "Q5_0"])
def gguf_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_gemma4_model(seed=3, **CONFIG)
    tensors = {
        name.removeprefix("model."): tensor
        for name, tensor in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    path = tmp_path_factory.mktemp("gemma4_blocks") / f"{request.param}.gguf"
    return write_gguf(path, hf.config.to_dict(), tensors, TINY_VOCAB, request.param)


@functools.cache
def _runners(path: Path) -> tuple[ModelRunner, ModelRunner]:
    """A native and a module runner of one load of `path` (loaded once per file)."""
    engine = Engine.load(path, device="cpu", progress=False)
    model = engine.model
    assert model.compute_dtype == torch.float32
    for layer in model.layers:
        assert isinstance(layer.mlp.down_proj, GGUFLinear)
        assert isinstance(layer.per_layer_input_gate, GGUFLinear)
        assert isinstance(layer.per_layer_projection, GGUFLinear)
    modes = {int(layer.self_attn.value_mode) for layer in model.layers}
    assert modes == {0, 2, 3}  # shared, own V normed, k_eq_v
    plan = ExecutionPlan.for_device("cpu")
    return ModelRunner(model, plan), ModelRunner(model, replace(plan, native_layers=False))


@pytest.mark.usefixtures("kernels_build")
@pytest.mark.parametrize(
    # Within the window of 8, and wrapping the sliding layers' ring during decode.
    "prompt_length",
    [3, 20],
)
def test_native_gemma4_blocks_layers_match_the_module_path(
    gguf_file: Path, prompt_length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_runner, module_runner = _runners(gguf_file)
    calls = count_kernel_calls(monkeypatch, "gemma4_blocks_layer")
    prompt = random_prompt(prompt_length, prompt_length)
    expected, expected_caches = greedy_after(module_runner, prompt, DECODE_STEPS)
    assert not calls
    got, got_caches = greedy_after(native_runner, prompt, DECODE_STEPS)
    assert len(calls) == DECODE_STEPS * len(native_runner.model.layers)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert (a - b).abs().max() <= RTOL * a.abs().max(), f"step {step}"
        assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))
    assert len(expected_caches) == len(got_caches)
    for a, b in zip(expected_caches, got_caches, strict=True):
        assert a.offset == b.offset
        if a.offset == 0:  # a KV-sharing layer's own cache: never written
            continue
        for plane_a, plane_b in zip(
            a.contents().stored.planes, b.contents().stored.planes, strict=True
        ):
            assert torch.allclose(plane_a, plane_b, rtol=0, atol=RTOL * plane_a.abs().max())


@pytest.mark.usefixtures("kernels_build")
def test_a_wrong_layer_scalar_is_seen(gguf_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tolerance tells a slip apart: the native layers reading the scalar of 1 (a missed
    `layer_scalar`) leave it by far."""
    native_runner, module_runner = _runners(gguf_file)
    prompt = random_prompt(5, 5)
    expected, _ = greedy_after(module_runner, prompt, DECODE_STEPS)
    one = torch.ones(1)
    step = native_runner.native
    assert isinstance(step, NativeDecodeStep)
    caches = native_runner.new_caches()
    with torch.inference_mode():
        native_runner.prefill(prompt, caches)
        layers = step._layers(caches)
        assert layers is not None
        saved = [built.operands.layer_scalar for built in layers]
        try:
            for built in layers:
                built.operands.layer_scalar = one.data_ptr()
            token = int(expected[0].argmax(dim=-1))
            wrong = native_runner.decode(token, caches, prompt.shape[1])
        finally:
            for built, address in zip(layers, saved, strict=True):
                built.operands.layer_scalar = address
    reference = expected[1]
    assert (wrong - reference).abs().max() > 100 * RTOL * reference.abs().max()


def test_a_bf16_model_on_the_same_blocks_keeps_its_own_step(gguf_file: Path) -> None:
    """bf16 compute on the same blocks is not the fp32 blocks step (its projections are no
    longer what `gemma4_blocks_layer` reads)."""
    engine = Engine.load(gguf_file, device="cpu", progress=False, dtype="bfloat16")
    assert not NativeDecodeStep(engine.model).gemma4_blocks


def test_a_moe_model_keeps_the_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE layers (26B-A4B) are not taken natively: the step declines, and decoding runs the
    modules, as HF runs the model (the logits' check is test_gguf_types_as_stored's)."""
    hf = tiny_gemma4_model(seed=4, **{**MOE, "moe_intermediate_size": 32})
    checkpoint = open_checkpoint(save_hf(hf, tmp_path / "hf"))
    tensors = dict(checkpoint.tensors())
    path = write_gguf(tmp_path / "moe.gguf", checkpoint.config, tensors, TINY_VOCAB, "Q8_0")
    runner = ModelRunner(Engine.load(path, device="cpu", progress=False).model)
    assert isinstance(runner.native, NativeDecodeStep) and runner.native.gemma4_blocks
    calls = count_kernel_calls(monkeypatch, "gemma4_blocks_layer")
    caches = runner.new_caches()
    with torch.inference_mode():
        logits = runner.prefill(random_prompt(4, 4), caches)
        assert runner.native._layers(caches) is None
        following = runner.decode(int(logits.argmax(dim=-1)), caches, 4)
    assert not calls
    assert torch.isfinite(following).all()
