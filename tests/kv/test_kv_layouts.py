"""Quantized KV caches: affine (MLX layout) and TurboQuant, against mlx and the dense cache.

* Affine K/V read back through the cache equal `mx.dequantize(mx.quantize(x))` bit for bit.
* TurboQuant codec: the rotation is orthonormal and self-inverse up to its sign diagonal,
  bit-packing is exact, and the codebooks reach the Lloyd–Max MSE of N(0, 1).
* Every `--kv-quant` kind on a tiny Gemma 3 (sliding + full layers) and a tiny Gemma 4 with KV
  sharing, through a prompt longer than the window of 8, decode steps and a trim: logits stay
  within a per-kind bound of the dense cache's, in units of the dense logits' std (≈4.4 on
  both models). Bounds are ~1.5-2x the measured maxima (seeded, deterministic); for scale,
  decoding TurboQuant values without the inverse rotation moves logits by 2.8 std.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.config import ModelConfig, parse_config
from hearth.kv import AffineCodec, CacheSpec, KVPolicy, LayerCache, make_caches, parse_kv_quant
from hearth.models import cache_specs
from hearth.models.loading import build_model
from hearth.quant.mlx import pack_codes, unpack_codes
from hearth.quant.turbo import (
    CODEBOOKS,
    decode_rotated,
    dequantize_normal,
    encode_rotated,
    hadamard,
    quantize_normal,
    random_signs,
    rotate,
    unrotate,
)
from tiny import (
    FULL,
    GEMMA4_SHARING,
    SLIDING,
    save_hf,
    tiny_gemma3_config,
    tiny_gemma3_model,
    tiny_gemma4_model,
)

KINDS = ["8", "4", "turbo:k8v4", "turbo:k8v3", "turbo:k4v3", "turbo:t4v3", "turbo:k8v2"]
# Max |logit - dense logit| / std(dense logits). Measured (Gemma 3, Gemma 4): 8: .019, .026;
# 4: .24, .42; k8v4: .19, .15; k8v3: .30, .28; k4v3: .35, .49; t4v3: .32, .58; k8v2: .65, .64.
LOGIT_BOUNDS = {
    "8": 0.05,
    "4": 0.7,
    "turbo:k8v4": 0.4,
    "turbo:k8v3": 0.6,
    "turbo:k4v3": 0.8,
    "turbo:t4v3": 0.9,
    "turbo:k8v2": 1.0,
}
# Lloyd–Max MSE of N(0, 1) at 1-4 bits (Max 1960), to the digits given.
LLOYD_MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}
PROMPT, TOTAL = 20, 32


def _kv(tokens: int, dtype: torch.dtype, dim: int = 64, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, tokens, dim, generator=generator).to(dtype)


def _mlx_roundtrip(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    array = mx.array(x.float().numpy()).astype(
        mx.bfloat16 if x.dtype == torch.bfloat16 else mx.float32
    )
    packed, scales, biases = mx.quantize(array, group_size=group_size, bits=bits)
    restored = mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    return torch.from_numpy(np.array(restored.astype(mx.float32))).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Affine layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (4, 64), (8, 32), (8, 64)])
def test_affine_cache_reads_back_mx_dequantize_bit_for_bit(
    bits: int, group_size: int, dtype: torch.dtype
) -> None:
    keys, values = _kv(9, dtype), -_kv(9, dtype, seed=1)
    cache = LayerCache(codec=AffineCodec(bits, group_size), step=8)
    prefill = cache.update_and_fetch(keys[:, :, :8], values[:, :, :8])
    # The prefill itself attends over exact K/V, then it is quantized.
    assert torch.equal(prefill.real()[0], keys[:, :, :8])
    view = cache.update_and_fetch(keys[:, :, 8:], values[:, :, 8:])
    read_keys, read_values = view.real()
    assert torch.equal(read_keys, _mlx_roundtrip(keys, bits, group_size))
    assert torch.equal(read_values, _mlx_roundtrip(values, bits, group_size))
    assert view.keys.shape[2] == 16 and not view.keys[:, :, 9:].any()  # zero padding
    assert cache.signature() == f"full:affine:b{bits}:g{group_size}"


def test_rotating_quantized_ring_holds_mx_quantized_tokens_and_trims() -> None:
    keys = _kv(10, torch.float32)
    cache = LayerCache(window=6, codec=AffineCodec(4, 32))
    cache.update_and_fetch(keys, keys)
    cache.trim(1)  # the ring holds 4..9; the next query at 9 needs 4..8
    step = _kv(1, torch.float32, seed=5)
    view = cache.update_and_fetch(step, step)
    assert view.positions is None and view.length == 6  # every slot visible to the query
    expected = _mlx_roundtrip(torch.cat([keys[:, :, :9], step], dim=2), 4, 32)
    held = cache.contents().positions.tolist()
    assert sorted(held) == [4, 5, 6, 7, 8, 9]
    for slot, position in enumerate(held):
        assert torch.equal(view.keys[:, :, slot], expected[:, :, position])
    assert cache.signature() == "ring:affine:b4:g32"


def test_rotation_is_orthonormal_and_self_inverse_up_to_signs() -> None:
    dim = 128
    matrix = rotate(torch.eye(dim))  # row i is the image of e_i
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(dim), atol=1e-6, rtol=0)
    x = torch.randn(5, 3, dim)
    torch.testing.assert_close(hadamard(hadamard(x)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(unrotate(rotate(x)), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(rotate(x), hadamard(x * random_signs(dim)), atol=0, rtol=0)
    # Sylvester order: H[0] is all ones, H[1] alternates.
    first_rows = hadamard(torch.eye(dim)[:2]) * dim**0.5
    expected = torch.stack([torch.ones(dim), torch.tensor([1.0, -1.0]).repeat(dim // 2)])
    torch.testing.assert_close(first_rows, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packing_is_exact_and_lsb_first(bits: int) -> None:
    generator = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 64), generator=generator, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 64 * bits // 32)
    assert torch.equal(unpack_codes(packed, bits), codes)
    # Code i occupies bits i·b .. i·b+b-1 of the row's little-endian bit stream.
    stream = sum(int(code) << (index * bits) for index, code in enumerate(codes[0].tolist()))
    assert packed[0].numpy().tobytes() == stream.to_bytes(64 * bits // 8, "little")


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_mse_on_normal_data_is_lloyd_max(bits: int) -> None:
    """2^20 samples: the sample mean's std is std(e²)/√n (≈4e-4 at 1 bit, 1e-5 at 4 bits);
    the bound is 5 of those plus the rounding of the published value."""
    samples = torch.randn(1 << 20, generator=torch.Generator().manual_seed(bits))
    squared = (samples - dequantize_normal(quantize_normal(samples, bits), bits)) ** 2
    tolerance = 5 * squared.std().item() / len(samples) ** 0.5 + 1e-4 * LLOYD_MAX_MSE[bits]
    assert abs(squared.mean().item() - LLOYD_MAX_MSE[bits]) < tolerance


def test_three_bit_codebook_matches_the_reference_tables() -> None:
    centroids, boundaries = CODEBOOKS[3]
    published = [0.24509, 0.75601, 1.34391, 2.15195]
    torch.testing.assert_close(centroids[4:], torch.tensor(published), atol=6e-6, rtol=0)
    torch.testing.assert_close(
        boundaries[4:], torch.tensor([0.50055, 1.04996, 1.74793]), atol=6e-6, rtol=0
    )


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_rotated_value_codec_mse_near_lloyd_max(bits: int) -> None:
    """Dividing each 32-group by its own RMS makes the coded coordinates slightly lighter-tailed
    than N(0, 1), which the codebook serves a little better: measured 5-6 % below the Lloyd–Max
    MSE at 2, 3 and 4 bits (0.1115, 0.0325, 0.00891). Bounds: -10 % to +5 %."""
    x = torch.randn(2048, 128, generator=torch.Generator().manual_seed(7))
    packed, sigma = encode_rotated(x, bits)
    assert packed.dtype == torch.uint32 and packed.shape == (2048, 128 * bits // 32)
    assert sigma.dtype == torch.float16 and sigma.shape == (2048, 4)
    mse = (decode_rotated(packed, sigma, bits, torch.float32) - x).square().mean().item()
    assert LLOYD_MAX_MSE[bits] * 0.90 < mse < LLOYD_MAX_MSE[bits] * 1.05


# ---------------------------------------------------------------------------------------------
# Caches in models


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    gemma3 = tiny_gemma3_model(seed=3, head_dim=64)
    with torch.no_grad():  # logits of std ~4, as in tiny Gemma 4, so errors show in them
        gemma3.model.embed_tokens.weight.normal_(0.0, 0.5)
    built = {}
    for name, hf in (("gemma3", gemma3), ("gemma4", tiny_gemma4_model(3, **GEMMA4_SHARING))):
        directory = save_hf(hf, tmp_path_factory.mktemp(name))
        built[name] = build_model(open_checkpoint(directory), torch.float32, progress=False)
    return built


def _logits_through_trim(model: Any, policy: KVPolicy, ids: torch.Tensor) -> torch.Tensor:
    """Prefill, decode to the end, trim the last token and decode it again; every step's logits."""
    caches = make_caches(model.cache_specs(), policy)

    def decode(position: int) -> torch.Tensor:
        return model(ids[:, position : position + 1], caches, start=position)[0, 0]

    steps = [model(ids[:, :PROMPT], caches)[0, -1], *map(decode, range(PROMPT, TOTAL))]
    for cache in caches:
        cache.trim(1)
    return torch.stack([*steps, decode(TOTAL - 1)])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model_name", ["gemma3", "gemma4"])
def test_every_kind_tracks_dense_logits(models: dict[str, Any], model_name: str, kind: str) -> None:
    model = models[model_name]
    ids = torch.randint(4, 256, (1, TOTAL), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        dense = _logits_through_trim(model, KVPolicy(), ids)
        quantized = _logits_through_trim(model, parse_kv_quant(kind, group_size=32), ids)
    error = (quantized - dense).abs().max().item() / dense.std().item()
    assert error < LOGIT_BOUNDS[kind], f"{kind}: {error:.3f} std"
    # After the trim, the re-decoded last token reads what the first decode of it read.
    assert torch.equal(quantized[-1], quantized[-2])


def test_policy_quantizes_sliding_and_full_layers(models: dict[str, Any]) -> None:
    config = models["gemma4"].config
    caches = parse_kv_quant("turbo:k4v3").make_caches(cache_specs(config))
    assert len(caches) == 4  # the two KV-sharing layers read their donors' caches
    for cache in caches:
        cache.update_and_fetch(*(_kv(1, torch.float32, dim=64),) * 2)
    # Layer head_dims: sliding 32, full 64; the ring keeps its window, quantized.
    assert [c.signature() for c in caches] == [
        "ring:turbo:k4v3",
        "ring:turbo:k4v3",
        "full:turbo:k4v3",
        "ring:turbo:k4v3",
    ]


def test_full_only_policy_keeps_sliding_layers_dense(models: dict[str, Any]) -> None:
    config = models["gemma4"].config
    caches = parse_kv_quant("turbo:k4v3@full").make_caches(cache_specs(config))
    for cache in caches:
        cache.update_and_fetch(*(_kv(1, torch.float32, dim=64),) * 2)
    signatures = [c.signature() for c in caches]
    assert signatures == ["ring:dense", "ring:dense", "full:turbo:k4v3", "ring:dense"]
    for bad in ("off@full", "config@full", "4@ful"):
        with pytest.raises(ValueError, match="--kv-quant"):
            parse_kv_quant(bad)


# ---------------------------------------------------------------------------------------------
# Bytes, kv_config.json, errors


def _bytes_per_head(kind: str, dim: int, element: int) -> int:
    """The layout arithmetic, per token and KV head, K plus V."""
    groups32 = dim // 32
    if kind in ("4", "8"):
        bits = int(kind)
        return 2 * (dim * bits // 8 + 2 * (dim // 64) * element)
    key, value = kind.removeprefix("turbo:").split("v")
    key_bits = int(key[1])
    # Affine keys: a scale and a bias per group in the model dtype; codebook keys: an fp16 σ.
    key_scales = 2 * groups32 * element if key[0] == "k" else 2 * groups32
    return dim * key_bits // 8 + key_scales + dim * int(value) // 8 + 2 * groups32


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_per_token_equal_the_layout_arithmetic(kind: str) -> None:
    policy = parse_kv_quant(kind)
    full, sliding = (
        policy(CacheSpec(0, FULL, 1, 128, None)),
        policy(CacheSpec(1, SLIDING, 1, 128, 8)),
    )
    keys = _kv(11, torch.bfloat16, dim=128)
    for cache in (full, sliding):
        cache.update_and_fetch(keys, keys)
        cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])
    per_token = 2 * _bytes_per_head(kind, 128, 2)  # 2 KV heads
    assert full.nbytes == 12 * per_token
    assert sliding.nbytes == 8 * per_token
    if kind == "turbo:k8v3":
        assert per_token == 2 * 200  # the reference's 200 bytes per head at d=128, bf16


def test_kv_config_json_sets_bits_per_layer(tmp_path: Path) -> None:
    entries = [
        {"layer_idx": 1, "bits": 8, "group_size": 32},
        {"layer_idx": 3, "bits": 4, "group_size": 64},
    ]
    (tmp_path / "kv_config.json").write_text(json.dumps(entries))
    config = _gemma3_config(head_dim=64)
    caches = parse_kv_quant("config", checkpoint=tmp_path).make_caches(cache_specs(config))
    for cache in caches:
        cache.update_and_fetch(*(_kv(1, torch.float32),) * 2)
    assert [c.signature() for c in caches] == [
        "ring:dense",
        "full:affine:b8:g32",
        "ring:dense",
        "full:affine:b4:g64",
    ]


def _gemma3_config(**overrides: Any) -> ModelConfig:
    return parse_config(tiny_gemma3_config(**overrides).to_dict())


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ("5", "unknown --kv-quant"),
        ("turbo:", "unknown --kv-quant"),
        ("turbo:k8v5", "value bits"),
        ("turbo:k2v3", "TurboQuant keys"),
        ("turbo:x8v3", "unknown TurboQuant scheme"),
        ("config", "kv_config.json"),
    ],
)
def test_invalid_choices_are_refused(choice: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_kv_quant(choice)


@pytest.mark.parametrize(
    ("choice", "head_dim", "message"),
    [
        ("4", 32, "multiple of it"),
        ("turbo", 48, "power of two"),
        ("turbo:k8v4", 16, "power of two"),
    ],
)
def test_head_dims_a_layout_cannot_store_are_refused_at_start(
    choice: str, head_dim: int, message: str
) -> None:
    with pytest.raises(ValueError, match=f"layer 0: .*{message}"):
        parse_kv_quant(choice).check(cache_specs(_gemma3_config(head_dim=head_dim)))
