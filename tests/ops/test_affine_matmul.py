"""Triton matmuls over MLX affine-packed weights, run in Triton's CPU interpreter.

Each kernel is checked against its torch reference and against an independent oracle: codes
unpacked by `unpack_codes`, ``scale * q + bias`` in fp64, matmul in fp64.

Tolerances. The kernels apply the group's scale and bias in fp32, never rounding the weight,
so against the oracle they differ only by fp32 accumulation (order differs; an error of about
sqrt(K) * eps32 of the sum of |x * w|, with a factor 4 of slack) and the final rounding to the
activations' dtype (half an ulp: eps_out * |y|). The reference rounds each weight to the
scales' dtype twice (``q * s`` then ``+ b``, as mlx does), up to one ulp of the scales' dtype
per weight, so it may stray from the oracle by eps_scales * sum |x * w| more; kernel vs
reference allows both. The 4-bit GEMV's folded offsets (`_offset_codes`) sum
``x * (256 + q)`` and take ``256 * sum(x)`` off per group, so their roundings scale with
eps32 * 271 * sum |x| |scale| rather than with |x w|: about 20x the exact codes' error here
(max error/bound 0.16 against 0.008 on these shapes), still inside the bound above, whose
sqrt(K) term grows as the fold's random-walk sum does. Shapes stay small (K <= 384) for
the interpreter's sake. The interpreter casts fp32 to bf16 by truncation (the GPU rounds),
so bf16 outputs are checked only where that cast is the one bf16 step (the GEMV, one ulp
allowed); elsewhere fp16 and fp32 stand in and the GPU scripts cover bf16.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from hearth.config import parse_config
from hearth.layers.affine import MLXQuantizedEmbedding, MLXQuantizedExperts, MLXQuantizedLinear
from hearth.layers.experts import Experts
from hearth.ops import affine_matmul as am
from hearth.ops.activation import gelu_tanh_mul_reference, gelu_tanh_mul_triton
from hearth.ops.norm import Partials
from hearth.quant.mlx import (
    dequantize_affine,
    quantize_affine,
    unpack_codes,
)
from tiny import tiny_gemma4_config

# These drive the kernels through Triton's interpreter on CPU tensors (CI has no GPU); on a
# GPU machine benchmarks/lab/gpu_kernels_*.py checks the compiled kernels against the references.
_interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="interpreter tests; the GPU scripts check compiled kernels"
)
pytestmark = [
    pytest.mark.skipif(not am.HAS_TRITON, reason="needs triton (its interpreter)"),
    _interpreter_only,
]
EPS32 = torch.finfo(torch.float32).eps


def _oracle_weight(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int):
    codes = unpack_codes(packed, bits).double()
    group = codes.shape[-1] // scales.shape[-1]
    grouped = codes.unflatten(-1, (-1, group))
    return (grouped * scales.double()[..., None] + biases.double()[..., None]).flatten(-2)


def _bound(got: torch.Tensor, want: torch.Tensor, magnitude, k: int, weight_eps: float):
    """The error allowed at each output: see the module docstring."""
    out_eps = max(torch.finfo(t.dtype).eps for t in (got, want))
    return out_eps * want.double().abs() + (weight_eps + 4 * math.sqrt(k) * EPS32) * magnitude


def _assert_close(got, want, magnitude, k, weight_eps=0.0):
    error = (got.double() - want.double()).abs()
    bound = _bound(got, want, magnitude, k, weight_eps) + 1e-30
    assert (error <= bound).all(), f"max error/bound {(error / bound).max().item():.3f}"


def _quantized(n: int, k: int, bits: int, group: int, dtype: torch.dtype, lead=()):
    packed, scales, biases = quantize_affine(torch.randn(*lead, n, k), bits, group)
    return packed, scales.to(dtype), biases.to(dtype)


# Pinned launches of the GEMV, on N = 21 (no multiple of any BLOCK_N: a partial last row
# block) and K = 384, whose 12 / 6 / 3 groups (group 32 / 64 / 128) are not all whole steps:
# "whole" takes whole steps and a masked tail (6 groups in steps of 4), "split2" a split with
# only a tail and an empty one (6 or 3 groups in splits of 8), "split3" three splits, the
# last a tail (3 groups in splits of 2). None is the heuristic's own launch. The prefetching
# loop (step s + 1 loaded before step s is added) runs 3, 1 or 0 whole steps before a tail
# ("prefetch"), 12, 6 or 3 whole steps and no tail ("prefetch G1"), and split ("prefetch
# split3").
GEMV_N, GEMV_K = 21, 384
GEMV_CONFIGS = {
    "heuristic": None,
    "whole": am.GemvConfig(16, 4),
    "split2": am.GemvConfig(8, 8, split_k=2),
    "split3": am.GemvConfig(32, 2, split_k=3),
    "prefetch": am.GemvConfig(16, 4, prefetch=True),
    "prefetch G1": am.GemvConfig(8, 1, prefetch=True),
    "prefetch split3": am.GemvConfig(32, 2, split_k=3, prefetch=True),
}


def _gemv_case(bits: int, group: int, rows: int, dtype: torch.dtype, scales_dtype=torch.float16):
    packed, scales, biases = _quantized(GEMV_N, GEMV_K, bits, group, scales_dtype)
    x = torch.randn(rows, GEMV_K).to(dtype)
    weight = _oracle_weight(packed, scales, biases, bits)
    oracle = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    return (x, packed, scales, biases), oracle, magnitude


# Every unrolled row count at group 64; groups 32 and 128 (other steps and tails) at 1 and 4
# rows, the rows' code being the same whatever the group.
GEMV_CASES = [(64, rows) for rows in (1, 2, 3, 4)] + [(g, r) for g in (32, 128) for r in (1, 4)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("group", "rows"), GEMV_CASES)
def test_gemv_matches_reference_and_oracle(bits, group, rows) -> None:
    """fp32 x, every unrolled row count, each pinned launch. Tolerances: the module
    docstring's (the fp32 output rounds once: eps32 |y|, inside the accumulation term)."""
    torch.manual_seed(bits * group + rows)
    operands, oracle, magnitude = _gemv_case(bits, group, rows, torch.float32)
    reference = am.affine_matmul_reference(*operands, bits, group)
    eps16 = torch.finfo(torch.float16).eps
    _assert_close(reference, oracle, magnitude, GEMV_K, weight_eps=eps16)
    for name, config in GEMV_CONFIGS.items():
        got = am.affine_gemv_triton(*operands, bits, group, config=config)
        assert got.dtype == torch.float32 and got.shape == (rows, GEMV_N), name
        _assert_close(got, oracle, magnitude, GEMV_K)
        _assert_close(got, reference, magnitude, GEMV_K, weight_eps=eps16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_split_sums_over_several_programs_are_bit_identical(
    bits: int, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A K split only stores its partials and `_sum_splits_kernel` adds them in split order,
    whatever the splits (a tail split, an empty one) and however many programs the sum
    launch has: 16 outputs a program (two over GEMV_N rows, the last partial) give the bits
    of one program over them all."""
    torch.manual_seed(20 + bits + rows)
    operands = _gemv_case(bits, 64, rows, torch.float32)[0]
    for name in ("split2", "split3", "prefetch split3"):
        config = GEMV_CONFIGS[name]
        results = []
        for block in (am.SPLIT_SUM_BLOCK, 16):
            with monkeypatch.context() as patch:
                patch.setattr(am, "SPLIT_SUM_BLOCK", block)
                results.append(am.affine_gemv_triton(*operands, bits, 64, config=config))
        assert torch.equal(*results), name


@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_partials_add_up_to_the_gemv_output(bits: int) -> None:
    """`affine_gemv_partials_triton` launches the GEMV without its sum: `Partials.total` of
    what it returns (the splits added in order, rounded once) is the GEMV's output, bit for
    bit; an unsplit launch has no partials. (fp16 x: the interpreter's bf16 truncates.)"""
    torch.manual_seed(30 + bits)
    operands = _gemv_case(bits, 64, 2, torch.float16)[0]
    for name in ("split2", "split3", "prefetch split3"):
        config = GEMV_CONFIGS[name]
        values = am.affine_gemv_partials_triton(*operands, bits, 64, config)
        assert values is not None and values.shape == (config.split_k, 2, GEMV_N), name
        total = Partials(values, torch.float16).total()
        assert torch.equal(total, am.affine_gemv_triton(*operands, bits, 64, config)), name
    assert am.affine_gemv_partials_triton(*operands, bits, 64, GEMV_CONFIGS["whole"]) is None
    assert am.affine_gemv_partials(*operands, bits, 64) is None  # off the GPU


def test_gemma3_4bit_decode_hands_split_partials_to_its_norms(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a decode step (the GPU dispatch, on CPU tensors) a 4-bit o_proj and down whose
    launch splits K hand their partials to the add-norm kernel after them (`Partials`); the
    pre-feed-forward norm stores its output codes-major for the unsplit gate/up GEMV, which
    reads it so and stores gelu_tanh(gate) · up; and the logits stay the torch path's. fp32
    throughout: the kernels and torch differ by summation order only; through the tiny
    model's layers and head, logits of size ~1-10 stay within 1e-4."""
    from hearth.checkpoint import open_checkpoint
    from hearth.kv import make_caches
    from hearth.models.loading import build_model
    from hearth.ops import norm
    from tiny import save_hf, tiny_gemma3_model

    model = build_model(
        open_checkpoint(save_hf(tiny_gemma3_model(seed=6), tmp_path)), torch.float32, "cpu", False
    )
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear):  # o_proj K=128 and down K=96: 4 and 3 groups
            model.set_submodule(name, MLXQuantizedLinear.from_float(module.weight.data, 4, 32))
    ids = torch.randint(4, 256, (1, 9), generator=torch.Generator().manual_seed(2))

    def decode() -> torch.Tensor:
        caches = make_caches(model.cache_specs())
        with torch.inference_mode():
            steps = [model(ids[:, :6], caches)]
            steps += [model(ids[:, p : p + 1], caches, start=p) for p in range(6, 9)]
        return torch.cat(steps, dim=1)

    expected = decode()
    handed: list[int] = []
    ordered: list[tuple[int, int] | None] = []
    original = norm.add_rms_norm_triton
    original_geglu = am.affine_gemv_geglu_out_triton
    stored_geglu: list[bool] = []

    def counted(residual, x, *args):
        handed.append(isinstance(x, norm.Partials))
        ordered.append(args[-1])
        return original(residual, x, *args)

    def geglu_counted(x, *args):
        stored_geglu.append(isinstance(x, am.CodesMajor))
        return original_geglu(x, *args)

    gate_up_rows = 2 * model.config.intermediate_size

    def split_launch(n, k, bits, group, multiprocessors=132):
        if n == gate_up_rows:  # unsplit, x codes-major: in blocks of 4 words (K = 64)
            return am.GemvConfig(64, 1, codes_major_x=True)
        return am.GemvConfig(64, 1, split_k=2) if k // group >= 2 else am.GemvConfig(64, 1)

    for module in (am, norm):
        monkeypatch.setattr(module, "kernel_enabled", lambda tensor: True)
    monkeypatch.setattr(am, "gemv_config", split_launch)
    monkeypatch.setattr(am, "X_BLOCK_WORDS", 4)
    monkeypatch.setattr(norm, "add_rms_norm_triton", counted)
    monkeypatch.setattr(am, "affine_gemv_geglu_out_triton", geglu_counted)
    got = decode()
    layers = model.config.num_hidden_layers
    assert sum(handed) == 2 * layers * 3  # o_proj's and down's, each decode step
    assert ordered.count((8, 4)) == layers * 3  # each pre-feed-forward norm
    # The prefill's 6 rows take the tensor-core kernel (then the GeGLU kernel), then each
    # decode step's gate/up reads its norm's order and stores the GeGLU.
    assert stored_geglu == [False] * layers + [True] * (layers * 3)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 4])
def test_gemv_bf16_activations(bits, rows) -> None:
    """bf16 x: loaded exactly into fp32, so the kernel's only bf16 step is the output cast,
    which the interpreter truncates (the GPU rounds): up to one ulp, eps_bf16 |y|, the
    bound's output term. Against the reference, which also rounds its output and its weights
    (to the scales' fp16, then to bf16), allow eps16 + 2 eps_bf16 per |x w| more."""
    torch.manual_seed(10 + bits + rows)
    operands, oracle, magnitude = _gemv_case(bits, 64, rows, torch.bfloat16)
    reference = am.affine_matmul_reference(*operands, bits, 64)
    slack = torch.finfo(torch.float16).eps + 2 * torch.finfo(torch.bfloat16).eps
    for name in ("heuristic", "split2"):
        got = am.affine_gemv_triton(*operands, bits, 64, config=GEMV_CONFIGS[name])
        assert got.dtype == torch.bfloat16, name
        _assert_close(got, oracle, magnitude, GEMV_K)
        _assert_close(got, reference, magnitude, GEMV_K, weight_eps=slack)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [5, 16])
def test_gemv_tile_rows(bits, rows) -> None:
    """5..GEMV_MAX_ROWS rows take the tile kernel (its default launch, and a pinned split);
    fp16 x and output (eps16 |y| for the output, as the module docstring)."""
    torch.manual_seed(20 + bits + rows)
    operands, oracle, magnitude = _gemv_case(bits, 32, rows, torch.float16)
    reference = am.affine_matmul_reference(*operands, bits, 32)
    eps16 = torch.finfo(torch.float16).eps
    for name in ("heuristic", "split2"):
        got = am.affine_gemv_triton(*operands, bits, 32, config=GEMV_CONFIGS[name])
        assert got.dtype == torch.float16 and got.shape == (rows, GEMV_N), name
        _assert_close(got, oracle, magnitude, GEMV_K)
        _assert_close(got, reference, magnitude, GEMV_K, weight_eps=eps16)


def test_gemv_leading_dims_and_bf16_scales() -> None:
    """x [2, 2, K] (four unrolled rows), bf16 scales, fp32 activations; oracle tolerance."""
    torch.manual_seed(1)
    n, k, bits, group = 72, 128, 4, 32
    packed, scales, biases = _quantized(n, k, bits, group, torch.bfloat16)
    x = torch.randn(2, 2, k)
    weight = _oracle_weight(packed, scales, biases, bits)
    split = GEMV_CONFIGS["split2"]
    got = am.affine_gemv_triton(x, packed, scales, biases, bits, group, config=split)
    assert got.shape == (2, 2, n)
    _assert_close(got, x.double() @ weight.T, x.double().abs() @ weight.abs().T, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("name", ["whole", "split3"])
def test_gemv_repeats_bits(bits, rows, name) -> None:
    """Bit for bit across launches, split or not: split partials are added in split order by
    a launch of their own."""
    torch.manual_seed(2)
    operands, _, _ = _gemv_case(bits, 32, rows, torch.float32)
    config = GEMV_CONFIGS[name]
    first = am.affine_gemv_triton(*operands, bits, 32, config=config)
    second = am.affine_gemv_triton(*operands, bits, 32, config=config)
    assert torch.equal(first, second)


def test_codes_major_places_each_input_by_block_code_and_word() -> None:
    """Element [m, b, j, w] is x[m, (b * 32 + w) * codes + j], from the definition."""
    x = torch.arange(2 * 512, dtype=torch.float32).view(2, 512)
    for bits in (4, 8):
        codes = 32 // bits
        got = am.codes_major(x, bits)
        assert got.shape == (2, 512 // (32 * codes), codes, 32)
        for m, b, j, w in [(0, 0, 0, 0), (1, 0, 3, 5), (0, 1, codes - 1, 31), (1, 1, 1, 17)]:
            assert got[m, b, j, w] == x[m, (b * 32 + w) * codes + j]
    assert am.codes_major_fits(512, 4) and not am.codes_major_fits(384, 4)


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_major_kernel_equals_the_reference(bits) -> None:
    """The Triton reorder places every input where `codes_major` does, bit for bit, for a row
    stride wider than K (a view of a wider tensor), K over several 1024-output programs and
    a partial last one; and the GEMV reordering x with it returns the same bits as reading
    x reordered by torch's copy (`CodesMajor`)."""
    torch.manual_seed(bits)
    wide = torch.randn(3, 3840 + 64).bfloat16()
    x = wide[:, :3840]
    want = am.codes_major(x, bits)
    got = am.codes_major_triton(x, bits)
    assert got.dtype == want.dtype and torch.equal(got, want)
    packed, scales, biases = _quantized(40, 3840, bits, 64, torch.bfloat16)
    config = am.GemvConfig(32, 4, prefetch=True, codes_major_x=True)
    copied = am.CodesMajor(want, x.shape)
    with_copy = am.affine_gemv_triton(copied, packed, scales, biases, bits, 64, config=config)
    with_kernel = am.affine_gemv_triton(x, packed, scales, biases, bits, 64, config=config)
    assert torch.equal(with_kernel, with_copy)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("name", ["whole", "split3", "prefetch", "prefetch split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_codes_major_x_equals_input_order(bits, rows, name, dtype) -> None:
    """Reading x codes-major changes only where each x value comes from, not which products
    are summed or in what order: bit for bit the input-order result. K = 768: 4-bit rows of
    96 words (3 blocks), 8-bit 192 (6), both with tails in the pinned configs."""
    torch.manual_seed(bits + rows)
    k = 768
    packed, scales, biases = _quantized(GEMV_N, k, bits, 64, torch.float16)
    x = torch.randn(rows, k).to(dtype)
    config = dataclasses.replace(GEMV_CONFIGS[name], codes_major_x=True)
    in_order = dataclasses.replace(config, codes_major_x=False)
    input_order = am.affine_gemv_triton(x, packed, scales, biases, bits, 64, config=in_order)
    ordered = am.affine_gemv_triton(x, packed, scales, biases, bits, 64, config=config)
    assert ordered.dtype == dtype and torch.equal(ordered, input_order)
    weight = _oracle_weight(packed, scales, biases, bits)
    _assert_close(ordered, x.double() @ weight.T, x.double().abs() @ weight.abs().T, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_stores_the_geglu_of_a_stacked_gate_up(bits, rows, monkeypatch) -> None:
    """With `geglu_out` an unsplit GEMV over a stacked gate/up weight [2 I, K] pairs gate row
    i with up row I + i in its programs and stores gelu_tanh(gate) · up: bit for bit the GEMV
    then the GeGLU kernel (the dots are the same sums; both round them, then the GeGLU, as
    `activation.geglu` does). I = 21 pairs leave a partial last block; x codes-major too. A
    K-split launch, and any launch off the kernel path, returns None. (fp16: the
    interpreter's bf16 truncates.)"""
    torch.manual_seed(40 + bits + rows)
    k, pairs = 768, GEMV_N
    packed, scales, biases = _quantized(2 * pairs, k, bits, 64, torch.float16)
    x = torch.randn(rows, 1, k).to(torch.float16)  # [batch, tokens, K], as a model passes it
    operands = (x, packed, scales, biases, bits, 64)
    for name, ordered in (("whole", False), ("prefetch", True)):
        config = dataclasses.replace(GEMV_CONFIGS[name], codes_major_x=ordered)
        got = am.affine_gemv_geglu_out_triton(*operands, config=config)
        want = gelu_tanh_mul_triton(am.affine_gemv_triton(*operands, config=config))
        assert got is not None and got.shape == (rows, 1, pairs), name
        assert torch.equal(got, want), (name, ordered)
    assert am.affine_gemv_geglu_out_triton(*operands, config=GEMV_CONFIGS["split3"]) is None
    assert am.affine_gemv_geglu_out(*operands) is None  # off the GPU


@pytest.mark.parametrize("rows", [1, 3])
def test_gemv_reads_x_stored_codes_major(rows, monkeypatch) -> None:
    """An x stored codes-major by its producer (`CodesMajor`) is read as it is: bit for bit
    the GEMV that reorders x itself. A launch that reads x in input order refuses it.
    `codes_major_input` asks for it only on the kernel path."""
    torch.manual_seed(60 + rows)
    k = 768
    packed, scales, biases = _quantized(GEMV_N, k, 4, 64, torch.float16)
    x = torch.randn(rows, 1, k).to(torch.float16)
    weights = (packed, scales, biases, 4, 64)
    stored = am.CodesMajor(am.codes_major(x.view(rows, k), 4), x.shape)
    assert torch.equal(stored.input_order(), x)
    config = dataclasses.replace(GEMV_CONFIGS["prefetch"], codes_major_x=True)
    got = am.affine_gemv_triton(stored, *weights, config=config)
    assert got.shape == (rows, 1, GEMV_N)
    assert torch.equal(got, am.affine_gemv_triton(x, *weights, config=config))
    with pytest.raises(ValueError, match="input order"):
        am.affine_gemv_triton(stored, *weights, config=GEMV_CONFIGS["split3"])
    assert am.codes_major_input(x, packed, 4, 64) is None  # off the GPU
    assert torch.equal(am.affine_linear(stored, *weights), am.affine_linear(x, *weights))
    monkeypatch.setattr(am, "kernel_enabled", lambda tensor: True)
    unsplit = am.GemvConfig(64, 4, codes_major_x=True)
    monkeypatch.setattr(am, "gemv_config", lambda *args: unsplit)
    assert am.codes_major_input(x, packed, 4, 64) == (8, am.X_BLOCK_WORDS)
    assert am.codes_major_input(x[:, :, :640], packed[:, :80], 4, 64) is None  # 2.5 blocks


# The H200 winners (group 64) of the launch sweeps in CUDA graphs (4-bit: commit 17a07a7's
# benchmarks/results/gpu_gemv_affine_sweep-2026-12-03.md; 8-bit: ..._8bit-2026-12-03.md);
# 4-bit with the prefetching loop, and x codes-major at 64 rows where it runs without a K
# split. (12B's 4-bit q/k/v, 8192 x 3840, has since gone unsplit: SHORT_ROWS_CONFIGS.)
MEASURED_CONFIGS = {
    (4, 30720, 3840): am.GemvConfig(64, 4, prefetch=True, codes_major_x=True),
    (4, 3840, 15360): am.GemvConfig(32, 16, split_k=2, prefetch=True),
    (4, 3840, 4096): am.GemvConfig(32, 16, split_k=2, prefetch=True),
    (4, 262144, 3840): am.GemvConfig(64, 4, prefetch=True, codes_major_x=True),
    (8, 30720, 3840): am.GemvConfig(32, 8),
    (8, 3840, 15360): am.GemvConfig(32, 8, split_k=4),
    (8, 3840, 4096): am.GemvConfig(32, 8, split_k=4),
    (8, 8192, 3840): am.GemvConfig(16, 16),
    (8, 262144, 3840): am.GemvConfig(32, 8),
}


def test_gemv_heuristic_picks_the_measured_winners() -> None:
    for (bits, n, k), config in MEASURED_CONFIGS.items():
        assert am.gemv_config(n, k, bits, 64, 132) == config, (bits, n, k)
    # Other groups keep the words per step; tiny N splits further, within whole steps.
    assert am.gemv_config(15360, 3840, 4, 32) == am.GemvConfig(
        64, 8, prefetch=True, codes_major_x=True
    )
    assert am.gemv_config(3840, 15360, 4, 128) == am.GemvConfig(32, 8, split_k=2, prefetch=True)
    assert am.gemv_config(15360, 3840, 8, 128) == am.GemvConfig(32, 4)
    # 32 row blocks: splits double to one program per SM (8), capped at one 16-group step each.
    assert am.gemv_config(1024, 4096, 4, 64) == am.GemvConfig(32, 16, split_k=4, prefetch=True)
    assert am.gemv_config(1024, 512, 4, 64) == am.GemvConfig(64, 4, split_k=2, prefetch=True)


# The H100 sweeps' winners (2026-12-06): 26B-A4B's dense 4-bit weights of few, short rows run
# unsplit (benchmarks/results/gpu_gemv_affine_sweep_unsplit_26b_h100-2026-12-06.md), and its
# gathered experts as `gathered_gemv_config` says (benchmarks/lab/gpu_gathered_gemv_sweep.py).
SHORT_ROWS_CONFIGS = {
    (8192, 2816): am.GemvConfig(16, 16),  # q/k/v
    (4224, 2816): am.GemvConfig(16, 16),  # gate/up
    (2816, 2112): am.GemvConfig(16, 16),  # down
    (8192, 3840): am.GemvConfig(16, 16),  # Gemma 3 12B's q/k/v: rows of 480 words
}
GATHERED_CONFIGS = {
    (4, 2816): am.GemvConfig(32, 16),  # gate/up: 352 words a row, 128 a step
    (4, 704): am.GemvConfig(16, 16),  # down: a row in one step
    (8, 2816): am.GemvConfig(16, 8),
    (8, 704): am.GemvConfig(32, 16),
}


def test_gemv_heuristics_pick_the_h100_winners() -> None:
    for (n, k), config in SHORT_ROWS_CONFIGS.items():
        assert am.gemv_config(n, k, 4, 64, 132) == config, (n, k)
    assert am.gemv_config(2816, 4096, 4, 64, 132).split_k == 2  # o: rows of 512 words split
    assert am.gemv_config(3840, 4096, 4, 64, 132).split_k == 2  # 12B's o too
    assert am.gemv_config(256, 2560, 4, 64, 132).split_k > 1  # 16 programs: too few unsplit
    for (bits, k), config in GATHERED_CONFIGS.items():
        assert am.gathered_gemv_config(k, bits, 64) == config, (bits, k)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
def test_embedding_rows_dequantized_by_one_kernel(bits, group) -> None:
    """A token table's rows (`affine_embed`: the dequantize kernel gathering rows, ids of any
    shape, repeated and out of order) equal the torch reference's, the gathered rows
    dequantized as mlx does, bit for bit (fp16 scales: the interpreter's bf16 truncates)."""
    torch.manual_seed(bits + group)
    packed, scales, biases = _quantized(50, 256, bits, group, torch.float16)
    for ids in (torch.tensor([[7]]), torch.tensor([[3, 49, 3], [0, 21, 8]])):
        want = am.affine_embed_reference(ids, packed, scales, biases, bits, group)
        assert torch.equal(want, dequantize_affine(packed, scales, biases, bits, group)[ids])
        for dtype in (torch.float16, torch.float32):
            got = am.affine_dequantize_triton(packed, scales, biases, bits, group, dtype, ids)
            assert got.shape == (*ids.shape, 256) and torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scales_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dequantize_kernel_rounds_as_mlx(bits, scales_dtype) -> None:
    """Bit for bit: the prefill path is this weight and the same F.linear as the reference.

    Except bf16 here: Triton's interpreter casts fp32 to bf16 by truncation (the GPU rounds to
    nearest even, and the GPU script checks bf16 bit for bit), so each of the two roundings
    may land one bf16 ulp lower in magnitude: within 2 ulps of |w| + |bias|."""
    torch.manual_seed(3)
    packed, scales, biases = _quantized(40, 128, bits, 32, scales_dtype)
    want = dequantize_affine(packed, scales, biases, bits, 32)
    for dtype in (scales_dtype, torch.float32):
        got = am.affine_dequantize_triton(packed, scales, biases, bits, 32, dtype)
        if scales_dtype != torch.bfloat16:
            assert torch.equal(got, want.to(dtype))
            continue
        ulp = torch.finfo(torch.bfloat16).eps
        span = want.float().abs() + biases.float().abs().repeat_interleave(32, dim=-1)
        assert ((got.float() - want.float()).abs() <= 2 * ulp * span).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_prefill_rows_equal_the_reference(bits) -> None:
    """Past MMA_MAX_ROWS: the dequantize kernel's weight and the reference's F.linear."""
    torch.manual_seed(4)
    packed, scales, biases = _quantized(40, 128, bits, 64, torch.float16)
    x = torch.randn(am.MMA_MAX_ROWS + 1, 128)
    got = am.affine_matmul_triton(x, packed, scales, biases, bits, 64)
    assert torch.equal(got, am.affine_matmul_reference(x, packed, scales, biases, bits, 64))


# ---------------------------------------------------------------------------------------------
# The tensor-core kernel (MMA_MIN_ROWS..MMA_MAX_ROWS rows)

# N = 40: a partial block of the heuristic's 64 rows, and two whole blocks and a partial one
# of 16. K = 384: 12 groups of 32 or 6 of 64; split 4 gives splits of 3 or 2 groups, the
# last of 6 groups' split 4 empty (its steps masked).
MMA_N, MMA_K = 40, 384
MMA_CASES = [(bits, group) for bits in (4, 8) for group in (32, 64)]


def _mma_launches(rows: int) -> dict[str, am.MmaConfig | None]:
    tile = max(16, 1 << (rows - 1).bit_length())
    return {"heuristic": None, "N16 split4": am.MmaConfig(tile, 16, split_k=4)}


def _mma_case(bits: int, group: int, rows: int, dtype: torch.dtype):
    packed, scales, biases = _quantized(MMA_N, MMA_K, bits, group, torch.float16)
    x = torch.randn(rows, MMA_K).to(dtype)
    weight = _oracle_weight(packed, scales, biases, bits)
    oracle = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    return (x, packed, scales, biases), oracle, magnitude


@pytest.mark.parametrize(("bits", "group"), MMA_CASES)
@pytest.mark.parametrize("rows", [5, 16, 33, 64])
def test_mma_matches_reference_and_oracle(bits, group, rows) -> None:
    """Rows padded to tiles of 16, 32 and 64; two launches (the heuristic's, 64 rows a
    program over 40; 16 rows a program with a K split, one split empty). fp16 and fp32 x.
    Tolerances: the module docstring's. Each group's dot is exact but for fp32 accumulation
    (codes and x exact in the operand dtype, products exact in fp32), and scale and bias
    apply to it in fp32, as in the GEMVs: against the oracle, fp32 accumulation plus the
    output's rounding; against the reference, plus its weights' rounding to the scales'
    fp16 (eps16 |x w|)."""
    torch.manual_seed(100 * bits + group + rows)
    eps16 = torch.finfo(torch.float16).eps
    for dtype in (torch.float16, torch.float32):
        operands, oracle, magnitude = _mma_case(bits, group, rows, dtype)
        reference = am.affine_matmul_reference(*operands, bits, group)
        for name, config in _mma_launches(rows).items():
            got = am.affine_mma_triton(*operands, bits, group, config=config)
            assert got.dtype == dtype and got.shape == (rows, MMA_N), (name, dtype)
            _assert_close(got, oracle, magnitude, MMA_K)
            _assert_close(got, reference, magnitude, MMA_K, weight_eps=eps16)


@pytest.mark.parametrize(("bits", "group"), MMA_CASES)
def test_mma_bf16_activations_and_leading_dims(bits, group) -> None:
    """bf16 x ``[2, 3, K]`` (6 rows): the output keeps x's leading dims; 4-bit codes come
    as bf16 ``128 + code`` (`_offset_bf16_codes`), the 128 taken off with the bias. The
    interpreter's dot runs in fp32 on the exact bf16 values (DOT_FP32), and its cast of the
    output to bf16 truncates (the GPU rounds): one ulp, eps_bf16 |y|, the bound's output
    term. Against the
    reference, which also rounds its weights to the scales' fp16 and then to bf16, allow
    eps16 + 2 eps_bf16 per |x w| more, as for the GEMV."""
    torch.manual_seed(110 + bits + group)
    operands, oracle, magnitude = _mma_case(bits, group, 6, torch.bfloat16)
    x = operands[0].view(2, 3, MMA_K)
    reference = am.affine_matmul_reference(x, *operands[1:], bits, group)
    slack = torch.finfo(torch.float16).eps + 2 * torch.finfo(torch.bfloat16).eps
    got = am.affine_mma_triton(x, *operands[1:], bits, group)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, MMA_N)
    _assert_close(got.view(6, MMA_N), oracle, magnitude, MMA_K)
    _assert_close(got, reference, magnitude.view(2, 3, MMA_N), MMA_K, weight_eps=slack)


def test_mma_split_repeats_its_bits_and_refuses_what_it_cannot_hold() -> None:
    """A K split's partials are added in split order by a launch of their own: the same bits
    every launch. More rows than the tile, or than MMA_MAX_ROWS, are refused."""
    torch.manual_seed(120)
    operands, _, _ = _mma_case(4, 32, 9, torch.float32)
    split = am.MmaConfig(16, 16, split_k=4)
    first = am.affine_mma_triton(*operands, 4, 32, config=split)
    assert torch.equal(first, am.affine_mma_triton(*operands, 4, 32, config=split))
    with pytest.raises(ValueError, match="cannot hold"):
        am.affine_mma_triton(*operands, 4, 32, config=am.MmaConfig(8, 16))
    many = torch.randn(am.MMA_MAX_ROWS + 1, MMA_K)
    with pytest.raises(ValueError, match="at most"):
        am.affine_mma_triton(many, *operands[1:], 4, 32)


def test_rows_pick_the_unrolled_gemv_the_mma_kernel_or_cublas(monkeypatch) -> None:
    """The GPU dispatch by rows: up to UNROLLED_ROWS the unrolled GEMV, MMA_MIN_ROWS to
    MMA_MAX_ROWS the tensor-core kernel, more the dequantized weight and F.linear."""
    chosen: list[str] = []
    for name in ("affine_gemv_triton", "affine_mma_triton", "affine_dequantize_triton"):
        launcher: Callable = getattr(am, name)

        def spy(*args, _launcher=launcher, _name=name, **kwargs):
            chosen.append(_name)
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(am, name, spy)
    packed, scales, biases = _quantized(MMA_N, 64, 4, 64, torch.float32)
    for rows in (am.UNROLLED_ROWS, am.MMA_MIN_ROWS, am.MMA_MAX_ROWS, am.MMA_MAX_ROWS + 1):
        am.affine_matmul_triton(torch.randn(rows, 64), packed, scales, biases, 4, 64)
    assert chosen == [
        "affine_gemv_triton",
        "affine_mma_triton",
        "affine_mma_triton",
        "affine_dequantize_triton",
    ]


def test_mma_heuristic_tiles_rows_and_splits_few_row_blocks() -> None:
    """Rows pad to the next tile of 16, 32 or 64 (8 warps for 64 x 128 tiles); weights of
    fewer than 132 blocks of 128 rows take blocks of 64 (Gemma 3 12B's q/k/v, o_proj and
    down), then split K while that keeps at most two programs an SM (132 SMs) and the
    partials stay under the weight's bytes (``split <= K * bits / (64 * M)``): q/k/v split 2,
    o_proj and down 4; splits keep at least 4 groups each."""
    for rows, tile in ((5, 16), (16, 16), (17, 32), (33, 64), (64, 64)):
        warps = 8 if tile == 64 else 4
        assert am.mma_config(rows, 30720, 3840, 4, 64) == am.MmaConfig(tile, 128, warps=warps)
    assert am.mma_config(16, 8192, 3840, 4, 64) == am.MmaConfig(16, 64, split_k=2)
    assert am.mma_config(64, 8192, 3840, 4, 64) == am.MmaConfig(64, 64, split_k=2)
    assert am.mma_config(16, 3840, 4096, 4, 64) == am.MmaConfig(16, 64, split_k=4)
    assert am.mma_config(64, 3840, 15360, 4, 64) == am.MmaConfig(64, 64, split_k=4)
    assert am.mma_config(64, 3840, 2048, 4, 64).split_k == 2  # capped by bytes: 2048 * 4 / 4096
    assert am.mma_config(64, 262144, 3840, 4, 64) == am.MmaConfig(64, 128, warps=8)
    assert am.mma_config(16, 256, 4096, 4, 64).split_k == 8  # 4 blocks: capped by MAX_SPLIT_K
    assert am.mma_config(5, 256, 2048, 8, 128).split_k == 4  # 16 groups: 4 a split


EXPERT_IDS = {
    "repeated": [[1, 1], [3, 1], [1, 3]],  # one expert twice in a token, shared across tokens
    "distinct": [[0, 2], [3, 1], [2, 0]],
}


def _pair_oracle(rows: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
    """Per (token, slot): rows [P, K] fp64 times weights[ids] [P, N, K] fp64."""
    chosen = weights[ids.reshape(-1)]
    oracle = torch.einsum("pk,pnk->pn", rows.double(), chosen)
    magnitude = torch.einsum("pk,pnk->pn", rows.double().abs(), chosen.abs())
    return oracle.view(*ids.shape, -1), magnitude.view(*ids.shape, -1)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("ids_name", list(EXPERT_IDS))
@pytest.mark.parametrize("per_slot", [False, True])
def test_gathered_experts(bits, ids_name, per_slot) -> None:
    torch.manual_seed(5)
    experts, n, k, group = 4, 40, 128, 32
    packed, scales, biases = _quantized(n, k, bits, group, torch.float16, lead=(experts,))
    ids = torch.tensor(EXPERT_IDS[ids_name])
    x = torch.randn(3, 2, k) if per_slot else torch.randn(3, k)
    x = x.half()
    rows = x.reshape(-1, k) if per_slot else x.repeat_interleave(2, dim=0)
    oracle, magnitude = _pair_oracle(rows, _oracle_weight(packed, scales, biases, bits), ids)
    reference = am.affine_expert_matmul_reference(x, packed, scales, biases, ids, bits, group)
    eps16 = torch.finfo(torch.float16).eps
    _assert_close(reference, oracle, magnitude, k, weight_eps=eps16)
    split = {"BLOCK_N": 16, "BLOCK_KW": 16, "SPLIT_K": 2}  # split-K over pairs (some cases)
    for config in (None, split) if per_slot else (None,):
        got = am.affine_expert_matmul_triton(
            x, packed, scales, biases, ids, bits, group, config=config
        )
        assert got.shape == (3, 2, n) and got.dtype == x.dtype
        _assert_close(got, oracle, magnitude, k)
        _assert_close(got, reference, magnitude, k, weight_eps=eps16)


@pytest.mark.parametrize(("bits", "per_slot"), [(4, False), (8, True)])
def test_gathered_unrolled_gemv_is_the_gemv_of_each_pair(bits, per_slot) -> None:
    """The unrolled GEMV over gathered experts (grid axis 2 = pair) computes, for each pair,
    bit for bit what the plain GEMV of that pair's x row by its expert computes at the same
    launch: masked tail steps (K = 384, group 64: 6 groups in steps of 4), the prefetching loop
    (at 4 bits with x reordered codes-major, K = 512). With `geglu_out` it stores the GeGLU of
    stacked gate/up rows: bit for bit that product, then the GeGLU kernel."""
    torch.manual_seed(70 + bits + per_slot)
    experts, n, group = 4, 42, 64  # 21 gate/up pairs: a partial row block either way
    ids = torch.tensor(EXPERT_IDS["repeated"])
    launches = [(384, am.GemvConfig(16, 4))]
    if bits == 4:  # the prefetching loop with x codes-major
        launches.append((512, am.GemvConfig(16, 4, prefetch=True, codes_major_x=True)))
    else:
        launches.append((384, am.GemvConfig(32, 4, prefetch=True)))
    for k, config in launches:
        packed, scales, biases = _quantized(n, k, bits, group, torch.float16, lead=(experts,))
        x = (torch.randn(3, 2, k) if per_slot else torch.randn(3, k)).half()
        operands = (x, packed, scales, biases, ids, bits, group)
        got = am.affine_expert_matmul_triton(*operands, gemv=config)
        assert got.shape == (3, 2, n)
        rows = x.reshape(-1, k) if per_slot else x.repeat_interleave(2, dim=0)
        flat_ids = ids.reshape(-1)
        for expert in flat_ids.unique().tolist():  # its pairs as the rows of one plain GEMV
            pairs = (flat_ids == expert).nonzero()[:, 0]  # at most 4 (the unrolled rows)
            weight = (packed[expert], scales[expert], biases[expert])
            alone = am.affine_gemv_triton(rows[pairs], *weight, bits, group, config)
            assert torch.equal(got.reshape(-1, n)[pairs], alone), (k, config, expert)
        geglu = am.affine_expert_matmul_triton(*operands, gemv=config, geglu_out=True)
        assert torch.equal(geglu, gelu_tanh_mul_triton(got)), (k, config)
    reference = am.affine_expert_matmul_reference(*operands, geglu_out=True)
    assert torch.equal(am.affine_expert_matmul(*operands, geglu_out=True), reference)  # CPU
    with pytest.raises(ValueError, match="without a K split"):
        am.affine_expert_matmul_triton(*operands, gemv=am.GemvConfig(16, 4, split_k=2))
    with pytest.raises(ValueError, match="only the unrolled"):
        am.affine_expert_matmul_triton(*operands, config=am.DEFAULT_TILE_CONFIG, geglu_out=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("per_slot", [False, True])
def test_gathered_float_experts(dtype, per_slot) -> None:
    torch.manual_seed(6)
    weights = torch.randn(4, 40, 96).to(dtype)  # K = 96: not a multiple of the K block
    ids = torch.tensor(EXPERT_IDS["repeated"])
    x = (torch.randn(3, 2, 96) if per_slot else torch.randn(3, 96)).to(dtype)
    rows = x.reshape(-1, 96) if per_slot else x.repeat_interleave(2, dim=0)
    oracle, magnitude = _pair_oracle(rows, weights.double(), ids)
    reference = am.float_expert_matmul_reference(x, weights, ids)
    got = am.float_expert_matmul_triton(x, weights, ids)
    _assert_close(reference, oracle, magnitude, 96)
    _assert_close(got, oracle, magnitude, 96)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_slot", [False, True])
def test_gathered_float_experts_with_a_geglu_output(dtype, per_slot) -> None:
    """Stacked gate/up experts [E, 2N, K] whose gathered GEMV stores gelu_tanh(gate) * up:
    bit for bit the plain gathered GEMV at the same tiles, then the GeGLU kernel (a program's
    rows pair gate c with up c; each dot summed as before). N = 20 leaves a ragged block."""
    torch.manual_seed(8)
    weights = torch.randn(4, 40, 96).to(dtype)
    ids = torch.tensor(EXPERT_IDS["repeated"])
    x = (torch.randn(3, 2, 96) if per_slot else torch.randn(3, 96)).to(dtype)
    config = {"BLOCK_N": 8, "BLOCK_K": 64}
    got = am.float_expert_matmul_triton(x, weights, ids, config=config, geglu_out=True)
    assert got.shape == (3, 2, 20)
    apart = gelu_tanh_mul_triton(am.float_expert_matmul_triton(x, weights, ids, config=config))
    assert torch.equal(got, apart)
    assert torch.equal(
        am.float_expert_matmul(x, weights, ids, geglu_out=True),  # off the GPU: the reference
        gelu_tanh_mul_reference(am.float_expert_matmul_reference(x, weights, ids)),
    )
    with pytest.raises(ValueError, match="stacked gate/up"):
        am.float_expert_matmul_triton(x, weights[:, 1:], ids, geglu_out=True)


# ---------------------------------------------------------------------------------------------
# Dispatch and the modules that use it


def _record_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Pretend the tensors are on a GPU, and record which kernel launchers run."""
    calls: list[str] = []
    monkeypatch.setattr(am, "kernel_enabled", lambda tensor: True)
    for name in ("affine_matmul_triton", "affine_expert_matmul_triton"):
        launcher: Callable = getattr(am, name)

        def spy(*args, _launcher=launcher, _name=name, **kwargs):
            calls.append(_name)
            return _launcher(*args, **kwargs)

        monkeypatch.setattr(am, name, spy)
    return calls


def test_dispatcher_falls_back_to_the_reference_for_other_widths(monkeypatch) -> None:
    calls = _record_kernel_calls(monkeypatch)
    x = torch.randn(2, 128)
    packed, scales, biases = _quantized(40, 128, 3, 64, torch.float32)
    got = am.affine_linear(x, packed, scales, biases, 3, 64)
    assert calls == []
    assert torch.equal(got, am.affine_matmul_reference(x, packed, scales, biases, 3, 64))
    packed, scales, biases = _quantized(40, 128, 4, 64, torch.float32)
    am.affine_linear(x, packed, scales, biases, 4, 64)
    assert calls == ["affine_matmul_triton"]


def test_cpu_modules_stay_the_reference_bit_for_bit() -> None:
    torch.manual_seed(7)
    linear = MLXQuantizedLinear.from_float(torch.randn(40, 128).bfloat16(), 4, 64)
    table = MLXQuantizedEmbedding(*quantize_affine(torch.randn(40, 128).bfloat16(), 8, 32), 8, 32)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    for module, call in ((linear, linear.forward), (table, table.head)):
        want = torch.nn.functional.linear(x, module.dequantize().to(x.dtype))
        assert torch.equal(call(x), want)


def _tiny_experts(bits: int | None) -> Experts:
    """The tiny MoE of test_mlx_gemma4 (hidden 64, experts 32 wide): random, maybe packed."""
    config = parse_config(
        tiny_gemma4_config(
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
        ).to_dict()
    )
    experts = Experts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, 0.2)
        experts.down_proj.normal_(0.0, 0.2)
    if bits is not None:
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(experts, name).detach()
            delattr(experts, name)  # a Parameter's name takes no module until freed
            packed = MLXQuantizedExperts(*quantize_affine(weight, bits, 32), bits, 32)
            setattr(experts, name, packed)
    return experts


@pytest.mark.parametrize("bits", [None, 4, 8])
@pytest.mark.parametrize("kernels", [False, True])
def test_sync_free_experts_equal_the_loop(bits, kernels, monkeypatch) -> None:
    """fp32 throughout, so only the summation order differs: 1e-5 relative to the output's
    scale is ~100 eps32, room for the two chained projections' reordered sums (the gate/up
    GEMV stores the GeGLU)."""
    torch.manual_seed(8)
    experts = _tiny_experts(bits)
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1], [1, 0], [3, 3], [2, 1], [0, 2]])
    weights = torch.rand(5, 2)
    calls = _record_kernel_calls(monkeypatch) if kernels else []
    gathered = experts.forward_gathered(x, weights, ids)
    monkeypatch.undo()
    loop = experts.forward_loop(x, weights, ids)
    launch = "affine_expert_matmul_triton"
    assert calls == ([launch, launch] if kernels and bits else [])
    torch.testing.assert_close(gathered, loop, rtol=0, atol=1e-5 * loop.abs().max().item())
    assert torch.equal(experts(x, weights, ids), loop)  # on CPU, forward is the loop
