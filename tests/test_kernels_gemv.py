"""The float GEMV kernel (kernels/gemv.py) in Triton's CPU interpreter.

Oracle: fp64 matmul of the same inputs; with `geglu`, the input is first made by the eager
torch ops (`gelu_tanh_mul_reference`, whose roundings the kernel reproduces exactly), so the
kernel differs from the oracle only by fp32 accumulation in another order (about
sqrt(K) eps32 of sum |x w|, a factor 4 of slack) and the output's final rounding (half an
ulp of its dtype). fp16/fp32 stand in for bf16: the interpreter's bf16 is not the GPU's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hearth.kernels import gemv as gemv_module
from hearth.kernels import norm
from hearth.kernels.activation import gelu_tanh_mul_reference
from hearth.kernels.norm import add_rms_norm_reference

pytestmark = [
    pytest.mark.skipif(not gemv_module.HAS_TRITON, reason="needs triton (its interpreter)"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; GPU script checks"),
]
EPS32 = torch.finfo(torch.float32).eps


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    geglu: bool,
    config: dict,
    up: torch.Tensor | None = None,
) -> None:
    got = gemv_module.gemv_triton(x, weight, geglu, config, up=up)
    inputs = gelu_tanh_mul_reference(x, up) if geglu else x
    oracle = inputs.double() @ weight.double().T
    magnitude = inputs.double().abs() @ weight.double().abs().T
    k = weight.shape[1]
    bound = torch.finfo(x.dtype).eps * oracle.abs() + 4 * math.sqrt(k) * EPS32 * magnitude
    assert got.shape == (*x.shape[:-1], weight.shape[0]) and got.dtype == x.dtype
    assert ((got.double() - oracle).abs() <= bound).all()
    reference = gemv_module.gemv_reference(x, weight, geglu, up)
    assert ((reference.double() - oracle).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("geglu", [False, True])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("stages", [1, 3])
def test_gemv_against_fp64(dtype: torch.dtype, geglu: bool, split: int, stages: int) -> None:
    # N=40 is not a multiple of BLOCK_N=16; K=200 leaves ragged last steps in every slice.
    generator = torch.Generator().manual_seed(split + 2 * geglu)
    n, k = 40, 200
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    x = torch.randn(3, 2 * k if geglu else k, generator=generator).to(dtype)
    config = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split, "LOOP_STAGES": stages}
    _check(x, weight, geglu, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_geglu_of_a_separate_up(dtype: torch.dtype, split: int) -> None:
    """gelu_tanh(gate) * up from two tensors (Gemma 4's per-layer input gate and its input),
    `up` a strided view: the same oracle as the stacked form, and the stacked form's bits."""
    generator = torch.Generator().manual_seed(7 + split)
    n, k = 40, 200
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    stacked = torch.randn(3, 2 * k, generator=generator).to(dtype)
    gate, up = stacked[:, :k].contiguous(), torch.randn(3, 2, k, generator=generator)[:, 1]
    up.copy_(stacked[:, k:])
    config = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split}
    _check(gate, weight, True, config, up=up.to(dtype))
    separate = gemv_module.gemv_triton(gate, weight, True, config, up=up.to(dtype))
    assert torch.equal(separate, gemv_module.gemv_triton(stacked, weight, True, config))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_of_an_add_norm_input(dtype: torch.dtype, split: int) -> None:
    """With an add-norm input the GEMV reads h = residual + round(rms_norm(x) · w), and its
    first row block stores h. h matches `add_rms_norm_reference` up to the RMS's fp32 sum
    order; the product is checked against the fp64 oracle of the h the kernel stored."""
    generator = torch.Generator().manual_seed(11 + split)
    n, k = 40, 200  # three row blocks: only the first stores h
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(dtype)
    x = (torch.randn(3, k, generator=generator) * 3).to(dtype)
    residual = torch.randn(3, k, generator=generator).to(dtype)
    norm_weight = torch.rand(k, generator=generator) + 0.5
    outputs = []
    for config in (None, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split}):
        add_norm = gemv_module.AddNorm(residual, norm_weight, 1e-6, torch.empty_like(x))
        outputs.append(
            (gemv_module.gemv_triton(x, weight, config=config, add_norm=add_norm), add_norm.out)
        )
    (got, summed), (again, summed_again) = outputs
    assert torch.equal(summed_again, summed)  # the same h whatever the tiles
    _, expected = gemv_module.gemv_add_norm_reference(x, weight, residual, norm_weight, 1e-6)
    normed = expected.double() - residual.double()
    ulp = torch.finfo(dtype).eps
    # The RMS's fp32 sums differ in order (~sqrt(K) eps32, +3 for rsqrt and the products),
    # then normed may round the other way (an ulp of it) and so may h (an ulp of h).
    ordering = (math.sqrt(k) + 3) * EPS32 * normed.abs()
    tolerance = ulp * (expected.double().abs() + normed.abs()) + ordering
    assert ((summed.double() - expected.double()).abs() <= tolerance).all()
    for out in (got, again):
        oracle = summed.double() @ weight.double().T
        magnitude = summed.double().abs() @ weight.double().abs().T
        bound = ulp * oracle.abs() + 4 * math.sqrt(k) * EPS32 * magnitude
        assert ((out.double() - oracle).abs() <= bound).all()
    # Off the GPU the public entry point is the reference itself.
    assert torch.equal(
        gemv_module.gemv_add_norm(x, weight, residual, norm_weight, 1e-6)[1], expected
    )


def test_gemv_keeps_leading_dims_and_runs_again_after_a_split() -> None:
    # The split-K counters must be back at zero after a launch, or the next one sums early.
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(24, 96, generator=generator)
    x = torch.randn(1, 1, 96, generator=generator)
    for _ in range(2):
        _check(x, weight, False, {"BLOCK_N": 8, "BLOCK_K": 16, "SPLIT_K": 2})


def test_gemv_rejects_a_wrong_width_and_too_many_rows() -> None:
    weight = torch.randn(8, 32)
    with pytest.raises(ValueError, match="inputs"):
        gemv_module.gemv_triton(torch.randn(1, 32), weight, geglu=True)
    with pytest.raises(ValueError, match="at most"):
        gemv_module.gemv_triton(torch.randn(5, 32), weight)
    with pytest.raises(ValueError, match="second input"):
        gemv_module.gemv_triton(torch.randn(1, 32), weight, True, up=torch.randn(1, 16))
    x = torch.randn(1, 32)
    add_norm = gemv_module.AddNorm(torch.randn(1, 16), torch.ones(32), 1e-6, torch.empty(1, 32))
    with pytest.raises(ValueError, match="residual"):
        gemv_module.gemv_triton(x, weight, add_norm=add_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("scaled", [False, True])
def test_gemv_with_the_add_norm_after_it(dtype: torch.dtype, split: int, scaled: bool) -> None:
    """The launch's last program runs `add_rms_norm` of the whole output row (o_proj, down):
    y is the plain GEMV's, bit for bit, and (h, norm(h)) match `add_rms_norm_reference` of
    that y up to the RMS sums' fp32 order."""
    generator = torch.Generator().manual_seed(13 + split + 2 * scaled)
    n, k = 2600, 64  # 41 row blocks of 64; N spans three 1024-column chunks, the last ragged
    weight = (torch.randn(n, k, generator=generator) * 0.3).to(dtype)
    x = torch.randn(1, 1, k, generator=generator).to(dtype)
    residual = torch.randn(1, 1, n, generator=generator).to(dtype)
    norm_weight, next_weight = torch.rand(2, n, generator=generator) + 0.5
    scale = torch.tensor([0.7], dtype=dtype) if scaled else None
    after = gemv_module.NormAfter(residual, norm_weight, 1e-6, next_weight, scale)
    config = {"BLOCK_N": 64, "BLOCK_K": 32, "SPLIT_K": split}
    plain = gemv_module.gemv_triton(x, weight, config=config)
    for _ in range(2):  # the arrival counter is back at zero after each launch
        summed, normed = torch.empty_like(residual), torch.empty_like(residual)
        y = gemv_module.gemv_triton(x, weight, config=config, norm_after=(after, summed, normed))
        assert torch.equal(y, plain)
        expected_sum, expected_norm = add_rms_norm_reference(
            residual, plain, norm_weight, 1e-6, next_weight, True, scale
        )
        ulp = torch.finfo(dtype).eps
        # Each RMS's fp32 sum in another order (~sqrt(N) eps32, +3 for rsqrt and the
        # products); then a value may round the other way: an ulp of h (and of norm(y) within
        # it); norm(h) moves by what h moved, times its factor inv_rms(h) · w_next, and may
        # round the other way itself.
        ordering = (math.sqrt(n) + 3) * EPS32
        added = expected_sum.double() - residual.double()
        bound = ulp * (expected_sum.double().abs() + added.abs()) + ordering * added.abs()
        assert ((summed.double() - expected_sum.double()).abs() <= bound).all()
        want = expected_norm.double()
        factor = (want / expected_sum.double()).nan_to_num().abs()
        norm_bound = bound * factor + (ulp + ordering) * want.abs()
        assert ((normed.double() - want).abs() <= norm_bound).all()


def test_gemv_norm_after_off_the_gpu_is_the_reference() -> None:
    weight, x = torch.randn(32, 16), torch.randn(1, 16)
    after = gemv_module.NormAfter(torch.randn(1, 32), torch.rand(32), 1e-6, torch.rand(32))
    assert not gemv_module.gemv_norm_after_applies(x, weight)
    got = gemv_module.gemv_norm_after(x, weight, after)
    want = add_rms_norm_reference(
        after.residual, x @ weight.T, after.weight, 1e-6, after.next_weight, True
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_gemv_norm_after_rejects_mismatched_operands() -> None:
    weight = torch.randn(32, 16)

    def launch(residual=None, weight_n=32, scale=None, rows=1, add_norm=None):
        after = gemv_module.NormAfter(
            torch.randn(1, 32) if residual is None else residual,
            torch.rand(weight_n), 1e-6, torch.rand(32), scale,
        )  # fmt: skip
        buffers = (after, torch.empty(1, 32), torch.empty(1, 32))
        inputs = torch.randn(rows, 16)
        gemv_module.gemv_triton(inputs, weight, norm_after=buffers, add_norm=add_norm)

    with pytest.raises(ValueError, match="residual"):
        launch(residual=torch.randn(1, 16))
    with pytest.raises(ValueError, match="weight must be"):
        launch(weight_n=16)
    with pytest.raises(ValueError, match="scale"):
        launch(scale=torch.ones(2))
    with pytest.raises(ValueError, match="one row"):
        launch(rows=2)
    add_norm = gemv_module.AddNorm(torch.randn(1, 16), torch.ones(16), 1e-6, torch.empty(1, 16))
    with pytest.raises(ValueError, match="not both"):
        launch(add_norm=add_norm)


def test_gemma3_decode_runs_its_add_norms_in_the_gemvs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a decode step (GPU dispatch, on CPU tensors) o_proj and down each run the add-norm
    after them in their GEMV launch, and no add-norm kernel runs apart; the logits stay the
    torch path's. fp32: the kernels and torch differ by summation order only; through the
    tiny model's layers and head, logits of size ~1-10 stay within 1e-4."""
    from hearth.checkpoint import open_checkpoint
    from hearth.kv import make_caches
    from hearth.models.loading import build_model
    from tiny import save_hf, tiny_gemma3_model

    model = build_model(
        open_checkpoint(save_hf(tiny_gemma3_model(seed=4), tmp_path)), torch.float32, "cpu", False
    )
    ids = torch.randint(4, 256, (1, 24), generator=torch.Generator().manual_seed(1))

    def decode() -> torch.Tensor:
        caches = make_caches(model.config)
        with torch.inference_mode():
            steps = [model(ids[:, :20], caches)]
            steps += [model(ids[:, p : p + 1], caches, start=p) for p in range(20, 24)]
        return torch.cat(steps, dim=1)

    expected = decode()
    launched: list[str] = []
    original_gemv, original_norm = gemv_module.gemv_triton, norm.add_rms_norm_triton

    def counted_gemv(*args, norm_after=None, **kwargs):
        launched.append("gemv with a norm after" if norm_after is not None else "gemv")
        return original_gemv(*args, norm_after=norm_after, **kwargs)

    def counted_norm(*args):
        launched.append("add-norm")
        return original_norm(*args)

    for module in (gemv_module, norm):
        monkeypatch.setattr(module, "kernel_enabled", lambda tensor: True)
    monkeypatch.setattr(gemv_module, "gemv_triton", counted_gemv)
    monkeypatch.setattr(norm, "add_rms_norm_triton", counted_norm)
    got = decode()
    per_step = 2 * model.config.num_hidden_layers
    assert launched.count("gemv with a norm after") == 4 * per_step
    assert "add-norm" in launched  # the prompt's, whose rows take no GEMV
    assert launched.count("add-norm") == per_step  # the prompt's only
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
