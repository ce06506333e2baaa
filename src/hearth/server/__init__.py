"""`hearth serve`: OpenAI- and Anthropic-compatible HTTP endpoints over one Engine.

The app (FastAPI, uvicorn) loads on first use, so the worker and the prompt cache import
without the web stack (a GPU host that runs only the engine)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ServerDefaults", "ServerLimits", "create_app", "listening_socket", "serve"]
_HOMES = {
    "ServerDefaults": "hearth.server.state",
    "ServerLimits": "hearth.server.app",
    "create_app": "hearth.server.app",
    "listening_socket": "hearth.server.app",
    "serve": "hearth.server.app",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hearth.server' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
