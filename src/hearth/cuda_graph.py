"""Batch-1 decode replayed from CUDA graphs.

An eager decode step launches hundreds of small kernels, and the host's launch time, not the
GPU, sets the pace (HF transformers reaches 1-10% of the bandwidth roofline). Here the step is
captured once per key-length bucket over static caches and replayed: one launch per token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hearth.kv.cache import LayerCache, layer_specs
from hearth.kv.policy import KVPolicy
from hearth.kv.static import StaticCache


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
    """Prefill eagerly, then decode one token per `step` from a captured graph."""

    def __init__(
        self,
        model: nn.Module,
        max_context: int,
        bucket: int = 256,
        policy: KVPolicy | None = None,
    ) -> None:
        self.model = model
        self.bucket = bucket
        self.max_context = -(-max_context // bucket) * bucket
        policy = policy or KVPolicy()
        policy.check(model.config)
        self.caches = [
            StaticCache(self.max_context, spec.window, policy.codec_of(spec.index, spec.window))
            for spec in layer_specs(model.config)
        ]
        device = model.device
        self._token = torch.zeros((1, 1), dtype=torch.long, device=device)
        self._position = torch.zeros((), dtype=torch.long, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.length = 0

    def _set_view(self, tokens: int) -> int:
        """Make full-attention caches expose the smallest bucket holding `tokens` keys."""
        length = min(-(-tokens // self.bucket) * self.bucket, self.max_context)
        for cache in self.caches:
            cache.view_length = length
        return length

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        """Logits [1, vocab] after the prompt `ids` [1, T], run eagerly in chunks."""
        if ids.shape[1] >= self.max_context:
            raise ValueError(f"the prompt ({ids.shape[1]} tokens) fills the context")
        self._set_view(ids.shape[1])
        for start in range(0, ids.shape[1], chunk):
            piece = ids[:, start : start + chunk]
            logits = self.model(piece, self.caches, start=start, last_only=True)[:, -1]
        self.length = ids.shape[1]
        return logits

    def readback(self) -> TokenReadback:
        return TokenReadback()

    @torch.inference_mode()
    def adopt(self, caches: Sequence[LayerCache], length: int) -> None:
        """Continue from dynamic caches that hold `length` tokens (e.g. a prompt-cache hit)."""
        if length >= self.max_context:
            raise ValueError(f"the prompt ({length} tokens) fills the context")
        for static, dynamic in zip(self.caches, caches, strict=True):
            static.load(dynamic.contents())
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
        return logits.clone()

    def _capture(self, view: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._position.fill_(self.length)

        def run() -> torch.Tensor:
            return self.model(self._token, self.caches, start=self._position, last_only=True)[:, -1]

        # Warm up on a side stream (cuBLAS picks kernels), then capture; both runs write one
        # token into the caches, which `reset` forgets.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self._rewind()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = run()
        self._rewind()
        self._graphs[view] = (graph, logits)
        return graph, logits

    def _rewind(self) -> None:
        for cache in self.caches:
            cache.reset(self.length)
