"""`kv.footprint.KVFootprint` against the caches themselves: for each layout, the most bytes
the caches `make_caches` builds allocate (`reserved_bytes`, summed over layers) while a
context grows to T tokens must equal the prediction, to the byte."""

from __future__ import annotations

import pytest
import torch

from hearth.config import parse_config
from hearth.kv import parse_kv_quant
from hearth.kv.cache import GROWTH_STEP
from hearth.kv.footprint import KVFootprint, token_bytes
from hearth.kv.policy import KVPolicy
from hearth.models import cache_specs
from tiny import tiny_gemma3_config, tiny_gemma4_config

BF16 = torch.bfloat16


def _configs() -> dict[str, object]:
    return {
        "gemma3": parse_config(tiny_gemma3_config().to_dict()),
        # 6 layers, the last 2 sharing K/V (no caches of their own); head dims 32 and 64
        "gemma4-shared-kv": parse_config(
            tiny_gemma4_config(
                num_hidden_layers=6,
                layer_types=["sliding_attention", "full_attention"] * 3,
                num_kv_shared_layers=2,
                head_dim=32,
                global_head_dim=64,
            ).to_dict()
        ),
    }


def _peak_reserved(config: object, policy: KVPolicy, tokens: int, chunk: int) -> int:
    """Run `tokens` random tokens through fresh caches in chunks; the largest total."""
    caches, specs = policy.make_caches(cache_specs(config)), cache_specs(config)
    peak, done = 0, 0
    while done < tokens:
        count = min(chunk, tokens - done)
        for cache, spec in zip(caches, specs, strict=True):
            shape = (1, spec.kv_heads, count, spec.head_dim)
            cache.update_and_fetch(torch.randn(shape, dtype=BF16), torch.randn(shape, dtype=BF16))
        done += count
        peak = max(peak, sum(cache.reserved_bytes for cache in caches))
    return peak


@pytest.mark.parametrize("config_name", ["gemma3", "gemma4-shared-kv"])
@pytest.mark.parametrize("kv_quant", ["off", "4", "8", "turbo:k8v3", "4@full"])
@pytest.mark.parametrize("tokens", [1, 7, 40, GROWTH_STEP + 3])
def test_predicted_bytes_equal_what_the_caches_allocate(
    config_name: str, kv_quant: str, tokens: int
) -> None:
    config = _configs()[config_name]
    policy = parse_kv_quant(kv_quant, group_size=32)
    measured = _peak_reserved(config, policy, tokens, chunk=32)
    assert KVFootprint.of(cache_specs(config), BF16, policy).bytes_at(tokens) == measured


def test_hand_derived_bytes_of_a_sliding_and_a_full_layer() -> None:
    """Tiny Gemma 3: 2 full and 2 sliding layers (window 8), 2 KV heads of 32 dims."""
    config = _configs()["gemma3"]
    per_token = 2 * 2 * 32 * 2  # K and V, heads, dims, bf16
    assert token_bytes(parse_kv_quant("off").codec, 2, 32, BF16) == per_token
    slot = per_token + 8  # and an int64 position a slot
    for tokens, full_slots in ((1, 256), (256, 256), (257, 512)):
        expected = 2 * full_slots * slot + 2 * 8 * slot  # the rings hold their window of 8
        assert KVFootprint.of(cache_specs(config), BF16).bytes_at(tokens) == expected
    assert KVFootprint.of(cache_specs(config), BF16).bytes_at(0) == 0
