"""Shared fixtures: the embedded real model (Gemma 3 270M GGUF), loaded once per session."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

# Tests import their helpers (tiny.py) and some of each other's fixtures by module name; the
# folders mirror the package's layers (tests/ops, tests/models, ...).
_TESTS = Path(__file__).parent
sys.path[:0] = [
    str(_TESTS),
    *(str(folder) for folder in sorted(_TESTS.iterdir()) if folder.is_dir()),
]

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU), so CPU tests
# check each kernel against its torch reference. Set before any kernel module is imported:
# `triton.jit` reads it at decoration time.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def on_kernel_device() -> Any:
    """Seeded tensors made on the GPU when there is one, else on the CPU (where the Triton
    kernels run in the interpreter): kernel tests run for real on a GPU machine."""
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        yield


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    from hearth.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def embedded_gguf_reader(embedded_gguf: Path) -> Any:
    """The `gguf` package's reader of the embedded file: an oracle for its metadata and tensor
    layout (~10 s to parse, so read once)."""
    import gguf

    reader = gguf.GGUFReader(embedded_gguf)
    # It holds ~2 million objects (a numpy memmap and its __dict__ a vocabulary entry) for the
    # rest of the session: out of the collector's generations, a full collection (each
    # `gc.collect()` of `hearth bench`, and the automatic ones) no longer walks them (~1 s).
    # Collected first, so that only live objects are frozen.
    gc.collect()
    gc.freeze()
    return reader


@contextmanager
def reusing_gguf_reader(path: Path, reader: Any) -> Iterator[None]:
    """transformers' GGUF loaders parse their file with `gguf.GGUFReader` (~11 s on the embedded
    file, twice for a model and once for a tokenizer): hand them the session's parse of `path`,
    the very reader they would build (read-only memmap, so they cannot change it)."""
    import gguf

    build = gguf.GGUFReader
    target = path.resolve()

    def shared(file: os.PathLike[str] | str, mode: str = "r") -> Any:
        if mode == "r" and Path(file).resolve() == target:
            return reader
        return build(file, mode)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = build


@pytest.fixture(scope="session")
def hearth_270m(embedded_gguf: Path) -> Any:
    import hearth

    """Every tensor dequantized to fp32 values (`--quantize none`): the exact reference."""
    return hearth.load(
        embedded_gguf, dtype="float32", device="cpu", progress=False, quantize="none"
    )


@pytest.fixture(scope="session")
def hf_270m(embedded_gguf: Path, embedded_gguf_reader: Any) -> Any:
    """HF transformers' own GGUF loader and model: the oracle (about 10 s past the shared parse,
    dequantized to fp32)."""
    from transformers import AutoModelForCausalLM

    with reusing_gguf_reader(embedded_gguf, embedded_gguf_reader):
        model = AutoModelForCausalLM.from_pretrained(
            str(embedded_gguf.parent), gguf_file=embedded_gguf.name, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def hf_270m_tokenizer(embedded_gguf: Path, embedded_gguf_reader: Any) -> Any:
    """HF transformers' tokenizer of the embedded file: the tokenizer's oracle."""
    from transformers import AutoTokenizer

    with reusing_gguf_reader(embedded_gguf, embedded_gguf_reader):
        return AutoTokenizer.from_pretrained(
            str(embedded_gguf.parent), gguf_file=embedded_gguf.name
        )


def pytest_collection_finish(session: pytest.Session) -> None:
    """The modules imported and the test items collected live for the session: frozen out of
    the collector's generations (see `embedded_gguf_reader`)."""
    gc.collect()
    gc.freeze()
