"""The batched decode step over block tables (`runtime.batch_graphs`, `kv.paged.PagedBatch`):
its logits equal those of the side-by-side step (`SequenceBatch`, each sequence's K/V gathered
out of the pool under a block-diagonal mask), on CPU, eagerly, through the torch reference of
`ops.paged_attention`.

Tiny Gemma 3 (sliding window 8, head_dim 64) and tiny Gemma 4 (window 8, sliding head_dim 32,
full 64, two KV-sharing layers, per-layer inputs, MoE), three sequences of prompt lengths 21,
13 and 6 (two past the window) prefilled alone in chunks of 8 into two pools of blocks of 4,
then 20 decode steps of all of them, the middle one leaving after 8 (the last one moves up a
row and is written anew), padded to the batch buckets (3 rows run as 4: a padded row writes
into the pool's trash block) or not, their block tables growing from 8 to 16 blocks wide.

Tolerances, on fp32 logits of std ~4. Dense K/V: 5e-5. The two steps run the same
projections on the same inputs and differ in attention's arithmetic only (the reference's
einsum over every slot of a row's blocks, masked, against SDPA over the gathered keys): about
1e-6 per layer, which later layers and steps carry on (measured at most 1.4e-5 over the 20
steps). Quantized K/V (8-bit affine, TurboQuant k8v3): 5e-4, with both pools given the same
stored codes before each step (else a value that lands within 1e-6 of a rounding boundary
takes the neighbouring code in one pool only, and such flips pile up over the steps: measured
up to 1e-2); within a step the new token's own K/V can still flip a code (8-bit: a step of
1/255 of its group's range, measured 1.4e-4). A wrong block, position or window moves the
logits by 1e-2 or more.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.kv import parse_kv_quant
from hearth.kv.paged import KVPool, PagedSequence
from hearth.models.loading import build_model
from hearth.ops.plan import ExecutionPlan
from hearth.runtime import batch_graphs
from hearth.runtime.batch_graphs import BatchDecoder
from hearth.runtime.runner import ModelRunner
from tiny import GEMMA4_SHARING, MOE, save_hf, tiny_gemma3_model, tiny_gemma4_model

PROMPTS = (21, 13, 6)
CHUNK, DECODE, BLOCK, LEAVES_AFTER = 8, 20, 4, 8
DENSE_TOLERANCE, CODED_TOLERANCE = 5e-5, 5e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    gemma3 = tiny_gemma3_model(seed=3, head_dim=64)
    with torch.no_grad():  # logits of std ~4, so errors show in them
        gemma3.model.embed_tokens.weight.normal_(0.0, 0.5)
    gemma4 = tiny_gemma4_model(3, **GEMMA4_SHARING, **MOE)
    built = {}
    for name, hf in (("gemma3", gemma3), ("gemma4", gemma4)):
        directory = save_hf(hf, tmp_path_factory.mktemp(name))
        built[name] = build_model(open_checkpoint(directory), torch.float32, progress=False)
    return built


def _ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 256, (length,), generator=generator).tolist()


def _plan(batched: bool) -> ExecutionPlan:
    """The CPU plan without the native layer step, so the step compared is the one asked."""
    cpu = ExecutionPlan.for_device("cpu")
    return replace(cpu, native_layers=False, paged_batch_decode=batched, batch_buckets=(2, 4, 8))


def _prefilled(model: Any, pool: KVPool, all_ids: list[list[int]]) -> list[PagedSequence]:
    """Each sequence's prompt (all but its last DECODE tokens) prefilled alone in chunks."""
    runner = ModelRunner(model, _plan(False))
    sequences = []
    for ids in all_ids:
        sequence = pool.sequence()
        prompt = len(ids) - DECODE
        for start in range(0, prompt, CHUNK):
            stop = min(start + CHUNK, prompt)
            assert sequence.reserve(stop - start)
            runner.prefill(torch.tensor([ids[start:stop]]), sequence.caches, start, CHUNK)
            sequence.after_forward(ids[:stop])
        sequences.append(sequence)
    return sequences


def _decode_both(
    model: Any, policy: Any, all_ids: list[list[int]], pad: bool, same_stored: bool
) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Decode the sequences together in two pools, by the paged batch step and by the
    side-by-side one; each sequence's logits per step from each. `same_stored`: before each
    step the side-by-side pool takes the other's stored K/V (the same blocks: both pools
    allocate alike), so a step's inputs agree to the code."""
    specs = model.cache_specs()
    pools = [KVPool(specs, policy, torch.float32, [64] * 2, BLOCK) for _ in range(2)]
    # Padded as a GPU runs it: the inputs in host buffers, copied to the step's each time.
    decoder = BatchDecoder(model, pools[0], _plan(True), 8, graphs=False, pad=pad, copies=pad)
    side_by_side = ModelRunner(model, _plan(False), policy)
    if pad:
        pools[1].trash_blocks()  # the same blocks taken in both pools
    both = [_prefilled(model, pool, all_ids) for pool in pools]
    logits: list[list[list[torch.Tensor]]] = [[[] for _ in all_ids] for _ in pools]
    live = list(range(len(all_ids)))
    for index in range(DECODE):
        if index == LEAVES_AFTER:
            for sequences in both:
                sequences[1].free()
            live.remove(1)
        positions = [len(all_ids[i]) - DECODE + index for i in live]
        tokens = [all_ids[i][p] for i, p in zip(live, positions, strict=True)]
        for sequences in both:
            for i in live:
                assert sequences[i].reserve(1)
        assert [both[0][i].tables for i in live] == [both[1][i].tables for i in live]
        if same_stored:
            for source, target in zip(pools[0].pools, pools[1].pools, strict=True):
                for planes, copies in zip(source.planes, target.planes, strict=True):
                    for plane, copy in zip(planes, copies, strict=True):
                        copy.copy_(plane)
        rows = [
            decoder.step([both[0][i] for i in live], tokens, positions),
            side_by_side.decode_batch(tokens, [both[1][i].caches for i in live], positions),
        ]
        for sequences, made, out in zip(both, rows, logits, strict=True):
            for row, i in enumerate(live):
                sequences[i].after_forward(all_ids[i][: positions[row] + 1])
                out[i].append(made[row].clone())
    assert sorted(decoder._tables) == [8, 16]  # the table widths the steps ran at
    for sequences in both:
        for sequence in sequences:
            sequence.free()
    assert pools[0].used_blocks == pools[1].used_blocks == 0  # trash blocks not counted
    return logits[0], logits[1]


@pytest.mark.parametrize(
    ("model_name", "kind", "pad"),
    [
        ("gemma3", "off", True),
        ("gemma3", "8", False),
        ("gemma4", "off", False),
        ("gemma4", "8", True),
        ("gemma4", "turbo:k8v3", False),
    ],
)
def test_paged_batch_step_equals_the_side_by_side_step(
    models: dict[str, Any], model_name: str, kind: str, pad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tables 4 blocks wide and up: the batch moves from 8-block tables to 16-block ones.
    monkeypatch.setattr(batch_graphs, "NARROWEST_TABLE", 4)
    model = models[model_name]
    policy = parse_kv_quant(kind, group_size=32)
    all_ids = [_ids(length + DECODE, 7 + i) for i, length in enumerate(PROMPTS)]
    with torch.inference_mode():
        got, expected = _decode_both(model, policy, all_ids, pad, same_stored=kind != "off")
    tolerance = DENSE_TOLERANCE if kind == "off" else CODED_TOLERANCE
    for sequence, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        assert len(mine) == len(theirs) == (LEAVES_AFTER if sequence == 1 else DECODE)
        for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            error = (a - b).abs().max().item()
            assert error <= tolerance, f"sequence {sequence} step {step}: {error:.2e}"
        assert torch.stack(theirs).std() > 1.0  # logits that errors would show in
