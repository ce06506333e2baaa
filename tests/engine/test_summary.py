"""`hearth inspect` summaries against hand-derived values and HF's parameter counts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hearth.summary import _bytes, _layer_pattern, describe, module_kind
from tiny import save_hf, tiny_gemma3_model


def test_layer_pattern_is_run_length_with_period() -> None:
    sliding, full = "sliding_attention", "full_attention"
    assert (
        _layer_pattern((sliding,) * 5 + (full,) + (sliding,) * 5 + (full,))
        == "5 sliding, 1 full (x2)"
    )
    assert _layer_pattern((sliding, full, full)) == "1 sliding, 2 full"


def test_module_kinds() -> None:
    assert module_kind("layers.3.self_attn.q_proj.weight") == "attention"
    assert module_kind("layers.3.self_attn.q_norm.weight") == "attention"
    assert module_kind("layers.0.post_feedforward_layernorm.weight") == "norms"
    assert module_kind("embed_tokens_per_layer.weight") == "per-layer embeddings"


def test_describe_tiny_hf_checkpoint(tmp_path: Path) -> None:
    hf = tiny_gemma3_model()
    text = describe(save_hf(hf, tmp_path))
    assert f"parameters: {hf.num_parameters() / 1e6:,.1f} M" in text
    assert "format: safetensors" in text and "1 sliding, 1 full (x2)" in text
    # A layer's token: (K + V) x 2 KV heads x 32 dims x 2 bytes = 256 bytes. At 512 tokens
    # (the most): 2 full layers x 512 x 256 + 2 sliding rings x 8 slots x (256 + 8) bytes.
    # Two full layers at 512 slots and two rings of 8, each slot 256 bytes of K/V and an int64
    # position.
    assert f"KV cache in bf16: {_bytes(2 * 512 * 264 + 2 * 8 * 264)} at 512 tokens" in text
    assert "(512 B a token on full layers; sliding layers keep 8)" in text
    assert "tensor types: F32 x" in text


def test_describe_embedded_gguf(embedded_gguf: Path) -> None:
    text = describe(embedded_gguf)
    assert "18 layers, hidden 640, vocab 262144 (tied head)" in text
    assert "5 sliding, 1 full (x3)" in text
    assert "Q4_K x27" in text and "Q8_0 x10" in text


def test_gguf_quantization_names_llama_cpps_file_type() -> None:
    """general.file_type as llama.cpp names it (15: MOSTLY_Q4_K_M; 1024 marks a guess), else
    the type holding most weight bytes (1-D norms do not count)."""
    from hearth.summary import _gguf_quantization

    storage = {
        "embed": ((1000, 64), 36_000, "Q8_0"),
        "mlp": ((64, 256), 9_216, "Q4_K"),
        "norm": ((64,), 99_999, "F32"),
    }
    assert _gguf_quantization({"general.file_type": 15}, storage) == (
        "Q4_K_M (general.file_type 15)"
    )
    assert _gguf_quantization({"general.file_type": 1024 + 7}, storage).startswith("Q8_0 ")
    assert _gguf_quantization({"general.file_type": 0}, storage).startswith("F32 ")
    assert _gguf_quantization({}, storage) == "mostly Q8_0 (no general.file_type)"


def test_describe_shows_each_gguf_type_in_memory_per_device(
    embedded_gguf: Path, embedded_gguf_reader: Any
) -> None:
    """Per GGML type, against the `gguf` package's reader: the stored bytes (what a default
    load keeps for block types on either device); F32 stays 4 bytes a value on the CPU and takes
    2 on a GPU (bf16)."""
    from collections import defaultdict

    stored: dict[str, int] = defaultdict(int)
    values: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for tensor in embedded_gguf_reader.tensors:
        name = tensor.tensor_type.name
        stored[name] += int(tensor.n_bytes)
        values[name] += int(tensor.n_elements)
        counts[name] += 1
    text = describe(embedded_gguf)
    heading = (
        "in memory by tensor type (blocks as stored; floats in fp32 on the CPU, bf16 on a GPU):"
    )
    assert heading in text
    for name in ("Q8_0", "Q5_0", "Q4_K", "Q6_K"):
        size = _bytes(stored[name])
        assert f"  {name}: {counts[name]} tensors, {size} stored; CPU {size}, GPU {size}" in text
    size = _bytes(stored["F32"])
    halves = _bytes(2 * values["F32"])
    assert f"  F32: {counts['F32']} tensors, {size} stored; CPU {size}, GPU {halves}" in text
    gpu = sum(stored.values()) - stored["F32"] + 2 * values["F32"]
    assert f"  all: CPU {_bytes(sum(stored.values()))}, GPU {_bytes(gpu)}" in text
