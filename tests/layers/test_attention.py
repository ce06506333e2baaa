"""Attention pieces against independent references: masks by hand, decode path against SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hearth.layers.attention import attention_mask, decode_attention


def test_sliding_mask_keeps_window_keys_including_the_query() -> None:
    mask = attention_mask(torch.tensor([5]), torch.arange(7), window=3)
    # q − k < 3 and k ≤ q: keys 3, 4, 5.
    assert mask.tolist() == [[False, False, False, True, True, True, False]]


def test_causal_mask_without_window() -> None:
    mask = attention_mask(torch.tensor([0, 1, 2]), torch.arange(3), window=None)
    assert mask.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_decode_attention_equals_sdpa_with_gqa() -> None:
    """fp32 inputs: both compute softmax(qk^T·s)v exactly up to summation order (1e-6)."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 1, 32, generator=generator)
    k = torch.randn(2, 2, 50, 32, generator=generator)
    v = torch.randn(2, 2, 50, 32, generator=generator)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(decode_attention(q, k, v, 0.3, 50), expected, atol=1e-6, rtol=0)


def test_decode_attention_ignores_zero_padding_past_length() -> None:
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 1, 16, generator=generator)
    k = torch.randn(1, 1, 20, 16, generator=generator)
    v = torch.randn(1, 1, 20, 16, generator=generator)
    padded_k = torch.cat([k, torch.zeros(1, 1, 12, 16)], dim=2)
    padded_v = torch.cat([v, torch.zeros(1, 1, 12, 16)], dim=2)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True)
    ours = decode_attention(q, padded_k, padded_v, 0.25, 20)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=0)
