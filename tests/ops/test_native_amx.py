"""The GGUF block prefill GEMM on AMX bf16 tiles (`NativeKernels.blocks_gemm_amx`): the weights
`gguf.quants.dequantize`'s exact values, the activations as the kernel rounds them.

Per group of G = 16 or 32 values along k the kernel sums exact products of bf16 inputs and
integer codes into an fp32 tile (one TDPBF16PS, or two where x is split into bf16 hi + lo: at
most 2G fp32 roundings), scales it by the group's step with one FMA into the row's running sum
and, for affine types (w = step·q - offset), subtracts offset · Σx̂ over the group with one more
(Σx̂: hi + lo added, 16 lanes reduced in 4, the two halves of a 32-group added: 6 roundings). A
term therefore reaches the result through at most n = 2G + 2·k/G + 8 fp32 roundings, so the
result lies within γ_n · Σ_k |x̂_k| (|step·q_k| + |offset_k|) of the exact sum over x̂ (Higham,
3.1; γ_n = n·u / (1 - n·u), u = 2⁻²⁴), x̂ = bf16(x) or bf16(x) + bf16(x - bf16(x)), each
exactly representable; the fp64 reference on the dequantized weights is exact far below that.
|step·q| + |offset| is |w - w₀| + |w₀| with w₀ the weight of code 0 (the block dequantized with
its code bytes zeroed, -offset; 0 for the symmetric types). A code or step taken wrongly, or x
rounded otherwise than stated, lands outside (the second test shows the rounding).

This machine (Xeon with AMX-BF16) runs them; a CPU without AMX builds no such kernel and the
tests of it skip there (the plan test runs everywhere).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from decoding import count_kernel_calls
from gguf_blocks_data import random_blocks
from hearth.engine import Engine
from hearth.layers.gguf import GGUFLinear
from hearth.ops import native
from hearth.ops import plan as plan_module
from hearth.ops.plan import AMX_HEAD_ROWS, ExecutionPlan
from native_builds import avx2_kernels

STORED_TYPES = tuple(native.STORED_BLOCK_TYPES)
# Byte ranges of each affine type's codes within a block (zeroed: the weight of code 0).
AFFINE_CODE_BYTES = {3: (4, 20), 7: (4, 24), 10: (16, 80), 12: (16, 144), 13: (16, 176)}
# Values per group of one step (and offset) of each type.
GROUP = {10: 16, 11: 16, 14: 16}


def _amx_kernels() -> native.NativeKernels | None:
    kernels = native.kernels()
    return kernels if kernels is not None and kernels.amx_gemm_types else None


needs_amx = pytest.mark.skipif(_amx_kernels() is None, reason="no AMX-BF16 kernels on this CPU")


def _dequantized(type_id: int, raw: np.ndarray) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(type_id))
    return torch.from_numpy(np.ascontiguousarray(values)).double()


def _code_zero_weights(type_id: int, raw: np.ndarray) -> torch.Tensor:
    """w₀ = -offset of every weight (the block's weight at code 0)."""
    if type_id not in AFFINE_CODE_BYTES:
        return torch.zeros(raw.shape[0], 1, dtype=torch.float64)
    _, nbytes = native.STORED_BLOCK_TYPES[type_id]
    blocks = raw.reshape(-1, nbytes).copy()
    first, last = AFFINE_CODE_BYTES[type_id]
    blocks[:, first:last] = 0
    return _dequantized(type_id, blocks.reshape(raw.shape))


def _rounded_inputs(x: torch.Tensor, split: bool) -> torch.Tensor:
    """x̂ as the kernel rounds x: bf16, or bf16 hi plus bf16 of the rest (exact in fp64)."""
    hi = x.to(torch.bfloat16).double()
    return hi + (x.double() - hi).to(torch.bfloat16).double() if split else hi


def _bound(
    type_id: int, x_hat: torch.Tensor, raw: np.ndarray, weight: torch.Tensor
) -> torch.Tensor:
    group = GROUP.get(type_id, 32)
    k = weight.shape[1]
    n = 2 * group + 2 * k // group + 8
    u = 2.0**-24
    gamma = n * u / (1 - n * u)
    zero = _code_zero_weights(type_id, raw)
    return gamma * (x_hat.abs() @ ((weight - zero).abs() + zero.abs()).T)


def _product(type_id: int, x: torch.Tensor, raw: np.ndarray, split: bool) -> torch.Tensor:
    kernels = _amx_kernels()
    assert kernels is not None
    out = torch.full((x.shape[0], raw.shape[0]), float("nan"))
    kernels.blocks_gemm_amx(type_id, x, torch.from_numpy(raw), out, split)
    return out


@needs_amx
@pytest.mark.parametrize("m", [37, 5], ids=["prefill", "decode"])
@pytest.mark.parametrize("split", [True, False], ids=["hi+lo", "bf16"])
@pytest.mark.parametrize("type_id", STORED_TYPES)
def test_amx_gemm_equals_fp64_on_the_gguf_weights(type_id: int, split: bool, m: int) -> None:
    """37 input rows (two full tiles of 16 and 5 padded) or 5 (a decode step's: the weights in
    the A tile, the inputs in B), 80 weight rows (a chunk of 64 and a partial one of 16),
    k = 512 (16 to 32 groups, two K-type blocks a row)."""
    raw = random_blocks(type_id, rows=80, cols=512, seed=type_id)
    weight = _dequantized(type_id, raw)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(type_id))
    x_hat = _rounded_inputs(x, split)
    got = _product(type_id, x, raw, split).double()
    error = (got - x_hat @ weight.T).abs()
    assert (error <= _bound(type_id, x_hat, raw, weight)).all()


@needs_amx
@pytest.mark.parametrize("m", [20, 6], ids=["prefill", "decode"])
@pytest.mark.parametrize("type_id", [8, 12, 14])  # Q8_0, Q4_K (affine), Q6_K (groups of 16)
def test_the_bound_tells_how_the_inputs_were_rounded(type_id: int, m: int) -> None:
    """The one-bf16 product lies outside the hi+lo reference's bound, and the hi+lo product
    outside the one-bf16 reference's: the bound is tight enough to see which rounding ran."""
    raw = random_blocks(type_id, rows=32, cols=256, seed=1)
    weight = _dequantized(type_id, raw)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(2))
    for split in (True, False):
        other = _rounded_inputs(x, not split)
        error = (_product(type_id, x, raw, split).double() - other @ weight.T).abs()
        assert (error > _bound(type_id, other, raw, weight)).any()


@needs_amx
@pytest.mark.parametrize(("m", "n"), [(1, 16), (17, 19), (16, 130)])
def test_odd_shapes_and_an_output_slice(m: int, n: int) -> None:
    """One input row, n not a multiple of 16, a chunk and a bit: written into columns of a wider
    matrix whose other columns stay untouched."""
    type_id = 6  # Q5_0
    raw = random_blocks(type_id, rows=n, cols=96, seed=m)
    weight = _dequantized(type_id, raw)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(n))
    wide = torch.full((m, n + 7), 7.0)
    kernels = _amx_kernels()
    assert kernels is not None
    kernels.blocks_gemm_amx(type_id, x, torch.from_numpy(raw), wide[:, 3 : 3 + n])
    x_hat = _rounded_inputs(x, True)
    error = (wide[:, 3 : 3 + n].double() - x_hat @ weight.T).abs()
    assert (error <= _bound(type_id, x_hat, raw, weight)).all()
    assert (wide[:, :3] == 7.0).all() and (wide[:, 3 + n :] == 7.0).all()


@needs_amx
def test_bad_operands_are_refused() -> None:
    kernels = _amx_kernels()
    assert kernels is not None
    raw = torch.from_numpy(random_blocks(8, rows=16, cols=64))
    with pytest.raises(ValueError, match="blocks_gemm_amx"):
        kernels.blocks_gemm_amx(8, torch.randn(20, 32), raw, torch.empty(20, 16))
    with pytest.raises(ValueError, match="blocks_gemm_amx"):
        kernels.blocks_gemm_amx(1, torch.randn(20, 64), raw, torch.empty(20, 16))


@needs_amx
def test_a_stacked_linear_prefills_on_amx_only_for_its_amx_types(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A q/k/v-like stack of Q5_0, Q8_0 and Q4_K parts with Q8_0 named: 24 rows (a prefill)
    take the AMX kernel once and match its direct call; the other parts are the fp32 tiled GEMM
    bit for bit; 16 rows (a decode step) never take it."""
    parts = [(6, 48), (8, 32), (12, 16)]
    raws = [torch.from_numpy(random_blocks(t, rows=r, cols=256, seed=t)) for t, r in parts]
    stacked = list(zip([t for t, _ in parts], raws, strict=True))
    amx = GGUFLinear(stacked, 256, amx_prefill_types=[8])
    fp32 = GGUFLinear(stacked, 256)
    x = torch.randn(24, 256)
    calls = count_kernel_calls(monkeypatch, "blocks_gemm_amx")
    got, reference = amx(x), fp32(x)
    assert len(calls) == 1
    assert torch.equal(got[:, :48], reference[:, :48])
    assert torch.equal(got[:, 80:], reference[:, 80:])
    amx(x[:16])
    assert len(calls) == 1
    assert torch.equal(got[:, 48:80], _product(8, x, raws[1].numpy(), True))


@needs_amx
def test_a_head_decode_step_of_enough_rows_runs_on_amx_with_bf16_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Q8_0 table with `amx_decode_rows` 6: 6 rows take the AMX kernel with one-bf16 inputs
    (its direct call's bits), 5 rows the fp32 block GEMV (a table without it, bit for bit)."""
    raw = torch.from_numpy(random_blocks(8, rows=48, cols=256, seed=5))
    head = GGUFLinear([(8, raw)], 256, amx_prefill_types=[8], amx_decode_rows=6)
    plain = GGUFLinear([(8, raw)], 256)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(6))
    calls = count_kernel_calls(monkeypatch, "blocks_gemm_amx")
    assert torch.equal(head(x), _product(8, x, raw.numpy(), False))
    assert len(calls) == 2  # the layer's and the reference's
    assert torch.equal(head(x[:5]), plain(x[:5]))
    assert len(calls) == 2


def test_the_plan_takes_amx_where_the_kernels_have_it(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = native.kernels()
    built = () if kernels is None else tuple(sorted(kernels.amx_gemm_types))
    monkeypatch.delenv(plan_module.BF16_GEMV_VARIABLE, raising=False)
    plan = ExecutionPlan.for_device("cpu")
    assert plan.gguf_amx_prefill_types == built and not plan.gguf_amx_bf16_inputs
    assert plan.gguf_amx_head_rows == (AMX_HEAD_ROWS if built else 0)
    assert "gguf_amx_prefill_types" in plan.describe()
    # fp32 activations asked for: the prefill's hi + lo stays (~16 bits), the head's bf16 goes.
    monkeypatch.setenv(plan_module.BF16_GEMV_VARIABLE, "0")
    assert ExecutionPlan.for_device("cpu").gguf_amx_head_rows == 0
    monkeypatch.delenv(plan_module.BF16_GEMV_VARIABLE)
    if kernels is None:
        return
    built_without = avx2_kernels()
    assert built_without is not None and built_without.amx_gemm_types == frozenset()
    monkeypatch.setattr(native, "kernels", lambda: built_without)
    without = ExecutionPlan.for_device("cpu")
    assert without.gguf_amx_prefill_types == () and without.gguf_amx_head_rows == 0


@needs_amx
def test_embedded_model_prefill_on_amx_is_the_fp32_prefill(embedded_gguf: Path) -> None:
    """The embedded 270M's logits over a 150-token prompt, every projection and the head on AMX
    with hi+lo inputs vs the tiled fp32 GEMM. Measured: 5.0e-4 apart at most on logits up to
    ~32 (2.5e-4 to 4.0e-4 on other prompts; on a 512-token one the fp32 path is 1.1e-4 from
    HF's fp32 and the AMX one 3.8e-4). Tolerance 1.5e-3, 3x that; inputs rounded to one bf16
    land ~0.47 apart, far outside."""
    plan = ExecutionPlan.for_device("cpu")
    engine = Engine.load(embedded_gguf, device="cpu", progress=False, plan=plan)
    ids = engine.encode(("The quick brown fox jumps over the lazy dog. " * 20), chat=False)[:150]
    layers = [m for m in engine.model.modules() if isinstance(m, GGUFLinear)]

    def logits(types: tuple[int, ...], bf16_inputs: bool) -> torch.Tensor:
        for layer in layers:
            layer.amx_prefill_types, layer.amx_bf16_inputs = frozenset(types), bf16_inputs
        with torch.inference_mode():
            return engine.model(torch.tensor([ids]))[0].float()

    reference = logits((), False)
    assert (logits(plan.gguf_amx_prefill_types, False) - reference).abs().max() <= 1.5e-3
    assert (logits(plan.gguf_amx_prefill_types, True) - reference).abs().max() > 100 * 1.5e-3


@needs_amx
@pytest.mark.parametrize("m", [50, 7], ids=["prefill", "decode"])
def test_the_result_does_not_depend_on_the_thread_count(m: int) -> None:
    """Each weight row's chunk is computed whole by one thread in a fixed order: 1, 2 and 3
    threads give the same bits (a prefill's logits do not change with the machine's cores)."""
    raw = random_blocks(12, rows=200, cols=512, seed=3)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_product(12, x, raw, True))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
