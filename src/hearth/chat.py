"""`hearth chat`: a conversation in the terminal, through the model's chat template."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

from hearth.lengths import DEFAULT_MAX_TOKENS
from hearth.runtime.sampling import SamplingParams

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (a --system prompt stays)",
    "/exit": "quit (so do Ctrl-D, and Ctrl-C at the prompt)",
}


def _say(line: str) -> None:
    """Notices go to stderr: stdout carries only the prompts and the model's text."""
    print(f"hearth: {line}", file=sys.stderr, flush=True)


def _enable_line_editing() -> None:
    """Line editing and history for `input()` at an interactive terminal (readline does it
    once imported)."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):  # a Python built without it: plain input
            import readline  # noqa: F401


class TerminalChat:
    """The conversation so far, and the loop that reads a line and streams the reply.

    Each reply keeps room for `reply_tokens` new tokens: the oldest turns go when the
    conversation would leave less (the context is a hard limit; a notice says what went).
    """

    def __init__(
        self,
        engine: Any,
        system: str | None,
        max_tokens: int | None,
        sampling: SamplingParams,
        stop: Sequence[str],
    ) -> None:
        self.engine = engine
        self.sampling = sampling
        self.stop = stop
        self.context = engine.model.config.max_position_embeddings
        self.reply_tokens = max_tokens or min(DEFAULT_MAX_TOKENS, self.context // 2)
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.first = len(self.messages)  # the first message a /reset or a drop removes

    def run(self) -> int:
        _enable_line_editing()
        _say("type a message; /help lists the commands, Ctrl-C stops a reply")
        while True:
            try:
                line = input(">>> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                _say("bye (Ctrl-C during a reply stops just the reply; /exit and Ctrl-D quit)")
                return 0
            text = line.strip()
            if text == "/exit":
                return 0
            if text.startswith("/") and " " not in text:
                self._command(text)
            elif text:
                self._reply(line)

    def _command(self, text: str) -> None:
        if text == "/help":
            for name, meaning in COMMANDS.items():
                print(f"  {name:7} {meaning}", file=sys.stderr)
        elif text == "/reset":
            del self.messages[self.first :]
            _say("conversation cleared")
        else:
            _say(f"unknown command {text}: /help lists the commands")

    def _reply(self, line: str) -> None:
        self.messages.append({"role": "user", "content": line})
        if not self._make_room():
            self.messages.pop()
            return
        reply = ""
        try:
            chunks = self.engine.stream(self.messages, self.reply_tokens, self.sampling, self.stop)
            for chunk in chunks:
                print(chunk.text, end="", flush=True)
                reply += chunk.text
            print()
        except KeyboardInterrupt:
            print()
            _say("reply stopped")
        self.messages.append({"role": "assistant", "content": reply})

    def _tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.engine.encode(messages))

    def _make_room(self) -> bool:
        """Drop the oldest turns until the conversation and a reply fit the context; False
        (nothing dropped) when the newest message alone leaves no room for one."""
        alone = self._tokens([*self.messages[: self.first], self.messages[-1]])
        if alone + self.reply_tokens > self.context:
            _say(
                f"not sent: this message has {alone} tokens, and with a reply of "
                f"{self.reply_tokens} the model's context of {self.context} is exceeded"
            )
            return False
        dropped = 0
        while self._tokens(self.messages) + self.reply_tokens > self.context:
            # Whole turns: a template may insist that a user message comes first.
            del self.messages[self.first]
            dropped += 1
            while self.messages[self.first]["role"] != "user":
                del self.messages[self.first]
                dropped += 1
        if dropped:
            _say(
                f"the conversation outgrew the model's context of {self.context} tokens: "
                f"dropped its oldest {dropped} messages"
            )
        return True
