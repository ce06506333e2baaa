"""The one generation worker: a thread that owns the model and runs requests first come, first
served, handing each request's text to its asyncio task as it is produced.

With `max_concurrent` 1 one request runs at a time, so fairness is the FIFO order of the
queue; with more, a `Scheduler` batches them on a paged K/V pool, admitted first come, first
served. A request whose client went away is cancelled between two tokens, and one
cancelled before its turn is skipped.

The decode loop is `hearth.runtime.generate.stream_generate`, with the job's cancel flag checked at
every token. Its caches come from the prompt cache (when the server has one), and go back to it
once the request ends.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from hearth.engine import Engine
from hearth.kv.prompt_cache import PromptCache
from hearth.runtime.constraints import OutputConstraint
from hearth.runtime.generate import (
    GenerationChunk,
    GenerationRequest,
    GenerationStats,
    PromptMedia,
)
from hearth.runtime.sampling import SamplingParams
from hearth.runtime.scheduler import Deliver, Scheduler

log = logging.getLogger("hearth.server")


@dataclass
class GenerationJob:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str]
    stop_ids: tuple[int, ...] | None
    top_logprobs: int | None  # None: no log-probabilities
    loop: asyncio.AbstractEventLoop
    constraint: OutputConstraint | None = None  # what the text must match (None: anything)
    media: tuple[PromptMedia, ...] = ()  # the prompt's images and audio, in order
    cancelled: threading.Event = field(default_factory=threading.Event)
    # Items handed over by the worker thread, taken by the request's task. One wake-up of the
    # event loop per burst, not per item: a wake-up is a syscall plus a loop iteration on the
    # HTTP thread, which competes with the model's threads for the same cores.
    _ready: deque[GenerationChunk | BaseException] = field(default_factory=deque, init=False)
    _wake_pending: bool = field(default=False, init=False)
    _woken: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def deliver(self, item: GenerationChunk | BaseException) -> None:
        """Hand one item to the waiting request; cancels the job if its event loop is gone."""
        self._ready.append(item)  # before the flag is read: see `batches`
        if self._wake_pending:
            return  # the request's task will drain the deque before it waits again
        self._wake_pending = True
        try:
            self.loop.call_soon_threadsafe(self._woken.set)
        except RuntimeError:  # the loop closed: the server is shutting down
            self.cancelled.set()

    async def batches(self) -> AsyncIterator[list[GenerationChunk]]:
        """Everything delivered since the last batch, in order; waits only when nothing is.

        Ends after the piece with finish_reason; a delivered exception is raised in its place.
        """
        while True:
            # Cleared before draining: an item appended after the drain sees the flag down
            # and wakes us again, so nothing is left behind.
            self._wake_pending = False
            batch: list[GenerationChunk] = []
            while self._ready:
                item = self._ready.popleft()
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                batch.append(item)
                if item.finish_reason is not None:
                    yield batch
                    return
            if batch:
                yield batch
                continue
            await self._woken.wait()
            self._woken.clear()


@dataclass
class WorkerCounters:
    """What the worker has done since it started (GET /stats and /metrics)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    cancelled: int = 0  # requests that ended before their generation did (client gone)
    running: int = 0  # generations admitted (prefilling or decoding)
    waiting: int = 0  # generations queued behind them

    def count(self, stats: GenerationStats) -> None:
        self.requests += 1
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.generated_tokens += stats.generated_tokens


class GenerationWorker:
    """Runs the server's generations: with `max_concurrent` 1 one at a time, first come,
    first served (each through `Engine.run`: on a GPU its CUDA graphs); with more, as a
    `Scheduler` batching up to that many at once. `kv_room`: the K/V bytes the admitted
    requests may reach together (a memory budget's room beside the weights)."""

    def __init__(
        self,
        engine: Engine,
        prompt_cache: PromptCache | None = None,
        max_concurrent: int = 1,
        kv_room: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_concurrent = max_concurrent
        self.kv_room = kv_room
        self.counters = WorkerCounters()
        # Several at once: a scheduler on a paged pool (made now, so a pool that cannot hold
        # a request stops the server at start), whose block prefix cache replaces the
        # snapshot prompt cache (kept for the one-at-a-time path, a GPU's CUDA graphs).
        self.scheduler: Scheduler | None = None
        self.prompt_cache = prompt_cache
        if max_concurrent > 1:
            self.scheduler = engine.scheduler(
                max_concurrent,
                prompt_cache is not None,
                kv_room,
                on_cancelled=lambda: self._cancelled("while generating"),
            )
            self.prompt_cache = None
            if self.scheduler.max_context == 0:
                raise ValueError(
                    f"the K/V pool ({self.scheduler.pool.describe()}) holds no request: "
                    "give --kv-cache-memory (or --memory-budget) more room"
                )
        self._jobs: queue.Queue[GenerationJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hearth-generation", daemon=True)

    def start(self) -> None:
        """Serve jobs on a thread of its own (in-process apps, tests)."""
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def run(self) -> None:
        """Serve jobs on the calling thread until `stop` (`hearth serve` runs the model on the
        main thread: from another thread PyTorch's CPU kernels decode 10-30% slower here)."""
        self._run()

    @property
    def queue_depth(self) -> int:
        """Requests waiting for their turn, plus those running."""
        return self._jobs.qsize() + self.counters.waiting + self.counters.running

    async def stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str],
        stop_ids: tuple[int, ...] | None = None,
        top_logprobs: int | None = None,
        constraint: OutputConstraint | None = None,
        media: tuple[PromptMedia, ...] = (),
    ) -> AsyncIterator[GenerationChunk]:
        """The pieces of one generation, in order, ending with the one that has finish_reason.

        Leaving the iteration early (client gone, task cancelled) cancels the generation.
        """
        batches = self.stream_batches(
            prompt_ids, max_tokens, sampling, stop, stop_ids, top_logprobs, constraint, media
        )
        try:
            async for batch in batches:
                for item in batch:
                    yield item
        finally:
            await batches.aclose()

    async def stream_batches(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str],
        stop_ids: tuple[int, ...] | None = None,
        top_logprobs: int | None = None,
        constraint: OutputConstraint | None = None,
        media: tuple[PromptMedia, ...] = (),
    ) -> AsyncIterator[list[GenerationChunk]]:
        """As `stream`, but all the pieces ready at once come together (a stream writes them
        in one send: the model never waits for a token, the client gets no extra delay)."""
        loop = asyncio.get_running_loop()
        job = GenerationJob(
            prompt_ids, max_tokens, sampling, stop, stop_ids, top_logprobs, loop, constraint, media
        )
        self._jobs.put(job)
        try:
            async for batch in job.batches():
                yield batch
        finally:
            job.cancelled.set()

    def _run(self) -> None:
        if self.max_concurrent > 1:
            self._run_batched()
            return
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                self._cancelled("before its turn")
                continue
            self.counters.running = 1
            try:
                self._generate(job)
            except Exception as error:  # reported to its request; the worker keeps serving
                log.exception("generation failed")
                job.deliver(error)
            finally:
                self.counters.running = 0

    def _generate(self, job: GenerationJob) -> None:
        finished = False
        for chunk in self.engine.run(_request_of(job), job.cancelled.is_set, self.prompt_cache):
            if chunk.stats is not None:  # the last piece: counted before the client hears it
                self.counters.count(chunk.stats)
                finished = True
            job.deliver(chunk)
        if not finished:  # its request ended first: the flag is also set after a whole reply
            self._cancelled("while generating")

    def _run_batched(self) -> None:
        scheduler = self.scheduler
        assert scheduler is not None
        while True:
            for job in self._new_jobs(wait=scheduler.idle):
                if job is None:
                    return
                try:
                    scheduler.submit(_request_of(job), self._delivery(job), job.cancelled.is_set)
                except ValueError as error:  # reported to its request
                    job.deliver(error)
            # Counted before the step too: a step hands out tokens, and a request whose client
            # has seen one must count as in progress (a shutdown reports what drains).
            self._count(scheduler)
            if not scheduler.idle:
                scheduler.step()
            self._count(scheduler)

    def _count(self, scheduler: Scheduler) -> None:
        self.counters.running = scheduler.active
        self.counters.waiting = len(scheduler.waiting)

    def _new_jobs(self, wait: bool) -> list[GenerationJob | None]:
        """The jobs queued since the last look; with `wait`, at least one (or the stop)."""
        jobs: list[GenerationJob | None] = [self._jobs.get()] if wait else []
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def _delivery(self, job: GenerationJob) -> Deliver:
        def deliver(item: GenerationChunk | BaseException) -> None:
            if isinstance(item, GenerationChunk) and item.stats is not None:
                self.counters.count(item.stats)  # the last piece: counted before it is handed on
            job.deliver(item)

        return deliver

    def _cancelled(self, when: str) -> None:
        self.counters.cancelled += 1
        log.info("generation cancelled %s: its request ended (client gone or shutdown)", when)


def _request_of(job: GenerationJob) -> GenerationRequest:
    return GenerationRequest(
        job.prompt_ids,
        job.max_tokens,
        job.sampling,
        job.stop,
        job.stop_ids,
        job.top_logprobs,
        job.constraint,
        job.media,
    )
