"""The batched paged decode step on a GPU (skipped without CUDA): replayed from CUDA graphs per
bucket it gives the eager step's logits, and the scheduler's tokens equal each request's run
alone through the batch-1 graph decoder.

Tolerances. Graphs against the eager step at the same padded bucket: 5e-5 on fp32 logits of
std ~4. A replay runs the kernels the eager run launched, on the same shapes; only a library
that picks another algorithm under capture (cuBLAS's workspace differs per stream) could sum in
another order, ~1e-6 per layer as in tests/runtime/test_graph_decoder.py. The scheduler
against a request alone: greedy tokens compared wherever the alone run's top two
log-probabilities are more than 1e-3 apart (the batched forward sums in another order than
the batch-1 one, ~1e-6 of fp32 logits).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import hearth
from hearth.checkpoint import open_checkpoint
from hearth.kv import KVPolicy
from hearth.kv.paged import KVPool, PagedSequence
from hearth.models.loading import build_model
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.batch_graphs import BatchDecoder
from hearth.runtime.generate import GenerationRequest, stream_generate
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from hearth.runtime.scheduler import Scheduler
from tiny import (
    GEMMA4_SHARING,
    save_hf,
    save_tiny_with_tokenizer,
    tiny_gemma3_model,
    tiny_gemma4_model,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ATOL = 5e-5
MARGIN = 1e-3
BLOCK = 16
PROMPTS = (40, 21, 9, 30)  # tokens (Gemma 3's window 8, Gemma 4's 8: all past it)
DECODE = 24


def _model(kind: str, tmp_path: Path) -> Any:
    if kind == "gemma3":
        hf = tiny_gemma3_model(seed=3, head_dim=64)
        with torch.no_grad():
            hf.model.embed_tokens.weight.normal_(0.0, 0.5)
    else:
        hf = tiny_gemma4_model(3, **GEMMA4_SHARING)
    directory = save_hf(hf, tmp_path / kind)
    return build_model(open_checkpoint(directory), torch.float32, "cuda", progress=False)


def _prefilled(runner: ModelRunner, pool: KVPool, all_ids: list[list[int]]) -> list[Any]:
    sequences: list[PagedSequence] = []
    for ids in all_ids:
        sequence = pool.sequence()
        prompt = ids[: len(ids) - DECODE]
        assert sequence.reserve(len(prompt))
        runner.prefill(torch.tensor([prompt], device="cuda"), sequence.caches, 0)
        sequence.after_forward(prompt)
        sequences.append(sequence)
    return sequences


@pytest.mark.parametrize("kind", ["gemma3", "gemma4"])
def test_graphs_per_bucket_equal_the_eager_paged_step(kind: str, tmp_path: Path) -> None:
    """Four sequences, then three (one leaves: bucket 4 with a padded row), two, one (buckets 2
    and 1), over 24 steps: every step's logits from the graphs equal the eager padded step's."""
    model = _model(kind, tmp_path)
    plan = ExecutionPlan.for_device("cuda")
    runner = ModelRunner(model, plan)
    if not runner.decodes_with_graphs:
        pytest.skip("this model's decode does not run from graphs here")
    generator = torch.Generator().manual_seed(5)
    all_ids = [torch.randint(4, 256, (n + DECODE,), generator=generator).tolist() for n in PROMPTS]
    specs = model.cache_specs()
    pools = [KVPool(specs, KVPolicy(), torch.float32, [64, 64], BLOCK, "cuda") for _ in range(2)]
    decoders = [
        BatchDecoder(model, pools[0], plan, rows=8, graphs=True),
        BatchDecoder(model, pools[1], plan, rows=8, graphs=False, pad=True),
    ]
    with torch.inference_mode():
        both = [_prefilled(runner, pool, all_ids) for pool in pools]
        live = list(range(len(all_ids)))
        for step in range(DECODE):
            if step in (6, 12, 18):  # 4 -> 3 -> 2 -> 1 rows
                for sequences in both:
                    sequences[live[0]].free()
                live.pop(0)
            positions = [len(all_ids[i]) - DECODE + step for i in live]
            tokens = [all_ids[i][p] for i, p in zip(live, positions, strict=True)]
            logits = []
            for decoder, sequences in zip(decoders, both, strict=True):
                for i in live:
                    assert sequences[i].reserve(1)
                rows = decoder.step([sequences[i] for i in live], tokens, positions).clone()
                for row, i in enumerate(live):
                    sequences[i].after_forward(all_ids[i][: positions[row] + 1])
                logits.append(rows)
            torch.testing.assert_close(logits[0], logits[1], atol=ATOL, rtol=0)
            assert logits[1].std() > 1.0
    assert {rows for rows, _ in decoders[0]._graphs} == {4, 2, 1}


def test_the_scheduler_gives_each_request_its_batch1_graph_decoder_tokens(
    tmp_path: Path,
) -> None:
    """Four greedy requests decoded together (the batched step from graphs, tokens sampled
    on the device at once) against each alone through `stream_generate`, whose decode on a
    GPU is the batch-1 graph decoder."""
    directory = save_tiny_with_tokenizer(tmp_path / "tiny", seed=5)
    with torch.no_grad():
        engine = hearth.load(directory, dtype="float32", device="cuda", progress=False)
    runner = engine.runner
    assert runner.plan.paged_batch_decode and runner.decodes_with_graphs
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, 256, (n,), generator=generator).tolist() for n in PROMPTS]
    scheduler = Scheduler(runner, engine.tokenizer, 4, prefix_cache=False)
    made: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    accept = scheduler._accept_token
    index_of = {}

    def recorded(sequence: Any, token: int, distribution: Any) -> None:
        made[index_of[id(sequence.request)]].append(token)
        accept(sequence, token, distribution)

    scheduler._accept_token = recorded  # type: ignore[method-assign]
    for index, ids in enumerate(prompts):
        request = GenerationRequest(ids, max_tokens=DECODE, stop_ids=())
        index_of[id(request)] = index
        scheduler.submit(request, lambda chunk: None, lambda: False)
    while not scheduler.idle:
        scheduler.step()
    compared = 0
    for index, ids in enumerate(prompts):
        chunks = stream_generate(
            runner, engine.tokenizer, ids, SamplingParams(), DECODE, stop_ids=(), top_logprobs=2
        )
        records = [r for chunk in chunks for r in (chunk.logprobs or ())]
        assert len(made[index]) == len(records) == DECODE
        for position, record in enumerate(records):
            if record.top_logprobs[0] - record.top_logprobs[1] < MARGIN:
                break
            assert made[index][position] == record.token, (index, position)
            compared += 1
    assert compared >= DECODE * len(prompts) // 2


def test_a_plan_without_the_paged_step_keeps_the_side_by_side_one(tmp_path: Path) -> None:
    """`paged_batch_decode` off: the runner makes no batch decoder (the A/B baseline)."""
    model = _model("gemma3", tmp_path)
    plan = replace(ExecutionPlan.for_device("cuda"), paged_batch_decode=False)
    runner = ModelRunner(model, plan)
    pool = KVPool(model.cache_specs(), KVPolicy(), torch.float32, [64, 64], BLOCK, "cuda")
    generator = torch.Generator().manual_seed(5)
    all_ids = [torch.randint(4, 256, (n + DECODE,), generator=generator).tolist() for n in PROMPTS]
    with torch.inference_mode():
        sequences = _prefilled(runner, pool, all_ids[:2])
        for sequence in sequences:
            assert sequence.reserve(1)
        positions = [len(ids) - DECODE for ids in all_ids[:2]]
        tokens = [ids[p] for ids, p in zip(all_ids, positions, strict=False)]
        runner.decode_batch(tokens, [s.caches for s in sequences], positions)
    assert len(runner._batch) == 0
