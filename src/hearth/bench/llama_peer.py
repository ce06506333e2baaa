"""llama.cpp (llama-cpp-python) as a peer and an oracle, opened the same way everywhere.

Built from source by pip, llama.cpp targets the build machine's CPU (GGML_NATIVE). On a Xeon
with AMX it then moves weights into repacked "extra" buffer types at load, and decode
segfaults in them on our VMs (seen 2026-12-04 on the embedded 270M model and on a tiny Q8_0
file; plain buffers run both). So on a CPU that reports AMX the weights stay in plain buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def cpu_has_amx(cpuinfo: Path = CPUINFO) -> bool:
    """Whether the CPU's flags name an AMX unit (Linux; False where they cannot be read)."""
    try:
        return " amx_" in cpuinfo.read_text()
    except OSError:
        return False


def open_llama(path: Path | str, plain_buffers: bool | None = None, **options: Any) -> Any:
    """`llama_cpp.Llama(path, **options)`; `plain_buffers` (default: on a CPU with AMX) keeps
    the weights out of llama.cpp's repacked buffer types."""
    import llama_cpp
    from llama_cpp import llama_cpp as bindings

    if plain_buffers is None:
        plain_buffers = cpu_has_amx()
    if not plain_buffers:
        return llama_cpp.Llama(str(path), **options)
    default_params = bindings.llama_model_default_params

    def plain() -> Any:
        params = default_params()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = plain  # read once, while Llama loads the model
    try:
        return llama_cpp.Llama(str(path), **options)
    finally:
        bindings.llama_model_default_params = default_params
