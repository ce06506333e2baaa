"""Ragged prefill (`ModelRunner.prefill_ragged`): several sequences' prompt chunks in one
forward give each sequence what prefilling it alone gives: the same last-token logits, the same
K/V in the pool, then the same greedy tokens over 10 batched decode steps.

Tiny Gemma 3 (sliding window 8, head_dim 64) and tiny Gemma 4 (window 8, sliding head_dim 32,
full 64, two KV-sharing layers, per-layer inputs, MoE), dense and 8-bit affine K/V, blocks of
4 tokens, chunks of 8; on the CPU and, where CUDA is, eagerly on the GPU (its attention and
K/V kernels; fp32 without TF32, torch's default, so the same tolerance holds). Prompts of 21,
13 and 10 tokens and a fourth of 25 whose first 16 are adopted from the prefix cache (a donor
prompt prefilled before, its blocks freed and cached); three ragged steps: the first asks for
no logits (no prompt ends in it), the others for some. Through the scheduler on the tiny
Gemma 4 vision model: a request with an image takes its prefill forward alone while two text
requests share one, each reply as alone.

Tolerance. The ragged forward runs every projection as one GEMM over all the step's rows
(up to 31) where the alone run has at most 8, and a GEMM may block a longer M differently, so
each row's fp32 sums may come out in another order: a few ulp of each activation, which the
layers carry to the logits (std ~4, largest ~20-30: one ulp there ~2e-6; measured at most
1.1e-5). 2e-5 is ~10 ulp of the largest logit. The K/V are compared to 1e-5 (values of std
~1, measured at most 2.6e-6: the same ordering drift); 8-bit codes may move one code step
where a value lands within that drift of a rounding boundary (none measured), which
`CODE_FLIPS` bounds at 1% of the codes. A wrong position, window, block or row moves logits
by 1e-2 or more.
"""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import test_gemma4_vision as vision
from hearth.checkpoint import open_checkpoint
from hearth.engine import Engine
from hearth.kv import parse_kv_quant
from hearth.kv.paged import KVPool, PagedSequence
from hearth.media import decode_image
from hearth.models.loading import build_model
from hearth.ops.plan import ExecutionPlan
from hearth.runtime.generate import GenerationRequest
from hearth.runtime.runner import ModelRunner
from test_scheduler import Collector
from tiny import GEMMA4_SHARING, MOE, save_hf, tiny_gemma3_model, tiny_gemma4_model

CHUNK, BLOCK, DECODE = 8, 4, 10
PROMPTS = (21, 13, 10)
SHARED, OWN = 16, 9  # the fourth prompt: 16 tokens of the donor's, then its own
LOGIT_TOLERANCE, KV_TOLERANCE = 2e-5, 1e-5
CODE_FLIPS = 0.01


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gemma3 = tiny_gemma3_model(seed=3, head_dim=64)
    with torch.no_grad():  # logits of std ~4, so errors show in them
        gemma3.model.embed_tokens.weight.normal_(0.0, 0.5)
    gemma4 = tiny_gemma4_model(3, **GEMMA4_SHARING, **MOE)
    return {
        name: save_hf(hf, tmp_path_factory.mktemp(name))
        for name, hf in (("gemma3", gemma3), ("gemma4", gemma4))
    }


def _ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 256, (length,), generator=generator).tolist()


def _runner(model: Any, policy: Any) -> ModelRunner:
    plan = ExecutionPlan.for_device(model.device)
    plan = replace(plan, native_layers=False, prefill_chunk=CHUNK)
    return ModelRunner(model, plan, policy)


def _with_donor(runner: ModelRunner, pool: KVPool, donor: list[int]) -> None:
    """The donor prompt prefilled and freed: its full blocks stay in the prefix cache."""
    sequence = pool.sequence()
    assert sequence.reserve(len(donor))
    runner.prefill(torch.tensor([donor], device=runner.device), sequence.caches)
    sequence.after_forward(donor)
    sequence.free()


def _start(pool: KVPool, prompt: list[int]) -> PagedSequence:
    sequence = pool.sequence()
    assert sequence.adopt_prefix(prompt, len(prompt) - 1) in (0, SHARED)
    return sequence


def _alone(runner: ModelRunner, pool: KVPool, prompts: list[list[int]]) -> list[Any]:
    """Each prompt prefilled by itself, in chunks; its sequence and last-token logits."""
    done = []
    for prompt in prompts:
        sequence = _start(pool, prompt)
        start = sequence.tokens
        assert sequence.reserve(len(prompt) - start)
        piece = torch.tensor([prompt[start:]], device=runner.device)
        logits = runner.prefill(piece, sequence.caches, start, CHUNK)
        sequence.after_forward(prompt)
        done.append((sequence, logits[0]))
    return done


def _ragged(runner: ModelRunner, pool: KVPool, prompts: list[list[int]]) -> list[Any]:
    """The prompts' chunks of 8 in ragged steps, one chunk of every unfinished prompt a step;
    each sequence and its last-token logits. Returns also how many rows each step asked."""
    sequences = [_start(pool, prompt) for prompt in prompts]
    logits: list[torch.Tensor | None] = [None] * len(prompts)
    asked = []
    while any(s.tokens < len(p) for s, p in zip(sequences, prompts, strict=True)):
        step = [
            i for i, (s, p) in enumerate(zip(sequences, prompts, strict=True)) if s.tokens < len(p)
        ]
        starts = [sequences[i].tokens for i in step]
        ends = [min(start + CHUNK, len(prompts[i])) for i, start in zip(step, starts, strict=True)]
        for i, start, end in zip(step, starts, ends, strict=True):
            assert sequences[i].reserve(end - start)
        wanted = [end == len(prompts[i]) for i, end in zip(step, ends, strict=True)]
        rows = runner.prefill_ragged(
            [prompts[i][s:e] for i, s, e in zip(step, starts, ends, strict=True)],
            [sequences[i].caches for i in step],
            starts,
            wanted,
        )
        asked.append(rows.shape[0])
        made = iter(rows)
        for i, end, want in zip(step, ends, wanted, strict=True):
            sequences[i].after_forward(prompts[i][:end])
            if want:
                logits[i] = next(made)
    return list(zip(sequences, logits, strict=True)), asked


def _stored(pool: KVPool, sequence: PagedSequence) -> list[torch.Tensor]:
    """Every group's layers' planes of the blocks the sequence holds, in logical order."""
    out = []
    for g, (table, blocks) in enumerate(zip(sequence.tables, pool.pools, strict=True)):
        held = [block for block in table if block is not None]
        for layer in blocks.planes:
            # uint32 codes compared as int32 (CUDA has no uint32 index kernel)
            out += [(p.view(torch.int32) if p.dtype == torch.uint32 else p)[held] for p in layer]
        freed = torch.tensor([block is None for block in table], device=blocks.planes[0][0].device)
        out.append(freed)  # which logical blocks the group let go
        assert g < len(pool.groups)
    return out


def _decode(runner: ModelRunner, done: list[Any], prompts: list[list[int]]) -> list[list[int]]:
    """DECODE greedy steps of all the sequences side by side, from their prompts' logits."""
    tokens = [[int(logits.argmax())] for _, logits in done]
    for step in range(DECODE):
        positions = [len(prompt) + step for prompt in prompts]
        for sequence, _ in done:
            assert sequence.reserve(1)
        logits = runner.decode_batch(
            [made[-1] for made in tokens], [s.caches for s, _ in done], positions
        )
        for row, ((sequence, _), prompt, made) in enumerate(
            zip(done, prompts, tokens, strict=True)
        ):
            sequence.after_forward([*prompt, *made])
            made.append(int(logits[row].argmax()))
    return tokens


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    ("model_name", "kind", "device"),
    [
        ("gemma3", "off", "cpu"),
        ("gemma3", "8", "cpu"),
        ("gemma4", "off", "cpu"),
        ("gemma4", "8", "cpu"),
        pytest.param("gemma3", "off", "cuda", marks=GPU),
        pytest.param("gemma4", "8", "cuda", marks=GPU),
    ],
)
def test_ragged_prefill_equals_each_prompt_alone(
    checkpoints: dict[str, Path], model_name: str, kind: str, device: str
) -> None:
    checkpoint = open_checkpoint(checkpoints[model_name])
    model = build_model(checkpoint, torch.float32, device, progress=False)
    policy = parse_kv_quant(kind, group_size=32)
    runner = _runner(model, policy)
    donor = _ids(20, 40)
    prompts = [_ids(n, 7 + i) for i, n in enumerate(PROMPTS)]
    prompts.append(donor[:SHARED] + _ids(OWN, 30))
    specs = model.cache_specs()
    pools = [KVPool(specs, policy, torch.float32, [64] * 2, BLOCK, device=device) for _ in range(2)]
    with torch.inference_mode():
        for pool in pools:
            _with_donor(runner, pool, donor)
        alone = _alone(runner, pools[0], prompts)
        ragged, asked = _ragged(runner, pools[1], prompts)
        assert ragged[3][0].stored == len(prompts[3]) and pools[1].hit_tokens == 0
        assert asked == [0, 3, 1]  # step 1 ends no prompt; 2: 13, 10 and 25; 3: 21
        for (mine, got), (theirs, expected) in zip(ragged, alone, strict=True):
            assert got is not None
            error = (got - expected).abs().max().item()
            assert error <= LOGIT_TOLERANCE, f"logits {error:.2e}"
            assert expected.std() > 1.0  # logits that errors would show in
            for a, b in zip(_stored(pools[1], mine), _stored(pools[0], theirs), strict=True):
                if a.dtype.is_floating_point:
                    assert (a - b).abs().max().item() <= KV_TOLERANCE
                else:  # 8-bit codes (one step apart at most, rarely) or the freed-block pattern
                    if a.dtype == torch.int32:  # four codes to a word: compare each code
                        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                    flips = (a.int() - b.int()).abs()
                    assert flips.max().item() <= 1 and flips.float().mean() <= CODE_FLIPS
        assert _decode(runner, ragged, prompts) == _decode(runner, alone, prompts)


checkpoint = vision.checkpoint  # the tiny Gemma 4 with a vision tower, and its directory
MARGIN = 1e-3  # a top-2 log-probability gap the ragged drift (~1e-5) cannot close


def test_a_request_with_an_image_prefills_alone_and_text_ones_together(
    checkpoint: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two text requests and one with an image (70 soft tokens, bidirectional) submitted
    together on the tiny Gemma 4 vision model: the text ones share one ragged forward, the
    image one takes its prefill forward alone; each reply equals its run alone, token for
    token while the alone run's top two log-probabilities are more than `MARGIN` apart."""
    engine = Engine.load(checkpoint[1], dtype="float32", device="cpu", progress=False)
    image = decode_image(_png(), 70)
    question = {"type": "text", "text": "What is it?"}
    messages: Any = [{"role": "user", "content": [{"type": "image", "image": image}, question]}]
    ids, media = engine.expand_media(engine.encode(messages), [image])
    fields: Any = {"max_tokens": 6, "stop_ids": (), "top_logprobs": 2}
    requests = [
        GenerationRequest(_ids(12, 3), **fields),
        GenerationRequest(_ids(9, 4), **fields),
        GenerationRequest(ids, media=media, **fields),
    ]
    alone = [_scheduled(engine, [request])[0] for request in requests]
    counts = {"alone": 0, "ragged": 0}
    prefill, ragged = engine.runner.prefill, engine.runner.prefill_ragged

    def counted_alone(*args: Any, **kwargs: Any) -> torch.Tensor:
        counts["alone"] += 1
        return prefill(*args, **kwargs)

    def counted_ragged(*args: Any) -> torch.Tensor:
        counts["ragged"] += 1
        return ragged(*args)

    monkeypatch.setattr(engine.runner, "prefill", counted_alone)
    monkeypatch.setattr(engine.runner, "prefill_ragged", counted_ragged)
    together = _scheduled(engine, requests)
    assert counts == {"alone": 1, "ragged": 1}
    compared = 0
    for got, single in zip(together, alone, strict=True):
        assert got.done and len(got.tokens) == len(single.tokens) == 6
        records = [r for c in single.chunks for r in (c.logprobs or ())]
        for position, record in enumerate(records):
            if record.top_logprobs[0] - record.top_logprobs[1] < MARGIN:
                break
            assert got.tokens[position] == record.token
            compared += 1
    assert compared >= 12


def _png() -> bytes:
    out = io.BytesIO()
    vision._pil(40, 28, seed=1).save(out, format="PNG")
    return out.getvalue()


def _scheduled(engine: Engine, requests: list[GenerationRequest]) -> list[Collector]:
    """What each request got, all submitted together to one scheduler."""
    scheduler = engine.scheduler(8)
    collectors = [Collector() for _ in requests]
    for request, collector in zip(requests, collectors, strict=True):
        scheduler.submit(request, collector, lambda: False)
    while not scheduler.idle:
        scheduler.step()
    return collectors
