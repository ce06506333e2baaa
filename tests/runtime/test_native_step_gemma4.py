"""Gemma 4 decode steps as one native call per layer (hearth/runtime/native_step.py) against
the module path they replace: the module path is the oracle here (itself checked against HF
transformers in test_gemma4.py), and the native layers do the same operations with the same
roundings, so logits and caches must be equal bit for bit (tolerance 0).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from decoding import (
    assert_native_layers_are_the_modules,
    count_kernel_calls,
    greedy_logits,
    native_or_module_decode,
)
from hearth.checkpoint import open_checkpoint
from hearth.kv.policy import KVPolicy
from hearth.layers import linear as linear_module
from hearth.layers.int8 import QuantizedEmbedding, QuantizedEmbeddingHead, quantize_model
from hearth.models.loading import build_model
from hearth.ops import gemv as gemv_module
from hearth.ops import native
from hearth.ops.plan import ExecutionPlan
from hearth.quant.kv_codecs import AffineCodec
from hearth.runtime.runner import ModelRunner
from tiny import FULL, SLIDING, save_hf, tiny_gemma4_model

pytestmark = pytest.mark.skipif(
    native.kernels() is None, reason="no C compiler with OpenMP, or neither AVX-512 nor AVX2 here"
)

DECODE_STEPS = 12
# Widths the int8 path takes whole (head_dims 32/64 as the KV tests use; PLE 32).
WIDE = {"head_dim": 32, "global_head_dim": 64}
CONFIGS: dict[str, dict[str, Any]] = {
    "windows": WIDE,  # sliding and full layers, window 8
    # E2B's features: per-layer inputs, KV sharing (owners 0-3; sharers 4, 5), double width.
    "ple_sharing_double_wide": {
        **WIDE,
        "hidden_size_per_layer_input": 32,
        "num_hidden_layers": 6,
        "num_kv_shared_layers": 2,
        "use_double_wide_mlp": True,
        "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
    },
    # 31B's: V is the normed raw K on full layers, which have one KV head.
    "k_eq_v": {**WIDE, "attention_k_eq_v": True, "num_global_key_value_heads": 1},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_hf(tiny_gemma4_model(seed=index, **config), tmp_path_factory.mktemp(name))
        for index, (name, config) in enumerate(CONFIGS.items())
    }


def bf16_model(path: Path, weights: str) -> Any:
    """The model as `--quantize int8` builds it (int8 layers and tables), or in plain bf16."""
    model = build_model(open_checkpoint(path), torch.bfloat16, progress=False)
    if weights == "int8":
        quantize_model(model, "int8")
        model.embed_tokens = QuantizedEmbeddingHead.from_float(model.embed_tokens.weight)
        if hasattr(model, "embed_tokens_per_layer"):
            table = model.embed_tokens_per_layer.weight
            model.embed_tokens_per_layer = QuantizedEmbedding.from_float(table)
    return model


# Greedy decode after a prompt, on the native layers or (not `natively`) the modules.
decode = functools.partial(native_or_module_decode, steps=DECODE_STEPS)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("weights", ["int8", "bf16"])
@pytest.mark.parametrize(
    "prompt_length",
    # Within the window of 8; wrapping the sliding layers' ring during decode; and crossing a
    # dense cache's growth step (256 slots) during decode.
    [3, 5, 250],
)
def test_native_layers_equal_the_module_path(
    checkpoints: dict[str, Path],
    name: str,
    weights: str,
    prompt_length: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = bf16_model(checkpoints[name], weights)
    assert_native_layers_are_the_modules(
        decode, model, prompt_length, monkeypatch, "gemma4_decode_layer"
    )


def test_a_step_any_layer_cannot_take_runs_on_the_modules(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 1 stores K/V as 8-bit codes, which the native layer cannot write: the whole step
    takes the module path (the sharers' donors must come from one path), with its results."""
    policy = KVPolicy(per_layer={1: AffineCodec(8, 32)})
    model = bf16_model(checkpoints["ple_sharing_double_wide"], "int8")
    calls = count_kernel_calls(monkeypatch, "gemma4_decode_layer")
    expected, _ = decode(model, 10, False, policy)
    got, _ = decode(model, 10, True, policy)
    assert not calls
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_expert_layers_run_on_the_modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2}
    path = save_hf(tiny_gemma4_model(seed=9, moe_intermediate_size=32, **WIDE, **moe), tmp_path)
    model = bf16_model(path, "bf16")
    calls = count_kernel_calls(monkeypatch, "gemma4_decode_layer")
    decode(model, 4, True)
    assert not calls


def test_moved_weights_rebuild_the_operands(checkpoints: dict[str, Path]) -> None:
    model = bf16_model(checkpoints["ple_sharing_double_wide"], "bf16")
    plan = ExecutionPlan.for_device("cpu")
    native_runner = ModelRunner(model, plan)  # keeps its layers' operands between steps
    module_runner = ModelRunner(model, replace(plan, native_layers=False))
    greedy_logits(native_runner, 4, DECODE_STEPS)  # builds every layer's operands
    with torch.no_grad():
        layer = model.layers[4]  # a sharer with a per-layer input
        projection = layer.per_layer_projection
        projection.weight = torch.nn.Parameter(-projection.weight.clone())
        layer.layer_scalar = torch.nn.Parameter(layer.layer_scalar * 2)
    expected, _ = greedy_logits(module_runner, 4, DECODE_STEPS)
    got, _ = greedy_logits(native_runner, 4, DECODE_STEPS)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_module_decode_steps_do_not_depend_on_torchs_gemm(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module path's decode step (the oracle above) takes the native row kernel for every
    float projection, as the native layer does, so the two agree bit for bit on any CPU.

    torch's CPU GEMM sums in an order of its own, which depends on the instruction set: on
    an AMX Xeon its bf16 GEMM, its widened fp32 GEMM and the native kernel each differ from
    the others in ~1e-4 of the outputs (640 x 256, 200 draws: 6, 7 and 10 of 128,000), and
    one such ulp made `test_moved_weights_rebuild_the_operands` fail there. A torch GEMM
    rounded away by a 2^-8 factor stands in for another CPU's: decode must not see it (the
    prefill, shared by both paths, does).
    """

    def another_cpus_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        exact = torch.nn.functional.linear(x.float(), weight.float())
        return (exact * (1 + 2**-8)).to(x.dtype)

    monkeypatch.setattr(gemv_module, "cpu_linear", another_cpus_gemm)
    monkeypatch.setattr(linear_module, "cpu_linear", another_cpus_gemm)
    model = bf16_model(checkpoints["ple_sharing_double_wide"], "bf16")
    expected, _ = decode(model, 5, False)
    got, _ = decode(model, 5, True)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"step {step}"
