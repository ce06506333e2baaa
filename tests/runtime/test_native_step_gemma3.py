"""Gemma 3 decode layers as one native call each (hearth/runtime/native_step.py) against the
module path they replace: the module path is the oracle here (itself checked against HF
transformers in test_gemma3_tiny.py), and the native layer does the same operations with the
same roundings, so logits and caches must be equal bit for bit (tolerance 0).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decoding import (
    assert_native_layers_are_the_modules,
    count_kernel_calls,
    greedy_logits,
    native_or_module_decode,
)
from hearth.checkpoint import open_checkpoint
from hearth.kv import make_caches
from hearth.kv.policy import KVPolicy
from hearth.layers.int8 import quantize_model
from hearth.models.loading import build_model
from hearth.ops import native
from hearth.ops.plan import ExecutionPlan
from hearth.quant.kv_codecs import AffineCodec
from hearth.runtime.native_step import NativeDecodeStep
from hearth.runtime.runner import ModelRunner
from tiny import save_hf, tiny_gemma3_model

pytestmark = pytest.mark.skipif(
    native.kernels() is None, reason="no C compiler with OpenMP, or neither AVX-512 nor AVX2 here"
)

DECODE_STEPS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(tiny_gemma3_model(seed=3), tmp_path_factory.mktemp("gemma3"))


def bf16_model(path: Path, weights: str) -> torch.nn.Module:
    model = build_model(open_checkpoint(path), torch.bfloat16, progress=False)
    if weights == "int8":
        quantize_model(model, "int8")
    return model


# Greedy decode after a prompt, on the native layers or (not `natively`) the modules.
decode = functools.partial(native_or_module_decode, steps=DECODE_STEPS)


@pytest.mark.parametrize("weights", ["int8", "bf16"])
@pytest.mark.parametrize(
    "prompt_length",
    # Within the window of 8; wrapping the sliding layers' ring during decode; and crossing a
    # dense cache's growth step (256 slots) during decode.
    [3, 5, 250],
)
def test_native_layers_equal_the_module_path(
    checkpoint: Path, weights: str, prompt_length: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = bf16_model(checkpoint, weights)
    assert_native_layers_are_the_modules(
        decode, model, prompt_length, monkeypatch, "gemma3_decode_layer"
    )


def test_a_quantized_kv_layer_keeps_the_module_path(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Layer 1 stores K/V as 8-bit codes, which the native layer cannot write: the whole step
    # runs through the modules (a step is native in every layer or in none).
    policy = KVPolicy(per_layer={1: AffineCodec(8, 32)})
    model = bf16_model(checkpoint, "int8")
    calls = count_kernel_calls(monkeypatch, "gemma3_decode_layer")
    expected, _ = decode(model, 10, False, policy)
    got, _ = decode(model, 10, True, policy)
    assert not calls
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_moved_weights_rebuild_the_operands(checkpoint: Path) -> None:
    model = bf16_model(checkpoint, "bf16")
    plan = ExecutionPlan.for_device("cpu")
    native_runner = ModelRunner(model, plan)  # keeps its layers' operands between steps
    module_runner = ModelRunner(model, replace(plan, native_layers=False))
    greedy_logits(native_runner, 4, DECODE_STEPS)  # builds every layer's operands
    with torch.no_grad():
        layer = model.layers[2]
        layer.mlp.down_proj.weight = torch.nn.Parameter(-layer.mlp.down_proj.weight.clone())
        layer.pre_feedforward_layernorm.weight = torch.nn.Parameter(
            layer.pre_feedforward_layernorm.weight * 2
        )
    expected, _ = greedy_logits(module_runner, 4, DECODE_STEPS)
    got, _ = greedy_logits(native_runner, 4, DECODE_STEPS)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    # A round trip through fp32 keeps the Parameter object but swaps its storage (the old
    # storage is held, so the new one cannot reuse its address).
    o_proj = model.layers[0].self_attn.o_proj
    weight, old_storage = o_proj.weight, o_proj.weight.detach()
    o_proj.float().to(torch.bfloat16)
    assert o_proj.weight is weight and weight.data_ptr() != old_storage.data_ptr()
    with torch.no_grad():
        weight.neg_()  # operands left on the old storage would now give other logits
    expected, _ = greedy_logits(module_runner, 4, DECODE_STEPS)
    got, _ = greedy_logits(native_runner, 4, DECODE_STEPS)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_fp32_and_prefill_keep_the_module_path(checkpoint: Path) -> None:
    model = build_model(open_checkpoint(checkpoint), torch.float32, progress=False)
    caches = make_caches(model.cache_specs())
    one, three = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)
    with torch.inference_mode():
        assert not NativeDecodeStep(model).applies(one, caches)  # fp32
    bf16 = model.to(torch.bfloat16)
    bf16.compute_dtype = torch.bfloat16
    step = NativeDecodeStep(bf16)
    with torch.inference_mode():
        assert not step.applies(three, caches)  # a prefill chunk
        assert not step.applies(one, None)
        assert step.applies(one, caches)
    assert not step.applies(one, caches)  # autograd would track it


def test_gelu_table_is_torchs_gelu_of_every_bf16_number() -> None:
    table = native.gelu_tanh_table()
    assert table.dtype == torch.bfloat16 and table.shape == (1 << 16,)
    # By bit pattern: 0x3f80 is 1.0, 0xbf80 is -1.0, 0x0000 is 0, 0x7f80 is +inf.
    numbers = torch.tensor([1.0, -1.0, 0.0, float("inf"), 3.0], dtype=torch.bfloat16)
    patterns = [0x3F80, 0xBF80, 0x0000, 0x7F80, 0x4040]
    expected = torch.nn.functional.gelu(numbers, approximate="tanh")
    assert torch.equal(table[patterns], expected)
    # gelu_tanh(1) = 0.5 (1 + tanh(0.79788 * 1.044715)) = 0.84119..., which bf16 (steps of
    # 2^-8 in [0.5, 1)) rounds to 215/256 = 0.83984375.
    assert table[0x3F80].item() == 215 / 256
