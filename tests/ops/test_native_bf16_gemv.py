"""The GGUF block GEMV on AVX512-BF16 (`NativeKernels.blocks_gemv(..., bf16=True)`): the
activations rounded to bf16, the weights still `gguf.quants.dequantize`'s exact values.

The kernel computes sum_groups step * (sum q x) - offset * (sum x) per block (w = step * q -
offset): products of bf16 codes and bf16 inputs are exact in fp32, and each term reaches the
result through at most n = k/32 + 16 fp32 roundings (up to 3 in a dot product's lane, one FMA
per chunk on its row's sums, at most k/32 on one of them, 2 joining the row's four sums, 4 in
the lane reduction, 1 for the offsets' subtraction; an offset term: 5 forming its 32-input sum,
k/256 FMAs, 1 more, 3 lanes, 1). So it lies within γ_n · Σ |term| of the exact sum over x̂ =
bf16(x), γ_n = n·u / (1 - n·u), u = 2⁻²⁴ (Higham, 3.1), and the fp64 reference on the
dequantized weights is exact far below that. The terms: |w·x̂| for Q4_0, Q5_0 and Q8_0; for
Q4_K, whose codes enter as the bf16 of 128 + q (taken back as 128·step·Σx̂), |step·(128 +
q)·x̂| + |128·step·x̂| + |offset·x̂|, at most (|w + offset| + 256·|step| + |offset|)·|x̂|; for
Q6_K (w = step·(q6 - 32), codes the bf16 of 128 + q6, 160·step·Σx̂ taken back), at most
(|w| + 320·|step|)·|x̂|. A code or a scale taken wrongly, or x left unrounded, lands outside
(the second test shows the latter).

This machine (Xeon, AVX512-BF16 and AMX) has the kernels; a CPU without AVX512-BF16 builds none
and the tests of them skip there.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from decoding import count_kernel_calls, greedy_after, random_prompt
from gguf_blocks_data import random_blocks
from hearth.checkpoint.gguf_writer import write_gguf
from hearth.engine import Engine
from hearth.layers.gguf import GGUFLinear
from hearth.ops import native
from hearth.ops import plan as plan_module
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.runner import ModelRunner
from native_builds import avx2_kernels
from tiny import FULL, SLIDING, TINY_VOCAB, tiny_gemma4_model

IN_FEATURES = 512  # two K-type blocks a row
BF16_TYPES = (2, 6, 8, 12, 14)  # Q4_0, Q5_0, Q8_0, Q4_K, Q6_K


def _bf16_kernels() -> native.NativeKernels | None:
    kernels = native.kernels()
    return kernels if kernels is not None and kernels.bf16_gemv_types else None


needs_bf16 = pytest.mark.skipif(
    _bf16_kernels() is None, reason="no native kernels with AVX512-BF16 on this CPU"
)


def _dequantized(type_id: int, raw: np.ndarray) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(np.ascontiguousarray(values)).double()


def _magnitudes(type_id: int, raw: np.ndarray, weight: torch.Tensor) -> torch.Tensor:
    """Per weight, what multiplies |x̂| in the sum of |term| (above). The steps and offsets come
    from the block bytes as ggml lays them out: Q4_K's d · scale and dmin · min (fp16 d, dmin,
    then 12 bytes of 6-bit scales and mins; |step·q| = |w + offset|), Q6_K's d · scale (16
    int8 scales at byte 192, fp16 d at 208)."""
    if type_id == 14:
        blocks = raw.reshape(-1, 210)
        d = blocks[:, 208:210].copy().view(np.float16).astype(np.float64)
        scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float64)
        step = torch.from_numpy(np.repeat(d * scales, 16, axis=1).reshape(weight.shape))
        return weight.abs() + 320 * step.abs()
    if type_id != 12:
        return weight.abs()
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    packed = blocks[:, 4:16].astype(np.int64)
    scales = np.empty((len(blocks), 8), dtype=np.int64)
    mins = np.empty((len(blocks), 8), dtype=np.int64)
    for j in range(4):
        scales[:, j] = packed[:, j] & 63
        mins[:, j] = packed[:, j + 4] & 63
        scales[:, j + 4] = (packed[:, j + 8] & 15) | ((packed[:, j] >> 6) << 4)
        mins[:, j + 4] = (packed[:, j + 8] >> 4) | ((packed[:, j + 4] >> 6) << 4)
    step = torch.from_numpy(np.repeat(d * scales, 32, axis=1).reshape(weight.shape))
    offset = torch.from_numpy(np.repeat(dmin * mins, 32, axis=1).reshape(weight.shape))
    return (weight + offset).abs() + 256 * step.abs() + offset.abs()


def _within_bound(type_id: int, raw: np.ndarray, y: torch.Tensor, x: torch.Tensor) -> bool:
    """y against the fp64 sum over bf16(x) and the exact weights, within the bound above."""
    k = x.shape[-1]
    weight = _dequantized(type_id, raw)
    rounded = x.bfloat16().double()
    n = k // 32 + 16
    unit = 2.0**-24
    gamma = n * unit / (1 - n * unit)
    bound = gamma * (rounded.abs() @ _magnitudes(type_id, raw, weight).T)
    return bool(((y.double() - rounded @ weight.T).abs() <= bound).all())


@needs_bf16
@pytest.mark.parametrize("type_id", BF16_TYPES)
def test_bf16_gemv_is_the_exact_weights_times_bf16_inputs(type_id: int) -> None:
    """1 and 5 input rows within the bound; up to 16 rows at once (several blocks of 4 rows and
    a partial one), each row bit for bit as alone."""
    kernels = _bf16_kernels()
    assert kernels is not None and type_id in kernels.bf16_gemv_types
    raw = random_blocks(type_id, rows=37, cols=IN_FEATURES, seed=type_id)
    blocks = torch.from_numpy(raw)
    x = torch.randn(16, IN_FEATURES, generator=torch.Generator().manual_seed(type_id))
    alone = torch.empty(16, 37)
    for row in range(16):
        kernels.blocks_gemv(
            type_id, x[row : row + 1].contiguous(), blocks, alone[row : row + 1], bf16=True
        )
    assert _within_bound(type_id, raw, alone, x)
    for rows in (2, 5, 16):
        together = torch.empty(rows, 37)
        kernels.blocks_gemv(type_id, x[:rows].contiguous(), blocks, together, bf16=True)
        assert torch.equal(together.view(torch.int32), alone[:rows].view(torch.int32)), rows


@needs_bf16
@pytest.mark.parametrize("type_id", BF16_TYPES)
def test_the_bound_tells_rounded_inputs_from_fp32_ones(type_id: int) -> None:
    """The fp32 GEMV (inputs not rounded) lies outside the bf16 bound, and the bf16 GEMV outside
    the fp32 one: each kernel is held to its own inputs."""
    kernels = _bf16_kernels()
    assert kernels is not None
    raw = random_blocks(type_id, rows=37, cols=IN_FEATURES, seed=type_id + 7)
    blocks = torch.from_numpy(raw)
    x = torch.randn(1, IN_FEATURES, generator=torch.Generator().manual_seed(5))
    fp32, bf16 = torch.empty(1, 37), torch.empty(1, 37)
    kernels.blocks_gemv(type_id, x, blocks, fp32)
    kernels.blocks_gemv(type_id, x, blocks, bf16, bf16=True)
    assert _within_bound(type_id, raw, bf16, x)
    assert not _within_bound(type_id, raw, fp32, x)


def test_the_avx2_build_has_no_bf16_gemv_and_refuses_it() -> None:
    """CI's AMD EPYC (AVX2 only) builds no bf16 kernel: none is listed, a call is refused, and
    the plan there names no type."""
    built = avx2_kernels()
    if built is None:
        pytest.skip("no native kernels here")
    assert built.bf16_gemv_types == frozenset()
    raw = torch.from_numpy(random_blocks(12, rows=4, cols=256))
    with pytest.raises(ValueError, match="no bf16 block GEMV"):
        built.blocks_gemv(12, torch.randn(1, 256), raw, torch.empty(1, 4), bf16=True)


def test_the_plan_takes_bf16_gemv_where_built_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernels = native.kernels()
    built = set() if kernels is None else kernels.bf16_gemv_types
    expected = tuple(t for t in plan_module.BF16_GEMV_TYPES if t in built)
    monkeypatch.delenv(plan_module.BF16_GEMV_VARIABLE, raising=False)
    assert ExecutionPlan.for_device("cpu").gguf_bf16_gemv_types == expected
    monkeypatch.setenv(plan_module.BF16_GEMV_VARIABLE, "1")
    assert ExecutionPlan.for_device("cpu").gguf_bf16_gemv_types == expected
    monkeypatch.setenv(plan_module.BF16_GEMV_VARIABLE, "0")
    assert ExecutionPlan.for_device("cpu").gguf_bf16_gemv_types == ()
    monkeypatch.delenv(plan_module.BF16_GEMV_VARIABLE)
    built_without = avx2_kernels()
    monkeypatch.setattr(native, "kernels", lambda: built_without)
    assert ExecutionPlan.for_device("cpu").gguf_bf16_gemv_types == ()


@needs_bf16
def test_a_stacked_linear_runs_bf16_only_for_its_bf16_types() -> None:
    """A q/k/v-like stack of Q5_0, Q8_0 and Q4_K parts with Q4_K named: that part's rows within
    the bf16 bound (and outside the fp32 one), the others' the fp32 GEMV bit for bit."""
    kernels = _bf16_kernels()
    assert kernels is not None
    raws = [
        random_blocks(t, rows=rows, cols=IN_FEATURES, seed=rows)
        for t, rows in ((6, 19), (8, 5), (12, 21))
    ]
    parts = [(t, torch.from_numpy(raw)) for t, raw in zip((6, 8, 12), raws, strict=True)]
    layer = GGUFLinear(parts, IN_FEATURES, bf16_gemv_types=(12,))
    x = torch.randn(1, 3, IN_FEATURES, generator=torch.Generator().manual_seed(3))
    y = layer(x)[0]
    first = 0
    for (type_id, blocks), raw in zip(parts, raws, strict=True):
        rows = blocks.shape[0]
        got = y[:, first : first + rows]
        fp32 = torch.empty(3, rows)
        kernels.blocks_gemv(type_id, x[0].contiguous(), blocks, fp32)
        if type_id == 12:
            assert _within_bound(type_id, raw, got, x[0])
            assert not torch.equal(got, fp32)
        else:
            assert torch.equal(got.view(torch.int32), fp32.view(torch.int32))
        first += rows


@pytest.fixture(scope="module")
def gemma4_q5_0(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_gemma4_model(
        seed=3,
        hidden_size_per_layer_input=32,
        num_hidden_layers=4,
        num_kv_shared_layers=1,
        layer_types=[SLIDING, SLIDING, FULL, SLIDING],
    )
    tensors = {
        name.removeprefix("model."): tensor
        for name, tensor in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    path = tmp_path_factory.mktemp("bf16_gemv") / "Q5_0.gguf"
    return write_gguf(path, hf.config.to_dict(), tensors, TINY_VOCAB, "Q5_0")


@needs_bf16
def test_native_layer_step_takes_the_bf16_gemv_as_the_modules_do(
    gemma4_q5_0: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan naming Q5_0 and Q8_0 (the tiny file's types): the native layer step's logits are
    the module path's under the same plan within the native step's own tolerance (2e-5 of the
    largest logit: fp32 reassociation in attention and GELU, tests/runtime/
    test_native_step_gemma4_blocks.py), and the fp32 plan's lie outside it (the rounding of
    the activations is seen, so both paths did take the bf16 GEMV)."""
    fp32_plan = replace(ExecutionPlan.for_device("cpu"), gguf_bf16_gemv_types=())
    plan = replace(fp32_plan, gguf_bf16_gemv_types=(6, 8))
    engine = Engine.load(gemma4_q5_0, device="cpu", progress=False, plan=plan)
    model = engine.model
    assert model.layers[0].mlp.down_proj.bf16_gemv_types == {6, 8}
    native_runner = ModelRunner(model, plan)
    module_runner = ModelRunner(model, replace(plan, native_layers=False))
    prompt = random_prompt(6, 6)
    calls = count_kernel_calls(monkeypatch, "gemma4_blocks_layer")
    expected, _ = greedy_after(module_runner, prompt, 4)
    got, _ = greedy_after(native_runner, prompt, 4)
    assert calls
    rtol = 2e-5
    for a, b in zip(expected, got, strict=True):
        assert (a - b).abs().max() <= rtol * a.abs().max()
    fp32_engine = Engine.load(gemma4_q5_0, device="cpu", progress=False, plan=fp32_plan)
    unrounded, _ = greedy_after(ModelRunner(fp32_engine.model, fp32_plan), prompt, 1)
    assert (unrounded[1] - got[1]).abs().max() > 10 * rtol * got[1].abs().max()


@pytest.fixture(scope="module", params=["Q4_K", "Q6_K"])
def gemma3_k_quant(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    from test_gguf_types_as_stored import GEMMA3, _typed_file
    from tiny import tiny_gemma3_model

    hf = tiny_gemma3_model(seed=11, **{**GEMMA3, "num_hidden_layers": 2})
    return _typed_file(
        hf, tmp_path_factory.mktemp("bf16_k") / f"{request.param}.gguf", request.param
    )


@needs_bf16
def test_native_batched_step_reads_the_k_quant_input_orders(
    gemma3_k_quant: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Gemma 3 native step over Q4_K or Q6_K blocks (each with its own order of the bf16
    inputs, `blocks_project`), three sequences at once and one alone: the module path's logits
    under the same plan within the native step's tolerance (2e-5 of the largest logit,
    tests/runtime/test_native_step_blocks.py), the fp32 plan's outside it."""
    fp32_plan = replace(ExecutionPlan.for_device("cpu"), gguf_bf16_gemv_types=())
    plan = replace(fp32_plan, gguf_bf16_gemv_types=(12, 14))
    engine = Engine.load(gemma3_k_quant, device="cpu", progress=False, plan=plan)
    runners = [
        ModelRunner(engine.model, plan),
        ModelRunner(engine.model, replace(plan, native_layers=False)),
    ]
    prompts = [random_prompt(5 + i, i) for i in range(3)]
    calls = count_kernel_calls(monkeypatch, "gemma3_blocks_layer")
    results = []
    with torch.inference_mode():
        for runner in runners:
            caches = [runner.new_caches() for _ in prompts]
            last = [runner.prefill(p, c, chunk=64) for p, c in zip(prompts, caches, strict=True)]
            tokens = [int(logits.argmax(dim=-1)) for logits in last]
            positions = [p.shape[1] for p in prompts]
            batch = runner.decode_batch(tokens, caches, positions)
            alone = runner.decode(int(batch[0].argmax()), caches[0], positions[0] + 1)
            results.append((batch.reshape(3, -1), alone.reshape(-1)))
    assert len(calls) == 2 * len(engine.model.layers)  # the native runner's two steps
    (native_batch, native_alone), (module_batch, module_alone) = results
    rtol = 2e-5
    for a, b in ((module_batch, native_batch), (module_alone, native_alone)):
        assert (a - b).abs().max() <= rtol * a.abs().max()
    fp32_engine = Engine.load(gemma3_k_quant, device="cpu", progress=False, plan=fp32_plan)
    runner = ModelRunner(fp32_engine.model, fp32_plan)
    with torch.inference_mode():
        caches = runner.new_caches()
        token = int(runner.prefill(prompts[0], caches, chunk=64).argmax(dim=-1))
        unrounded = runner.decode(token, caches, prompts[0].shape[1]).reshape(-1)
    assert (unrounded - native_batch[0]).abs().max() > 10 * rtol * unrounded.abs().max()
