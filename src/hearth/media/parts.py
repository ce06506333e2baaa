"""Decoded inputs as chat messages carry them, and the faces' early check that a model takes
them (before anything is fetched or decoded, and before a text-only chat template, which
cannot render an image part, is asked to)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hearth.media import Audio, Image, MediaError

KIND_NAMES = {"image": "images", "audio": "audio inputs"}


def kind_of(item: Image | Audio) -> str:
    return "image" if isinstance(item, Image) else "audio"


def media_part(item: Image | Audio) -> dict[str, Any]:
    """A decoded input as the content part chat templates read."""
    if isinstance(item, Image):
        return {"type": "image", "image": item}
    return {"type": "audio", "audio": item}


def media_in(messages: Iterable[dict[str, Any]]) -> list[Image | Audio]:
    """The decoded inputs of rendered messages, in prompt order."""
    found: list[Image | Audio] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            found += [part[part["type"]] for part in content if part.get("type") in KIND_NAMES]
    return found


def refuse_untaken(kinds: Iterable[str], modalities: Sequence[str], model_name: str) -> None:
    """MediaError for the first kind of input (image, audio) the model does not take."""
    for kind in kinds:
        if kind not in modalities:
            raise MediaError(
                f"{KIND_NAMES[kind]} are not supported by this model ({model_name} takes: "
                f"{', '.join(modalities)})"
            )
