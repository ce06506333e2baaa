"""The one generation worker: a thread that owns the model and runs requests first come, first
served, handing each request's text to its asyncio task as it is produced.

One request runs at a time (the model and its caches are not shared), so fairness is the FIFO
order of the queue. A request whose client went away is cancelled between two tokens, and one
cancelled before its turn is skipped.

The decode loop is `hearth.generate.stream_generate`, with the job's cancel flag checked at
every token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from hearth.engine import Engine
from hearth.generate import GenerationChunk, stream_generate
from hearth.sampling import SamplingParams

log = logging.getLogger("hearth.server")


@dataclass
class GenerationJob:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: Sequence[str]
    stop_ids: tuple[int, ...] | None
    loop: asyncio.AbstractEventLoop
    results: asyncio.Queue[GenerationChunk | BaseException] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def deliver(self, item: GenerationChunk | BaseException) -> None:
        """Hand one item to the waiting request; cancels the job if its event loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self.results.put_nowait, item)
        except RuntimeError:  # the loop closed: the server is shutting down
            self.cancelled.set()


class GenerationWorker:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._jobs: queue.Queue[GenerationJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="hearth-generation", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

    async def stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop: Sequence[str],
        stop_ids: tuple[int, ...] | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """The pieces of one generation, in order, ending with the one that has finish_reason.

        Leaving the iteration early (client gone, task cancelled) cancels the generation.
        """
        loop = asyncio.get_running_loop()
        job = GenerationJob(prompt_ids, max_tokens, sampling, stop, stop_ids, loop)
        self._jobs.put(job)
        try:
            while True:
                item = await job.results.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            job.cancelled.set()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if job.cancelled.is_set():
                continue
            try:
                self._generate(job)
            except Exception as error:  # reported to its request; the worker keeps serving
                log.exception("generation failed")
                job.deliver(error)

    def _generate(self, job: GenerationJob) -> None:
        chunks = stream_generate(
            self.engine.model,
            self.engine.tokenizer,
            job.prompt_ids,
            job.sampling,
            job.max_tokens,
            job.stop,
            job.stop_ids,
            cancelled=job.cancelled.is_set,
            caches=self.engine.new_caches(),
        )
        for chunk in chunks:
            job.deliver(chunk)
        if job.cancelled.is_set():
            log.info("generation cancelled")
