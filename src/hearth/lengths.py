"""How many tokens a generation may add: the one default, and the model's context window."""

from __future__ import annotations

from hearth.errors import HearthError

# mlx_lm.server's default, used by the CLI, the library and the server alike (mlx-lm's own
# CLI and library differ: 100 and 256).
DEFAULT_MAX_TOKENS = 512


class ContextOverflow(HearthError, ValueError):
    """A prompt, or a prompt plus the tokens asked for, longer than the model's context."""


def generation_limit(prompt_tokens: int, max_tokens: int | None, context: int) -> int:
    """The number of tokens a generation may add after `prompt_tokens`, in `context` positions.

    None takes DEFAULT_MAX_TOKENS, shrunk to the room the prompt leaves (as the server does);
    a given count must be at least 1 and fit beside the prompt: it is never cut silently.
    """
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    room = context - prompt_tokens
    if room < 1:
        raise ContextOverflow(
            f"the prompt has {prompt_tokens} tokens; this model's context holds {context}"
        )
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens > room:
        raise ContextOverflow(
            f"max_tokens {max_tokens} plus the prompt's {prompt_tokens} tokens exceeds this "
            f"model's context of {context} tokens"
        )
    return max_tokens
