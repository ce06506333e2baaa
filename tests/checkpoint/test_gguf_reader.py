"""Hearth's GGUF container parser and Q8_0 path against the `gguf` package (the oracle)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from hearth.checkpoint.gguf import dequantize_q8_0
from hearth.checkpoint.gguf_file import GGUFFile
from hearth.checkpoint.gguf_names import canonical_name
from hearth.errors import CheckpointError


@pytest.fixture(scope="module")
def reader(embedded_gguf: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(embedded_gguf)


def test_metadata_equals_gguf_reader(embedded_gguf: Path, reader: gguf.GGUFReader) -> None:
    ours = GGUFFile(embedded_gguf).metadata
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}  # header
    assert set(ours) == set(fields)
    for key, field in fields.items():
        expected = field.contents()
        if isinstance(expected, float):
            assert ours[key] == pytest.approx(expected, rel=1e-7), key
        else:
            assert ours[key] == expected, key


def test_tensor_bytes_equal_gguf_reader(embedded_gguf: Path, reader: gguf.GGUFReader) -> None:
    ours = GGUFFile(embedded_gguf)
    assert len(ours.tensors) == len(reader.tensors) == 236
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(int(n) for n in reversed(tensor.shape))
        assert info.type_id == tensor.tensor_type.value
        assert np.array_equal(
            np.asarray(ours.raw(info)).reshape(-1),
            np.asarray(tensor.data).view(np.uint8).reshape(-1),
        )


def test_every_tensor_has_a_canonical_name(embedded_gguf: Path) -> None:
    names = {canonical_name(n) for n in GGUFFile(embedded_gguf).tensors}
    assert "embed_tokens.weight" in names and "layers.17.mlp.down_proj.weight" in names


def test_q8_0_dequantization_is_bit_identical_to_gguf() -> None:
    values = np.random.default_rng(0).normal(size=(64, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)
    ours = dequantize_q8_0(torch.from_numpy(blocks))
    assert torch.equal(ours, torch.from_numpy(expected))


def test_bad_magic_and_truncation(tmp_path: Path, embedded_gguf: Path) -> None:
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"GGUX" + bytes(60))
    with pytest.raises(CheckpointError, match="not a GGUF"):
        GGUFFile(wrong)
    short = tmp_path / "short.gguf"
    short.write_bytes(embedded_gguf.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated"):
        GGUFFile(short)
