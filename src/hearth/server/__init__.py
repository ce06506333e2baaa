"""`hearth serve`: OpenAI- and Anthropic-compatible HTTP endpoints over one Engine."""

from hearth.server.app import ServerLimits, create_app, serve
from hearth.server.state import ServerDefaults

__all__ = ["ServerDefaults", "ServerLimits", "create_app", "serve"]
