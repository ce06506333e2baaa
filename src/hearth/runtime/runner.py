"""The model runner: one model under one execution plan and KV policy.

It owns everything a run keeps besides the weights: the caches it makes, the step strategies
(the eager forward, the native CPU layer step, the CUDA-graph decoder) and what they keep
between requests (the idle graph decoder and its captured graphs, the native layers'
operands). Nothing is stored on the model, so two runners of one model (an A/B of two plans)
do not see each other.
"""

from __future__ import annotations

import weakref

import torch

from hearth.kv import KVPolicy, LayerCache
from hearth.kv.paged import KVPool, PagedLayerCache, PagedSequence
from hearth.layers.attention import RaggedBatch, SequenceBatch
from hearth.layers.experts import Experts
from hearth.models import Model
from hearth.models.decoder import SoftTokens, chunk_end
from hearth.ops import HAS_TRITON
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.batch_graphs import BatchDecoder
from hearth.runtime.graphs import GraphDecoder, grown_slots

__all__ = ["ModelRunner", "chunk_end"]
from hearth.runtime.native_step import NativeDecodeStep


class ModelRunner:
    """Runs `model`'s forwards: prefill in chunks, decode steps by the fastest strategy the
    plan allows, and graph decoders reused across requests."""

    def __init__(
        self,
        model: Model,
        plan: ExecutionPlan | None = None,
        kv_policy: KVPolicy | None = None,
    ) -> None:
        self.model = model
        self.plan = plan or ExecutionPlan.for_device(model.device)
        self.kv_policy = kv_policy or KVPolicy()
        self.kv_policy.check(model.cache_specs())
        self.native = NativeDecodeStep(model) if self.plan.native_layers else None
        # The most K/V slots a graph decoder may take beyond what its request needs (what a
        # server's memory budget leaves for K/V); None: the model's positions.
        self.slot_limit: int | None = None
        self._idle: GraphDecoder | None = None
        # Batched decoders by the pool they run on, kept while it lives (not keeping it).
        self._batch: weakref.WeakKeyDictionary[KVPool, BatchDecoder] = weakref.WeakKeyDictionary()
        self.capture_seconds = 0.0  # spent capturing batched decode graphs, all decoders
        # `decodes_with_graphs` under the plan it was found for (it walks the modules).
        self._graphs_under: tuple[ExecutionPlan, bool] | None = None

    # Rows a batched decoder is made with at least (its graph buckets go that far).
    BATCH_ROWS = 64

    @property
    def device(self) -> torch.device:
        return self.model.device

    def new_caches(self) -> list[LayerCache]:
        """Empty caches of the runner's KV policy, one per layer that stores K/V."""
        return self.kv_policy.make_caches(self.model.cache_specs())

    @property
    def decodes_with_graphs(self) -> bool:
        """Whether decode runs from CUDA graphs: the plan says so, on a CUDA model whose MoE
        blocks, if any, run on the gathered-expert kernels (the per-expert loop synchronises
        with the host, which a graph cannot capture)."""
        model = self.model
        if not (self.plan.cuda_graphs and model.device.type == "cuda" and HAS_TRITON):
            return False
        return all(m.kernels_cover_weights for m in model.modules() if isinstance(m, Experts))

    def prefill(
        self,
        prompt: torch.Tensor,
        caches: list[LayerCache],
        position: int = 0,
        chunk: int | None = None,
        soft: list[SoftTokens] | None = None,
    ) -> torch.Tensor:
        """Run `prompt` [1, T] (its first token at `position`) through the model in chunks of
        the plan's `prefill_chunk` (or `chunk`); the last position's logits [1, V].

        `soft`: media soft tokens at their absolute positions; a chunk never splits one that
        attends bidirectionally (`chunk_end`)."""
        step = chunk or self.plan.prefill_chunk
        end = position + prompt.shape[1]
        extra = {"soft": soft} if soft else {}
        start = position
        while True:
            stop = chunk_end(start, end, step, soft or ())
            piece = prompt[:, start - position : stop - position]
            logits = self.model(piece, caches, start=start, last_only=True, **extra)
            if stop == end:
                return logits[:, -1]
            start = stop

    def prefill_ragged(
        self,
        pieces: list[list[int]],
        caches: list[list[LayerCache]],
        starts: list[int],
        logits_of: list[bool],
    ) -> torch.Tensor:
        """One forward over several sequences' prompt chunks (`pieces[i]`, its first token at
        `starts[i]`, into `caches[i]`), their tokens side by side: one GEMM per projection
        over all their rows, RoPE positions, K/V writes and attention per sequence. The
        logits [n, V] of the last token of each sequence where `logits_of` says, in order
        (the head runs over those rows only). Chunks whose soft tokens attend to each other
        (media) take `prefill`, alone."""
        device = self.device
        counts = [len(piece) for piece in pieces]
        ids = torch.tensor([[token for piece in pieces for token in piece]], device=device)
        positions = torch.cat(
            [
                torch.arange(start, start + count)
                for start, count in zip(starts, counts, strict=True)
            ]
        ).to(device)
        ends = torch.tensor(counts).cumsum(0) - 1
        rows = ends[torch.tensor(logits_of, dtype=torch.bool)].to(device)
        layers = [
            RaggedBatch(list(layer), counts, logits_of) for layer in zip(*caches, strict=True)
        ]
        logits = self.model(ids, layers, last_only=True, last_index=rows, positions=positions)
        return logits[0]

    def decode(self, token: int, caches: list[LayerCache], position: int) -> torch.Tensor:
        """Logits [1, V] after `token` at `position`: one native call per layer where the plan
        and the caches allow it, the modules otherwise."""
        ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        if self.native is not None and self.native.applies(ids, caches):
            logits = self.native(ids, caches, position)
            if logits is not None:
                return logits[:, -1]
        return self.model(ids, caches, start=position, last_only=True)[:, -1]

    def decode_batch(
        self,
        tokens: list[int] | torch.Tensor,
        caches: list[list[LayerCache]],
        positions: list[int],
    ) -> torch.Tensor:
        """Logits [B, V] after one token of each of B sequences, each with its own caches and
        position: one forward over the B tokens side by side (the weights read once for all);
        a single sequence takes `decode`, and a model the native layers take for several rows
        (fp32 over GGUF blocks) runs them natively.

        Caches of a paged pool with the plan's `paged_batch_decode`: one forward over block
        tables (`BatchDecoder`), from a CUDA graph per batch bucket where graphs run (a lone
        sequence too: its bucket of 1), eagerly elsewhere. The logits then may be a graph's
        output buffer, valid until the next step.

        `tokens` may be a tensor [B] on the device (see `takes_device_tokens`)."""
        sequences = self._batch_step_sequences(caches)
        if sequences is not None:
            decoder = self._batch_decoder(sequences[0].pool, len(tokens))
            captured = decoder.capture_seconds
            logits = decoder.step(sequences, tokens, positions)
            self.capture_seconds += decoder.capture_seconds - captured
            return logits
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.tolist()
        if len(tokens) == 1:
            return self.decode(tokens[0], caches[0], positions[0])
        if (
            self.native is not None
            and (rows := self.native.decode_rows(tokens, caches, positions)) is not None
        ):
            return rows
        device = self.device
        ids = torch.tensor([tokens], dtype=torch.long, device=device)
        at = torch.tensor(positions, dtype=torch.long, device=device)
        ones = [1] * len(tokens)
        layers = [SequenceBatch(list(layer), ones) for layer in zip(*caches, strict=True)]
        return self.model(ids, layers, positions=at)[0]

    def takes_device_tokens(self, caches: list[list[LayerCache]]) -> bool:
        """Whether `decode_batch` over `caches` reads tokens left on the device without a
        host sync (the batched paged step), so a caller may launch a step on the last one's
        samples before reading them."""
        return self._batch_step_sequences(caches) is not None

    def _batch_step_sequences(self, caches: list[list[LayerCache]]) -> list[PagedSequence] | None:
        """The paged sequences of `caches` where `decode_batch` takes the batched paged step
        (several rows, or one where graphs run), else None."""
        sequences = self._paged_sequences(caches)
        if sequences is None or (len(caches) == 1 and not self._one_row_from_graphs()):
            return None
        return sequences

    def _one_row_from_graphs(self) -> bool:
        """`decodes_with_graphs`, found once per plan: a lone sequence's step asks each time."""
        if self._graphs_under is None or self._graphs_under[0] is not self.plan:
            self._graphs_under = (self.plan, self.decodes_with_graphs)
        return self._graphs_under[1]

    def _paged_sequences(self, caches: list[list[LayerCache]]) -> list[PagedSequence] | None:
        """The paged sequences of `caches` where the batched paged step applies, else None."""
        if not self.plan.paged_batch_decode or not caches:
            return None
        sequences = []
        for layers in caches:
            first = layers[0] if layers else None
            if not isinstance(first, PagedLayerCache):
                return None
            sequences.append(first.sequence)
        pool = sequences[0].pool
        return sequences if all(s.pool is pool for s in sequences) else None

    def _batch_decoder(self, pool: KVPool, count: int) -> BatchDecoder:
        """The batched decoder of `pool` with room for `count` rows (a new one, its graphs
        captured anew, where the rows do not fit)."""
        decoder = self._batch.pop(pool, None)
        if decoder is None or decoder.rows < count:
            rows = max(count, self.BATCH_ROWS, decoder.rows if decoder is not None else 0)
            graphs = self.decodes_with_graphs
            if graphs:
                rows = next((b for b in self.plan.batch_buckets if b >= rows), rows)
            del decoder  # its graphs and buffers go before the new ones are made
            decoder = BatchDecoder(self.model, pool, self.plan, rows, graphs)
        self._batch[pool] = decoder
        return decoder

    def acquire_decoder(self, max_context: int) -> GraphDecoder:
        """A graph decoder for one request: the idle one if it is large enough (reset to empty,
        its graphs kept), else a new one, which takes the plan's `decoder_growth` times the
        slots of an idle one it replaces where that is more. Give it back with
        `release_decoder`."""
        idle, self._idle = self._idle, None
        if idle is not None and idle.max_context >= max_context:
            idle.reset()
            return idle
        slots = max_context
        if idle is not None:
            grown = grown_slots(
                self.model,
                self.kv_policy,
                max_context,
                self.plan.decoder_growth * idle.max_context,
                self.slot_limit,
                self.plan.view_bucket,
            )
            slots = max(max_context, grown)
        del idle  # its caches go before the new ones are made
        return GraphDecoder(self.model, slots, self.plan, self.kv_policy)

    def release_decoder(self, decoder: GraphDecoder) -> None:
        """Keep `decoder` (its caches and graphs) for the next request."""
        self._idle = decoder

    def discard_idle(self) -> None:
        """Drop the idle decoder: the next request captures anew."""
        self._idle = None
