"""The devices Hearth runs on, named as torch names them, checked before anything loads."""

from __future__ import annotations

import torch

from hearth.errors import HearthError

KINDS = ("cpu", "cuda")


def parse_device(name: str | torch.device | None, available: bool = True) -> torch.device:
    """The device `name` gives (None: cuda if present, else cpu).

    HearthError, one line, for a name torch does not know, a kind Hearth does not run on, or,
    with `available`, a device this machine lacks (`hearth fit` plans for a GPU from anywhere).
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise HearthError(f"device {str(name)!r} is not a device name: give cpu or cuda") from None
    if device.type not in KINDS:
        raise HearthError(f"device {str(name)!r}: Hearth runs on cpu or cuda")
    if available and device.type == "cuda":
        _require_cuda(device)
    return device


def _require_cuda(device: torch.device) -> None:
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "none found"
        raise HearthError(f"device {str(device)!r}: no CUDA device is available ({why})")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise HearthError(f"device {str(device)!r}: this machine has {count} CUDA device(s)")
