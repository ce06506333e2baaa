"""Continuous batching: many requests on one runner, each step doing some of their work.

A step either prefills one chunk of a request being admitted, or decodes one token of every
running request at once: one forward over their tokens side by side, each with its own caches
(`runner.decode_batch`), so the weights are read once for all of them. The two kinds of step
alternate while both have work, so a long prompt delays the running requests by a chunk at a
time, not by its whole prefill. Requests are admitted in arrival order, at most `max_running`
at once and, with `kv_room` set, only while the K/V their prompt and `max_tokens` can reach
fits beside the others' (so none is ever cut short or preempted for memory).

Each request keeps its own sampler (and seed), stop strings, log-probabilities and reply: a
seeded request's tokens do not depend on what else runs beside it, up to the order in which
a batched forward sums (the tolerance of tests/runtime/test_scheduler.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hearth.kv import LayerCache
from hearth.kv.footprint import KVFootprint
from hearth.kv.prompt_cache import PromptCache, Reuse, snapshot_caches
from hearth.lengths import generation_limit
from hearth.models.decoder import SoftTokens
from hearth.runtime.constraints import GrammarMatcher
from hearth.runtime.generate import (
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    Reply,
    peak_memory_bytes,
    sample_next,
    soft_tokens,
)
from hearth.runtime.runner import ModelRunner, chunk_end
from hearth.runtime.sampling import Sampler
from hearth.tokenizer import Tokenizer

log = logging.getLogger("hearth.scheduler")

Deliver = Callable[[GenerationChunk | BaseException], None]


@dataclass(eq=False)
class Sequence:
    """One request's state while it is admitted: its caches, tokens and reply."""

    request: GenerationRequest
    deliver: Deliver
    cancelled: Callable[[], bool]
    max_tokens: int
    sampler: Sampler
    reply: Reply
    reserved: int  # K/V bytes its prompt and max_tokens can reach
    grammar: GrammarMatcher | None = None  # masks its logits row when the request is constrained
    caches: list[LayerCache] = field(default_factory=list)
    history: list[int] = field(default_factory=list)  # prompt, then the tokens made
    computed: int = 0  # leading tokens of `history` whose K/V the caches hold
    produced: int = 0
    next_token: int | None = None  # made, not yet fed to the model
    boundary: list[LayerCache] | None = None  # the caches at the prompt, for the prompt cache
    soft: list[SoftTokens] | None = None  # the media's soft tokens, encoded at the first chunk
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids


class Scheduler:
    """Runs submitted requests to completion, a step at a time (`step`)."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        max_running: int = 8,
        prompt_cache: PromptCache | None = None,
        kv_room: int | None = None,
        on_cancelled: Callable[[], None] | None = None,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.prompt_cache = prompt_cache
        # K/V bytes the admitted requests may reach together (None: no limit beyond the count).
        self.kv_room = kv_room
        self.on_cancelled = on_cancelled
        model = runner.model
        self._footprint = KVFootprint.of(model.cache_specs(), model.compute_dtype, runner.kv_policy)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._prefilling: Sequence | None = None
        self._prefill_next = True  # which kind of step goes first when both have work

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self._prefilling)

    @property
    def active(self) -> int:
        """Requests admitted (prefilling or decoding)."""
        return len(self.running) + (self._prefilling is not None)

    def submit(
        self, request: GenerationRequest, deliver: Deliver, cancelled: Callable[[], bool]
    ) -> None:
        """Queue `request`; its chunks (the last with finish_reason and stats) go to `deliver`,
        an error to `deliver` in their place. A bad request raises here, before it is queued."""
        model = self.runner.model
        if not request.prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = model.config.vocab_size
        if (bad := next((i for i in request.prompt_ids if not 0 <= i < vocab), None)) is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary of {vocab}")
        positions = model.config.max_position_embeddings
        max_tokens = generation_limit(len(request.prompt_ids), request.max_tokens, positions)
        request.sampling.validate(vocab)
        reply = Reply(self.tokenizer, request.stop, request.stop_ids, request.top_logprobs)
        sampler = Sampler(request.sampling, device=self.runner.device)
        reserved = self._footprint.bytes_at(len(request.prompt_ids) + max_tokens)
        if self.kv_room is not None and reserved > self.kv_room:
            raise ValueError(
                f"this request's K/V ({reserved} bytes) can never fit the {self.kv_room} left"
            )
        grammar = reply.grammar_matcher(request.constraint, self.tokenizer, vocab)
        sequence = Sequence(
            request, deliver, cancelled, max_tokens, sampler, reply, reserved, grammar
        )
        self.waiting.append(sequence)

    def step(self) -> None:
        """One step of work: a prefill chunk or a decode step of every running request."""
        self._drop_cancelled()
        if self._prefilling is None:
            self._prefilling = self._admit()
        prefill = self._prefilling is not None and (self._prefill_next or not self.running)
        try:
            if prefill:
                assert self._prefilling is not None
                self._prefill_chunk(self._prefilling)
            elif self.running:
                self._decode_step()
        except Exception as error:  # a failed step fails the requests it ran
            log.exception("generation failed")
            failed = [self._prefilling] if prefill else list(self.running)
            for sequence in failed:
                if sequence is not None:
                    self._remove(sequence)
                    sequence.deliver(error)
        self._prefill_next = not prefill

    # -- admission and prefill

    def _admit(self) -> Sequence | None:
        """The next waiting request, with its caches, if the limits let one more in."""
        if not self.waiting or len(self.running) >= self.max_running:
            return None
        sequence = self.waiting[0]
        if self.kv_room is not None:
            held = sum(other.reserved for other in self.running)
            if held + sequence.reserved > self.kv_room:
                return None
        self.waiting.popleft()
        reuse = Reuse(None, 0)
        if self.prompt_cache is not None:
            reuse = self.prompt_cache.take(sequence.request.cache_ids)
        sequence.caches = reuse.caches if reuse.caches is not None else self.runner.new_caches()
        sequence.computed = reuse.cached_tokens
        sequence.history = list(sequence.prompt_ids)
        sequence.stats.prompt_tokens = len(sequence.history)
        sequence.stats.cached_tokens = reuse.cached_tokens
        sequence.started = time.perf_counter()
        return sequence

    @torch.inference_mode()
    def _prefill_chunk(self, sequence: Sequence) -> None:
        """The next chunk of the prompt; after the last, its first token."""
        runner = self.runner
        chunk = runner.plan.prefill_chunk
        if sequence.soft is None:
            sequence.soft = soft_tokens(runner, sequence.request.media, sequence.computed)
        start = sequence.computed
        end = chunk_end(start, len(sequence.prompt_ids), chunk, sequence.soft)
        piece = sequence.history[start:end]
        ids = torch.tensor([piece], dtype=torch.long, device=runner.device)
        logits = runner.prefill(ids, sequence.caches, start, end - start, sequence.soft)
        sequence.computed = start + len(piece)
        if sequence.computed < len(sequence.prompt_ids):
            return
        self._prefilling = None
        if self.prompt_cache is not None:
            sequence.boundary = snapshot_caches(sequence.caches)
        sequence.soft = None  # freed
        self.running.append(sequence)
        self._take_token(sequence, logits)

    # -- decoding

    @torch.inference_mode()
    def _decode_step(self) -> None:
        running = list(self.running)
        tokens = [sequence.next_token for sequence in running]
        assert all(token is not None for token in tokens)
        positions = [sequence.computed for sequence in running]
        caches = [sequence.caches for sequence in running]
        logits = self.runner.decode_batch(tokens, caches, positions)  # type: ignore[arg-type]
        for row, sequence in enumerate(running):
            sequence.computed += 1
            self._take_token(sequence, logits[row : row + 1])

    def _take_token(self, sequence: Sequence, logits: torch.Tensor) -> None:
        """Sample `sequence`'s next token from its logits [1, V] and hand its text on."""
        recorder = sequence.reply.recorder
        sampled, distribution = sample_next(
            sequence.sampler, logits, sequence.history, recorder is not None, sequence.grammar
        )
        token = int(sampled)
        if recorder is not None and distribution is not None:
            recorder.record(distribution.reshape(-1), token)
        now = time.perf_counter()
        if sequence.produced == 0:
            sequence.stats.prefill_seconds = now - sequence.started
            sequence.first_token_at = now
        else:
            sequence.stats.decode_seconds = now - sequence.first_token_at
        sequence.produced += 1
        sequence.stats.generated_tokens = sequence.produced
        sequence.history.append(token)
        sequence.next_token = token
        if sequence.grammar is not None:
            sequence.grammar.advance(token)
        chunk = sequence.reply.add(token)
        sequence.reply.check_grammar(sequence.grammar)
        if chunk is not None:
            sequence.deliver(chunk)
        if sequence.reply.ended or sequence.produced >= sequence.max_tokens:
            self._finish(sequence)

    def _finish(self, sequence: Sequence) -> None:
        """The last chunk, after the prompt's caches went to the prompt cache."""
        self._remove(sequence)
        if self.prompt_cache is not None and sequence.boundary is not None:
            self.prompt_cache.put(sequence.request.cache_ids, sequence.boundary)
        sequence.stats.peak_memory_bytes = peak_memory_bytes(self.runner.device)
        sequence.deliver(sequence.reply.finish(sequence.stats))

    # -- leaving

    def _drop_cancelled(self) -> None:
        """Requests whose client went away end at once, without a last chunk."""
        for sequence in [*self.waiting, *self.running, self._prefilling]:
            if sequence is not None and sequence.cancelled():
                self._remove(sequence)
                if self.on_cancelled is not None:
                    self.on_cancelled()

    def _remove(self, sequence: Sequence) -> None:
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
        if self._prefilling is sequence:
            self._prefilling = None
        sequence.caches = []  # freed
