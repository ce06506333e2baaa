"""The layer cache, full-attention and ring: storage arithmetic, trim, and logits against full
recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.kv import LayerCache, make_caches
from hearth.models.loading import build_model
from tiny import save_hf, tiny_gemma3_model


def _kv(tokens: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys whose every element is the token's position, so reads show what was stored."""
    positions = torch.arange(start, start + tokens, dtype=torch.float32)
    keys = positions.view(1, 1, tokens, 1).expand(1, 2, tokens, 4).contiguous()
    return keys, -keys


def test_dense_cache_grows_and_trims() -> None:
    cache = LayerCache(step=4)
    cache.update_and_fetch(*_kv(6))
    view = cache.update_and_fetch(*_kv(1, start=6))
    keys, values = view.real()
    assert view.positions is None and keys[0, 0, :, 0].tolist() == list(range(7))
    assert torch.equal(values, -keys)
    # Storage grew to 8 (two steps of 4); the padding row is zero.
    assert view.keys.shape[2] == 8 and view.keys[0, 0, 7].abs().sum() == 0
    # 7 tokens × 2 heads × 4 dims × 4 bytes, for K and V.
    assert cache.nbytes == 7 * 2 * 4 * 4 * 2
    cache.trim(3)
    keys, _ = cache.update_and_fetch(*_kv(1, start=4)).real()
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]


def test_rotating_cache_prefill_longer_than_window_returns_all_then_keeps_window() -> None:
    cache = LayerCache(window=4)
    view = cache.update_and_fetch(*_kv(10))
    # A fresh prompt attends over every new token, keys 0..9 in order (the mask, made from
    # the queries' positions, applies the window).
    assert view.positions is None and view.length == 10
    view = cache.update_and_fetch(*_kv(1, start=10))
    # A decode step on a full ring reads exactly the window, so it needs no mask.
    assert view.positions is None and view.length == 4
    assert sorted(view.keys[0, 0, :, 0].tolist()) == [7, 8, 9, 10]
    assert cache.nbytes == 4 * 2 * 4 * 4 * 2


def test_rotating_cache_prefill_attends_only_over_filled_slots() -> None:
    """Before the ring wraps, a prefill chunk's view holds the stored tokens and the new ones
    (no empty slots); once it has wrapped, the whole ring and the new ones."""
    cache = LayerCache(window=6)
    view = cache.update_and_fetch(*_kv(3))  # a fresh prompt: nothing stored yet
    assert view.length == 3 and view.positions is None
    assert view.keys[0, 0, :, 0].tolist() == [0, 1, 2]
    view = cache.update_and_fetch(*_kv(2, start=3))
    assert view.positions.tolist() == [0, 1, 2, 3, 4]
    assert view.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    cache.update_and_fetch(*_kv(3, start=5))  # 8 tokens in a ring of 6: wrapped
    view = cache.update_and_fetch(*_kv(2, start=8))
    assert view.length == 6 + 2 and sorted(view.positions.tolist()) == list(range(2, 10))
    assert torch.equal(view.keys[0, 0, :, 0], view.positions.float())


def test_rotating_cache_trim_within_and_beyond_the_ring() -> None:
    cache = LayerCache(window=6)
    cache.update_and_fetch(*_kv(8))  # the ring holds 2..7
    cache.trim(1)  # the next query at 7 needs 2..6: still held
    cache.update_and_fetch(*_kv(1, start=7))
    held = cache.contents().positions
    assert sorted(p for p in held.tolist() if p < 100) == [2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="no longer holds"):
        cache.trim(5)


def test_rotating_cache_logits_equal_full_recompute_past_the_window(tmp_path: Path) -> None:
    """Window 8; a 20-token prefill, then 20 decode steps, each compared with a cache-free
    forward over the whole sequence (the full-recompute reference). fp32; tolerance 2e-5 as
    in test_gemma3_tiny (summation order only)."""
    hf = tiny_gemma3_model(seed=11, layer_types=["sliding_attention"] * 4)
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, progress=False)
    ids = torch.randint(4, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    caches = make_caches(model.cache_specs())
    assert all(c.window is not None for c in caches)
    with torch.inference_mode():
        reference = model(ids)
        model(ids[:, :20], caches)
        for position in range(20, 40):
            step = model(ids[:, position : position + 1], caches, start=position)
            torch.testing.assert_close(step[0, 0], reference[0, position], atol=2e-5, rtol=0)
