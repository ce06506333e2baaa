"""Open a model path (GGUF file or HF-format directory) as a `Checkpoint`."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hearth.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from hearth.tokenizer import Tokenizer


class Checkpoint(Protocol):
    """A readable model: an HF-style config dict, canonical tensors and a tokenizer."""

    path: Path

    @property
    def format(self) -> str: ...

    @property
    def config(self) -> dict[str, Any]: ...

    @property
    def stored_dtype(self) -> torch.dtype | None:
        """The float dtype the weights are stored in (None: quantized blocks)."""
        ...

    def tensor_names(self) -> list[str]: ...

    def tensor_storage(self) -> dict[str, tuple[tuple[int, ...], int, str]]:
        """Each tensor's (shape, stored bytes, storage type name), without reading data."""
        ...

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = (), meta: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Canonical tensors, but not those named in `skip`. `dtype` is the model's: a reader
        that widens stored blocks to floats (GGUF) returns them rounded to it; a stored float
        or packed tensor comes as is. `meta`: tensors of the same shapes and dtypes on the
        meta device, nothing read (a load that only sizes the model: `hearth fit`)."""
        ...

    def tokenizer(self) -> Tokenizer: ...


def open_checkpoint(path: str | Path, mmproj: str | Path | None = None) -> Checkpoint:
    """The checkpoint at `path`; raises CheckpointError with one readable line otherwise.

    `mmproj`: a llama.cpp mmproj GGUF whose vision tower joins a Gemma 4 GGUF text model.
    Without it, the one `mmproj*.gguf` beside a Gemma 4 GGUF model is taken (said in the log).
    """
    from hearth.config import parse_config

    checkpoint = _open(Path(path).expanduser())
    checkpoint = _with_mmproj(checkpoint, Path(mmproj).expanduser() if mmproj else None)
    parse_config(checkpoint.config)  # refuse an unsupported model before reading tensors
    return checkpoint


def _with_mmproj(checkpoint: Checkpoint, mmproj: Path | None) -> Checkpoint:
    from hearth.checkpoint.gguf import GGUFCheckpoint
    from hearth.checkpoint.mmproj import GGUFWithMmproj, MmprojFile, find_sibling_mmproj, log

    if mmproj is not None:
        if not isinstance(checkpoint, GGUFCheckpoint):
            raise CheckpointError(
                f"--mmproj goes with a GGUF model file; {checkpoint.path} is a "
                f"{checkpoint.format} checkpoint, whose towers come with it"
            )
        if not mmproj.is_file():
            raise CheckpointError(f"no mmproj file at {mmproj}")
        return GGUFWithMmproj(checkpoint, MmprojFile(mmproj))
    if not isinstance(checkpoint, GGUFCheckpoint) or checkpoint.architecture != "gemma4":
        return checkpoint
    sibling = find_sibling_mmproj(checkpoint.path)
    if sibling is None:
        return checkpoint
    try:
        joined = GGUFWithMmproj(checkpoint, MmprojFile(sibling))
    except CheckpointError as error:
        log.warning("not using %s, found beside the model: %s", sibling.name, error)
        return checkpoint
    kinds = "image and audio" if joined.mmproj.reads_audio else "image"
    log.warning("using %s, found beside the model, for %s input", sibling.name, kinds)
    return joined


def _open(path: Path) -> Checkpoint:
    from hearth.checkpoint.gguf import GGUFCheckpoint
    from hearth.checkpoint.safetensors import SafetensorsCheckpoint

    if not path.exists():
        raise CheckpointError(f"no model at {path}: the path does not exist")
    if path.is_dir():
        from hearth.checkpoint.mmproj import is_mmproj_name

        # A model folder may hold its vision tower's mmproj file beside the model's.
        ggufs = sorted(p for p in path.glob("*.gguf") if not is_mmproj_name(p))
        if (path / "config.json").exists():
            return SafetensorsCheckpoint(path)
        if len(ggufs) == 1:
            return GGUFCheckpoint(ggufs[0])
        raise CheckpointError(
            f"{path} is not a model directory: it has no config.json"
            + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else "")
        )
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error.strerror}") from None
    if magic == b"GGUF":
        return GGUFCheckpoint(path)
    raise CheckpointError(
        f"{path} is neither a GGUF file nor an HF-format directory (first bytes {magic!r})"
    )
