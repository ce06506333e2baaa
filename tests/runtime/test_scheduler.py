"""Continuous batching (`runtime.scheduler`): requests decoded together give each one's own
answer, and the scheduler admits, interleaves, cancels and refuses as it says."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from hearth.runtime.generate import GenerationChunk, GenerationRequest, Reply, stream_generate
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from hearth.runtime.scheduler import Scheduler

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    ",
    "The three primary colors are",
    "In July 1969, Neil Armstrong",
    "Water boils at",
    "A haiku about autumn:\n",
    "The quick brown fox",
]
TOKENS = 12
# fp32: the batched forward (one SDPA over all the sequences' keys, masked to each one's own)
# and a request alone (SDPA over its keys) differ only in the order their sums run, ~1e-6 of
# the logits (~10-30). A token is compared only where the alone run's top two log-probs are
# further apart than that can move them.
MARGIN = 1e-3


class Collector:
    """What a scheduler hands one request: its chunks, in order."""

    def __init__(self) -> None:
        self.chunks: list[GenerationChunk] = []
        self.error: BaseException | None = None

    def __call__(self, item: GenerationChunk | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        else:
            self.chunks.append(item)

    @property
    def tokens(self) -> list[int]:
        return [r.token for c in self.chunks for r in (c.logprobs or ())]

    @property
    def done(self) -> bool:
        return bool(self.chunks) and self.chunks[-1].finish_reason is not None


def _run(scheduler: Scheduler, limit: int = 10_000) -> None:
    for _ in range(limit):
        if scheduler.idle:
            return
        scheduler.step()
    raise AssertionError("the scheduler did not finish")


def _request(engine: Any, prompt: str, **fields: Any) -> GenerationRequest:
    ids = engine.tokenizer.encode(prompt)
    return GenerationRequest(ids, max_tokens=TOKENS, top_logprobs=2, **fields)


def _alone(engine: Any, request: GenerationRequest) -> list[Any]:
    """Each token's log-probability record, the request run alone (as `hearth generate` does)."""
    chunks = stream_generate(
        engine.runner,
        engine.tokenizer,
        request.prompt_ids,
        request.sampling,
        request.max_tokens,
        stop_ids=(),
        top_logprobs=2,
    )
    return [record for chunk in chunks for record in (chunk.logprobs or ())]


def test_requests_decoded_together_give_each_ones_own_answer(hearth_270m: Any) -> None:
    """Eight greedy requests of different lengths, all running at once on the real 270M (fp32):
    every token equals the request's own alone-run token wherever that one was a clear pick."""
    requests = [replace(_request(hearth_270m, p), stop_ids=()) for p in PROMPTS]
    scheduler = hearth_270m.scheduler(max_running=8)
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        scheduler.submit(request, collector, lambda: False)
    _run(scheduler)
    compared = 0
    for request, collector in zip(requests, collectors, strict=True):
        assert collector.done and collector.error is None
        alone = _alone(hearth_270m, request)
        for position, record in enumerate(alone):
            if record.top_logprobs[0] - record.top_logprobs[1] < MARGIN:
                break  # a near tie: the two runs may part here, and after
            assert collector.tokens[position] == record.token, (request, position)
            compared += 1
    assert compared > 0.8 * len(requests) * TOKENS


def test_seeded_sampling_does_not_depend_on_the_batch(hearth_270m: Any) -> None:
    """A seeded request at temperature 1 draws the same tokens alone and beside others: its
    sampler and random generator are its own."""
    sampling = SamplingParams(temperature=1.0, seed=7)
    request = replace(_request(hearth_270m, PROMPTS[1]), sampling=sampling)
    alone = Collector()
    scheduler = hearth_270m.scheduler(max_running=4)
    scheduler.submit(request, alone, lambda: False)
    _run(scheduler)
    together = [Collector() for _ in range(3)]
    scheduler.submit(request, together[0], lambda: False)
    for prompt, collector in zip(PROMPTS[2:4], together[1:], strict=True):
        scheduler.submit(_request(hearth_270m, prompt), collector, lambda: False)
    _run(scheduler)
    assert together[0].tokens == alone.tokens and len(alone.tokens) == TOKENS


def test_at_most_max_running_at_once_and_long_prompts_in_chunks(hearth_270m: Any) -> None:
    """With room for two, a third request waits for one of them to finish; a prompt longer
    than a prefill chunk is prefilled a chunk a step, the running request decoding between its
    chunks."""
    plan = replace(hearth_270m.runner.plan, prefill_chunk=8)
    runner = ModelRunner(hearth_270m.model, plan)
    scheduler = Scheduler(runner, hearth_270m.tokenizer, max_running=2)
    short, long, third = Collector(), Collector(), Collector()
    scheduler.submit(_request(hearth_270m, PROMPTS[0]), short, lambda: False)
    long_request = _request(hearth_270m, " ".join(PROMPTS))
    assert len(long_request.prompt_ids) > 4 * 8
    scheduler.submit(long_request, long, lambda: False)
    scheduler.submit(_request(hearth_270m, PROMPTS[5]), third, lambda: False)
    scheduler.step()  # the short prompt, one chunk: its first token
    made = [len(short.tokens)]
    while not long.chunks and not long.done:
        scheduler.step()
        assert scheduler.active <= 2 and not third.chunks
        made.append(len(short.tokens))
    # The long prompt's chunks and the short request's steps took turns.
    assert made[-1] - made[0] >= len(long_request.prompt_ids) // 8 - 1
    _run(scheduler)
    assert short.done and long.done and third.done
    assert len(long.tokens) == len(third.tokens) == TOKENS


def test_a_cancelled_request_leaves_at_once_and_the_others_finish(hearth_270m: Any) -> None:
    scheduler = hearth_270m.scheduler(max_running=4)
    gone = {"flag": False}
    leaving, staying = Collector(), Collector()
    scheduler.submit(_request(hearth_270m, PROMPTS[0]), leaving, lambda: gone["flag"])
    scheduler.submit(_request(hearth_270m, PROMPTS[1]), staying, lambda: False)
    for _ in range(4):
        scheduler.step()
    gone["flag"] = True
    had = len(leaving.chunks)
    scheduler.step()
    assert scheduler.active == 1
    _run(scheduler)
    assert staying.done and len(leaving.chunks) == had  # no chunk after, no last chunk


def test_a_request_that_can_never_fit_is_refused_before_it_is_queued(hearth_270m: Any) -> None:
    scheduler = hearth_270m.scheduler(max_running=4, kv_room=10_000)
    with pytest.raises(ValueError, match="can never fit"):
        scheduler.submit(_request(hearth_270m, PROMPTS[0]), Collector(), lambda: False)
    assert scheduler.idle


def test_reply_ends_at_an_end_id_or_a_stop_string(hearth_270m: Any) -> None:
    reply = Reply(hearth_270m.tokenizer, stop=["lo w"], stop_ids=(7,))
    assert reply.add(7) is None and reply.ended
    reply = Reply(hearth_270m.tokenizer, stop=["lo w"])
    texts = []
    for token in hearth_270m.tokenizer.encode("hello world", add_special_tokens=False):
        chunk = reply.add(token)
        texts.append(chunk.text if chunk else "")
        if reply.ended:
            break
    assert "".join(texts) == "hel" and reply.finish_reason == "stop"
