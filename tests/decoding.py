"""Greedy decoding helpers shared by the tests of the native decode paths."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from hearth.kv.policy import KVPolicy
from hearth.ops import native
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.runner import ModelRunner
from tiny import TINY_VOCAB


def random_prompt(length: int, seed: int) -> torch.Tensor:
    """Token ids [1, length] of the tiny vocabulary (past its 4 special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, len(TINY_VOCAB), (1, length), generator=generator)


def greedy_after(runner: ModelRunner, prompt: torch.Tensor, steps: int) -> tuple[list, list]:
    """Greedy decode after `prompt` [1, T]: the prefill's and every step's logits, and the
    caches at the end."""
    caches = runner.new_caches()
    with torch.inference_mode():
        logits = [runner.prefill(prompt, caches, chunk=64)]
        for step in range(steps):
            token = int(logits[-1].argmax(dim=-1))
            logits.append(runner.decode(token, caches, prompt.shape[1] + step))
    return logits, caches


def greedy_logits(runner: ModelRunner, prompt_length: int, steps: int) -> tuple[list, list]:
    """`greedy_after` a random prompt of `prompt_length` tokens (seeded by its length)."""
    return greedy_after(runner, random_prompt(prompt_length, prompt_length), steps)


def native_or_module_decode(
    model: Any,
    prompt_length: int,
    natively: bool,
    policy: KVPolicy | None = None,
    steps: int = 12,
) -> tuple[list[torch.Tensor], list]:
    """`greedy_logits` of a runner whose plan runs decode steps as native layers, or, not
    `natively`, through the modules."""
    plan = replace(ExecutionPlan.for_device(model.device), native_layers=natively)
    return greedy_logits(ModelRunner(model, plan, policy), prompt_length, steps)


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
    expected, expected_caches = decode(model, prompt_length, False)
    assert not calls
    got, got_caches = decode(model, prompt_length, True)
    assert len(calls) == (len(got) - 1) * len(model.layers)
    for step, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    assert_same_caches(expected_caches, got_caches)
