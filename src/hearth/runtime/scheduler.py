"""Continuous batching: many requests on one runner, each step doing some of their work, their
K/V in one paged pool (`kv.paged`).

A step either prefills the next chunks of the requests being admitted, or decodes one token of
every running request at once: one forward over their tokens side by side, each with its own
block tables (`runner.decode_batch`; on a GPU replayed from a CUDA graph per batch size,
`runtime.batch_graphs`), so the weights are read once for all of them, and every row's token
is sampled on the device and read back at once (one host sync per step; a row asking for
log-probabilities is sampled alone). Where every row samples on the device, the steps are
chained: the next is launched on those samples before the host reads them, so the host's work
on a step's tokens (detokenizing, stop strings, delivery) overlaps the device's. The two kinds
of step alternate while both have work, so a long prompt delays the running requests by a
chunk at a time, not by its whole prefill.

A prefill step takes the admitted requests' next chunks in arrival order while they fit the
plan's `prefill_chunk` tokens together (the first always; each request's chunks cut as if it
ran alone), and runs them as one ragged forward (`runner.prefill_ragged`): one GEMM per
projection over all their rows, attention and K/V writes per request, the head only over the
last row of each request whose prompt ends there. Short prompts arriving together thus share
one forward, where the dequantized weight tiles of a CPU GEMM are reused over more rows. A
request whose chunk holds media soft tokens takes a prefill step alone.

Requests are admitted in arrival order, at most `max_running` at once, while the next prefill
step has tokens to spare and the pool's free blocks hold the prompt besides what the requests
still prefilling will take (blocks for decoding are taken a token at a time, as needed). When
a step finds the pool exhausted, the most recently admitted request is preempted by recompute:
its blocks are freed and it goes back to the head of the queue with its prompt and the tokens
it made, its sampler (and random state) kept; re-admitted, it prefills them again (mostly from
its own blocks, still in the prefix cache) and goes on where it stopped, nothing re-sent to its
client. A request that could not fit even in the whole pool is refused when submitted. A
cancelled request's blocks are freed at once.

Prefix cache: a new request shares the longest run of whole cached blocks its prompt begins
with (`PagedSequence.adopt_prefix`) and prefills only the rest.

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

from hearth.kv.paged import KVPool, PagedSequence, default_pool_bytes
from hearth.kv.prompt_cache import MIN_SHARED_TOKENS
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
from hearth.runtime.sampling import Sampler, first_argmax
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
    grammar: GrammarMatcher | None = None  # masks its logits row when the request is constrained
    paged: PagedSequence | None = None  # its block tables and caches while admitted
    history: list[int] = field(default_factory=list)  # prompt, then the tokens made
    computed: int = 0  # leading tokens of `history` whose K/V the caches hold
    produced: int = 0
    next_token: int | None = None  # made, not yet fed to the model
    preemptions: int = 0
    soft: list[SoftTokens] | None = None  # the media's soft tokens, encoded at the first chunk
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float = 0.0

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def prefill_target(self) -> int:
        """Tokens whose K/V a prefill makes: the prompt, or after a preemption everything but
        the token made last (fed by the next decode step)."""
        return len(self.history) - 1 if self.produced else len(self.prompt_ids)

    def ids_to_name(self) -> list[int]:
        """What `PagedSequence.after_forward` names its blocks by: the cache ids where the
        tokens just stored fill a block, else nothing (a decode step mostly fills none)."""
        assert self.paged is not None
        return self.cache_ids() if self.paged.fills_a_block else []

    def cache_ids(self) -> list[int]:
        """What the prefix cache keys its blocks on: the prompt's cache ids (media keyed on
        their content), then the tokens made."""
        return self.request.cache_ids + self.history[len(self.prompt_ids) :]


@dataclass(eq=False)
class _InFlight:
    """A decode step whose tokens the host has not read yet: its rows, their sampled tokens on
    the device (what a chained next step feeds), and those tokens' copy to the host."""

    rows: list[Sequence]
    tokens: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor  # [B] int64, pinned on a GPU
    copied: torch.cuda.Event | None

    def read(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class Scheduler:
    """Runs submitted requests to completion, a step at a time (`step`)."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        max_running: int = 8,
        prefix_cache: bool = True,
        kv_room: int | None = None,
        on_cancelled: Callable[[], None] | None = None,
        pool: KVPool | None = None,
    ) -> None:
        """`kv_room`: the bytes of the K/V pool (None: `default_pool_bytes`); `pool`: a pool
        made by the caller instead."""
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.prefix_cache = prefix_cache
        self.on_cancelled = on_cancelled
        self.pool = pool or make_pool(runner, max_running, kv_room)
        # The longest request (prompt and reply) the whole pool holds: longer ones are refused.
        self.max_context = min(
            self.pool.longest_context(runner.plan.prefill_chunk),
            runner.model.config.max_position_embeddings,
        )
        self.preemptions = 0
        self.prefix_hits = 0  # requests admitted with cached blocks
        self.prefix_misses = 0
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefilling: list[Sequence] = []  # admitted, still prefilling, in arrival order
        self._in_step: list[Sequence] = []  # the requests the current prefill step runs
        self._prefill_next = True  # which kind of step goes first when both have work
        # The decode step launched last, its tokens not yet read (see `_decode_step`).
        self._in_flight: _InFlight | None = None
        # Set to a list (a benchmark does), each decode step appends (rows, seconds) to it,
        # the seconds without any spent capturing a CUDA graph (a one-off).
        self.decode_log: list[tuple[int, float]] | None = None

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.running or self.prefilling)

    @property
    def active(self) -> int:
        """Requests admitted (prefilling or decoding)."""
        return len(self.running) + len(self.prefilling)

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
        tokens = len(request.prompt_ids) + max_tokens
        if not self.pool.fits(tokens, self.runner.plan.prefill_chunk):
            raise ValueError(
                f"the prompt's {len(request.prompt_ids)} tokens plus max_tokens {max_tokens} "
                f"can never fit the K/V pool ({self.pool.describe()})"
            )
        reply = Reply(self.tokenizer, request.stop, request.stop_ids, request.top_logprobs)
        sampler = Sampler(request.sampling, device=self.runner.device)
        grammar = reply.grammar_matcher(request.constraint, self.tokenizer, vocab)
        sequence = Sequence(request, deliver, cancelled, max_tokens, sampler, reply, grammar)
        self.waiting.append(sequence)

    def step(self) -> None:
        """One step of work: a prefill step (chunks of one or more admitted requests) or a
        decode step of every running request."""
        self._drop_cancelled()
        self._admit_while_room()
        prefill = bool(self.prefilling) and (self._prefill_next or not self.running)
        try:
            if self._in_flight is not None and (prefill or not self.running):
                self._settle()
            if prefill:
                self._prefill_step()
            elif self.running:
                self._decode_step()
        except Exception as error:  # a failed step fails the requests it ran
            log.exception("generation failed")
            self._in_flight = None
            failed = list(self._in_step) if prefill else list(self.running)
            for sequence in failed:
                self._remove(sequence)
                sequence.deliver(error)
        self._in_step = []
        self._prefill_next = not prefill

    # -- admission and prefill

    def _admit_while_room(self) -> None:
        """Admit waiting requests while the next prefill step has tokens to spare."""
        while self.waiting and self._planned()[1] < self.runner.plan.prefill_chunk:
            sequence = self._admit()
            if sequence is None:
                return
            self.prefilling.append(sequence)

    def _planned(self) -> tuple[list[Sequence], int]:
        """The requests the next prefill step runs, in arrival order, and the tokens it takes
        (the plan's whole `prefill_chunk` where no later request may join it): each one's next
        chunk while they fit the budget together, the first always; one with media alone."""
        budget = self.runner.plan.prefill_chunk
        chosen: list[Sequence] = []
        used = 0
        for sequence in self.prefilling:
            if _with_media(sequence):
                if not chosen:
                    chosen.append(sequence)
                return chosen, budget
            start, target = sequence.computed, sequence.prefill_target
            tokens = chunk_end(start, target, budget, ()) - start if start < target else 0
            if chosen and used + tokens > budget:
                return chosen, budget
            chosen.append(sequence)
            used += tokens
        return chosen, used

    def _admit(self) -> Sequence | None:
        """The next waiting request, with its block tables, if one more may run and the free
        blocks hold its prompt (after what it shares from the prefix cache) besides what the
        requests still prefilling will take."""
        if not self.waiting or self.active >= self.max_running:
            return None
        sequence = self.waiting[0]
        paged = self.pool.sequence()
        target = sequence.prefill_target
        cached = 0
        if self.prefix_cache:
            # One prompt token is always prefilled: the first sampled token needs its logits.
            most = target if sequence.produced else target - 1
            cached = paged.adopt_prefix(sequence.cache_ids(), most)
            # A hit ends on a block boundary: never inside an image or clip, whose soft tokens
            # are placed (and may attend to each other) within one chunk.
            while inside := next(
                (m for m in sequence.request.media if m.start < cached < m.start + m.length),
                None,
            ):
                paged.free()
                cached = paged.adopt_prefix(sequence.cache_ids(), inside.start)
            if cached < MIN_SHARED_TOKENS and not sequence.produced:
                paged.free()  # the chat template's opening: not worth counting as a hit
                cached = 0
        chunk = self.runner.plan.prefill_chunk
        promised = [0] * len(self.pool.pools)
        for other in self.prefilling:
            assert other.paged is not None
            growth = other.paged.growth(other.prefill_target + 1, chunk)
            promised = [a + b for a, b in zip(promised, growth, strict=True)]
        if not paged.can_grow_to(target + 1, chunk, promised):
            paged.free()
            return None
        self.waiting.popleft()
        sequence.paged = paged
        sequence.computed = cached
        if not sequence.produced:
            sequence.history = list(sequence.prompt_ids)
            sequence.stats.prompt_tokens = len(sequence.history)
            sequence.stats.cached_tokens = cached
            sequence.started = time.perf_counter()
        if cached:
            self.pool.hit_tokens += cached
        if self.prefix_cache and not sequence.produced:
            if cached:
                self.prefix_hits += 1
            else:
                self.prefix_misses += 1
        return sequence

    @torch.inference_mode()
    def _prefill_step(self) -> None:
        """The next chunks of the planned requests (`_planned`), in one forward; after a
        request's last, its first token (a resumed request: back to decoding, its next token
        already made)."""
        runner = self.runner
        chunks: list[tuple[Sequence, int, int]] = []
        planned = self._planned()[0]
        self._in_step = list(planned)  # what fails if encoding the media fails
        for sequence in planned:
            if sequence not in self.prefilling:
                break  # preempted to make room for an earlier one's chunk
            start, target = sequence.computed, sequence.prefill_target
            if sequence.soft is None and start < target:
                sequence.soft = soft_tokens(runner, sequence.request.media, start)
            end = chunk_end(start, target, runner.plan.prefill_chunk, sequence.soft or ())
            if self._reserve(sequence, end - start):
                chunks.append((sequence, start, end))
        self._in_step = [sequence for sequence, _, _ in chunks]
        logits = self._prefill_forward([c for c in chunks if c[1] < c[2]])
        for sequence, start, end in chunks:
            paged = sequence.paged
            assert paged is not None
            if start < end:
                paged.after_forward(sequence.ids_to_name())
                sequence.computed = end
            if end < sequence.prefill_target:
                continue
            self.prefilling.remove(sequence)
            sequence.soft = None  # freed
            self.running.append(sequence)
            if sequence.produced == 0:
                self._take_token(sequence, logits.pop(sequence))

    def _reserve(self, sequence: Sequence, tokens: int) -> bool:
        """Blocks for `sequence`'s next `tokens`, preempting the most recently admitted
        requests still prefilling (running ones took the blocks since they were admitted)
        until it has them; False if it was preempted itself."""
        assert sequence.paged is not None
        while not sequence.paged.reserve(tokens):
            victim = self.prefilling[-1]
            self._preempt(victim)
            if victim is sequence:
                return False
        return True

    def _prefill_forward(
        self, chunks: list[tuple[Sequence, int, int]]
    ) -> dict[Sequence, torch.Tensor]:
        """Run `chunks` (request, start, end) as one forward; the logits [1, V] of each request
        whose prompt it ends (a lone request's chunk: the plain prefill, media included)."""
        runner = self.runner
        ends = [s.produced == 0 and end == s.prefill_target for s, _, end in chunks]
        if len(chunks) == 1:
            sequence, start, end = chunks[0]
            assert sequence.paged is not None
            ids = torch.tensor(
                [sequence.history[start:end]], dtype=torch.long, device=runner.device
            )
            logits = runner.prefill(ids, sequence.paged.caches, start, end - start, sequence.soft)
            return {sequence: logits} if ends[0] else {}
        if not chunks:
            return {}
        caches = [s.paged.caches for s, _, _ in chunks if s.paged is not None]
        rows = runner.prefill_ragged(
            [s.history[start:end] for s, start, end in chunks],
            caches,
            [start for _, start, _ in chunks],
            ends,
        )
        asked = [s for (s, _, _), end in zip(chunks, ends, strict=True) if end]
        return {s: rows[i : i + 1] for i, s in enumerate(asked)}

    # -- decoding

    @torch.inference_mode()
    def _decode_step(self) -> None:
        """Decode one token of every running request.

        Where the forward reads its tokens on the device (`runner.takes_device_tokens`: the
        batched paged step) and every row samples there (no grammar, log-probabilities or
        penalties, which need the host), the steps are chained: a step is launched on the
        last step's samples before the host reads them, and the host then takes those tokens
        (detokenizing, stop strings, delivery) while the device runs. A row that ended on
        the last step's token has made one step too many: its result is dropped unread.
        Anything else first settles the step in flight."""
        started = time.perf_counter()
        captured = self.runner.capture_seconds
        flight, self._in_flight = self._in_flight, None
        reserved: list[Sequence] = []
        if flight is not None and not (
            flight.rows == self.running and self._reserve_each(reserved)
        ):
            self._take_tokens(flight.rows, flight.read())
            flight = None
            if not self.running:
                return
        if flight is None:
            self._make_room(reserved)
        running = list(self.running)
        caches = [sequence.paged.caches for sequence in running if sequence.paged is not None]
        positions = [sequence.computed for sequence in running]
        if flight is not None:
            tokens: list[int] | torch.Tensor = flight.tokens
        else:
            tokens = [sequence.next_token for sequence in running]  # type: ignore[misc]
        logits = self.runner.decode_batch(tokens, caches, positions)
        for sequence in running:
            sequence.computed += 1
        chain = self.runner.takes_device_tokens(caches) and all(map(_samples_on_device, running))
        if chain:
            self._in_flight = self._launch_samples(running, logits)
        if flight is not None:
            self._take_tokens(flight.rows, flight.read())
        for sequence in running:
            if sequence.paged is not None:  # not ended by the last step's token
                sequence.paged.after_forward(sequence.ids_to_name())
        if not chain:
            made = self._sample_rows(running, logits)
        if self.decode_log is not None:  # the step's (or the last one's) tokens are read
            capturing = self.runner.capture_seconds - captured
            self.decode_log.append((len(running), time.perf_counter() - started - capturing))
        if not chain:
            for row, sequence in enumerate(running):
                token = made[row]
                if sequence.paged is None:  # ended on the last step's token
                    continue
                if token is None:  # log-probabilities asked: sampled with its distribution
                    self._take_token(sequence, logits[row : row + 1])
                else:
                    self._accept_token(sequence, token, None)

    def _reserve_each(self, reserved: list[Sequence]) -> bool:
        """Room for each running request's next token, without preempting (which needs the
        host to know the tokens in flight first): False at the first that finds none, those
        reserved so far listed in `reserved`."""
        for sequence in self.running:
            assert sequence.paged is not None
            if not sequence.paged.reserve(1):
                return False
            reserved.append(sequence)
        return True

    def _launch_samples(self, running: list[Sequence], logits: torch.Tensor) -> _InFlight:
        """Sample every row on the device and start copying the tokens to the host."""
        tokens = self._sample_on_device(running, logits)
        pinned = tokens.device.type == "cuda"
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pinned)
        host.copy_(tokens, non_blocking=pinned)
        copied = None
        if pinned:
            copied = torch.cuda.Event()
            copied.record()
        return _InFlight(running, tokens, host, copied)

    def _settle(self) -> None:
        """Read the step in flight's tokens and take them."""
        flight, self._in_flight = self._in_flight, None
        if flight is not None:
            self._take_tokens(flight.rows, flight.read())

    def _take_tokens(self, rows: list[Sequence], tokens: list[int]) -> None:
        """Take each row's token, but not a row's that ended or left since its step began."""
        for sequence, token in zip(rows, tokens, strict=True):
            if sequence.paged is not None and sequence in self.running:
                self._accept_token(sequence, token, None)

    def _sample_rows(self, running: list[Sequence], logits: torch.Tensor) -> list[int | None]:
        """Each row's next token, read back from the device at once (one host sync): plain
        greedy rows by one argmax over all the rows, every other row by its own sampler (its
        own generator: a seeded row draws as it would alone), on the device; None for a row
        that asks for log-probabilities (sampled by `_take_token`, which records them)."""
        tokens = self._sample_on_device(running, logits)
        made: list[int | None] = list(tokens.tolist())
        for row, sequence in enumerate(running):
            if sequence.reply.recorder is not None:
                made[row] = None
        return made

    def _sample_on_device(self, running: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Each row's next token [B] on the device, not read: plain greedy rows by one argmax
        over all the rows, every other row by its own sampler (its own generator: a seeded
        row draws as it would alone); a row asking for log-probabilities is left to
        `_take_token`."""
        tokens = first_argmax(logits.float())
        for row, sequence in enumerate(running):
            if sequence.reply.recorder is not None:
                continue
            if sequence.grammar is not None or not _plain_greedy(sequence.sampler):
                token, _ = sample_next(
                    sequence.sampler,
                    logits[row : row + 1],
                    sequence.history,
                    False,
                    sequence.grammar,
                )
                tokens[row] = token.reshape(())
        return tokens

    def _make_room(self, reserved: list[Sequence]) -> None:
        """A block for each running request's next token (but those `reserved` already),
        preempting the most recently admitted requests (a prefilling one first) until the
        rest have theirs."""
        pending = [sequence for sequence in self.running if sequence not in reserved]
        while pending:
            sequence = pending[0]
            assert sequence.paged is not None
            if sequence.paged.reserve(1):
                pending.pop(0)
                continue
            victim = self.prefilling[-1] if self.prefilling else self.running[-1]
            if victim is sequence and len(self.running) == 1:
                raise RuntimeError("the K/V pool cannot hold the one request it admitted")
            self._preempt(victim)
            if victim in pending:
                pending.remove(victim)

    def _preempt(self, sequence: Sequence) -> None:
        """Free `sequence`'s blocks and put it back at the head of the queue: re-admitted, it
        recomputes its K/V and goes on where it stopped (its sampler and reply kept)."""
        log.info("preempting a request: the K/V pool is full")
        assert sequence.paged is not None
        sequence.paged.free()
        sequence.paged = None
        sequence.computed = 0
        sequence.soft = None
        sequence.preemptions += 1
        self.preemptions += 1
        if sequence in self.running:
            self.running.remove(sequence)
        if sequence in self.prefilling:
            self.prefilling.remove(sequence)
        self.waiting.appendleft(sequence)

    def _take_token(self, sequence: Sequence, logits: torch.Tensor) -> None:
        """Sample `sequence`'s next token from its logits [1, V] and hand its text on."""
        recorder = sequence.reply.recorder
        sampled, distribution = sample_next(
            sequence.sampler, logits, sequence.history, recorder is not None, sequence.grammar
        )
        self._accept_token(sequence, int(sampled), distribution)

    def _accept_token(
        self, sequence: Sequence, token: int, distribution: torch.Tensor | None
    ) -> None:
        """Take `token` as `sequence`'s next (`distribution`: its log-probabilities row, where
        asked) and hand its text on."""
        recorder = sequence.reply.recorder
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
        """The last chunk, after its blocks went back (full ones stay in the prefix cache)."""
        self._remove(sequence)
        sequence.stats.peak_memory_bytes = peak_memory_bytes(self.runner.device)
        sequence.deliver(sequence.reply.finish(sequence.stats))

    # -- leaving

    def _drop_cancelled(self) -> None:
        """Requests whose client went away end at once, without a last chunk."""
        for sequence in [*self.waiting, *self.running, *self.prefilling]:
            if sequence.cancelled():
                self._remove(sequence)
                if self.on_cancelled is not None:
                    self.on_cancelled()

    def _remove(self, sequence: Sequence) -> None:
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        if sequence in self.running:
            self.running.remove(sequence)
        if sequence in self.prefilling:
            self.prefilling.remove(sequence)
        if sequence.paged is not None:
            sequence.paged.free()
            sequence.paged = None


def _samples_on_device(sequence: Sequence) -> bool:
    """Whether `sequence`'s next token needs nothing from the host: no grammar mask, no
    log-probabilities, no penalty over the tokens made (the last one is still on the device)."""
    params = sequence.sampler.params
    return (
        sequence.grammar is None
        and sequence.reply.recorder is None
        and params.repetition_penalty == 1
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
    )


def _with_media(sequence: Sequence) -> bool:
    """Whether `sequence`'s prompt has media still to prefill (soft tokens, not yet encoded
    or left after its cached prefix): its chunks take a prefill step alone."""
    if not sequence.request.media:
        return False
    return sequence.soft is None or bool(sequence.soft)


def _plain_greedy(sampler: Sampler) -> bool:
    """Whether `sampler` picks the argmax of the logits as they are (no bias, no penalty)."""
    params = sampler.params
    return (
        params.temperature == 0
        and not params.logit_bias
        and params.repetition_penalty == 1
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
    )


def make_pool(runner: ModelRunner, max_running: int, kv_bytes: int | None = None) -> KVPool:
    """The runner's K/V pool of `kv_bytes` (None: `default_pool_bytes` for `max_running`
    sequences)."""
    model = runner.model
    specs, policy, dtype = model.cache_specs(), runner.kv_policy, model.compute_dtype
    chunk = runner.plan.prefill_chunk
    context = model.config.max_position_embeddings
    if kv_bytes is None:
        kv_bytes = default_pool_bytes(
            specs, policy, dtype, max_running, context, chunk, runner.device
        )
    return KVPool.for_budget(
        specs, policy, dtype, kv_bytes, max_running, chunk, device=runner.device,
        max_context=context,
    )  # fmt: skip
