"""Batch-1 decode replayed from CUDA graphs.

An eager decode step launches hundreds of small kernels, and the host's launch time, not the
GPU, sets the pace (HF transformers reaches 1-10% of the bandwidth roofline). Here the step is
captured once per key-length bucket over static caches and replayed: one launch per token.

A short prompt's prefill is host-bound the same way. With the plan's `prefill_graphs`, a
fresh decoder's one-chunk prompt is padded to a bucket and replayed from a graph captured for
that bucket: the caches store only the real tokens (`LayerCache.real_tokens`) and the logits
are those of the last real one (bit-identical to the eager prefill's). Graphs belong to their
decoder's caches, so they pay off when the runner reuses its decoder across requests, and a
bucket's graph is captured the second time a prompt lands in it: a one-off prompt (a CLI run)
never pays for a capture (a warm-up run and the capture, about twice its eager prefill).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hearth.kv.cache import LayerCache
from hearth.kv.footprint import KVFootprint
from hearth.kv.policy import KVPolicy
from hearth.models.decoder import SoftTokens, chunk_end
from hearth.ops.plan import ExecutionPlan

log = logging.getLogger("hearth.runtime.graphs")


class TokenReadback:
    """A sampled token copied to pinned host memory without waiting for later GPU work.

    `start` queues the copy and marks it with an event; `result` waits for that event only,
    so a decode step queued after `start` keeps running while the host reads the token.
    """

    def __init__(self) -> None:
        self._host = torch.empty((1,), dtype=torch.long, pin_memory=True)
        self._copied = torch.cuda.Event()

    def start(self, token: torch.Tensor) -> None:
        self._host.copy_(token.reshape(1), non_blocking=True)
        self._copied.record()

    def result(self) -> int:
        self._copied.synchronize()
        return int(self._host[0])


class GraphDecoder:
    """Prefill eagerly (or from a padded graph), then decode one token per `step` from a
    captured graph, over static caches of `max_context` slots in the KV policy's layout."""

    def __init__(
        self,
        model: nn.Module,
        max_context: int,
        plan: ExecutionPlan | None = None,
        policy: KVPolicy | None = None,
    ) -> None:
        self.model = model
        self.plan = plan or ExecutionPlan.for_device(model.device)
        self.bucket = self.plan.view_bucket
        self.max_context = -(-max_context // self.bucket) * self.bucket
        policy = policy or KVPolicy()
        specs = model.cache_specs()
        policy.check(specs)
        self.caches = [
            LayerCache.pinned_at(
                self.max_context, spec.window, policy.codec_of(spec.index, spec.window)
            )
            for spec in specs
        ]
        device = model.device
        self._token = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._position = torch.zeros((), dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.length = 0
        self.policy = policy
        # Prefill graphs by padded length: graph, logits, the padded ids it reads.
        self._prefill_graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        # The same after stored tokens (a prompt-cache hit), over the whole view.
        self._continuation_graphs: dict[
            int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]
        ] = {}
        self._real = torch.zeros((), dtype=torch.long, device=device)
        self._start = torch.zeros((), dtype=torch.long, device=device)
        self._prefill_graphs_failed = False
        # (bucket, continued) prefilled eagerly once: the next such prompt captures.
        self._prefill_buckets_seen: set[tuple[int, bool]] = set()
        self.graph_bucket: int | None = None  # the last prefill's graph, if it ran from one

    @torch.inference_mode()  # the caches' tensors were made in inference mode
    def reset(self) -> None:
        """Forget every token: the caches are empty and fresh, the graphs stay valid."""
        for cache in self.caches:
            cache.reset(0)
        self.length = 0

    def _set_view(self, tokens: int) -> int:
        """Make full-attention caches expose the smallest bucket holding `tokens` keys."""
        length = min(-(-tokens // self.bucket) * self.bucket, self.max_context)
        for cache in self.caches:
            cache.view_length = length
        return length

    @property
    def continues_hits(self) -> bool:
        """Whether a prompt-cache hit should be adopted first and its new tokens prefilled
        here (from a graph where one applies), not into the hit's dynamic caches."""
        plan = self.plan
        return plan.prefill_graphs and plan.continuation_graphs and self.policy.is_dense

    @torch.inference_mode()
    def prefill(
        self, ids: torch.Tensor, chunk: int = 512, soft: Sequence[SoftTokens] = ()
    ) -> torch.Tensor:
        """Logits [1, vocab] after the tokens `ids` [1, T], which follow the `length` tokens
        held: from a prefill graph where one applies (`graph_bucket` then holds its padded
        length), else eagerly in chunks. `soft`: media soft tokens at their absolute
        positions (graphs take token ids only, so these prefill eagerly)."""
        held, tokens = self.length, ids.shape[1]
        if held + tokens >= self.max_context:
            raise ValueError(f"the prompt ({held + tokens} tokens) fills the context")
        self.graph_bucket = None if soft else self._prefill_bucket(tokens, chunk)
        if self.graph_bucket is not None:
            logits = self._graph_prefill(ids, self.graph_bucket)
            if logits is not None:
                return logits
            self.graph_bucket = None
        self._set_view(held + tokens)
        extra = {"soft": list(soft)} if soft else {}
        start, end = held, held + tokens
        while start < end:
            stop = chunk_end(start, end, chunk, soft)
            piece = ids[:, start - held : stop - held]
            logits = self.model(piece, self.caches, start=start, last_only=True, **extra)[:, -1]
            start = stop
        self.length = end
        return logits

    def _prefill_bucket(self, tokens: int, chunk: int) -> int | None:
        """The padded length a graph prefills these tokens at, or None (eager): graphs on,
        one chunk, dense caches only; on a fresh decoder (the bucket may be longer than the
        caches: only real tokens are stored), or after held tokens with `continues_hits`
        (the full caches must have room for the padded chunk)."""
        if not self.plan.prefill_graphs or self._prefill_graphs_failed or tokens > chunk:
            return None
        if not all(cache.is_dense for cache in self.caches):
            return None
        bucket = next((b for b in self.plan.prefill_buckets if b >= tokens), None)
        if not self.length:
            return bucket if all(cache.is_fresh for cache in self.caches) else None
        if not self.continues_hits or bucket is None:
            return None
        return bucket if self.length + bucket <= self.max_context else None

    def _graph_prefill(self, ids: torch.Tensor, bucket: int) -> torch.Tensor | None:
        tokens, held = ids.shape[1], self.length
        graphs = self._continuation_graphs if held else self._prefill_graphs
        entry = graphs.get(bucket)
        if entry is None:
            seen = (bucket, bool(held))
            if seen not in self._prefill_buckets_seen:  # the first time: eager, no capture
                self._prefill_buckets_seen.add(seen)
                return None
            entry = self._capture_padded(bucket, continued=bool(held))
            if entry is None:
                return None
        graph, logits, padded = entry
        padded.zero_()
        padded[:, :tokens].copy_(ids)
        self._real.fill_(tokens)
        self._start.fill_(held)
        # A continuation graph attends over the whole view (one graph whatever was held).
        self._set_view(self.max_context if held else tokens)
        graph.replay()
        self.length = held + tokens
        self._set_offsets()
        return logits.clone()

    def _capture_padded(
        self, bucket: int, continued: bool
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor] | None:
        """Capture the padded prefill at `bucket` tokens: on a fresh decoder (its warm-up run
        fills the caches, which are emptied after), or (`continued`) after the held tokens,
        over the whole view, with a warm-up run of no real tokens, which stores nothing. On
        any capture error prefill stays eager for this decoder."""
        padded = torch.zeros((1, bucket), dtype=torch.long, device=self._real.device)
        self._real.fill_(0 if continued else bucket)
        if continued:
            self._start.fill_(self.length)
            self._set_view(self.max_context)
        start = self._start if continued else 0
        # A continued warm-up stores no token but leaves each cache's count on the device;
        # telling them the held length again keeps the capture from reading it back.
        undo = self._set_offsets if continued else self.reset

        def run() -> torch.Tensor:
            for cache in self.caches:
                cache.real_tokens = self._real
            try:
                last = (self._real - 1).clamp(min=0)
                return self.model(
                    padded, self.caches, start=start, last_only=True, last_index=last
                )[:, -1]
            finally:
                for cache in self.caches:
                    cache.real_tokens = None

        try:
            graph, logits = _warm_up_and_capture(run, undo, self._prefill_pool())
        except RuntimeError:
            log.exception("prefill graph capture failed; prefilling eagerly")
            self._prefill_graphs_failed = True
            undo()
            return None
        undo()
        graphs = self._continuation_graphs if continued else self._prefill_graphs
        graphs[bucket] = (graph, logits, padded)
        return graph, logits, padded

    def _prefill_pool(self) -> object:
        """One memory pool for all prefill graphs: they never run at the same time."""
        if not hasattr(self, "_pool"):
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def readback(self) -> TokenReadback:
        return TokenReadback()

    @torch.inference_mode()
    def adopt(self, caches: Sequence[LayerCache], length: int) -> None:
        """Continue from caches that hold `length` tokens (e.g. a prompt-cache hit), copied
        into this decoder's pinned ones as stored."""
        if length >= self.max_context:
            raise ValueError(f"the prompt ({length} tokens) fills the context")
        for pinned, held in zip(self.caches, caches, strict=True):
            pinned.load(held.contents())
        self.length = length

    @torch.inference_mode()
    def step(self, token: torch.Tensor) -> torch.Tensor:
        """Logits [1, vocab] after feeding `token` ([1, 1], on the device) at the next position.

        A copy: the graph's own output buffer is overwritten by the next step.
        """
        if self.length >= self.max_context:
            raise ValueError("the context is full")
        view = self._set_view(self.length + 1)
        graph, logits = self._graphs.get(view) or self._capture(view)
        self._token.copy_(token)
        self._position.fill_(self.length)
        graph.replay()
        self.length += 1
        self._set_offsets()
        return logits.clone()

    def _set_offsets(self) -> None:
        """Tell the caches how many tokens a replay stored (it ran no Python)."""
        for cache in self.caches:
            cache.offset = self.length

    def _capture(self, view: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._position.fill_(self.length)

        def run() -> torch.Tensor:
            return self.model(self._token, self.caches, start=self._position, last_only=True)[:, -1]

        # Both runs write one token into the caches, which `_rewind` forgets.
        graph, logits = _warm_up_and_capture(run, self._rewind)
        self._rewind()
        self._graphs[view] = (graph, logits)
        return graph, logits

    def _rewind(self) -> None:
        for cache in self.caches:
            cache.reset(self.length)


def _warm_up_and_capture(
    run: Callable[[], torch.Tensor], undo: Callable[[], None], pool: object = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`run` once on a side stream (cuBLAS and Triton pick their kernels), `undo` what it
    wrote, then capture it: the graph and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    undo()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


def grown_slots(
    model: nn.Module,
    policy: KVPolicy,
    needed: int,
    slots: int,
    slot_limit: int | None,
    bucket: int,
) -> int:
    """`slots`, within the model's positions, `slot_limit` and, beyond the `needed` ones, half
    the device's free memory in K/V slots of `policy`'s layout (a slot grows the
    full-attention layers only: rings keep their window); in whole buckets so that rounding
    up never passes a limit."""
    limit = model.config.max_position_embeddings + 1
    if slot_limit is not None:
        limit = min(limit, slot_limit)
    free = device_free_bytes(model.device)
    if free is not None:
        footprint = KVFootprint.of(model.cache_specs(), model.compute_dtype, policy)
        per_slot = sum(layer.stored for layer in footprint.layers if layer.window is None)
        limit = min(limit, needed + free // 2 // per_slot)
    return min(slots, limit) // bucket * bucket


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device (None elsewhere)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
