"""Gemma 4 GGUF files in llama.cpp's layout: llama.cpp runs them as HF runs the model, and
Hearth reads back the very model it reads from the HF checkpoint.

Tiny random HF models (tests/tiny.py) are written by Hearth's writer, which follows llama.cpp's
converter (names, norms stored as w, per-layer arrays, proportional RoPE as `rope_freqs`).
llama.cpp is the oracle for that layout: a file it runs with HF's logits has the conventions
right. Hearth's reader (its own name table, not the `gguf` package's map the writer's names
were checked against) must then recover the same config and the same tensors.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.checkpoint.gguf_names import canonical_name
from hearth.checkpoint.gguf_writer import write_gguf
from hearth.config import parse_config
from hearth.layers.mapped_table import MappedBlockTable
from hearth.models.loading import build_model
from hearth.ops import native
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.sampling import Sampler, SamplingParams
from tiny import FULL, K_EQ_V, MOE, PLE, SLIDING, TINY_VOCAB, save_hf, tiny_gemma4_model

# llama.cpp gives a KV-sharing layer the cache of the last owner (full) or the one before it
# (sliding), as in the released E2B/E4B; HF looks up the last owner of the sharer's type. The
# sharing configs below keep both rules on the same donor.
SHARING = {
    **PLE,
    "num_hidden_layers": 6,
    "num_kv_shared_layers": 2,
    "layer_types": [SLIDING, SLIDING, SLIDING, FULL, SLIDING, FULL],
}
DOUBLE_WIDE = {
    **SHARING,
    "num_kv_shared_layers": 3,
    "use_double_wide_mlp": True,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, FULL, FULL],
}
# Expert width 32: whole Q8_0 blocks, so the quantized test stores the experts quantized too.
MOE_32 = {**MOE, "moe_intermediate_size": 32}
CONFIGS: dict[str, dict[str, Any]] = {
    "windows": {},
    "ple": PLE,
    "kv_sharing": SHARING,
    "ple_sharing_double_wide": DOUBLE_WIDE,
    "k_eq_v": K_EQ_V,
    "moe": MOE_32,
    "k_eq_v_moe": {**K_EQ_V, **MOE_32},
}
TOKENS = 20
# Hearth against HF in fp32, as tests/models/test_gemma4.py: op order differs, a dozen ulps of the
# largest logit (~25).
ATOL = 5e-5
# llama.cpp against HF, relative to the largest |logit|: at most 1.3e-3 measured over these
# configs (ggml evaluates GELU through an fp16 table, and its attention and matmul sum in
# their own order; KV cache in f32 here). 4x that. Rotating the wrong pairs on the two full
# layers alone moves them by 1.7% (test_llama_cpp_sees_a_wrong_rope).
LLAMA_RTOL = 5e-3
GGML_F32 = 0  # llama.cpp's type id for an f32 KV cache
HEARTH_GENERATE = [sys.executable, "-m", "hearth.cli", "generate"]

Files = Callable[[str], tuple[Any, Path, Path]]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    """(HF model, its safetensors directory, its F32 GGUF) for a config of CONFIGS."""
    built: dict[str, tuple[Any, Path, Path]] = {}

    def get(name: str) -> tuple[Any, Path, Path]:
        if name not in built:
            hf = tiny_gemma4_model(seed=list(CONFIGS).index(name), **CONFIGS[name])
            directory = save_hf(hf, tmp_path_factory.mktemp(name))
            built[name] = hf, directory, _write(directory, directory.with_suffix(".gguf"))
        return built[name]

    return get


def _write(directory: Path, path: Path, matrix_type: str = "F32", **config: Any) -> Path:
    checkpoint = open_checkpoint(directory)
    tensors = dict(checkpoint.tensors())
    return write_gguf(path, {**checkpoint.config, **config}, tensors, TINY_VOCAB, matrix_type)


def _generate(path: Path) -> subprocess.CompletedProcess[str]:
    """`hearth generate` on the file: four tokens, on the CPU defaults."""
    command = [*HEARTH_GENERATE, str(path), "t5 t6 t7", "--max-tokens", "4"]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


def _ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(4, len(TINY_VOCAB), (1, TOKENS), generator=generator)


def _hf_logits(hf: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=ids).logits[0]


def _llama_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    pytest.importorskip("llama_cpp")
    from hearth.bench.llama_peer import open_llama

    llama = open_llama(
        path, n_ctx=64, logits_all=True, verbose=False, type_k=GGML_F32, type_v=GGML_F32
    )
    llama.eval(ids[0].tolist())
    return torch.from_numpy(np.array(llama.scores[: ids.shape[1]]))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_llama_cpp_runs_the_file_as_hf_runs_the_model(files: Files, name: str) -> None:
    hf, _, path = files(name)
    ids = _ids()
    reference = _hf_logits(hf, ids)
    error = (_llama_logits(path, ids) - reference).abs().max()
    assert error <= LLAMA_RTOL * reference.abs().max()


def test_llama_cpp_sees_a_wrong_rope(files: Files, tmp_path: Path) -> None:
    """The tolerance above tells conventions apart: a file whose full layers rotate every pair
    (a converter that missed proportional RoPE) is outside it with room to spare."""
    hf, directory, _ = files("windows")
    full_rotation = {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 1.0}
    rope = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0}, FULL: full_rotation}
    wrong = _write(directory, tmp_path / "wrong.gguf", rope_parameters=rope)
    ids = _ids()
    reference = _hf_logits(hf, ids)
    error = (_llama_logits(wrong, ids) - reference).abs().max()
    assert error > 2 * LLAMA_RTOL * reference.abs().max()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_and_tensors_equal_the_hf_checkpoint(files: Files, name: str) -> None:
    _, directory, path = files(name)
    ours, theirs = open_checkpoint(path), open_checkpoint(directory)
    config, expected_config = parse_config(ours.config), parse_config(theirs.config)
    # GGUF stores the epsilon as float32 (1e-6 reads back as 9.99999997e-07).
    expected_config = replace(
        expected_config, rms_norm_eps=float(np.float32(expected_config.rms_norm_eps))
    )
    if not expected_config.hidden_size_per_layer_input:  # no table: its row count is unused
        config = replace(config, vocab_size_per_layer_input=0)
        expected_config = replace(expected_config, vocab_size_per_layer_input=0)
    assert config == expected_config
    assert sorted(ours.tensor_names()) == sorted(theirs.tensor_names())
    expected = dict(theirs.tensors())
    for tensor_name, tensor in ours.tensors():
        assert torch.equal(tensor, expected[tensor_name].float()), tensor_name


@pytest.mark.parametrize("name", ["ple_sharing_double_wide", "k_eq_v_moe"])
def test_logits_and_greedy_tokens_match_hf(files: Files, name: str) -> None:
    hf, _, path = files(name)
    model = build_model(open_checkpoint(path), torch.float32, progress=False)
    ids = _ids()
    with torch.inference_mode():
        logits = model(ids)[0]
    assert (logits - _hf_logits(hf, ids)).abs().max() <= ATOL
    prompt = ids[0, :12].tolist()
    sampler = Sampler(SamplingParams(), device=model.device)
    produced = list(generate_tokens(model, prompt, sampler, 8, GenerationStats(), prefill_step=5))
    reference = _hf_logits(hf, torch.tensor([prompt + produced]))
    assert produced == reference[len(prompt) - 1 : -1].argmax(dim=-1).tolist()


@pytest.mark.parametrize("matrix_type", ["Q8_0", "Q4_0"])
def test_quantized_tensors_dequantize_as_the_gguf_package(
    files: Files, tmp_path: Path, matrix_type: str
) -> None:
    """Every tensor (3-D experts included, split into gate and up) against `gguf`'s reader."""
    _, directory, _ = files("k_eq_v_moe")
    path = _write(directory, tmp_path / "quantized.gguf", matrix_type)
    reader = gguf.GGUFReader(path)
    expected: dict[str, torch.Tensor] = {}
    stored_types = set()
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        stored_types.add(tensor.tensor_type.name)
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        name = canonical_name(tensor.name, "gemma4")
        if name.endswith("experts.gate_up_proj"):
            gate, up = values.chunk(2, dim=-2)
            expected[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            expected[name.replace("gate_up_proj", "up_proj.weight")] = up
        else:
            expected[name.replace("experts.down_proj", "experts.down_proj.weight")] = values
    assert matrix_type in stored_types
    ours = dict(open_checkpoint(path).tensors())
    assert ours.keys() == expected.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name].reshape(tensor.shape)), name


def test_sharers_kv_weights_in_the_file_are_skipped(files: Files, tmp_path: Path) -> None:
    """Google's releases keep k_proj/v_proj/k_norm on the KV-sharing layers, and llama.cpp's
    converter writes them; nothing reads them, so Hearth skips them (HF's save drops them)."""
    hf, directory, _ = files("kv_sharing")
    checkpoint = open_checkpoint(directory)
    tensors = dict(checkpoint.tensors())
    generator = torch.Generator().manual_seed(0)
    for layer in (4, 5):  # the sharers
        for name, like in (("k_proj", 2), ("v_proj", 2), ("k_norm", 3)):
            shape = tensors[f"layers.{like}.self_attn.{name}.weight"].shape
            tensors[f"layers.{layer}.self_attn.{name}.weight"] = torch.randn(
                shape, generator=generator
            )
    path = write_gguf(tmp_path / "with-sharer-kv.gguf", checkpoint.config, tensors, TINY_VOCAB)
    assert any(t.name == "blk.4.attn_k.weight" for t in gguf.GGUFReader(path).tensors)
    ours = open_checkpoint(path)
    assert sorted(ours.tensor_names()) == sorted(checkpoint.tensor_names())
    model = build_model(ours, torch.float32, progress=False)
    ids = _ids()
    with torch.inference_mode():
        logits = model(ids)[0]
    assert (logits - _hf_logits(hf, ids)).abs().max() <= ATOL


@pytest.mark.parametrize("name", ["ple_sharing_double_wide", "k_eq_v_moe"])
def test_cli_generates_from_a_gemma4_gguf(files: Files, name: str) -> None:
    """The default CPU path for a GGUF (blocks as stored, fp32 compute) end to end; these F32
    files' weights load as fp32 values."""
    _, _, path = files(name)
    result = _generate(path)
    assert result.returncode == 0, result.stderr
    assert "generation: 4 tokens" in result.stderr


@pytest.mark.skipif(
    native.kernels() is None, reason="no C compiler with OpenMP, or neither AVX-512 nor AVX2"
)
def test_int8_load_leaves_the_per_layer_table_in_the_file(files: Files, tmp_path: Path) -> None:
    """With int8 weights (`--quantize int8`), a per-layer table stored in blocks the
    native kernels decode stays in the file: each looked-up row is the file's value rounded to
    bf16, as the gguf package dequantizes it; the model generates from it."""
    _, directory, _ = files("ple")  # 4 layers x 8: rows of one Q8_0 block
    path = _write(directory, tmp_path / "q8_0.gguf", "Q8_0")
    model = build_model(open_checkpoint(path), torch.bfloat16, progress=False, quantize="int8")
    table = model.embed_tokens_per_layer
    assert isinstance(table, MappedBlockTable)
    assert "embed_tokens_per_layer.weight" not in model.state_dict()
    reader = gguf.GGUFReader(path)
    stored = next(t for t in reader.tensors if t.name == "per_layer_token_embd.weight")
    assert stored.tensor_type == gguf.GGMLQuantizationType.Q8_0
    values = gguf.quants.dequantize(stored.data, stored.tensor_type)
    expected = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16)
    ids = torch.tensor([[0, 7, 255, 7], [3, 1, 2, 200]])
    assert torch.equal(table.embed(ids, torch.bfloat16), expected[ids])
    result = _generate(path)
    assert result.returncode == 0, result.stderr
