"""A fast reader of the GGUF container: metadata and tensor byte ranges, memory-mapped.

`gguf.GGUFReader` builds a numpy view for every item of every array, which takes ~10 s on a
262144-token vocabulary; this reader parses the same layout in well under a second and leaves
quantization formats (block sizes, dequantization) to the `gguf` package.
"""

from __future__ import annotations

import itertools
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hearth.errors import CheckpointError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of one scalar (8: string, 9: array are handled apart).
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
# `GGUFFile.copy` copies this many bytes at a time before dropping their pages.
_COPY_BYTES = 16 << 20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dims innermost first)
    type_id: int
    start: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer, self.position, self.path = buffer, 0, path

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self.buffer, self.position)
        self.position += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        self._need(length)
        raw = bytes(self.buffer[self.position : self.position + length])
        self.position += length
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: `string` inlined, as a vocabulary holds 262k of them
        (0.8 s of a load one call at a time, ~0.2 s so)."""
        buffer, position, end = self.buffer, self.position, len(self.buffer)
        items = []
        for _ in range(count):
            if position + 8 > end:
                self.position = position
                self._need(8)
            (length,) = _LENGTH.unpack_from(buffer, position)
            position += 8
            if position + length > end:
                self.position = position
                self._need(length)
            items.append(str(buffer[position : position + length], "utf-8", "replace"))
            position += length
        self.position = position
        return items

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                self._need(count * dtype.itemsize)
                items = np.frombuffer(self.buffer, dtype, count, self.position)
                self.position += count * dtype.itemsize
                return items.tolist()
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise CheckpointError(f"{self.path}: unknown GGUF value type {type_id} (corrupt file?)")

    def _need(self, size: int) -> None:
        if self.position + size > len(self.buffer):
            raise CheckpointError(f"{self.path} is truncated: the header runs past the end")


class GGUFFile:
    """Metadata dict and tensor index of a GGUF file; tensor bytes are read on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
            # numpy's memmap keeps its mmap object here: `release` advises it.
            self._mmap: mmap.mmap | None = getattr(self._map, "_mmap", None)
        except (OSError, ValueError) as error:
            raise CheckpointError(f"cannot read {path}: {error}") from None
        cursor = _Cursor(memoryview(self._map), path)
        if bytes(self._map[:4]) != _MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file")
        cursor.position = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise CheckpointError(f"{path}: GGUF version {version} is not supported")
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        raw_infos = [self._read_tensor_info(cursor) for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cursor.position // alignment) * alignment
        self.tensors = {info.name: self._place(info, data_start) for info in raw_infos}
        self._check_extents()

    @staticmethod
    def _read_tensor_info(cursor: _Cursor) -> TensorInfo:
        name = cursor.string()
        dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
        type_id, offset = cursor.scalar("<I"), cursor.scalar("<Q")
        return TensorInfo(name, tuple(reversed(dims)), type_id, offset, 0)

    def _place(self, info: TensorInfo, data_start: int) -> TensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(info.type_id)]
        except ValueError:
            raise CheckpointError(
                f"{self.path}: tensor {info.name} has unknown type {info.type_id}"
            ) from None
        if info.shape and info.shape[-1] % block:
            raise CheckpointError(
                f"{self.path}: tensor {info.name} has rows of {info.shape[-1]} values, not whole "
                f"{GGMLQuantizationType(info.type_id).name} blocks of {block}"
            )
        nbytes = math.prod(info.shape) // block * block_bytes
        start = data_start + info.start
        if start + nbytes > len(self._map):
            raise CheckpointError(
                f"{self.path} is truncated: tensor {info.name} ends at byte {start + nbytes:,}, "
                f"the file has {len(self._map):,}"
            )
        return TensorInfo(info.name, info.shape, info.type_id, start, nbytes)

    def _check_extents(self) -> None:
        """Each tensor's bytes (its type and shape's) end before the next tensor's begin: a
        tensor whose stored size disagrees with its type and shape overlaps its successor."""
        from gguf import GGMLQuantizationType

        placed = sorted(self.tensors.values(), key=lambda info: info.start)
        for info, following in itertools.pairwise(placed):
            if info.start + info.nbytes > following.start:
                kind = GGMLQuantizationType(info.type_id).name
                raise CheckpointError(
                    f"{self.path}: tensor {info.name} ({kind}, shape {info.shape}) takes "
                    f"{info.nbytes:,} bytes, but only {following.start - info.start:,} lie "
                    f"before the next tensor, {following.name}"
                )

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes, shaped [rows, bytes per row] as `gguf.quants.dequantize` wants."""
        row_bytes = info.nbytes // max(1, math.prod(info.shape[:-1]))
        return self._map[info.start : info.start + info.nbytes].reshape(-1, row_bytes)

    def copy(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes copied out of the file ([rows, bytes per row], as `raw`), a few
        MiB at a time with each part's pages dropped once copied: a load holds the copy, not
        the copy plus the file's pages of it (178 MB of the 270M's token table)."""
        raw = self.raw(info)
        out = np.empty_like(raw)
        rows = max(1, _COPY_BYTES // max(1, raw.shape[1]))
        for first in range(0, raw.shape[0], rows):
            out[first : first + rows] = raw[first : first + rows]
            start = info.start + first * raw.shape[1]
            self._drop(start, min(info.start + info.nbytes, start + rows * raw.shape[1]))
        return out

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's pages from this process's resident memory once it has been read
        (they stay in the page cache): a load then holds the model, not the model plus the
        file. Pages shared with a neighbouring tensor are dropped too and read again if used."""
        self._drop(info.start, min(info.start + info.nbytes, len(self._map)))

    def _drop(self, start: int, end: int) -> None:
        """Drop the pages of bytes start..end from this process's resident memory (the page
        holding `start` included)."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start -= start % mmap.PAGESIZE
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)
