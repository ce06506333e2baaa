"""The generate loop: prefill, decode, sampling, stop ids and stop strings, streaming,
statistics. It drives a `ModelRunner` and knows nothing about kernels or HTTP."""

from __future__ import annotations

import hashlib
import resource
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hearth.kv import LayerCache
from hearth.lengths import generation_limit
from hearth.media import Audio, Image, MediaError
from hearth.models import Model
from hearth.models.decoder import SoftTokens
from hearth.runtime.constraints import GrammarMatcher, OutputConstraint, matcher_for
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import Sampler, SamplingParams
from hearth.tokenizer import Tokenizer

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens already in the caches, not prefilled
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def prefill_tokens_per_second(self) -> float:
        prefilled = self.prompt_tokens - self.cached_tokens
        return prefilled / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes from the prefill; decode speed counts the steps after it.
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else 0.0

    def summary(self) -> str:
        return (
            f"prompt: {self.prompt_tokens} tokens, {self.prefill_tokens_per_second:.1f} tok/s | "
            f"generation: {self.generated_tokens} tokens, "
            f"{self.decode_tokens_per_second:.1f} tok/s | "
            f"peak memory: {self.peak_memory_bytes / 2**30:.2f} GiB"
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probability, and the most likely tokens at its step.

    The distribution is log_softmax of the logits after the logit processors (bias, penalties)
    and before the temperature and the top-p/min-p/top-k filters: `Sampler.logprobs`, the
    numbers mlx-lm reports.
    """

    token: int
    logprob: float
    top_tokens: tuple[int, ...] = ()  # most likely first
    top_logprobs: tuple[float, ...] = ()


@dataclass
class LogprobRecorder:
    """Asks `generate_tokens` for every token's `TokenLogprobs` with `top` alternatives (0 or
    more); they gather in `records` until taken."""

    top: int = 0
    records: list[TokenLogprobs] = field(default_factory=list)

    def record(self, logprobs: torch.Tensor, token: int) -> None:
        """Read one step's record off the device (`logprobs`: [vocab]) in a single copy."""
        top = min(self.top, logprobs.shape[-1])
        values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0])
        # Ids below 2**53 are exact in float64, so one tensor carries everything at once.
        chosen = logprobs[token : token + 1]
        numbers = torch.cat([chosen.double(), values.double(), ids.double()]).tolist()
        top_ids = tuple(int(i) for i in numbers[1 + top :])
        self.records.append(TokenLogprobs(token, numbers[0], top_ids, tuple(numbers[1 : 1 + top])))

    def take(self) -> tuple[TokenLogprobs, ...]:
        taken, self.records = tuple(self.records), []
        return taken


@dataclass(frozen=True)
class GenerationChunk:
    """One streamed piece: new text (possibly empty) and, at the end, why generation stopped.

    `logprobs` (only when asked for) holds the records of the tokens generated since the
    previous chunk, in order: across a stream every generated token appears exactly once, also
    those whose text is held back, cut by a stop string, or an end id (no text at all).
    """

    text: str
    token: int | None
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the text, if one did
    stats: GenerationStats | None = field(default=None, compare=False)
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class PromptMedia:
    """One image or audio clip in a prompt: its soft tokens are `prompt_ids[start:start+length]`."""

    start: int
    length: int
    item: Image | Audio


@dataclass(frozen=True)
class GenerationRequest:
    """One generation, as a face (the CLI, the server) hands it to the engine."""

    prompt_ids: list[int]
    max_tokens: int | None = None  # None: DEFAULT_MAX_TOKENS, shrunk to fit the context
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    stop_ids: tuple[int, ...] | None = None  # None: the tokenizer's end-of-sequence ids
    top_logprobs: int | None = None  # None: no log-probabilities
    constraint: OutputConstraint | None = None  # what the text must match (None: anything)
    media: tuple[PromptMedia, ...] = ()  # the prompt's images and audio, in order

    @property
    def cache_ids(self) -> list[int]:
        """The prompt as the prompt cache keys it: `media_cache_ids`."""
        return media_cache_ids(self.prompt_ids, self.media)


# Soft-token keys: -1 - (content hash << _INDEX_BITS | index), below every real token id.
_INDEX_BITS = 12
_HASH_BITS = 48


def media_cache_ids(prompt_ids: Sequence[int], media: Sequence[PromptMedia]) -> list[int]:
    """`prompt_ids` with each media item's soft tokens replaced by keys derived from its
    content (digest, budget, token count) and index: the placeholder ids are the same for
    every image, so two different images never share a prefix, and the same image again does.
    """
    ids = list(prompt_ids)
    for span in media:
        budget = getattr(span.item, "max_tokens", None)
        name = f"{span.item.digest}/{budget}/{span.length}".encode()
        content = int.from_bytes(hashlib.sha256(name).digest()[: _HASH_BITS // 8], "big")
        for index in range(span.length):
            ids[span.start + index] = -1 - (content << _INDEX_BITS | index % (1 << _INDEX_BITS))
    return ids


def soft_tokens(
    runner: ModelRunner, media: Sequence[PromptMedia], cached_tokens: int = 0
) -> list[SoftTokens]:
    """Each media item's soft tokens from the model's tower for it, placed at its span; none
    for the items wholly within the `cached_tokens` a prompt-cache hit already holds."""
    placed = []
    for span in media:
        if span.start + span.length <= cached_tokens:
            continue
        encoded = runner.model.embed_media(span.item)  # type: ignore[union-attr]
        if encoded.embeddings.shape[0] != span.length:
            raise MediaError(
                f"the prompt holds {span.length} soft tokens for an item the model encodes "
                f"into {encoded.embeddings.shape[0]}"
            )
        placed.append(replace(encoded, start=span.start))
    return placed


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: allocator peak on CUDA, peak resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """This process's peak resident set. On Linux, VmHWM: ru_maxrss carries a parent's peak
    across fork and exec, so a process started by a large one would report the parent's."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        kilobytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kilobytes if sys.platform == "darwin" else kilobytes * 1024
    line = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


class StopStrings:
    """Cuts text at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.stopped = False
        self.matched: str | None = None
        self._pending = ""

    def feed(self, text: str) -> str:
        """The text safe to emit; sets `stopped` (and `matched`) once a stop string is reached."""
        self._pending += text
        hits = [(i, stop) for stop in self.stops if (i := self._pending.find(stop)) >= 0]
        if hits:
            cut, self.matched = min(hits, key=lambda hit: hit[0])
            emitted, self._pending, self.stopped = self._pending[:cut], "", True
            return emitted
        cut = len(self._pending) - self._longest_partial_stop()
        emitted, self._pending = self._pending[:cut], self._pending[cut:]
        return emitted

    def flush(self) -> str:
        rest, self._pending = self._pending, ""
        return rest

    def _longest_partial_stop(self) -> int:
        text = self._pending
        for size in range(min(len(text), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            if any(stop.startswith(text[-size:]) for stop in self.stops):
                return size
        return 0


class Reply:
    """One request's tokens turned into its chunks: end ids, stop strings, the text as it
    detokenizes, and each token's log-probabilities when asked for. `add` takes each token and
    says whether the reply has ended; `finish` gives the last chunk."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        stop_ids: Sequence[int] | None = None,
        top_logprobs: int | None = None,
    ) -> None:
        self.end_ids = frozenset(tokenizer.eos_ids if stop_ids is None else stop_ids)
        self.detokenizer = tokenizer.detokenizer()
        self.stops = StopStrings(stop)
        # Asks the loop for every token's log-probabilities (None: none are computed).
        self.recorder = None if top_logprobs is None else LogprobRecorder(top_logprobs)
        self.finish_reason = FINISH_LENGTH
        self.ended = False

    def grammar_matcher(
        self, constraint: OutputConstraint | None, tokenizer: Tokenizer, vocab_size: int
    ) -> GrammarMatcher | None:
        """A matcher for `constraint` whose stop tokens are this reply's end ids."""
        if constraint is None:
            return None
        return matcher_for(constraint, tokenizer, vocab_size, self.end_ids)

    def check_grammar(self, matcher: GrammarMatcher | None) -> None:
        """End the reply where its grammar is complete and no end id is left to sample."""
        if matcher is not None and matcher.terminated and not self.ended:
            self.finish_reason, self.ended = FINISH_STOP, True

    def add(self, token: int) -> GenerationChunk | None:
        """The chunk `token` completes, if any; sets `ended` at an end id or a stop string."""
        if token in self.end_ids:
            self.finish_reason, self.ended = FINISH_STOP, True
            return None
        text = self.stops.feed(self.detokenizer.add_token(token))
        if self.stops.stopped:
            self.finish_reason, self.ended = FINISH_STOP, True
        return GenerationChunk(text, token, logprobs=self._records()) if text else None

    def finish(self, stats: GenerationStats) -> GenerationChunk:
        """The last chunk: the text held back, why the reply ended, and `stats`."""
        tail = ""
        stops = self.stops
        if not stops.stopped:
            tail = stops.feed(self.detokenizer.flush())
            tail += "" if stops.stopped else stops.flush()
            if stops.stopped:
                self.finish_reason = FINISH_STOP
        return GenerationChunk(
            tail, None, self.finish_reason, stops.matched, stats, self._records()
        )

    def _records(self) -> tuple[TokenLogprobs, ...] | None:
        return None if self.recorder is None else self.recorder.take()


def as_runner(model: Model | ModelRunner) -> ModelRunner:
    """`model`'s runner: itself if a runner, else a new one with the device's default plan."""
    return model if isinstance(model, ModelRunner) else ModelRunner(model)


@torch.inference_mode()
def generate_tokens(
    model: Model | ModelRunner,
    prompt_ids: Sequence[int],
    sampler: Sampler,
    max_tokens: int,
    stats: GenerationStats,
    caches: list[LayerCache] | None = None,
    prefill_step: int | None = None,
    cached_tokens: int = 0,
    on_prefilled: Callable[[list[LayerCache]], None] | None = None,
    logprobs: LogprobRecorder | None = None,
    grammar: GrammarMatcher | None = None,
    media: Sequence[PromptMedia] = (),
) -> Iterator[int]:
    """Token ids, one per step, until `max_tokens`; the caller decides when to stop early.

    With no `caches` given, the runner makes them in its KV policy: static ones decoded
    through CUDA graphs where its plan says so, dynamic ones elsewhere.

    `cached_tokens`: how many leading prompt tokens `caches` already hold (a prompt cache
    hit); only the rest is prefilled, and at least one token must be left to prefill.
    `on_prefilled` sees the caches once they hold exactly the prompt (a prompt cache keeps a
    snapshot there). `logprobs`: records each token's log-probabilities before it is yielded
    (None: none are computed). `grammar`: masks each step's logits and advances on its token.
    `media`: the prompt's images and audio, encoded by their towers before the prefill, which
    then runs eagerly (the graph prefills take token ids only), into the graph decoder's
    caches where there is one.
    """
    runner = as_runner(model)
    if not 0 <= cached_tokens < len(prompt_ids):
        raise ValueError(f"cached_tokens {cached_tokens} must leave a prompt token to prefill")
    vocab = runner.model.config.vocab_size
    if (bad := next((i for i in prompt_ids if not 0 <= i < vocab), None)) is not None:
        # Checked here: the GPU's embedding kernels read rows unchecked.
        raise ValueError(f"prompt token id {bad} is outside the vocabulary of {vocab}")
    device = runner.device
    history = list(prompt_ids)
    prompt = torch.tensor([history[cached_tokens:]], dtype=torch.long, device=device)
    stats.prompt_tokens = len(history)
    stats.cached_tokens = cached_tokens
    started = decode_started = time.perf_counter()
    prefill_step = prefill_step or runner.plan.prefill_chunk
    graph = (
        runner.acquire_decoder(len(history) + max_tokens + 1)
        if runner.decodes_with_graphs
        else None
    )
    try:
        soft = soft_tokens(runner, media, cached_tokens) if media else []
        if graph is not None and caches is None:
            caches = graph.caches
            logits = graph.prefill(prompt, prefill_step, soft)
        elif graph is not None and cached_tokens and graph.continues_hits:
            graph.adopt(caches, cached_tokens)  # the hit first, then its new tokens
            caches = graph.caches
            logits = graph.prefill(prompt, prefill_step, soft)
        else:
            caches = runner.new_caches() if caches is None else caches
            logits = runner.prefill(prompt, caches, cached_tokens, prefill_step, soft)
        if on_prefilled is not None:
            on_prefilled(caches)
        if graph is not None and caches is not graph.caches:
            graph.adopt(caches, len(history))  # given caches (a prompt cache): decode via graphs
        readback = graph.readback() if graph is not None else None
        sampled, distribution = sample_next(sampler, logits, history, logprobs is not None, grammar)
        for produced in range(max_tokens):
            more = produced + 1 < max_tokens
            if more and graph is not None and readback is not None:
                # Queue the next step before reading this token back: the GPU never waits for
                # the host, which reads the token while the step runs.
                readback.start(sampled)
                logits = graph.step(sampled.reshape(1, 1))
                token = readback.result()
            else:
                token = int(sampled)
            if logprobs is not None and distribution is not None:
                logprobs.record(distribution.reshape(-1), token)
            now = time.perf_counter()
            if produced == 0:
                stats.prefill_seconds = now - started
                decode_started = now
            else:
                stats.decode_seconds = now - decode_started
            stats.generated_tokens = produced + 1
            history.append(token)
            if grammar is not None:
                grammar.advance(token)
            yield token
            if more:
                if graph is None:
                    logits = runner.decode(token, caches, len(history) - 1)
                sampled, distribution = sample_next(
                    sampler, logits, history, logprobs is not None, grammar
                )
    finally:
        if graph is not None:  # its caches and graphs serve the next request
            runner.release_decoder(graph)


def sample_next(
    sampler: Sampler,
    logits: torch.Tensor,
    history: list[int],
    with_logprobs: bool,
    grammar: GrammarMatcher | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next token on the device (no host sync) and, if asked, its logprob row; with a
    `grammar`, among the tokens it allows (greedy or sampled alike)."""
    if grammar is not None:
        logits = grammar.mask(logits)
    if with_logprobs:
        return sampler.sample_with_logprobs(logits, history)
    return sampler.sample(logits, history), None


def stream_generate(
    model: Model | ModelRunner,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    sampling: SamplingParams | None = None,
    max_tokens: int | None = None,
    stop: Sequence[str] = (),
    stop_ids: Sequence[int] | None = None,
    cancelled: Callable[[], bool] | None = None,
    caches: list[LayerCache] | None = None,
    cached_tokens: int = 0,
    on_prefilled: Callable[[list[LayerCache]], None] | None = None,
    top_logprobs: int | None = None,
    constraint: OutputConstraint | None = None,
    media: Sequence[PromptMedia] = (),
) -> Iterator[GenerationChunk]:
    """Stream text as it is generated; the last chunk carries `finish_reason` and the stats.

    `cached_tokens`, `on_prefilled`, `media`: see `generate_tokens`. `top_logprobs`: None
    computes no log-probabilities; a count (0 or more) fills each chunk's `logprobs`, with that many
    alternatives per token. `constraint`: what the text must match; the reply ends where it
    is complete (its end ids are allowed only there).

    `max_tokens`: see `hearth.lengths.generation_limit` (None: the default, shrunk to fit).
    `cancelled` is checked before each token; once it returns true the stream ends at once,
    without a final chunk (a server's client went away).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    runner = as_runner(model)
    positions = runner.model.config.max_position_embeddings
    max_tokens = generation_limit(len(prompt_ids), max_tokens, positions)
    sampling = sampling or SamplingParams()
    sampling.validate(runner.model.config.vocab_size)
    sampler = Sampler(sampling, device=runner.device)
    reply = Reply(tokenizer, stop, stop_ids, top_logprobs)
    grammar = reply.grammar_matcher(constraint, tokenizer, runner.model.config.vocab_size)
    stats = GenerationStats()
    tokens = generate_tokens(
        runner,
        prompt_ids,
        sampler,
        max_tokens,
        stats,
        caches,
        cached_tokens=cached_tokens,
        on_prefilled=on_prefilled,
        logprobs=reply.recorder,
        grammar=grammar,
        media=media,
    )
    for token in tokens:
        if cancelled is not None and cancelled():
            return
        chunk = reply.add(token)
        reply.check_grammar(grammar)
        if chunk is not None:
            yield chunk
        if reply.ended:
            break
    stats.peak_memory_bytes = peak_memory_bytes(runner.device)
    yield reply.finish(stats)
