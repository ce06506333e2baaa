"""`hearth chat`: a conversation in the terminal, through the model's chat template."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hearth.lengths import DEFAULT_MAX_TOKENS
from hearth.media import Audio, Image, MediaError, decode_audio, decode_image
from hearth.media.fetch import FetchPolicy, read_media_url
from hearth.media.parts import kind_of, media_in, media_part, refuse_untaken
from hearth.runtime.constraints import OutputConstraint
from hearth.runtime.generate import GenerationRequest
from hearth.runtime.sampling import SamplingParams

COMMANDS = {
    "/help": "list these commands",
    "/image PATH": "show the model an image (a file; a URL with --allow-fetch) with your next "
    "message",
    "/audio PATH": "let the model hear an audio file with your next message",
    "/reset": "forget the conversation (a --system prompt stays)",
    "/exit": "quit (so do Ctrl-D, and Ctrl-C at the prompt)",
}
URL_SCHEMES = ("http://", "https://", "data:")


def read_media_file(
    kind: str, where: str, policy: FetchPolicy, image_max_tokens: int | None = None
) -> Image | Audio:
    """An image or audio input from a file (or a URL: data: always, http(s) where `policy`
    allows); MediaError names the file and the problem."""
    try:
        if where.lower().startswith(URL_SCHEMES):
            data = read_media_url(where, policy)
        else:
            data = Path(where).expanduser().read_bytes()
        return decode_image(data, image_max_tokens) if kind == "image" else decode_audio(data)
    except OSError as error:
        raise MediaError(f"cannot read {where}: {error.strerror or error}") from None
    except MediaError as error:
        raise MediaError(f"{where}: {error}") from None


def media_request(
    engine: Any,
    messages: list[dict[str, Any]],
    max_tokens: int | None,
    sampling: SamplingParams,
    stop: Sequence[str],
    constraint: OutputConstraint | None = None,
) -> GenerationRequest:
    """A conversation with image and audio parts as the engine runs it: the template
    rendered, each placeholder expanded to the model's soft tokens."""
    ids, spans = media_prompt(engine, messages)
    return GenerationRequest(ids, max_tokens, sampling, stop, constraint=constraint, media=spans)


def media_prompt(engine: Any, messages: list[dict[str, Any]]) -> tuple[list[int], tuple[Any, ...]]:
    media = media_in(messages)
    # Refused before rendering: a text-only chat template cannot render an image part.
    refuse_untaken([kind_of(item) for item in media], engine.modalities, engine.path.name)
    return engine.expand_media(engine.encode(messages), media)


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
        fetch: FetchPolicy | None = None,
        image_max_tokens: int | None = None,
    ) -> None:
        self.engine = engine
        self.sampling = sampling
        self.stop = stop
        self.fetch = fetch or FetchPolicy()
        self.image_max_tokens = image_max_tokens
        self.attached: list[Image | Audio] = []  # what /image and /audio add to the next message
        self.context = engine.model.config.max_position_embeddings
        self.reply_tokens = max_tokens or min(DEFAULT_MAX_TOKENS, self.context // 2)
        self.messages: list[dict[str, Any]] = []
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
            command, _, argument = text.partition(" ")
            if command in ("/image", "/audio"):
                self._attach(command[1:], argument.strip())
            elif text.startswith("/") and " " not in text:
                self._command(text)
            elif text:
                self._reply(line)

    def _command(self, text: str) -> None:
        if text == "/help":
            for name, meaning in COMMANDS.items():
                print(f"  {name:11} {meaning}", file=sys.stderr)
        elif text == "/reset":
            del self.messages[self.first :]
            _say("conversation cleared")
        else:
            _say(f"unknown command {text}: /help lists the commands")

    def _attach(self, kind: str, where: str) -> None:
        if not where:
            _say(f"/{kind} needs a path: /{kind} PATH")
            return
        try:
            refuse_untaken([kind], self.engine.modalities, self.engine.path.name)
            item = read_media_file(kind, where, self.fetch, self.image_max_tokens)
        except MediaError as error:
            _say(f"not attached: {error}")
            return
        self.attached.append(item)
        _say(f"{kind} attached: it goes with your next message")

    def _reply(self, line: str) -> None:
        content: str | list[dict[str, Any]] = line
        if self.attached:
            content = [*map(media_part, self.attached), {"type": "text", "text": line}]
        self.messages.append({"role": "user", "content": content})
        if not self._make_room():
            self.messages.pop()
            return
        self.attached = []
        reply = ""
        try:
            if media_in(self.messages):
                request = media_request(
                    self.engine, self.messages, self.reply_tokens, self.sampling, self.stop
                )
                chunks = self.engine.run(request)
            else:
                chunks = self.engine.stream(
                    self.messages, self.reply_tokens, self.sampling, self.stop
                )
            for chunk in chunks:
                print(chunk.text, end="", flush=True)
                reply += chunk.text
            print()
        except KeyboardInterrupt:
            print()
            _say("reply stopped")
        self.messages.append({"role": "assistant", "content": reply})

    def _tokens(self, messages: list[dict[str, Any]]) -> int:
        if media_in(messages):
            return len(media_prompt(self.engine, messages)[0])
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
