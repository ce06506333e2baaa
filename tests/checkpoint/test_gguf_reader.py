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
def reader(embedded_gguf_reader: gguf.GGUFReader) -> gguf.GGUFReader:
    return embedded_gguf_reader


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


def _two_tensor_file(path: Path, first_bytes: int, first_type: int = 8) -> Path:
    """A GGUF holding `first` (Q8_0 [4, 64] as declared) written with `first_bytes` bytes of
    data, then `second` (F32 [64]): the writer places `second` after the bytes it was given,
    and the file is long enough for `first`'s declared bytes either way."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tensor_info(
        "first", (4, 64), np.dtype(np.float32), first_bytes, raw_dtype=gguf.GGMLQuantizationType(8)
    )
    writer.add_tensor_info("second", (64,), np.dtype(np.float32), 256)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_tensor_data(np.zeros(first_bytes, np.uint8))
    writer.write_tensor_data(np.zeros(64, np.float32))
    writer.close()
    if first_type != 8:  # patch the type id after the tensor's name, dims and shape
        data = bytearray(path.read_bytes())
        at = data.index(b"first") + len(b"first") + 4 + 2 * 8
        data[at : at + 4] = first_type.to_bytes(4, "little")
        path.write_bytes(bytes(data))
    return path


def test_a_tensor_whose_bytes_disagree_with_its_type_and_shape_is_named(tmp_path: Path) -> None:
    """Q8_0 [4, 64] takes 4 x 2 x 34 = 272 bytes; the file holds 160 before the next tensor."""
    assert GGUFFile(_two_tensor_file(tmp_path / "right.gguf", 272)).tensors["first"].nbytes == 272
    with pytest.raises(CheckpointError, match=r"tensor first \(Q8_0, shape \(4, 64\)\) takes 272"):
        GGUFFile(_two_tensor_file(tmp_path / "short.gguf", 160))


def test_an_unknown_type_id_is_named(tmp_path: Path) -> None:
    path = _two_tensor_file(tmp_path / "unknown.gguf", 272, first_type=99)
    with pytest.raises(CheckpointError, match="tensor first has unknown type 99"):
        GGUFFile(path)


def test_rows_that_are_not_whole_blocks_are_named(tmp_path: Path) -> None:
    path = _two_tensor_file(tmp_path / "q4_k.gguf", 272, first_type=12)  # Q4_K: 256 a block
    with pytest.raises(CheckpointError, match="tensor first has rows of 64 values, not whole Q4_K"):
        GGUFFile(path)
