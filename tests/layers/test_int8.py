"""Weight-only int8 / int4 quantization: hand-worked examples, error bounds, kernel parity.

Notation for the bounds: u = 2^-24 is the fp32 unit roundoff; bf16 keeps 8 significant bits,
so it rounds to within 2^-8 relative. Every tolerance below is derived in the comment next to
it, not tuned.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hearth.layers import int8 as cpu
from hearth.layers.int8 import (
    Int4Linear,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedEmbeddingHead,
    dequantize_int4_groups,
    quantize_int4_groups,
    quantize_int8_rows,
    quantize_model,
    quantized_linear,
    quantized_linear_of_parts,
)
from hearth.ops import native

needs_int8_kernel = pytest.mark.skipif(not cpu.HAS_INT8_KERNEL, reason="no int8 kernel")
needs_int4_kernel = pytest.mark.skipif(not cpu.HAS_INT4_KERNEL, reason="no int4 kernel")

# (mode, group_size) pairs covering both schemes and the smallest and largest int4 group.
MODES = [("int8", 0), ("int4", 32), ("int4", 128)]
# Kernel vs reference, each against the exact product: the kernel rounds its fp32-accumulated
# sum to bf16 (2^-8 rel.) and, for fp32 x only, x to bf16 (2^-8); the reference rounds nothing
# for fp32 x, and for bf16 x rounds W to bf16 (2^-8) and its sum (2^-8); fp32 accumulation over
# K <= 2048 adds K·u <= 2^-13 on each side. Every term is relative to |x|·|W|, so
# |kernel - reference| <= (3·2^-8 + 2^-12)·(|x| @ |W|ᵀ) < 2^-6·(|x| @ |W|ᵀ).
# (This bound read 2^-7 until 2026-12-04, from taking bf16's unit roundoff as 2^-9: a wrong
# derivation, corrected here, not a widening to pass; the tests passed under both.)
MATMUL_REL = 2.0**-6


def random_weight(out_features: int, in_features: int, seed: int) -> Tensor:
    """Gaussian weights with per-row scale spread and a few offset rows, like trained layers.

    The offset rows make |zero| >> group range, where rounding the int4 zero to bf16 matters.
    """
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) * 0.02
    weight *= torch.rand(out_features, 1, generator=generator) * 4 + 0.1
    weight[::7] += 3.0
    return weight


def quantized(
    mode: str, weight: Tensor, group_size: int, bias: Tensor | None = None
) -> Int8Linear | Int4Linear:
    if mode == "int8":
        return Int8Linear.from_float(weight, bias)
    return Int4Linear.from_float(weight, group_size, bias)


@functools.cache
def cached_layer(
    mode: str, group_size: int, out_features: int, in_features: int
) -> tuple[Tensor, Int8Linear | Int4Linear]:
    weight = random_weight(out_features, in_features, seed=out_features + in_features)
    return weight, quantized(mode, weight, group_size)


def element_steps(layer: Int8Linear | Int4Linear) -> Tensor:
    """The quantization step s of every weight element, [out, in]."""
    if isinstance(layer, Int8Linear):
        return layer.scales.float()[:, None].expand(layer.out_features, layer.in_features)
    steps = layer.scales_and_zeros[..., 0].t().float()
    return steps.repeat_interleave(layer.group_size, dim=1)


def error_bound(layer: Int8Linear | Int4Linear, dequantized: Tensor) -> Tensor:
    """Per-element bound on |w - dequantized w|, from the scheme.

    The code is round(t̂) with t̂ the fp32 value of w / s (int8) or (w - z) / s + 8 (int4);
    |t| <= 16 and at most three fp32 roundings give |t̂ - t| <= 3·16·u < 2^-18, and the stored
    scale covers [min, max] (rounded up to bf16, see cpu.py), so |t - code| <= 1/2 + 2^-18.
    (code - 8)·s is exact in fp32 and adding z rounds once, by at most u·|deq|.
    """
    return element_steps(layer) * (0.5 + 2.0**-18) + 2.0**-24 * dequantized.abs()


def assert_within(actual: Tensor, expected: Tensor, bound: Tensor) -> None:
    excess = ((actual.float() - expected.float()).abs() - bound).max().item()
    assert excess <= 0.0, f"exceeds the bound by {excess}"


# ---------------------------------------------------------------------------------------------
# Hand-worked examples


def test_int8_hand_example() -> None:
    # Row 0: max 127·2^-7 gives s = 2^-7 (exact in bf16); 0.01 / 2^-7 = 1.28 -> 1.
    # Row 1: all zero; the floored scale keeps it finite and the codes 0.
    # Row 2: max |w| = 127·2^-6 gives s = 2^-6; -0.01 / 2^-6 = -0.64 -> -1.
    weight = torch.tensor(
        [
            [0.9921875, -0.5, 0.01, 0.0],
            [0.0, 0.0, 0.0, 0.0],
            [-1.984375, 1.0, 0.25, -0.01],
        ]
    )
    q, scales = quantize_int8_rows(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16
    assert q.tolist() == [[127, -64, 1, 0], [0, 0, 0, 0], [-127, 64, 16, -1]]
    assert scales.float().tolist() == [2.0**-7, cpu.SCALE_FLOOR, 2.0**-6]
    expected = [[0.9921875, -0.5, 0.0078125, 0.0], [0.0] * 4, [-1.984375, 1.0, 0.25, -0.015625]]
    assert Int8Linear(q, scales).dequantize().tolist() == expected


def test_int8_scale_rounds_up_to_bf16() -> None:
    # 1/127 = 1.00787·2^-7 lies between the bf16 values (1 + 1/128)·2^-7 and (1 + 2/128)·2^-7.
    # Rounding to nearest would pick the lower one and 1.0 / s = 127.0079 would clamp at 127;
    # rounding up gives s = 1.015625·2^-7, 1.0 / s = 126.03 -> 126, error 0.00024 < s / 2.
    q, scales = quantize_int8_rows(torch.tensor([[1.0, -0.25]]))
    assert scales.float().tolist() == [1.015625 * 2.0**-7]
    assert q.tolist() == [[126, -32]]


def test_int4_hand_example() -> None:
    # Row 0: min 0, max 1.875 -> s = 1.875 / 15 = 0.125, z = 0 + 8·s = 1.0 (both exact in bf16).
    #   codes = round((w - 1) / 0.125) + 8: 0 -> 0, 1.875 -> 15, 0.3 -> round(-5.6) + 8 = 2,
    #   0.95 -> round(-0.4) + 8 = 8, 1.0 -> 8.
    # Row 1: min -1, max 0.875 -> s = 0.125, z = 0: -1 -> 0, 0.875 -> 15, 0.3 -> round(2.4) + 8
    #   = 10, -0.55 -> round(-4.4) + 8 = 4, 0 -> 8.
    weight = torch.tensor(
        [[0.0, 1.875, 0.3, 0.95] + [1.0] * 28, [-1.0, 0.875, 0.3, -0.55] + [0.0] * 28]
    )
    codes, scales_and_zeros = quantize_int4_groups(weight, group_size=32)
    assert codes.tolist() == [[0, 15, 2, 8] + [8] * 28, [0, 15, 10, 4] + [8] * 28]
    assert scales_and_zeros.shape == (1, 2, 2)
    assert scales_and_zeros.float().tolist() == [[[0.125, 1.0], [0.125, 0.0]]]
    dequantized = dequantize_int4_groups(codes, scales_and_zeros, group_size=32)
    # (code - 8)·0.125 + z
    assert dequantized.tolist() == [
        [0.0, 1.875, 0.25, 1.0] + [1.0] * 28,
        [-1.0, 0.875, 0.25, -0.5] + [0.0] * 28,
    ]


def test_int4_rejects_bad_group_sizes() -> None:
    with pytest.raises(ValueError, match="group_size"):
        Int4Linear.from_float(torch.zeros(16, 64), group_size=48)
    with pytest.raises(ValueError, match="divisible"):
        Int4Linear.from_float(torch.zeros(16, 96), group_size=64)


# ---------------------------------------------------------------------------------------------
# Error bound of the schemes


@pytest.mark.parametrize(("mode", "group_size"), MODES)
def test_dequantized_error_within_half_a_step(mode: str, group_size: int) -> None:
    weight, layer = cached_layer(mode, group_size, 256, 640)
    dequantized = layer.dequantize()
    assert_within(dequantized, weight, error_bound(layer, dequantized))


def test_int4_step_widens_when_zero_rounds() -> None:
    # Group in [1, 1.001]: s = 0.001 / 15 = 6.7e-5 and z = bf16(1 + 8·s) = 1.0 (bf16 spacing near
    # 1 is 2^-7). Keeping that s, the top code would reach 1 + 7·s = 1.00047 and miss 1.001 by
    # 8·s; widening s to (1.001 - z) / 7 keeps every element within half a step.
    weight = (1.0 + torch.linspace(0.0, 1e-3, 32)).expand(16, 32)
    layer = Int4Linear.from_float(weight, 32)
    scale, zero = layer.scales_and_zeros[0, 0].float().tolist()
    assert zero == 1.0
    assert scale >= (1.001 - zero) / 7
    dequantized = layer.dequantize()
    assert_within(dequantized, weight, error_bound(layer, dequantized))


def test_constant_and_zero_groups_are_exact() -> None:
    # An int4 group of range 0 gets the floored step, so every element lands on code 8, i.e. on
    # z = bf16(c), which is c for a bf16 value c; an all-zero int8 row gets codes 0.
    weight = torch.cat((torch.full((16, 32), 0.75), torch.zeros(16, 32)), dim=1)
    assert torch.equal(Int4Linear.from_float(weight, 32).dequantize(), weight)
    zeros = torch.zeros(16, 64)
    assert torch.equal(Int8Linear.from_float(zeros).dequantize(), zeros)


# ---------------------------------------------------------------------------------------------
# Kernel path against the dequantize-then-matmul reference


@needs_int8_kernel
@needs_int4_kernel
@pytest.mark.parametrize(("mode", "group_size"), MODES)
@pytest.mark.parametrize("out_features", [256, 2048])
@pytest.mark.parametrize("in_features", [640, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference(
    mode: str, group_size: int, out_features: int, in_features: int, dtype: torch.dtype
) -> None:
    _, layer = cached_layer(mode, group_size, out_features, in_features)
    assert layer.uses_kernel
    dequantized_abs = layer.dequantize().abs()
    generator = torch.Generator().manual_seed(1)
    for leading in [(1,), (7,), (2, 3)]:
        x = torch.randn(*leading, in_features, generator=generator).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (*leading, out_features)
        bound = MATMUL_REL * (x.float().abs() @ dequantized_abs.t())
        assert_within(y, layer.reference_forward(x), bound)


def test_int4_portable_layout_matches_kernel_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    weight, kernel_layer = cached_layer("int4", 32, 256, 640)
    monkeypatch.setattr(cpu, "HAS_INT4_KERNEL", False)
    portable = Int4Linear.from_float(weight, 32)
    assert not portable.uses_kernel
    # Same codes and scales, so the dequantized weights agree bit for bit.
    assert torch.equal(portable.dequantize(), kernel_layer.dequantize())
    x = torch.randn(3, 640)
    assert torch.equal(portable(x), portable.reference_forward(x))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_stacked_parts_quantize_as_their_concatenation(mode: str) -> None:
    """Rows quantize independently, so quantizing q/k/v (or gate/up) apart and stacking the
    codes gives the layer of the concatenated weight, bit for bit (bf16, as a CPU load has
    them; 16 + 32 + 16 rows keep the int4 kernel's multiple of 16)."""
    parts = [random_weight(rows, 128, seed=rows).to(torch.bfloat16) for rows in (16, 32, 16)]
    stacked = quantized_linear_of_parts(parts, mode)
    whole = quantized_linear(torch.cat(parts), mode)
    assert type(stacked) is type(whole)
    assert stacked.state_dict().keys() == whole.state_dict().keys()
    for name, tensor in whole.state_dict().items():
        assert torch.equal(stacked.state_dict()[name], tensor), name


def test_int4_falls_back_when_out_is_not_a_multiple_of_16() -> None:
    layer = Int4Linear.from_float(random_weight(24, 64, seed=3), 32)
    assert not layer.uses_kernel
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), layer.reference_forward(x))


@needs_int8_kernel
def test_int8_kernel_takes_misaligned_inputs() -> None:
    # The kernel's aligned loads would segfault on this view (data 2 bytes past 64-byte
    # alignment); the layer must copy it. Same bound as test_kernel_matches_reference.
    _, layer = cached_layer("int8", 0, 256, 640)
    x = torch.randn(3 * 640 + 1).to(torch.bfloat16)[1:].view(3, 640)
    assert x.data_ptr() % 64 != 0
    bound = MATMUL_REL * (x.float().abs() @ layer.dequantize().abs().t())
    assert_within(layer(x), layer.reference_forward(x), bound)


def test_int8_falls_back_when_in_is_not_a_multiple_of_16(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's kernel has no K tail loop (garbage for K = 24): without the native kernel (which
    # has one, see test_native_int8_kernel_matches_reference) such layers use the reference.
    monkeypatch.setattr(native, "kernels", lambda: None)  # the library did not build
    layer = Int8Linear.from_float(random_weight(32, 24, seed=7))
    assert not layer.uses_kernel
    x = torch.randn(2, 24)
    assert torch.equal(layer(x), layer.reference_forward(x))


def test_int8_fallback_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "HAS_INT8_KERNEL", False)
    monkeypatch.setattr(native, "kernels", lambda: None)  # the library did not build
    layer = Int8Linear.from_float(random_weight(32, 64, seed=4))
    assert not layer.uses_kernel
    x = torch.randn(2, 64)
    assert torch.equal(layer(x), layer.reference_forward(x))


@pytest.mark.parametrize(("mode", "group_size"), MODES)
def test_bias_is_added_after_the_matmul(mode: str, group_size: int) -> None:
    # Same buffers with and without bias: fp32 outputs must differ by exactly + bias.
    weight, layer = cached_layer(mode, group_size, 256, 640)
    bias = torch.randn(256)
    with_bias = quantized(mode, weight, group_size, bias)
    x = torch.randn(2, 640)
    assert torch.equal(with_bias(x), layer(x) + bias)


# ---------------------------------------------------------------------------------------------
# Tied embedding / head


def test_embedding_head() -> None:
    weight = random_weight(512, 640, seed=5)
    table = QuantizedEmbeddingHead.from_float(weight)
    dequantized = table.dequantize()
    ids = torch.tensor([[0, 7, 511], [3, 3, 100]])
    for dtype in (torch.float32, torch.bfloat16):
        # Both sides compute q·s in fp32 (exact) and then round once to dtype.
        assert torch.equal(table.embed(ids, dtype), dequantized[ids].to(dtype))
    x = torch.randn(2, 640).to(torch.bfloat16)
    bound = MATMUL_REL * (x.float().abs() @ dequantized.abs().t())
    assert_within(table.head(x), F.linear(x, dequantized.to(x.dtype)), bound)
    assert_within(dequantized, weight, error_bound(table.table, dequantized))


# ---------------------------------------------------------------------------------------------
# Whole-model conversion


class TwoLayerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.layers = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)


@pytest.mark.parametrize(("mode", "group_size"), MODES[:2])
def test_quantize_model(mode: str, group_size: int) -> None:
    torch.manual_seed(6)
    model = TwoLayerModel()
    floats = [layer.weight.detach().clone() for layer in model.layers]
    embedding = model.embed.weight
    x = torch.randn(5, 64)
    expected = model(x)

    quantize_model(model, mode, group_size)

    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.embed.weight is embedding
    # Propagate a bound layer by layer, with y = x·Wᵀ exact and ŷ the quantized output:
    # |ŷ - y| <= |ŷ_in - y_in|·|W|ᵀ  (input error carried through the float weights)
    #          + |ŷ_in|·|W - D|ᵀ      (weight error, <= error_bound)
    #          + 2^-7·|ŷ_in|·|D|ᵀ     (kernel rounding, as in MATMUL_REL)
    actual, carried = x, torch.zeros_like(x)
    for layer, weight in zip(model.layers, floats, strict=True):
        dequantized = layer.dequantize()
        carried = (
            carried @ weight.abs().t()
            + actual.abs() @ error_bound(layer, dequantized).t()
            + MATMUL_REL * (actual.abs() @ dequantized.abs().t())
        )
        actual = layer(actual)
    assert_within(actual, expected, carried)
    assert_within(model(x), expected, carried)


def test_quantize_model_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        quantize_model(TwoLayerModel(), "int3")


# ---------------------------------------------------------------------------------------------
# Memory


def test_nbytes_match_the_layout() -> None:
    out_features, in_features = 256, 640
    _, int8 = cached_layer("int8", 0, out_features, in_features)
    # int8 codes + one bf16 scale per row.
    assert int8.nbytes == out_features * in_features + 2 * out_features
    for group_size in (32, 128):
        _, int4 = cached_layer("int4", group_size, out_features, in_features)
        # Two codes per byte + a bf16 (scale, zero) pair per group and row.
        groups = in_features // group_size
        assert int4.nbytes == out_features * in_features // 2 + groups * out_features * 2 * 2
    table = QuantizedEmbeddingHead.from_float(torch.randn(100, 64))
    assert table.nbytes == 100 * 64 + 2 * 100


# ---------------------------------------------------------------------------------------------
# Quantizing while loading


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_load_quantizes_as_the_loaded_model_would_be(
    family: str, mode: str, tmp_path: Path
) -> None:
    """`build_model(quantize=...)` quantizes each layer as the file streams in; it must build
    the very model that quantizing the whole bf16 model afterwards builds (every tensor equal),
    stacked projections, per-layer inputs, the tied table and the per-layer table included."""
    from hearth.checkpoint import open_checkpoint
    from hearth.models.loading import build_model
    from tiny import save_hf, tiny_gemma3_model, tiny_gemma4_model

    if family == "gemma3":
        hf = tiny_gemma3_model()
    else:
        hf = tiny_gemma4_model(hidden_size_per_layer_input=32)  # int4: whole groups of 32
    checkpoint = open_checkpoint(save_hf(hf, tmp_path))
    streamed = build_model(checkpoint, torch.bfloat16, progress=False, quantize=mode)
    afterwards = build_model(checkpoint, torch.bfloat16, progress=False)
    quantize_model(afterwards, mode)
    afterwards.embed_tokens = QuantizedEmbeddingHead.from_float(afterwards.embed_tokens.weight)
    if family == "gemma4":
        table = afterwards.embed_tokens_per_layer.weight
        afterwards.embed_tokens_per_layer = QuantizedEmbedding.from_float(table)
    ours, expected = streamed.state_dict(), afterwards.state_dict()
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name
    assert [type(m) for m in streamed.modules()] == [type(m) for m in afterwards.modules()]


def test_quantized_embedding_groups() -> None:
    """Each group of 32 is an int8 row: |w - q·s| <= s/2 with s >= amax/127 the group's own,
    so a group of small values keeps its precision beside a group of large ones."""
    torch.manual_seed(8)
    weight = torch.randn(10, 96).to(torch.bfloat16)
    weight[:, 32:64] *= 1e-3  # a quiet layer's inputs beside loud ones
    table = QuantizedEmbedding.from_float(weight)
    assert table.codes.dtype == torch.int8 and table.scales.shape == (10, 3)
    dequantized = table.dequantize()
    groups = weight.float().unflatten(-1, (3, 32))
    scales = table.scales.float()[..., None]
    assert (scales >= groups.abs().amax(dim=-1, keepdim=True) / 127).all()
    assert ((dequantized.unflatten(-1, (3, 32)) - groups).abs() <= scales / 2).all()
    ids = torch.tensor([[3, 0, 9]])
    rows = table.embed(ids, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows[0], dequantized[[3, 0, 9]].bfloat16())
    assert table.nbytes == 10 * 96 + 10 * 3 * 2
