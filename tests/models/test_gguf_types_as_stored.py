"""Tiny random Gemma 3 and Gemma 4 GGUF files in each block type Hearth keeps as stored, run by
the default CPU path (blocks as stored, fp32) against HF transformers on the same weights.

Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 hold the HF model's weights quantized by the `gguf` package;
the k-quants (which it cannot quantize) hold random blocks (`random_blocks`). Gemma 3's oracle
is HF reading the file itself (`gguf_file=`); Gemma 4's is the HF model given the file's
tensors as `gguf.quants.dequantize` reads them (names by llama.cpp's table, checked against
llama.cpp in test_gemma4_gguf.py). Both sides compute in fp32 on the same weight values, so
they differ only in the order of sums: at most ~1e-6 of the largest logit measured; the
tolerance is 2e-5 of it. fp32 activations throughout (``HEARTH_GGUF_BF16=0``): the default's
bf16 GEMV inputs are held to HF in test_gguf_as_stored.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from gguf_blocks_data import random_blocks
from hearth.checkpoint.gguf_names import ROPE_FREQS, canonical_name
from hearth.checkpoint.gguf_writer import GGUFTensor, minimal_tokenizer, stream_gguf, write_gguf
from hearth.engine import Engine
from hearth.errors import UnsupportedModelError
from hearth.layers.gguf import GGUFLinear
from hearth.ops import plan as plan_module
from hearth.quant.gguf_blocks import BLOCK_FORMATS
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.sampling import Sampler, SamplingParams
from tiny import TINY_VOCAB, tiny_gemma3_model, tiny_gemma4_model

RTOL = 2e-5
QUANTIZED_BY_GGUF = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ2_0")
# Widths of whole k-quant blocks (256): every projection's input is 256 or 512 wide.
GEMMA3 = {
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "head_dim": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "layer_types": None,
}
GEMMA4 = {"hidden_size": 256, "intermediate_size": 256, "head_dim": 64, "global_head_dim": 128}
TYPES = [block.name for _, block in sorted(BLOCK_FORMATS.items())]


@pytest.fixture(autouse=True)
def _fp32_activations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plan_module.BF16_GEMV_VARIABLE, "0")


def _typed_file(hf: Any, path: Path, type_name: str) -> Path:
    """The HF model as a GGUF whose matrices are `type_name` (k-quants: random blocks)."""
    tensors = {
        name.removeprefix("model."): t
        for name, t in hf.state_dict().items()
        if name != "lm_head.weight"
    }
    config = hf.config.to_dict()
    if type_name in QUANTIZED_BY_GGUF:
        return write_gguf(path, config, tensors, TINY_VOCAB, type_name)
    written = write_gguf(path.with_suffix(".f32.gguf"), config, tensors, TINY_VOCAB)
    reader = gguf.GGUFReader(written)
    quant_type = gguf.GGMLQuantizationType[type_name]
    architecture = str(reader.fields["general.architecture"].contents())
    encoded = []
    for seed, tensor in enumerate(reader.tensors):
        if tensor.name == ROPE_FREQS:
            continue  # stream_gguf writes it again from the config
        shape = tuple(int(n) for n in reversed(tensor.shape))
        name = canonical_name(tensor.name, architecture)
        if len(shape) == 2 and not name.endswith("norm.weight"):
            blocks = random_blocks(quant_type.value, shape[0], shape[1], seed)
            encoded.append(GGUFTensor(name, shape, type_name, lambda b=blocks: b))
        else:
            values = np.array(tensor.data)
            encoded.append(GGUFTensor(name, shape, "F32", lambda v=values: v))
    return stream_gguf(path, config, encoded, minimal_tokenizer(TINY_VOCAB))


def _hf_reading(path: Path, architecture: str, hf: Any) -> Any:
    if architecture == "gemma3":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name == ROPE_FREQS:
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape))
        name = "model." + canonical_name(tensor.name, architecture)
        state[name] = torch.from_numpy(np.array(values)).reshape(shape)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.mark.parametrize("architecture", ["gemma3", "gemma4"])
@pytest.mark.parametrize("type_name", TYPES)
def test_a_tiny_file_in_each_type_runs_as_hf_runs_it(
    tmp_path: Path, architecture: str, type_name: str
) -> None:
    make = tiny_gemma3_model if architecture == "gemma3" else tiny_gemma4_model
    hf = make(seed=TYPES.index(type_name), **(GEMMA3 if architecture == "gemma3" else GEMMA4))
    path = _typed_file(hf, tmp_path / f"{type_name}.gguf", type_name)
    oracle = _hf_reading(path, architecture, hf)
    engine = Engine.load(path, device="cpu", progress=False)
    projections = [m for m in engine.model.modules() if isinstance(m, GGUFLinear)]
    assert projections and all(m.type_ids == [m.type_ids[0]] * len(m.type_ids) for m in projections)
    assert BLOCK_FORMATS[projections[0].type_ids[0]].name == type_name
    ids = torch.randint(4, len(TINY_VOCAB), (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        reference = oracle(input_ids=ids).logits[0]
        ours = engine.model(ids)[0]
    assert (ours - reference).abs().max() <= RTOL * reference.abs().max()
    # Decode steps (the block GEMV) choose HF's argmax given the tokens before.
    prompt = ids[0].tolist()
    sampler = Sampler(SamplingParams(temperature=0))
    produced = list(generate_tokens(engine.runner, prompt, sampler, 4, GenerationStats()))
    with torch.inference_mode():
        following = oracle(input_ids=torch.tensor([prompt + produced])).logits[0]
    assert produced == following[len(prompt) - 1 : -1].argmax(dim=-1).tolist()


def test_a_type_not_computed_on_as_stored_is_refused_by_name(tmp_path: Path) -> None:
    """TQ2_0 (the `gguf` package writes it): one line naming the tensor and its type."""
    hf = tiny_gemma3_model(seed=0, **GEMMA3)
    path = _typed_file(hf, tmp_path / "tq2_0.gguf", "TQ2_0")
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.0\.\S+ uses TQ2_0, which Hearth"):
        Engine.load(path, device="cpu", progress=False)
