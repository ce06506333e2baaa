"""Greedy decoding helpers shared by the tests of the native decode paths."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from hearth import native
from hearth.generate import prefill
from hearth.kv.policy import KVPolicy
from tiny import TINY_VOCAB


def greedy_logits(
    model: Any, prompt_length: int, steps: int, policy: KVPolicy | None = None
) -> tuple[list[torch.Tensor], list]:
    """Greedy decode after a random prompt: the prefill's and every step's logits, and the
    caches at the end."""
    generator = torch.Generator().manual_seed(prompt_length)
    ids = torch.randint(4, len(TINY_VOCAB), (1, prompt_length), generator=generator)
    caches = (policy or KVPolicy()).make_caches(model.config)
    with torch.inference_mode():
        logits = [prefill(model, ids, caches, step=64)]
        for step in range(steps):
            token = logits[-1].argmax(dim=-1).reshape(1, 1)
            start = prompt_length + step
            logits.append(model(token, caches, start=start, last_only=True)[:, -1])
    return logits, caches


def native_or_module_decode(
    native_module: ModuleType,
    model: Any,
    prompt_length: int,
    natively: bool,
    monkeypatch: pytest.MonkeyPatch,
    policy: KVPolicy | None = None,
    steps: int = 12,
) -> tuple[list[torch.Tensor], list]:
    """`greedy_logits` on the native layers of `native_module` (`gemma_native`,
    `gemma4_native`) or, not `natively`, on the modules."""
    with monkeypatch.context() as patch:
        if not natively:
            patch.setattr(native_module, "applies", lambda x, caches: False)
        return greedy_logits(model, prompt_length, steps, policy)


def assert_same_caches(first: list, second: list) -> None:
    for a, b in zip(first, second, strict=True):
        assert a.offset == b.offset
        planes = zip(a.contents().stored.planes, b.contents().stored.planes, strict=True)
        assert all(torch.equal(plane_a, plane_b) for plane_a, plane_b in planes)


def count_kernel_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """A list that grows by one at each call of the native kernel `name`."""
    calls: list[int] = []
    kernels = native.kernels()
    assert kernels is not None
    real = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda *a: calls.append(1) or real(*a))
    return calls


def assert_native_layers_are_the_modules(
    decode: Any, model: Any, prompt_length: int, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """Logits at every step and the caches after equal bit for bit, natively and on the
    modules, with every decode layer (and no prefill) taking the native `kernel`."""
    calls = count_kernel_calls(monkeypatch, kernel)
    expected, expected_caches = decode(model, prompt_length, False, monkeypatch)
    assert not calls
    got, got_caches = decode(model, prompt_length, True, monkeypatch)
    assert len(calls) == (len(got) - 1) * len(model.layers)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    assert_same_caches(expected_caches, got_caches)
