"""The paged KV pool (`kv.paged`): paged caches give the logits the dense caches give, block
bookkeeping (window freeing, reference counts, the prefix cache) does what it says.

Logits: tiny Gemma 3 (sliding window 8, head_dim 64 on every layer) and tiny Gemma 4 (window 8,
sliding head_dim 32, full 64, two KV-sharing layers), three sequences of prompt lengths 21, 13
and 6 (two past the window) prefilled in chunks of 8 (ring continuations), then 20 decode steps
of all three side by side in one forward, on the pool's blocks (block size 4, so a window spans
several) and on `LayerCache`s of the same layout. Tolerance 0: a paged view lays its keys out
as the ring or full cache does (same order, same length, same codes), so both forwards run the
same operations on the same numbers; any difference is a bug (a quantized layout would turn a
1-ulp difference into a flipped code, so nothing looser would be a sound bound either).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.kv import KVPolicy, make_caches, parse_kv_quant
from hearth.kv.paged import KVPool, block_hashes, cache_groups
from hearth.layers.attention import SequenceBatch
from hearth.models.loading import build_model
from tiny import GEMMA4_SHARING, save_hf, tiny_gemma3_model, tiny_gemma4_model

# Every layout: dense, affine (8 and 4 bits share the code path), TurboQuant, `@full`.
CASES = [
    ("gemma4", "off"),
    ("gemma4", "4"),
    ("gemma4", "turbo:k8v3"),
    ("gemma4", "turbo:k8v3@full"),
    ("gemma3", "off"),
    ("gemma3", "8"),
]
PROMPTS = (21, 13, 6)
CHUNK, DECODE, BLOCK = 8, 20, 4
TOLERANCE = 0.0
SEED = 1


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    gemma3 = tiny_gemma3_model(seed=3, head_dim=64)
    with torch.no_grad():  # logits of std ~4, so errors show in them
        gemma3.model.embed_tokens.weight.normal_(0.0, 0.5)
    built = {}
    for name, hf in (("gemma3", gemma3), ("gemma4", tiny_gemma4_model(3, **GEMMA4_SHARING))):
        directory = save_hf(hf, tmp_path_factory.mktemp(name))
        built[name] = build_model(open_checkpoint(directory), torch.float32, progress=False)
    return built


def _ids(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, 256, (length,), generator=generator).tolist()


class _DenseSequence:
    """`LayerCache`s driven like a `PagedSequence` (the reference)."""

    def __init__(self, model: Any, policy: KVPolicy) -> None:
        self.caches = make_caches(model.cache_specs(), policy)

    def reserve(self, tokens: int) -> bool:
        return True

    def after_forward(self, ids: list[int]) -> None:
        return None


def _batched(model: Any, make: Any, sequences_ids: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence prefilled alone in chunks, then all decoded side by side; every step's
    logits."""
    sequences = [make() for _ in sequences_ids]
    steps: list[list[torch.Tensor]] = [[] for _ in sequences_ids]
    for index, (sequence, ids) in enumerate(zip(sequences, sequences_ids, strict=True)):
        prompt = len(ids) - DECODE
        for start in range(0, prompt, CHUNK):
            stop = min(start + CHUNK, prompt)
            assert sequence.reserve(stop - start)
            logits = model(torch.tensor([ids[start:stop]]), sequence.caches, start=start)[0, -1]
            sequence.after_forward(ids[:stop])
        steps[index].append(logits)
    for step in range(DECODE - 1):
        positions = [len(ids) - DECODE + step for ids in sequences_ids]
        tokens = [ids[p] for ids, p in zip(sequences_ids, positions, strict=True)]
        for sequence in sequences:
            assert sequence.reserve(1)
        layers = [
            SequenceBatch(list(layer), [1] * len(sequences))
            for layer in zip(*(s.caches for s in sequences), strict=True)
        ]
        logits = model(torch.tensor([tokens]), layers, positions=torch.tensor(positions))[0]
        for index, (sequence, ids) in enumerate(zip(sequences, sequences_ids, strict=True)):
            sequence.after_forward(ids[: positions[index] + 1])
            steps[index].append(logits[index])
    return [torch.stack(s) for s in steps]


@pytest.mark.parametrize(("model_name", "kind"), CASES)
def test_paged_logits_equal_the_dense_caches(
    models: dict[str, Any], model_name: str, kind: str
) -> None:
    model = models[model_name]
    policy = parse_kv_quant(kind, group_size=32)
    all_ids = [_ids(length + DECODE, SEED + i) for i, length in enumerate(PROMPTS)]
    pool = KVPool(model.cache_specs(), policy, torch.float32, [64] * 2, BLOCK)
    with torch.inference_mode():
        paged = _batched(model, pool.sequence, all_ids)
        dense = _batched(model, lambda: _DenseSequence(model, policy), all_ids)
        for got, expected in zip(paged, dense, strict=True):
            assert got.shape == expected.shape
            error = (got - expected).abs().max().item()
            assert error <= TOLERANCE, f"{kind}: {error:.2e}"
    # Sliding groups kept about a window's blocks per sequence; full groups every block.
    for g, group in enumerate(pool.groups):
        used = pool.pools[g].used_blocks
        if group.window is None:
            assert used == sum(-(-(len(ids) - 1) // BLOCK) for ids in all_ids)  # last unfed
        else:
            assert used <= len(all_ids) * (group.window // BLOCK + 1)


def test_block_hashes_name_whole_prefixes() -> None:
    """A block's hash covers every token before it: prompts that part in block 0 share no
    hash, prompts that part in block 2 share the first two; a partial block has none."""
    ids = list(range(10, 50))
    same = block_hashes(ids, 16)
    assert len(same) == 2 and same == block_hashes([*ids[:32], 1, 2], 16)
    changed_early = block_hashes([11, *ids[1:]], 16)
    assert all(a != b for a, b in zip(same, changed_early, strict=True))
    assert block_hashes([*ids[:40], *[7] * 8], 16)[:2] == same


def test_a_budget_sizes_sliding_groups_by_window_and_full_groups_by_the_rest(
    models: dict[str, Any],
) -> None:
    """Tiny Gemma 3, fp32, one KV head pair of 64 dims: a token costs 2 x 2 x 64 x 4 = 1,024
    bytes per layer; two sliding and two full layers. 4 sequences with chunks of 8 and window
    8 hold at most ceil((8 + 8) / 4) + 1 = 5 sliding blocks each."""
    model = models["gemma3"]
    specs, policy = model.cache_specs(), KVPolicy()
    groups = cache_groups(specs, policy)
    assert [g.window for g in groups] == [8, None]
    block = 2 * 1024 * BLOCK  # two layers a group
    pool = KVPool.for_budget(specs, policy, torch.float32, 100 * block, 4, 8, BLOCK)
    assert [p.num_blocks for p in pool.pools] == [4 * 5, 100 - 4 * 5]
    assert pool.nbytes <= 100 * block and pool.longest_context(8) == 80 * BLOCK
    tight = KVPool.for_budget(specs, policy, torch.float32, 12 * block, 4, 8, BLOCK)
    assert [p.num_blocks for p in tight.pools] == [6, 6]  # half each, one window at least


def test_a_short_budget_gives_sliding_and_full_groups_the_same_blocks(
    models: dict[str, Any],
) -> None:
    """Tiny Gemma 4: its sliding and full layers store tokens at different byte sizes (head
    sizes and KV heads differ, the full layers' K is V). A budget too small for every
    sequence's window splits so each group gets the same number of blocks, and the two run
    out at the same length (an equal split of bytes left the group of more bytes a block
    with fewer blocks, and the first to run out). A budget that holds every window leaves
    the full groups the rest, as before."""
    model = models["gemma4"]
    specs, policy = model.cache_specs(), KVPolicy()
    groups = cache_groups(specs, policy)
    sizes = [g.token_bytes(torch.float32) * BLOCK for g in groups]
    sliding = sum(b for g, b in zip(groups, sizes, strict=True) if g.window is not None)
    full = sum(b for g, b in zip(groups, sizes, strict=True) if g.window is None)
    assert sliding != full  # else the split would not tell the rules apart
    short = KVPool.for_budget(specs, policy, torch.float32, 30 * (sliding + full), 64, 8, BLOCK)
    by_window = {g.window is None: p.num_blocks for g, p in zip(groups, short.pools, strict=True)}
    assert by_window == {False: 30, True: 30}
    roomy = KVPool.for_budget(specs, policy, torch.float32, 400 * (sliding + full), 4, 8, BLOCK)
    one = -(-(max(g.window or 0 for g in groups) + 8) // BLOCK) + 1
    counts = {g.window is None: p.num_blocks for g, p in zip(groups, roomy.pools, strict=True)}
    assert counts[False] == 4 * one
    assert counts[True] == (400 * (sliding + full) - 4 * one * sliding) // full


def test_a_window_longer_than_the_context_takes_no_more_than_the_context(
    models: dict[str, Any],
) -> None:
    """A prefill chunk longer than the model's positions (a GPU plan's 4k chunk on a model of
    32 positions): one sequence of the window group never holds more than ceil(32 / 4) = 8
    blocks, so the minimum of one window is 8 blocks, not ceil((8 + 4096) / 4) + 1, and the
    full group keeps the rest of the budget (it got none: found on the H100)."""
    model = models["gemma3"]
    specs, policy = model.cache_specs(), KVPolicy()
    block = 2 * 1024 * BLOCK
    pool = KVPool.for_budget(
        specs, policy, torch.float32, 40 * block, 4, 4096, BLOCK, max_context=32
    )
    assert [p.num_blocks for p in pool.pools] == [20, 20]  # half of 40, 4 x 8 wanted
    assert pool.fits(32, 4096)
