"""The scheduler with the batched decode step over block tables (`runtime.batch_graphs`, forced
on the CPU through the plan's `paged_batch_decode`): requests decoded together give each one's
own answer, sampled on the device in one go where they can be.

Tiny Gemma 3 (fp32, sliding window 8, blocks of 4 tokens), six requests of 5 to 30 prompt
tokens decoded together: plain greedy ones (one argmax over all their rows), one asking for
log-probabilities (sampled alone, with its distribution), one with a repetition penalty and one
seeded temperature-1 request (each by its own sampler and generator), in a pool small enough
that the newest are preempted and resumed. Each request's tokens equal its run alone (the
batch-1 step on its own pool) wherever the alone run's top two log-probabilities are more than
`MARGIN` apart: the batched step's attention (the paged reference's fp32 einsum over whole
blocks) sums in another order than one sequence's SDPA, which moves fp32 logits of this model
(std ~2) by ~1e-6; 1e-3 leaves a wide berth.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import hearth
from hearth.kv.paged import KVPool
from hearth.runtime.batch_graphs import BatchDecoder
from hearth.runtime.generate import GenerationChunk, GenerationRequest
from hearth.runtime.sampling import SamplingParams
from hearth.runtime.scheduler import Scheduler
from tiny import save_tiny_with_tokenizer

MARGIN = 1e-3
BLOCK = 4


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    directory: Path = save_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), seed=5)
    with torch.no_grad():
        loaded = hearth.load(directory, dtype="float32", device="cpu", progress=False)
    loaded.runner.plan = replace(
        loaded.runner.plan, prefill_chunk=8, native_layers=False, paged_batch_decode=True
    )
    loaded.runner.native = None
    return loaded


def _pool(engine: Any, full: int) -> KVPool:
    model = engine.model
    policy, dtype = engine.runner.kv_policy, model.compute_dtype
    return KVPool(model.cache_specs(), policy, dtype, [64, full], BLOCK)


def _request(length: int, seed: int, **fields: Any) -> GenerationRequest:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 256, (length,), generator=generator).tolist()
    fields = {"max_tokens": 16, "stop_ids": (), **fields}
    return GenerationRequest(ids, **fields)


def _run(
    engine: Any,
    requests: list[GenerationRequest],
    pool: KVPool,
    preempts: bool = True,
    cancel_after: dict[int, int] | None = None,
) -> list[list[int]]:
    """Every request's tokens (as the scheduler takes them), all submitted at once to a
    scheduler on `pool`; request i cancelled once it made `cancel_after[i]` tokens."""
    scheduler = Scheduler(engine.runner, engine.tokenizer, len(requests), False, pool=pool)
    made: dict[int, list[int]] = {id(request): [] for request in requests}
    accept = scheduler._accept_token

    def recorded(sequence: Any, token: int, distribution: Any) -> None:
        made[id(sequence.request)].append(token)
        accept(sequence, token, distribution)

    scheduler._accept_token = recorded  # type: ignore[method-assign]
    cancel_after = cancel_after or {}
    done = [index in cancel_after for index in range(len(requests))]

    def deliver_to(index: int) -> Any:
        def deliver(chunk: GenerationChunk | BaseException) -> None:
            assert not isinstance(chunk, BaseException), chunk
            done[index] = done[index] or chunk.finish_reason is not None

        return deliver

    def cancelled(index: int) -> bool:
        return index in cancel_after and len(made[id(requests[index])]) >= cancel_after[index]

    for index, request in enumerate(requests):
        scheduler.submit(request, deliver_to(index), lambda i=index: cancelled(i))
    for _ in range(5_000):
        if scheduler.idle:
            break
        scheduler.step()
    assert all(done) and pool.used_blocks == 0
    assert (scheduler.preemptions > 0) == preempts
    return [made[id(request)] for request in requests]


def test_requests_decoded_together_by_the_paged_batch_step_give_each_ones_own_answer(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows: list[int] = []
    step = BatchDecoder.step

    def counted(self: BatchDecoder, sequences: Any, tokens: Any, positions: Any) -> Any:
        rows.append(len(sequences))
        return step(self, sequences, tokens, positions)

    monkeypatch.setattr(BatchDecoder, "step", counted)
    requests = [
        _request(5, 1),
        _request(30, 2),
        _request(12, 3, top_logprobs=2),
        _request(9, 4, sampling=SamplingParams(repetition_penalty=1.3)),
        _request(17, 5, sampling=SamplingParams(temperature=1.0, seed=11)),
        _request(22, 6),
    ]
    # Full layers hold 30 blocks (120 tokens) of the 51 the six reach: some are preempted.
    pool = _pool(engine, 30)
    together = _run(engine, requests, pool)
    assert max(rows) >= 4  # several side by side (the pool never holds all six at once)
    total = 0
    for request, tokens in zip(requests, together, strict=True):
        # Alone: the batch-1 step (not the batched one), with its log-probabilities.
        alone_request = replace(request, top_logprobs=2)
        collected: list[Any] = []
        scheduler = Scheduler(engine.runner, engine.tokenizer, 1, False, pool=_pool(engine, 64))
        scheduler.submit(alone_request, collected.append, lambda: False)
        before = len(rows)
        while not scheduler.idle:
            scheduler.step()
        assert len(rows) == before  # one sequence never takes the batched step on a CPU
        records = [r for chunk in collected for r in (chunk.logprobs or ())]
        assert len(tokens) == len(records) == request.max_tokens
        compared = 0
        for position, record in enumerate(records):
            if record.top_logprobs[0] - record.top_logprobs[1] < MARGIN:
                break  # a near tie: the runs may part here
            assert tokens[position] == record.token, position
            compared += 1
        total += compared
    assert total >= 64  # of 96 tokens (77 here): the comparison stops early only at near ties


def test_a_batch_decoder_lives_no_longer_than_its_pool(engine: Any) -> None:
    """The runner keeps a batch decoder per pool, weakly: once the scheduler and its pool are
    gone, so are the decoder's buffers (a benchmark sizes each level's pool from free memory)."""
    gc.collect()  # the pools of tests before (held in reference cycles) go first
    pool = _pool(engine, 64)
    _run(engine, [_request(6, 1), _request(9, 2)], pool, preempts=False)
    assert len(engine.runner._batch) == 1
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    assert gone() is None and len(engine.runner._batch) == 0


def test_chained_steps_give_the_tokens_of_steps_that_wait_for_the_host(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every row samples on the device (greedy, seeded), a step is launched on the last
    step's samples before the host reads them (`Scheduler._decode_step`). Requests ending at
    different steps (a row's step after its last token is dropped unread) and one cancelled
    midway leave every request's tokens exactly those of steps that each wait for the host:
    both runs take the same batched step over the same rows, so the logits are the same
    floats (no tolerance)."""
    fed_from_device: list[bool] = []
    step = BatchDecoder.step

    def recorded(self: BatchDecoder, sequences: Any, tokens: Any, positions: Any) -> Any:
        fed_from_device.append(isinstance(tokens, torch.Tensor))
        return step(self, sequences, tokens, positions)

    monkeypatch.setattr(BatchDecoder, "step", recorded)
    requests = [
        _request(5, 1, max_tokens=7),
        _request(30, 2, max_tokens=30),
        _request(17, 5, sampling=SamplingParams(temperature=1.0, seed=11), max_tokens=24),
        _request(22, 6, max_tokens=9),
        _request(11, 7, max_tokens=16),  # cancelled after its fourth token
    ]

    def run() -> list[list[int]]:
        return _run(engine, requests, _pool(engine, 64), preempts=False, cancel_after={4: 4})

    chained = run()  # the cancelled request's blocks and the dropped steps' went back
    # After the admissions (each prefill step settles the step in flight), the steps chain
    # but where a request ended or left on the last step.
    assert sum(fed_from_device) >= 10
    monkeypatch.setattr(engine.runner, "takes_device_tokens", lambda caches: False)
    fed_from_device.clear()
    waited = run()
    assert not any(fed_from_device)
    assert chained == waited
    # A chain broken every other step (the step in flight then taken after an unchained one).
    calls = iter(range(10_000))
    monkeypatch.setattr(engine.runner, "takes_device_tokens", lambda caches: next(calls) % 2 == 0)
    fed_from_device.clear()
    alternating = run()
    assert any(fed_from_device) and alternating[:4] == waited[:4]
    # An unchained step takes two tokens (its own and the one in flight): the cancelled
    # request may stop a token later.
    assert alternating[4][:4] == waited[4][:4]
    assert [len(tokens) for tokens in chained] == [7, 30, 24, 9, len(chained[4])]
    assert 4 <= len(chained[4]) < 16
