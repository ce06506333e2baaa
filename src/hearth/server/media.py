"""Images and audio in requests: each API's parts become a `MediaSource` while the body is
parsed (nothing is read or decoded there), and the route reads and decodes them off the event
loop into the content parts chat templates take (`{"type": "image", "image": Image}`,
`{"type": "audio", "audio": Audio}`). docs/media.md has the request shapes."""

from __future__ import annotations

import asyncio
from typing import Any

from hearth.media import Audio, Image, MediaError
from hearth.media.fetch import FetchPolicy
from hearth.media.parts import media_part, refuse_untaken
from hearth.server.errors import RequestError
from hearth.server.schemas import MediaSource


async def read_media(
    messages: list[dict[str, Any]], policy: FetchPolicy, default_budget: int | None
) -> tuple[list[dict[str, Any]], list[Image | Audio]]:
    """The messages with every `MediaSource` part read and decoded, and the decoded inputs in
    prompt order. A problem with one is a 400 naming its place in the request."""
    resolved: list[dict[str, Any]] = []
    media: list[Image | Audio] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            resolved.append(message)
            continue
        parts = []
        for part in content:
            if part.get("type") == "media":
                item = await _decode(part["source"], policy, default_budget)
                media.append(item)
                part = media_part(item)
            parts.append(part)
        resolved.append({**message, "content": parts})
    return resolved, media


async def _decode(
    source: MediaSource, policy: FetchPolicy, default_budget: int | None
) -> Image | Audio:
    try:
        # Decoding (and any fetch) blocks: a thread keeps the event loop serving.
        return await asyncio.to_thread(source.decode, policy, default_budget)
    except MediaError as error:
        raise RequestError(f"{source.param}: {error}", source.param) from None


def media_sources(messages: list[dict[str, Any]]) -> list[MediaSource]:
    return [
        part["source"]
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "media"
    ]


def check_taken(sources: list[MediaSource], modalities: tuple[str, ...], model_name: str) -> None:
    """A 400 naming the first part of a kind the model does not take, before any is read."""
    for source in sources:
        try:
            refuse_untaken([source.kind], modalities, model_name)
        except MediaError as error:
            raise RequestError(f"{source.param}: {error}", source.param) from None
