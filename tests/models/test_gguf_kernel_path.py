"""Tiny random Gemma 3 and Gemma 4 GGUF files run through the Triton block kernels (the plan's
`gguf_block_kernels`, on by default on CUDA) against HF transformers on the same weights, as
tests/models/test_gguf_types_as_stored.py runs the CPU path: the kernels see the file's
weights bit for bit (tests/ops/test_gguf_matmul.py), and activations are fp32 here, so the two
sides differ only in the order of fp32 sums. The same tolerance, 2e-5 of the largest logit
(~1e-6 measured on the CPU path), applies. Without a GPU the kernels run in Triton's
interpreter on a CPU load under a plan that takes them; on a GPU the default CUDA load runs
them compiled, its decode steps in CUDA graphs (fp32 matmuls there are true fp32: torch leaves
TF32 off). Q4_K and Q8_0 are repacked at load into their planar layouts (lossless). (Q6_K and the
other types are checked kernel by kernel there; each model here costs ~10 s interpreted.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hearth.engine import Engine
from hearth.layers.gguf import GGUFKernelLinear, GGUFKernelTable
from hearth.ops import HAS_TRITON
from hearth.ops.plan import ExecutionPlan
from hearth.quant.gguf_blocks import BLOCK_FORMATS, is_planar
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.sampling import Sampler, SamplingParams
from test_gguf_types_as_stored import GEMMA3, GEMMA4, RTOL, _hf_reading, _typed_file
from tiny import TINY_VOCAB, tiny_gemma3_model, tiny_gemma4_model

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs triton (its interpreter)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _load(path: Path) -> Engine:
    """fp32 activations through the block kernels: the default CUDA load on a GPU, else a
    CPU load under the CPU plan with the kernels in place of the native/torch block path."""
    if DEVICE == "cuda":
        return Engine.load(path, device="cuda", dtype="float32", progress=False)
    plan = ExecutionPlan.for_device("cpu")
    plan = dataclasses.replace(
        plan, gguf_block_kernels=True, native_kernels=False, native_layers=False
    )
    return Engine.load(path, device="cpu", progress=False, plan=plan)


# Gemma 4 with per-layer inputs (their 64-wide projection takes a 32-value type).
CASES = {
    "gemma3-Q4_K": ("gemma3", "Q4_K", GEMMA3),
    "gemma4-Q8_0-ple": ("gemma4", "Q8_0", GEMMA4 | {"hidden_size_per_layer_input": 64}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tiny_file_through_the_block_kernels_runs_as_hf_runs_it(
    tmp_path: Path, case: str
) -> None:
    architecture, type_name, shape = CASES[case]
    make = tiny_gemma3_model if architecture == "gemma3" else tiny_gemma4_model
    hf = make(seed=3, **shape)
    path = _typed_file(hf, tmp_path / f"{type_name}.gguf", type_name)
    oracle = _hf_reading(path, architecture, hf)
    engine = _load(path)
    projections = [m for m in engine.model.modules() if isinstance(m, GGUFKernelLinear)]
    assert projections and BLOCK_FORMATS[projections[0].type_ids[0]].name == type_name
    # Both types are repacked at load into their planar layout, which the kernels then read.
    assert all(is_planar(layout) for p in projections for layout, _ in p.parts())
    assert isinstance(engine.model.embed_tokens, GGUFKernelTable)
    if architecture == "gemma4":  # the per-layer table on blocks too (no memory map, no sync)
        assert isinstance(engine.model.embed_tokens_per_layer, GGUFKernelTable)
    ids = torch.randint(4, len(TINY_VOCAB), (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        reference = oracle(input_ids=ids).logits[0]
        ours = engine.model(ids.to(DEVICE))[0].cpu()  # 12 rows: dequantized tiles, a GEMM
    assert (ours - reference).abs().max() <= RTOL * reference.abs().max()
    # Decode steps (the block GEMV) choose HF's argmax given the tokens before.
    prompt = ids[0].tolist()
    sampler = Sampler(SamplingParams(temperature=0))
    produced = list(generate_tokens(engine.runner, prompt, sampler, 3, GenerationStats()))
    with torch.inference_mode():
        following = oracle(input_ids=torch.tensor([prompt + produced])).logits[0]
    assert produced == following[len(prompt) - 1 : -1].argmax(dim=-1).tolist()


def test_a_kernel_layer_sized_on_meta_holds_what_a_real_one_holds() -> None:
    """`hearth fit` sizes a GPU load on the meta device: a stack of Q4_K and Q6_K parts (the
    planar layout's bytes there) and a Q2_K one (no planar layout: the file's bytes) takes
    what the same layer built from real blocks takes, and repacks only the planar types."""
    from gguf_blocks_data import random_blocks

    real = [(t, torch.from_numpy(random_blocks(t, 6, 512, seed=t))) for t in (12, 14, 10)]
    sized = [(t, torch.empty(b.shape, dtype=torch.uint8, device="meta")) for t, b in real]
    built, meta = GGUFKernelLinear(real, 512), GGUFKernelLinear(sized, 512)
    assert [is_planar(layout) for layout, _ in built.parts()] == [True, True, False]
    assert meta.nbytes == built.nbytes == 6 * (304 + 432 + 168)
    assert [b.shape for _, b in meta.parts()] == [b.shape for _, b in built.parts()]
