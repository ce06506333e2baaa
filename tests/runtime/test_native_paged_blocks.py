"""The native Gemma 3 blocks layer (`gemma3_blocks_layer`) reading and writing K/V through a
paged pool's block tables (`PagedLayerCache.decode_blocks`), against the path it replaces,
which copied each sequence's context out of its blocks into one buffer a step
(`PagedLayerCache.decode_slot`) and wrote the new token back after it (`flush`).

Both run the same arithmetic in the same order: the paged kernel reads a sliding layer's
window in the ring-slot order the copy holds it in, and only where each key lies differs. So
logits and the pool's contents must be equal bit for bit (no tolerance), on this CPU's library
and on the AVX2 one, with several sequences of different lengths, sliding windows shorter than
the context and GQA. Against the module path (torch attention on the gathered blocks) the bound
is test_native_step_blocks.py's, 2e-5 of the largest logit: the native layer sums attention
and GELU in another order than torch (fp32 reassociation, ~1e-6 measured there).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hearth.checkpoint.gguf_writer import write_gguf
from hearth.engine import Engine
from hearth.kv.paged import KVPool, PagedLayerCache, cache_groups
from hearth.ops import native
from hearth.ops.plan import ExecutionPlan
from hearth.runtime import native_step
from hearth.runtime.runner import ModelRunner
from native_builds import kernels_build  # noqa: F401 (a fixture)
from tiny import TINY_VOCAB, tiny_gemma3_model

RTOL = 2e-5  # against the module path: see the module docstring
DECODE_STEPS = 14


def _copy_path_row_kv(
    cache: PagedLayerCache, sample: torch.Tensor, tables: dict[int, torch.Tensor]
) -> native.ContiguousKV:
    """The path before block tables: the context copied out of the blocks (`decode_slot`),
    the new token stored back at `flush`."""
    slot = cache.decode_slot(sample)
    assert slot is not None
    return native.ContiguousKV(slot.keys, slot.values, slot.slot, slot.length)


@pytest.fixture(scope="module")
def tiny_gqa_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma 3 (4 query heads over 2 KV heads, sliding window 8) in Q8_0 blocks."""
    hf = tiny_gemma3_model(seed=7)
    tensors = {
        name.removeprefix("model."): tensor
        for name, tensor in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    path = tmp_path_factory.mktemp("paged_blocks") / "gqa.gguf"
    return write_gguf(path, hf.config.to_dict(), tensors, TINY_VOCAB, "Q8_0")


@pytest.fixture(scope="module")
def embedded_engine(embedded_gguf: Path) -> Engine:
    """The real 270M as the CPU loads it by default (GGUF blocks, fp32), for the two tests
    below: each decodes on caches and pools of its own."""
    return Engine.load(embedded_gguf, device="cpu", progress=False)


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab, (length,), generator=generator).tolist()


def _paged_decode(
    runner: ModelRunner, prompts: list[list[int]], steps: int, block_size: int
) -> tuple[list[torch.Tensor], KVPool, list]:
    """Prefill `prompts` into one pool, then `steps` greedy decode steps of all of them
    together (`decode_batch`); every step's logits [B, vocab], the pool and the sequences."""
    model = runner.model
    specs, policy = model.cache_specs(), runner.kv_policy
    pool = KVPool(specs, policy, model.compute_dtype, [96] * len(cache_groups(specs, policy)),
                  block_size)  # fmt: skip
    sequences = [pool.sequence() for _ in prompts]
    histories = [list(prompt) for prompt in prompts]
    steps_logits = []
    with torch.inference_mode():
        last = []
        for prompt, sequence, history in zip(prompts, sequences, histories, strict=True):
            assert sequence.reserve(len(prompt))
            last.append(runner.prefill(torch.tensor([prompt]), sequence.caches)[0])
            sequence.after_forward(history)
        for step in range(steps):
            tokens = [int(logits.argmax()) for logits in last]
            positions = [len(prompt) + step for prompt in prompts]
            for sequence in sequences:
                assert sequence.reserve(1)
            rows = runner.decode_batch(tokens, [s.caches for s in sequences], positions)
            for sequence, history, token in zip(sequences, histories, tokens, strict=True):
                history.append(token)
                sequence.after_forward(history)
            steps_logits.append(rows.clone())
            last = list(rows)
    return steps_logits, pool, sequences


def _stored_contents(pool: KVPool, sequences: list) -> list[torch.Tensor]:
    """Every stored token's K/V in every plane, per sequence and held block (the slots past a
    sequence's last token were never written: their bits are nobody's)."""
    size = pool.block_size
    contents = []
    for sequence in sequences:
        for group, block_pool in enumerate(pool.pools):
            for logical, block in enumerate(sequence.tables[group]):
                if block is None:
                    continue
                slots = min(size, sequence.stored - logical * size)
                for planes in block_pool.planes:
                    contents += [plane[block, :, :slots] for plane in planes]
    return contents


@pytest.mark.usefixtures("kernels_build")
@pytest.mark.parametrize("block_size", [4, 16])
def test_block_tables_equal_the_copy_path_bit_for_bit(
    tiny_gqa_gguf: Path, block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four sequences (prompts 3 to 21 tokens: inside the window of 8 and past it, so the
    sliding layers' ring wraps, and its oldest blocks are freed as it moves) decoded together
    for 14 steps: logits and every held block equal the copy path's bit for bit, and no
    context is copied."""
    runner = ModelRunner(Engine.load(tiny_gqa_gguf, device="cpu", progress=False).model)
    prompts = [_prompt(length, length, len(TINY_VOCAB)) for length in (3, 21, 9, 14)]
    copies: list[int] = []
    original = PagedLayerCache.decode_slot

    def counting(self: PagedLayerCache, sample: torch.Tensor):  # type: ignore[no-untyped-def]
        copies.append(1)
        return original(self, sample)

    monkeypatch.setattr(PagedLayerCache, "decode_slot", counting)
    paged, paged_pool, paged_sequences = _paged_decode(runner, prompts, DECODE_STEPS, block_size)
    assert not copies
    monkeypatch.setattr(native_step, "_row_kv", _copy_path_row_kv)
    copied, copied_pool, copied_sequences = _paged_decode(runner, prompts, DECODE_STEPS, block_size)
    assert len(copies) == DECODE_STEPS * len(prompts) * len(runner.model.layers)
    for step, (a, b) in enumerate(zip(copied, paged, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    assert [s.tables for s in copied_sequences] == [s.tables for s in paged_sequences]
    for a, b in zip(
        _stored_contents(copied_pool, copied_sequences),
        _stored_contents(paged_pool, paged_sequences),
        strict=True,
    ):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("kernels_build")
def test_block_tables_match_the_module_path(tiny_gqa_gguf: Path) -> None:
    """The same sequences through the modules (torch attention over the gathered blocks), to
    the bound of the module docstring, and the same greedy tokens."""
    model = Engine.load(tiny_gqa_gguf, device="cpu", progress=False).model
    plan = ExecutionPlan.for_device("cpu")
    prompts = [_prompt(length, length, len(TINY_VOCAB)) for length in (5, 19, 12)]
    native_logits, _, _ = _paged_decode(ModelRunner(model, plan), prompts, DECODE_STEPS, 4)
    module_runner = ModelRunner(model, replace(plan, native_layers=False))
    module_logits, _, _ = _paged_decode(module_runner, prompts, DECODE_STEPS, 4)
    for step, (a, b) in enumerate(zip(module_logits, native_logits, strict=True)):
        for row in range(len(prompts)):
            scale = a[row].abs().max()
            assert (a[row] - b[row]).abs().max() <= RTOL * scale, f"step {step}, row {row}"
        assert torch.equal(a.argmax(dim=-1), b.argmax(dim=-1))


def test_the_embedded_model_on_block_tables_equals_each_sequence_alone(
    embedded_engine: Engine,
) -> None:
    """The real 270M (GGUF blocks, fp32, the CPU default): three sequences of different
    lengths on one pool, decoded together through block tables, give each one's logits bit
    for bit as decoding it alone on contiguous `LayerCache`s (the copy path's layout)."""
    runner = embedded_engine.runner
    assert runner.native is not None and runner.native.blocks
    vocab = runner.model.config.vocab_size
    prompts = [_prompt(length, length, vocab) for length in (5, 37, 18)]
    steps = 4
    together, _, _ = _paged_decode(runner, prompts, steps, 16)
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            caches = runner.new_caches()
            logits = runner.prefill(torch.tensor([prompt]), caches)[0]
            for step in range(steps):
                logits = runner.decode(int(logits.argmax()), caches, len(prompt) + step)[0]
                assert torch.equal(logits, together[step][row]), f"step {step}, row {row}"


def test_a_table_missing_a_block_read_is_refused(tiny_gqa_gguf: Path) -> None:
    """A block table whose span read or written holds a freed or out-of-pool block, or is
    shorter than the span, is refused before the kernel runs: it would read or write outside
    the pool."""
    kernels = native.kernels()
    if kernels is None:
        pytest.skip("no native kernels here")
    model = Engine.load(tiny_gqa_gguf, device="cpu", progress=False).model
    step = native_step.NativeDecodeStep(model)
    built = step._operands(0, model.layers[0], model.next_norm(0))
    assert built is not None
    operands = built.operands
    assert isinstance(operands, native.BlocksLayerOperands)
    planes = torch.zeros(3, operands.kv_heads, 4, operands.head_dim)
    x = torch.zeros(1, operands.hidden)
    rope = torch.zeros(1, operands.head_dim)
    for table in ([None, 0], [0, 3], [0]):
        blocks = native.BlockTable(table, planes.shape[0])
        rows = [native.PagedKV(planes, planes.clone(), blocks, 5, ((0, 6),))]
        with pytest.raises(ValueError, match="no block of the pool"):
            kernels.gemma3_blocks_layer(operands, x, x.clone(), rope, rope, rows)


def test_eight_sequences_take_the_amx_head_within_its_input_rounding(
    embedded_engine: Engine,
) -> None:
    """Eight sequences together on a CPU with AMX: the head (6+ rows) runs on AMX tiles with its
    input rounded to one bf16, so each sequence's logits are its alone ones (fed the same
    tokens) up to that rounding. Measured: at most 0.057 apart here (8 text prompts, 4 steps;
    0.10 on random-token prompts, logits up to ~58); tolerance 0.3, 3x the larger (bf16's 2^-9
    relative step on inputs summed over 640 products). So the greedy tokens agree wherever the
    alone run's top two logits are more than twice that apart (23 of the 32 picks here). Three
    sequences (the test above) stay on the fp32 GEMV, bit for bit: a difference here is the
    head's."""
    engine = embedded_engine
    runner = engine.runner
    if not runner.plan.gguf_amx_head_rows:
        pytest.skip("no AMX-BF16 on this CPU: the head stays the fp32 GEMV (see the test above)")
    tolerance = 0.3
    texts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "def fibonacci(n):\n    ",
        "The three primary colors are",
        "Water boils at",
        "In July 1969, Neil Armstrong",
        "A haiku about autumn:\n",
        "The quick brown fox",
    ]
    prompts = [engine.encode(text, chat=False) for text in texts]
    steps = 4
    together, _, _ = _paged_decode(runner, prompts, steps, 16)
    worst, compared = 0.0, 0
    with torch.inference_mode():
        for row, prompt in enumerate(prompts):
            caches = runner.new_caches()
            token = int(runner.prefill(torch.tensor([prompt]), caches)[0].argmax())
            for step in range(steps):
                logits = runner.decode(token, caches, len(prompt) + step)[0]
                batched = together[step][row]
                worst = max(worst, float((logits - batched).abs().max()))
                top = logits.topk(2).values
                if top[0] - top[1] > 2 * tolerance:
                    assert int(logits.argmax()) == int(batched.argmax()), (row, step)
                    compared += 1
                token = int(batched.argmax())  # the token the batched run fed next
    assert 0.0 < worst <= tolerance
    assert compared >= steps * len(prompts) // 2  # most picks are clear on these prompts
