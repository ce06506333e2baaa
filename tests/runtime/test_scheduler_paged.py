"""The scheduler on the paged K/V pool, on a tiny Gemma 3 (fp32, sliding window 8, blocks of
4 tokens): preemption when the pool runs out, cancellation, refusal, block sharing by
reference count and the sliding-window-safe prefix cache.

Greedy tokens are compared with the same request run alone wherever the alone run's top two
log-probabilities are more than `MARGIN` apart: a batched forward (and a preempted request's
recomputed prefill) sums in another order than one sequence's decode, which moves fp32 logits
of this model (std ~2) by ~1e-6; 1e-3 leaves a wide berth.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import hearth
import test_scheduler
from hearth.checkpoint import open_checkpoint
from hearth.kv.paged import KVPool
from hearth.models.loading import build_model
from hearth.ops import native
from hearth.runtime.generate import GenerationRequest
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from hearth.runtime.scheduler import Scheduler
from tiny import save_tiny_with_tokenizer

MARGIN = 1e-3
BLOCK = 4


class Collector(test_scheduler.Collector):
    """test_scheduler's collector, with each token's log-probability record and the stats."""

    @property
    def records(self) -> list[Any]:
        return [r for c in self.chunks for r in (c.logprobs or ())]

    @property
    def stats(self) -> Any:
        return self.chunks[-1].stats


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="module")
def engine(directory: Path) -> Any:
    with torch.no_grad():
        loaded = hearth.load(directory, dtype="float32", device="cpu", progress=False)
    loaded.runner.plan = replace(loaded.runner.plan, prefill_chunk=8)
    return loaded


def _pool(engine: Any, sliding: int, full: int) -> KVPool:
    model = engine.model
    return KVPool(
        model.cache_specs(), engine.runner.kv_policy, model.compute_dtype, [sliding, full], BLOCK
    )


def _scheduler(engine: Any, max_running: int, pool: KVPool, prefix: bool = True) -> Scheduler:
    return Scheduler(engine.runner, engine.tokenizer, max_running, prefix, pool=pool)


def _request(length: int, seed: int, max_tokens: int = 16, **fields: Any) -> GenerationRequest:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 256, (length,), generator=generator).tolist()
    return GenerationRequest(ids, max_tokens=max_tokens, stop_ids=(), top_logprobs=2, **fields)


def _run(scheduler: Scheduler, limit: int = 5_000) -> None:
    for _ in range(limit):
        if scheduler.idle:
            return
        scheduler.step()
    raise AssertionError("the scheduler did not finish")


def _alone(engine: Any, request: GenerationRequest) -> Collector:
    collector = Collector()
    scheduler = _scheduler(engine, 1, _pool(engine, 64, 64), prefix=False)
    scheduler.submit(request, collector, lambda: False)
    _run(scheduler)
    return collector


def _assert_same_clear_tokens(got: Collector, alone: Collector) -> int:
    assert got.done and got.error is None
    compared = 0
    for position, record in enumerate(alone.records):
        if record.top_logprobs[0] - record.top_logprobs[1] < MARGIN:
            break  # a near tie: the runs may part here
        assert got.tokens[position] == record.token, position
        compared += 1
    return compared


def test_an_exhausted_pool_preempts_the_newest_request_which_resumes_identically(
    engine: Any,
) -> None:
    """Four requests of 10-14 prompt tokens and 16 new ones in a pool whose full layers hold 24
    blocks (96 tokens): they cannot all reach their length at once, so the newest are
    preempted and resumed; each one's tokens (greedy, and a seeded sampled one) equal its
    run alone, and every block goes back at the end."""
    sampled = SamplingParams(temperature=1.0, seed=11)
    requests = [
        _request(10, 1),
        _request(14, 2),
        _request(12, 3, sampling=sampled),
        _request(11, 4),
    ]
    pool = _pool(engine, 64, 24)
    scheduler = _scheduler(engine, 4, pool, prefix=False)
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        scheduler.submit(request, collector, lambda: False)
    _run(scheduler)
    assert scheduler.preemptions > 0
    compared = 0
    for request, collector in zip(requests, collectors, strict=True):
        alone = _alone(engine, request)
        assert len(collector.tokens) == len(alone.tokens) == 16
        if request.sampling.temperature:
            assert collector.tokens == alone.tokens  # its random state went along
        else:
            compared += _assert_same_clear_tokens(collector, alone)
    assert compared > 0.8 * 3 * 16
    assert pool.used_blocks == 0


def test_a_cancelled_request_frees_its_blocks_at_once(engine: Any) -> None:
    pool = _pool(engine, 64, 64)
    scheduler = _scheduler(engine, 2, pool, prefix=False)
    gone = {"flag": False}
    leaving, staying = Collector(), Collector()
    scheduler.submit(_request(20, 1, max_tokens=30), leaving, lambda: gone["flag"])
    scheduler.submit(_request(6, 2, max_tokens=30), staying, lambda: False)
    for _ in range(8):
        scheduler.step()
    full = pool.pools[1]
    before = full.used_blocks
    gone["flag"] = True
    scheduler.step()
    # The leaving request held ceil(its stored tokens / 4) full blocks; the step after its
    # cancel may take one more block for the other.
    assert full.used_blocks <= before - 5 + 1
    _run(scheduler)
    assert staying.done and not leaving.done and pool.used_blocks == 0


def test_a_request_that_could_never_fit_the_pool_is_refused(engine: Any) -> None:
    """24 full blocks hold 96 tokens: 90 of prompt and 10 new ones can never fit."""
    scheduler = _scheduler(engine, 2, _pool(engine, 64, 24))
    with pytest.raises(ValueError, match="can never fit the K/V pool"):
        scheduler.submit(_request(90, 1, max_tokens=10), Collector(), lambda: False)
    scheduler.submit(_request(80, 1, max_tokens=10), Collector(), lambda: False)
    assert len(scheduler.waiting) == 1


def test_prefix_blocks_are_shared_and_freed_by_reference_count(engine: Any) -> None:
    """Two requests with one 22-token prefix: the second, admitted after the first's prefill,
    shares its 5 full blocks (20 tokens) instead of computing them; both reach their own
    answers; the shared blocks are released by each, cached after the last."""
    prefix = _request(22, 7).prompt_ids
    first = replace(_request(3, 8), prompt_ids=[*prefix, 40, 41, 42])
    second = replace(_request(3, 9), prompt_ids=[*prefix, 50, 51])
    pool = _pool(engine, 64, 64)
    scheduler = _scheduler(engine, 2, pool)
    one, two = Collector(), Collector()
    scheduler.submit(first, one, lambda: False)
    for _ in range(3):  # the first's 25 tokens take 4 chunks of 8 with decode steps between
        scheduler.step()
    scheduler.submit(second, two, lambda: False)
    _run(scheduler)
    assert two.stats.cached_tokens == 20 and one.stats.cached_tokens == 0
    full = pool.pools[1]
    assert full.used_blocks == 0 and full.cached_blocks >= 5
    for request, collector in ((first, one), (second, two)):
        assert _assert_same_clear_tokens(collector, _alone(engine, request)) >= 8


def test_shared_blocks_are_counted_while_both_hold_them(engine: Any) -> None:
    pool = _pool(engine, 64, 64)
    scheduler = _scheduler(engine, 2, pool)
    prompt = _request(21, 3).prompt_ids
    one, two = Collector(), Collector()
    scheduler.submit(replace(_request(1, 1, max_tokens=20), prompt_ids=prompt), one, lambda: False)
    _run(scheduler)
    scheduler.submit(replace(_request(1, 1, max_tokens=20), prompt_ids=prompt), one, lambda: False)
    scheduler.submit(replace(_request(1, 1, max_tokens=20), prompt_ids=prompt), two, lambda: False)
    for _ in range(4):
        scheduler.step()
    full = pool.pools[1]
    tables = [s.paged.tables[1] for s in scheduler.running if s.paged is not None]
    assert len(tables) == 2
    shared = [b for b in tables[0][:5] if b in tables[1][:5]]
    assert len(shared) == 5 and all(full.refcounts[b] == 2 for b in shared)
    _run(scheduler)
    assert all(full.refcounts[b] == 0 for b in shared) and full.used_blocks == 0


def test_eviction_takes_the_least_recently_freed_cached_blocks(engine: Any) -> None:
    """A pool of 12 full blocks: a second, unrelated request needs the blocks the first left
    cached and evicts its oldest; the first's prompt then misses where they were."""
    pool = _pool(engine, 64, 12)
    scheduler = _scheduler(engine, 1, pool)
    first = _request(30, 1, max_tokens=4)
    scheduler.submit(first, Collector(), lambda: False)
    _run(scheduler)
    full = pool.pools[1]
    assert full.cached_blocks == 8  # 33 tokens stored: 8 full blocks
    scheduler.submit(_request(30, 2, max_tokens=4), Collector(), lambda: False)
    _run(scheduler)
    again = Collector()
    scheduler.submit(first, again, lambda: False)
    _run(scheduler)
    assert again.stats.cached_tokens == 0  # its first blocks were evicted first


@pytest.mark.skipif(native.kernels() is None, reason="no native CPU kernels here")
def test_one_sequence_decodes_natively_on_paged_caches_as_on_layer_caches(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 tiny Gemma 3: a 13-token prompt (past the window of 8), then 12 decode steps. A
    lone sequence on paged caches takes the native layer step (its `decode_slot` copies the
    keys out as a `LayerCache` holds them), so its logits equal the `LayerCache` run's to the
    bit, steps where the ring has wrapped included; the native step ran every time."""
    model = build_model(open_checkpoint(directory), torch.bfloat16, progress=False)
    runner = ModelRunner(model)
    ids = torch.randint(4, 256, (25,), generator=torch.Generator().manual_seed(2)).tolist()
    prompt = 13
    calls = {"native": 0}
    step = runner.native

    def counted(*args: Any) -> Any:
        out = step(*args)  # type: ignore[misc]
        calls["native"] += out is not None
        return out

    monkeypatch.setattr(runner, "native", counted)
    monkeypatch.setattr(counted, "applies", step.applies, raising=False)  # type: ignore[union-attr]
    with torch.inference_mode():
        caches = runner.new_caches()
        dense = [runner.prefill(torch.tensor([ids[:prompt]]), caches)]
        dense += [runner.decode(ids[p], caches, p) for p in range(prompt, len(ids))]
        native_calls = calls["native"]
        pool = KVPool(model.cache_specs(), runner.kv_policy, torch.bfloat16, [64, 64], BLOCK)
        sequence = pool.sequence()
        assert sequence.reserve(prompt)
        paged = [runner.prefill(torch.tensor([ids[:prompt]]), sequence.caches)]
        sequence.after_forward(ids[:prompt])
        for p in range(prompt, len(ids)):
            assert sequence.reserve(1)
            paged.append(runner.decode(ids[p], sequence.caches, p))
            sequence.after_forward(ids[: p + 1])
    assert native_calls == calls["native"] - native_calls == len(ids) - prompt
    for got, expected in zip(paged, dense, strict=True):
        assert torch.equal(got, expected)


def test_a_preempted_request_resumes_from_its_own_cached_blocks(engine: Any) -> None:
    """With the prefix cache on, a preempted request's full blocks stay cached: re-admitted,
    it takes them back instead of recomputing them, and still makes its alone-run tokens."""
    requests = [_request(10, 1), _request(14, 2), _request(12, 3), _request(11, 4)]
    pool = _pool(engine, 64, 24)
    scheduler = _scheduler(engine, 4, pool, prefix=True)
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        scheduler.submit(request, collector, lambda: False)
    _run(scheduler)
    assert scheduler.preemptions > 0 and pool.hit_tokens >= BLOCK
    compared = sum(
        _assert_same_clear_tokens(collector, _alone(engine, request))
        for request, collector in zip(requests, collectors, strict=True)
    )
    assert compared > 0.8 * 4 * 16
    assert all(c.stats.cached_tokens == 0 for c in collectors)  # no prompt was cached


def _count_prefills(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the runner's prefill forwards from now on: of one request alone (`prefill`)
    and of several together (`prefill_ragged`), and the requests those took together."""
    counts = {"alone": 0, "ragged": 0, "together": 0}
    alone, ragged = runner.prefill, runner.prefill_ragged

    def counted_alone(*args: Any, **kwargs: Any) -> torch.Tensor:
        counts["alone"] += 1
        return alone(*args, **kwargs)

    def counted_ragged(pieces: list[list[int]], *args: Any) -> torch.Tensor:
        counts["ragged"] += 1
        counts["together"] += len(pieces)
        return ragged(pieces, *args)

    monkeypatch.setattr(runner, "prefill", counted_alone)
    monkeypatch.setattr(runner, "prefill_ragged", counted_ragged)
    return counts


def test_requests_submitted_together_share_prefill_forwards(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six requests of 3-7 prompt tokens (27 in all) under a prefill budget of 16 tokens: the
    first step takes the first three (3 + 5 + 4; the 7 would pass 16), the next prefill step
    the other three (7 + 6 + 2): two forwards, not six. Each request's tokens (a seeded
    sampled one among them) equal its run alone."""
    sampled = SamplingParams(temperature=1.0, seed=5)
    lengths = (3, 5, 4, 7, 6, 2)
    requests = [_request(n, 20 + i, max_tokens=12) for i, n in enumerate(lengths)]
    requests[4] = replace(requests[4], sampling=sampled)
    alone = [_alone(engine, request) for request in requests]
    monkeypatch.setattr(engine.runner, "plan", replace(engine.runner.plan, prefill_chunk=16))
    counts = _count_prefills(engine.runner, monkeypatch)
    scheduler = _scheduler(engine, 8, _pool(engine, 64, 64), prefix=False)
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        scheduler.submit(request, collector, lambda: False)
    _run(scheduler)
    assert counts == {"alone": 0, "ragged": 2, "together": 6}
    assert _same_as_alone(requests, collectors, alone, 12) > 0.8 * 5 * 12


def _same_as_alone(
    requests: list[Any], collectors: list[Any], alone: list[Any], new_tokens: int
) -> int:
    """Each request made `new_tokens` tokens, a seeded sampled one exactly its run alone's,
    a greedy one its clear ones (`_assert_same_clear_tokens`); the greedy tokens compared."""
    compared = 0
    for request, collector, single in zip(requests, collectors, alone, strict=True):
        assert len(collector.tokens) == len(single.tokens) == new_tokens
        if request.sampling.temperature:
            assert collector.tokens == single.tokens
        else:
            compared += _assert_same_clear_tokens(collector, single)
    return compared


def test_ragged_prefill_steps_preempt_and_resume_identically(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six requests of 6-14 prompt tokens and 16 new ones, a prefill budget of 24 tokens and
    16 full blocks (64 tokens): prompts are prefilled one to three at a time, the pool runs
    out both in decode steps and in a prefill step (a request admitted earlier finds the
    blocks taken when its chunk comes: the most recently admitted ones still prefilling go
    back), the newest are re-prefilled with others, and each request's tokens equal its run
    alone."""
    sampled = SamplingParams(temperature=1.0, seed=11)
    requests = [
        _request(10, 1),
        _request(14, 2),
        _request(12, 3, sampling=sampled),
        _request(11, 4),
        _request(9, 5),
        _request(6, 6),
    ]
    alone = [_alone(engine, request) for request in requests]
    monkeypatch.setattr(engine.runner, "plan", replace(engine.runner.plan, prefill_chunk=24))
    counts = _count_prefills(engine.runner, monkeypatch)
    pool = _pool(engine, 64, 16)
    scheduler = _scheduler(engine, 6, pool, prefix=False)
    reserving = {"preempted": 0}
    reserve = scheduler._reserve

    def counted_reserve(sequence: Any, tokens: int) -> bool:
        before = scheduler.preemptions
        done = reserve(sequence, tokens)
        reserving["preempted"] += scheduler.preemptions - before
        return done

    monkeypatch.setattr(scheduler, "_reserve", counted_reserve)
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        scheduler.submit(request, collector, lambda: False)
    _run(scheduler)
    assert scheduler.preemptions > reserving["preempted"] > 0 and counts["ragged"] > 0
    assert _same_as_alone(requests, collectors, alone, 16) > 0.8 * 5 * 16
    assert pool.used_blocks == 0
