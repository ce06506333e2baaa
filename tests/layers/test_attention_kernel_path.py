"""The model's GPU decode-attention path (Triton kernel over the cache's planes), run in
Triton's interpreter on CPU, against the torch path, through every cache kind the model
decodes with: dynamic dense/rotating (positions implicit), static ring and full caches, and
static quantized caches whose planes the kernel reads without decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
# On a GPU machine the kernel runs for real on CUDA tensors (tests/runtime/test_graph_decoder.py's
# GPU tests); this file drives it through the interpreter on CPU tensors, as CI does.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter path; the GPU runs the kernel itself"
)

from hearth.checkpoint import open_checkpoint  # noqa: E402
from hearth.kv import make_caches, parse_kv_quant  # noqa: E402
from hearth.kv.cache import LayerCache  # noqa: E402
from hearth.layers import attention as gemma  # noqa: E402
from hearth.models.loading import build_model  # noqa: E402
from tiny import GEMMA4_SHARING, save_hf, tiny_gemma3_model, tiny_gemma4_model  # noqa: E402

# fp32 throughout: kernel and torch differ by summation order and exp2 vs exp (the kernel
# tests bound that at 2e-5 per output); through a few layers and the head, logits of size
# ~1 stay within 1e-4.
ATOL = 1e-4
PROMPT, STEPS = 20, 6


def _caches(model: torch.nn.Module, kind: str, scheme: str) -> list:
    policy = parse_kv_quant(scheme, group_size=32)
    if kind == "dynamic":
        return make_caches(model.cache_specs(), policy)
    return [
        LayerCache.pinned_at(64, spec.window, policy.codec_of(spec.index))
        for spec in model.cache_specs()
    ]


def _tiny_model(family: str, tmp_path: Path) -> tuple[torch.nn.Module, torch.Tensor]:
    """A tiny fp32 Gemma 3 or Gemma 4 (KV sharing) model and the ids the tests decode."""
    hf = (
        tiny_gemma3_model(seed=8, head_dim=32)
        if family == "gemma3"
        else tiny_gemma4_model(3, **GEMMA4_SHARING)
    )
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, "cpu", False)
    ids = torch.randint(4, 256, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    return model, ids


def _decode(model: torch.nn.Module, ids: torch.Tensor, caches: list) -> torch.Tensor:
    with torch.inference_mode():
        model(ids[:, :PROMPT], caches)
        steps = [
            model(ids[:, p : p + 1], caches, start=torch.tensor(p))
            for p in range(PROMPT, PROMPT + STEPS)
        ]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize(
    ("family", "kind", "scheme"),
    [
        ("gemma3", "dynamic", "off"),
        ("gemma3", "static", "off"),
        ("gemma3", "static", "8"),
        ("gemma3", "static", "turbo:k8v3"),
        ("gemma4", "dynamic", "off"),
        ("gemma4", "static", "turbo:t4v3"),
    ],
)
def test_kernel_path_matches_torch_path(
    family: str, kind: str, scheme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, ids = _tiny_model(family, tmp_path)
    expected = _decode(model, ids, _caches(model, kind, scheme))
    calls = []
    kernel = gemma._kernel_decode_attention

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return kernel(*args, **kwargs)

    # The GPU dispatch, on CPU tensors: only attention switches (the other fused kernels
    # have their own tests), and the prompt still goes through SDPA.
    monkeypatch.setattr(gemma, "kernel_enabled", lambda tensor: True)
    monkeypatch.setattr(gemma, "_kernel_decode_attention", counted)
    got = _decode(model, ids, _caches(model, kind, scheme))
    assert len(calls) >= STEPS
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("queries", "keys", "window"),
    [
        (12, 12, None),
        (12, 12, 12),
        (12, 12, 5),
        (4, 12, None),
        (4, 12, 6),
        (1, 12, None),
        (1, 12, 5),
    ],
)
def test_gpu_prefill_dispatch_matches_masked_sdpa(
    queries: int, keys: int, window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multi-query attention on the GPU path takes SDPA's is_causal only where that mask is
    ours (queries = keys 0..S-1, window not binding), else the position-masked kernel; both
    must equal the CPU path's SDPA with our explicit mask. fp32; the paths differ only by
    summation order (1e-6 on outputs of size ~1)."""
    from hearth.kv.cache import KVView

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, queries, 16, generator=generator)
    k, v = (torch.randn(1, 2, keys, 16, generator=generator) for _ in range(2))
    view = KVView(k, v, keys, None)
    positions = torch.arange(keys - queries, keys)
    expected = gemma.attend(q, view, positions, window, 0.25)
    monkeypatch.setattr(gemma, "kernel_enabled", lambda tensor: True)
    got = gemma.attend(q, view, positions, window, 0.25)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_kv_sharing_prefill_last_token_keeps_the_window(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A last-token-only prefill: Gemma 4's KV-sharing layers run one query over their
    donor's whole first chunk (20 keys, window 8). On the GPU path that query went through
    the decode kernel with the window dropped; its logits must equal the torch path's."""
    model, ids = _tiny_model("gemma4", tmp_path)
    assert model.config.sliding_window < PROMPT
    with torch.inference_mode():
        expected = model(ids[:, :PROMPT], _caches(model, kind, "off"), last_only=True)
        monkeypatch.setattr(gemma, "kernel_enabled", lambda tensor: True)
        got = model(ids[:, :PROMPT], _caches(model, kind, "off"), last_only=True)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
