"""Gemma 4's thought channel: `<|channel>thought\n…<channel|>answer`, split into reasoning and
answer text as the generation streams."""

from __future__ import annotations

from typing import Literal

THOUGHT_START = "<|channel>"
THOUGHT_END = "<channel|>"

PartKind = Literal["reasoning", "text"]


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that could still grow into `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Feeds on generated text; returns (kind, text) pieces, holding back any partial marker.

    The first line inside the channel names it ("thought") and is dropped. Tolerant of what
    models write: a `<channel|>` with no channel open is dropped, and with a `call_marker`, a
    tool call inside the thought ends it (the call belongs to the answer).
    """

    def __init__(self, call_marker: str | None = None) -> None:
        self._pending = ""
        self._state: Literal["answer", "label", "thought"] = "answer"
        # A tool call's opening tag, which ends a thought left unclosed (None: it does not).
        self._call_marker = call_marker

    def feed(self, text: str) -> list[tuple[PartKind, str]]:
        self._pending += text
        pieces: list[tuple[PartKind, str]] = []
        while self._step(pieces):
            pass
        return [(kind, piece) for kind, piece in pieces if piece]

    def finish(self) -> list[tuple[PartKind, str]]:
        """What is still held back: an unclosed channel's text stays reasoning."""
        rest, self._pending = self._pending, ""
        if self._state == "label" or not rest:
            return []
        return [("reasoning" if self._state == "thought" else "text", rest)]

    def _step(self, pieces: list[tuple[PartKind, str]]) -> bool:
        """Consume what can be decided now; True while there may be more to do."""
        if self._state == "answer":
            # A close with no channel open (before the next opening) is dropped.
            opening = self._pending.find(THOUGHT_START)
            head, tail = (self._pending, "") if opening < 0 else self._split_at(opening)
            self._pending = head.replace(THOUGHT_END, "") + tail
            return self._until_marker(THOUGHT_START, "text", "label", pieces)
        if self._state == "thought":
            call = self._pending.find(self._call_marker) if self._call_marker else -1
            end = self._pending.find(THOUGHT_END)
            if call >= 0 and (end < 0 or call < end):
                pieces.append(("reasoning", self._pending[:call]))
                self._pending = self._pending[call:]  # the answer starts with the call
                self._state = "answer"
                return True
            return self._until_marker(THOUGHT_END, "reasoning", "answer", pieces)
        return self._skip_label()

    def _split_at(self, index: int) -> tuple[str, str]:
        return self._pending[:index], self._pending[index:]

    def _until_marker(
        self,
        marker: str,
        kind: PartKind,
        next_state: Literal["answer", "label", "thought"],
        pieces: list[tuple[PartKind, str]],
    ) -> bool:
        found = self._pending.find(marker)
        if found < 0:
            # Held back: a tail that may grow into this marker or another one that matters.
            others = [THOUGHT_END] if kind == "text" else [self._call_marker or ""]
            held = max(partial_marker_length(self._pending, m) for m in [marker, *others] if m)
            safe = len(self._pending) - held
            pieces.append((kind, self._pending[:safe]))
            self._pending = self._pending[safe:]
            return False
        pieces.append((kind, self._pending[:found]))
        self._pending = self._pending[found + len(marker) :]
        self._state = next_state
        return True

    def _skip_label(self) -> bool:
        newline = self._pending.find("\n")
        end = self._pending.find(THOUGHT_END)
        if end >= 0 and (newline < 0 or end < newline):  # a channel with a label and no text
            self._pending = self._pending[end + len(THOUGHT_END) :]
            self._state = "answer"
            return True
        if newline < 0:
            return False
        self._pending = self._pending[newline + 1 :]
        self._state = "thought"
        return True
