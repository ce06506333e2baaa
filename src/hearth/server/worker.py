"""The one generation worker: a thread that owns the model and runs requests first come, first
served, handing each request's text to its asyncio task as it is produced.

One request runs at a time (the model and its caches are not shared), so fairness is the FIFO
order of the queue. A request whose client went away is cancelled between two tokens, and one
cancelled before its turn is skipped.

The decode loop is `hearth.generate.stream_generate`, with the job's cancel flag checked at
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
from hearth.generate import GenerationChunk, GenerationStats, stream_generate
from hearth.kv import LayerCache
from hearth.sampling import SamplingParams
from hearth.server.prompt_cache import PromptCache, Reuse, snapshot_caches

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
    running: int = 0  # 1 while a generation runs

    def count(self, stats: GenerationStats) -> None:
        self.requests += 1
        self.prompt_tokens += stats.prompt_tokens
        self.cached_tokens += stats.cached_tokens
        self.generated_tokens += stats.generated_tokens


class GenerationWorker:
    def __init__(self, engine: Engine, prompt_cache: PromptCache | None = None) -> None:
        self.engine = engine
        self.prompt_cache = prompt_cache
        self.counters = WorkerCounters()
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
        """Requests waiting for their turn, plus the one running."""
        return self._jobs.qsize() + self.counters.running

    async def stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str],
        stop_ids: tuple[int, ...] | None = None,
        top_logprobs: int | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """The pieces of one generation, in order, ending with the one that has finish_reason.

        Leaving the iteration early (client gone, task cancelled) cancels the generation.
        """
        batches = self.stream_batches(
            prompt_ids, max_tokens, sampling, stop, stop_ids, top_logprobs
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
    ) -> AsyncIterator[list[GenerationChunk]]:
        """As `stream`, but all the pieces ready at once come together (a stream writes them
        in one send: the model never waits for a token, the client gets no extra delay)."""
        loop = asyncio.get_running_loop()
        job = GenerationJob(prompt_ids, max_tokens, sampling, stop, stop_ids, top_logprobs, loop)
        self._jobs.put(job)
        try:
            async for batch in job.batches():
                yield batch
        finally:
            job.cancelled.set()

    def _run(self) -> None:
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
        reuse = self._caches_for(job.prompt_ids)
        boundary: list[list[LayerCache]] = []  # the caches holding exactly the prompt
        keep = self.prompt_cache is not None
        # A miss with dense K/V: no caches given, so on a GPU the prompt goes straight into
        # the graph decoder's static caches (from a prefill graph once one is captured), not
        # into dynamic ones that decode would copy. Quantized K/V keeps dynamic caches: a
        # snapshot of static ones would be re-encoded.
        given = reuse.cached_tokens or not self.engine.kv_policy.is_dense
        new_caches = self.engine.new_caches
        chunks = stream_generate(
            self.engine.model,
            self.engine.tokenizer,
            job.prompt_ids,
            job.sampling,
            job.max_tokens,
            job.stop,
            job.stop_ids,
            cancelled=job.cancelled.is_set,
            caches=reuse.caches if given else None,
            cached_tokens=reuse.cached_tokens,
            on_prefilled=(
                (lambda caches: boundary.append(snapshot_caches(caches, new_caches)))
                if keep
                else None
            ),
            top_logprobs=job.top_logprobs,
            kv_policy=self.engine.kv_policy,
        )
        finished = False
        for chunk in chunks:
            if chunk.stats is not None:  # the last piece: the caches will not change again
                self._finish(job, boundary, chunk.stats)
                finished = True
            job.deliver(chunk)
        if not finished:  # its request ended first: the flag is also set after a whole reply
            self._cancelled("while generating")

    def _cancelled(self, when: str) -> None:
        self.counters.cancelled += 1
        log.info("generation cancelled %s: its request ended (client gone or shutdown)", when)

    def _finish(
        self, job: GenerationJob, boundary: list[list[LayerCache]], stats: GenerationStats
    ) -> None:
        """Count the generation and keep its prompt-boundary caches, before the client hears
        it has ended (so its next turn, and /stats, find them)."""
        self.counters.count(stats)
        if self.prompt_cache is not None and boundary:
            self.prompt_cache.put(job.prompt_ids, boundary[0])

    def _caches_for(self, prompt_ids: list[int]) -> Reuse:
        if self.prompt_cache is None:
            return Reuse(self.engine.new_caches(), 0)
        return self.prompt_cache.take(prompt_ids, self.engine.new_caches)
