"""Images and audio through the APIs: the real openai and anthropic SDKs build the requests,
and the parts arrive, decoded and in order, at the engine's `expand_media`; its spans reach the
worker's `GenerationRequest.media`. Bad input is a 400 in each API's error body naming the
part. The model is the scripted tiny Gemma 4 (the real Gemma 4 chat template) with
`media_kinds` set and `expand_media` recorded (the vision and audio towers are not this test's
subject); the text-only refusals run on the embedded Gemma 3 270M, a real text-only model.

The oracles: Pillow and soundfile encode the inputs (PNG is lossless, so the decoded pixels
equal the source's), hashlib names their bytes, and the template's own placeholders
(`<|image|>`, `<|audio|>`) mark where each part went in the rendered prompt.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import io
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import numpy as np
import openai
import pytest
import soundfile
from fastapi.testclient import TestClient
from PIL import Image as PILImage

from hearth.engine import Engine
from hearth.media import Audio, Image
from hearth.media.fetch import FetchPolicy
from hearth.runtime.generate import GenerationRequest, PromptMedia
from hearth.server import ServerDefaults, create_app
from hearth.server import worker as worker_module
from scripted_gemma4 import NO_PROMPT_CACHE, last_prompt, one_torch_thread, say, shared_engine


def png(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def wav(seconds: float = 0.1, rate: int = 8000) -> bytes:
    samples = np.sin(np.arange(int(seconds * rate)) * 0.3).astype(np.float32) * 0.5
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{b64(data)}"


PNG_A, PNG_B, WAV = png(20, 10, seed=1), png(7, 13, seed=2), wav()
TEXT = {"type": "text", "text": "What do you see and hear?"}


@dataclasses.dataclass
class Recorder:
    """What the engine's `expand_media` was given and what the worker was handed."""

    media: list[list[Image | Audio]] = dataclasses.field(default_factory=list)
    requests: list[GenerationRequest] = dataclasses.field(default_factory=list)

    def expand(self, ids: list[int], media: Any) -> tuple[list[int], tuple[PromptMedia, ...]]:
        self.media.append(list(media))
        # One span per input, each at a distinct position (as a real expansion's would be).
        return ids, tuple(PromptMedia(i, 1, item) for i, item in enumerate(media))


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with one_torch_thread():
        yield shared_engine()


@pytest.fixture
def recorder(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """The scripted model takes images and audio; its expansion and the worker's requests are
    recorded. The worker runs each generation without its spans: the scripted model has no
    tower to encode them with."""
    record = Recorder()
    monkeypatch.setattr(engine.model, "media_kinds", ("image", "audio"), raising=False)
    monkeypatch.setattr(engine, "expand_media", record.expand)
    request_of = worker_module._request_of

    def recorded(job: Any) -> GenerationRequest:
        request = request_of(job)
        record.requests.append(request)
        return dataclasses.replace(request, media=())

    monkeypatch.setattr(worker_module, "_request_of", recorded)
    say(engine, "A picture.")
    return record


@pytest.fixture
def client(engine: Engine, recorder: Recorder) -> Iterator[TestClient]:
    defaults = ServerDefaults(image_max_tokens=560)
    with TestClient(create_app(engine, defaults, NO_PROMPT_CACHE)) as test_client:
        yield test_client


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
    )


@pytest.fixture
def claude(client: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=client, max_retries=0
    )


def assert_image(item: Image | Audio, source: bytes, max_tokens: int | None) -> None:
    assert isinstance(item, Image)
    assert item.digest == hashlib.sha256(source).hexdigest()
    with PILImage.open(io.BytesIO(source)) as original:
        assert item.size == original.size
        assert item.pixels.tobytes() == original.convert("RGB").tobytes()  # type: ignore[attr-defined]
    assert item.max_tokens == max_tokens


def assert_audio(item: Image | Audio, source: bytes) -> None:
    assert isinstance(item, Audio)
    assert item.digest == hashlib.sha256(source).hexdigest()
    assert len(item.samples) == 1600  # 0.1 s at 16 kHz, resampled from 8 kHz


def placeholders(engine: Engine) -> list[str]:
    """The template's media placeholders in the rendered prompt, in order."""
    text = last_prompt(engine)
    marks = sorted(
        (i, mark)
        for mark in ("<|image|>", "<|audio|>")
        for i in range(len(text))
        if text.startswith(mark, i)
    )
    return [mark for _, mark in marks]


def test_openai_chat_image_and_audio_parts_arrive_in_order(
    oai: openai.OpenAI, engine: Engine, recorder: Recorder
) -> None:
    """image_url (data URLs, each detail level) and input_audio, interleaved with text: the
    engine gets them decoded and in order; "auto" takes the server's --image-max-tokens."""
    content: Any = [
        {"type": "image_url", "image_url": {"url": data_url(PNG_A), "detail": "low"}},
        TEXT,
        {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "wav"}},
        {"type": "image_url", "image_url": {"url": data_url(PNG_B), "detail": "auto"}},
        {"type": "image_url", "image_url": {"url": data_url(PNG_B), "detail": "high"}},
    ]
    reply = oai.chat.completions.create(
        model="g", messages=[{"role": "user", "content": content}], max_tokens=32
    )
    assert reply.choices[0].message.content == "A picture."
    [media] = recorder.media
    assert_image(media[0], PNG_A, 70)
    assert_audio(media[1], WAV)
    assert_image(media[2], PNG_B, 560)
    assert_image(media[3], PNG_B, 1120)
    assert placeholders(engine) == ["<|image|>", "<|audio|>", "<|image|>", "<|image|>"]
    assert TEXT["text"] in last_prompt(engine)
    [request] = recorder.requests
    assert [span.item for span in request.media] == media


def test_anthropic_image_blocks_arrive_in_order(
    claude: anthropic.Anthropic, engine: Engine, recorder: Recorder
) -> None:
    """base64 sources (any media type: the bytes say what they are), in block order; a later
    turn's image comes after an earlier one's."""
    first = {"type": "base64", "media_type": "image/png", "data": b64(PNG_A)}
    second = {"type": "base64", "media_type": "image/jpeg", "data": b64(PNG_B)}
    messages: Any = [
        {"role": "user", "content": [{"type": "image", "source": first}, TEXT]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": [TEXT, {"type": "image", "source": second}]},
    ]
    reply = claude.messages.create(model="g", max_tokens=32, messages=messages)
    assert reply.content[0].text == "A picture."  # type: ignore[union-attr]
    [media] = recorder.media
    assert_image(media[0], PNG_A, 560)
    assert_image(media[1], PNG_B, 560)
    assert placeholders(engine) == ["<|image|>", "<|image|>"]
    assert [span.item for span in recorder.requests[0].media] == media


def test_anthropic_count_tokens_counts_the_expanded_prompt(
    client: TestClient, recorder: Recorder
) -> None:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png"}}
    block["source"]["data"] = b64(PNG_A)  # type: ignore[index]
    body = {"model": "g", "messages": [{"role": "user", "content": [block, TEXT]}]}
    reply = client.post("/v1/messages/count_tokens", json=body)
    assert reply.status_code == 200, reply.text
    assert len(recorder.media) == 1 and isinstance(recorder.media[0][0], Image)


def test_responses_input_image_and_input_audio_arrive_in_order(
    oai: openai.OpenAI, engine: Engine, recorder: Recorder
) -> None:
    content: Any = [
        {"type": "input_text", "text": TEXT["text"]},
        {"type": "input_audio", "input_audio": {"data": b64(WAV), "format": "wav"}},
        {"type": "input_image", "image_url": data_url(PNG_A), "detail": "low"},
    ]
    reply = oai.responses.create(model="g", input=[{"role": "user", "content": content}])
    assert reply.output_text == "A picture."
    [media] = recorder.media
    assert_audio(media[0], WAV)
    assert_image(media[1], PNG_A, 70)
    assert placeholders(engine) == ["<|audio|>", "<|image|>"]
    assert [span.item for span in recorder.requests[0].media] == media
    # A follow-up through previous_response_id shows the model the earlier inputs again.
    oai.responses.create(model="g", input="And now?", previous_response_id=reply.id)
    assert [item.digest for item in recorder.media[1]] == [item.digest for item in media]


def test_models_lists_the_modalities(oai: openai.OpenAI, client: TestClient) -> None:
    card = client.get("/v1/models").json()["data"][0]
    assert card["architecture"] == {
        "modality": "text+image+audio->text",
        "input_modalities": ["text", "image", "audio"],
        "output_modalities": ["text"],
    }


def _chat_error(client: TestClient, part: dict[str, Any], role: str = "user") -> dict[str, Any]:
    body = {"model": "g", "max_tokens": 4, "messages": [{"role": role, "content": [part, TEXT]}]}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


def _image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def _audio(data: bytes) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}


def _unknown_codec_wav() -> bytes:
    """A RIFF/WAVE file whose format tag no decoder knows (0x1234)."""
    fmt = struct.pack("<HHIIHH", 0x1234, 1, 8000, 16000, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", 1600) + bytes(1600)
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        (_image(data_url(b"not an image")), "messages.0.content.0.image_url", "not in a format"),
        (_image(data_url(PNG_A[:60])), "messages.0.content.0.image_url", "could not be decoded"),
        (_image("data:image/png;base64,@@@"), "messages.0.content.0.image_url", "malformed"),
        (
            _image("https://example.com/cat.png"),
            "messages.0.content.0.image_url",
            "--allow-fetch",
        ),
        (_image("file:///etc/passwd"), "messages.0.content.0.image_url", "not file:"),
        (_audio(WAV[:30]), "messages.0.content.0.input_audio.data", "could not be decoded"),
        (
            _audio(_unknown_codec_wav()),
            "messages.0.content.0.input_audio.data",
            "could not be decoded",
        ),
        (_audio(b"ID3" + bytes(100)), "messages.0.content.0.input_audio.data", "decoded"),
    ],
    ids=[
        "corrupt-image",
        "truncated-png",
        "bad-base64",
        "url-fetch-off",
        "file-scheme",
        "truncated-wav",
        "unknown-codec",
        "empty-mp3",
    ],
)
def test_bad_media_is_a_400_naming_the_part(
    client: TestClient, part: dict[str, Any], param: str, words: str
) -> None:
    error = _chat_error(client, part)
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ") and words in error["message"]
    assert error["type"] == "invalid_request_error"


def test_media_outside_user_messages_is_refused(client: TestClient) -> None:
    error = _chat_error(client, _image(data_url(PNG_A)), role="system")
    assert "images and audio go in user messages" in error["message"]


def test_anthropic_errors_use_its_body(claude: anthropic.Anthropic) -> None:
    corrupt = {"type": "base64", "media_type": "image/png", "data": b64(b"not an image")}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model="g",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": corrupt}]}],  # type: ignore[list-item]
        )
    body: Any = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages.0.content.0.source.data: ")
    url = {"type": "url", "url": "http://169.254.169.254/latest/meta-data/"}
    with pytest.raises(anthropic.BadRequestError, match="--allow-fetch"):
        claude.messages.create(
            model="g",
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": url}]}],  # type: ignore[list-item]
        )


def test_a_too_large_file_is_refused(engine: Engine, recorder: Recorder) -> None:
    small = FetchPolicy(max_bytes=1000)
    with TestClient(create_app(engine, limits=NO_PROMPT_CACHE, fetch=small)) as client:
        error = _chat_error(client, _image(data_url(png(64, 64))))
    assert "at most 1000 are accepted" in error["message"]


def test_fetching_when_allowed_still_refuses_the_servers_own_networks(
    engine: Engine, recorder: Recorder
) -> None:
    """--allow-fetch on: an http URL is fetched, but loopback and the metadata address are
    refused by the SSRF guard (tests/media/test_media_fetch.py has the guard's own tests)."""
    allowed = FetchPolicy(allowed=True)
    with TestClient(create_app(engine, limits=NO_PROMPT_CACHE, fetch=allowed)) as client:
        loopback = _chat_error(client, _image("http://127.0.0.1:8080/cat.png"))
        metadata = _chat_error(client, _image("http://169.254.169.254/latest/meta-data/"))
    assert "a loopback address" in loopback["message"]
    assert "a link-local address" in metadata["message"]
    assert recorder.media == []


class _ImageFiles(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = {"/a.png": PNG_A, "/b.png": PNG_B}.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: Any) -> None:
        pass


def test_urls_are_fetched_when_allowed(engine: Engine, recorder: Recorder) -> None:
    """An http URL in a chat image_url and an Anthropic url source, served by a loopback
    server: `trust_first_hop` (test only) lets the request reach it past the SSRF guard."""
    files = ThreadingHTTPServer(("127.0.0.1", 0), _ImageFiles)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    policy = FetchPolicy(allowed=True, trust_first_hop=True)
    try:
        with TestClient(create_app(engine, limits=NO_PROMPT_CACHE, fetch=policy)) as client:
            chat = {"messages": [{"role": "user", "content": [_image(f"{base}/a.png"), TEXT]}]}
            reply = client.post("/v1/chat/completions", json={"model": "g", **chat})
            assert reply.status_code == 200, reply.text
            source = {"type": "url", "url": f"{base}/b.png"}
            blocks = [{"type": "image", "source": source}, TEXT]
            turn = {"role": "user", "content": blocks}
            body = {"model": "g", "max_tokens": 4, "messages": [turn]}
            assert client.post("/v1/messages", json=body).status_code == 200
    finally:
        files.shutdown()
        files.server_close()
    assert_image(recorder.media[0][0], PNG_A, None)
    assert_image(recorder.media[1][0], PNG_B, None)


@pytest.fixture(scope="module")
def text_only(hearth_270m: Engine) -> Iterator[TestClient]:
    with TestClient(create_app(hearth_270m, limits=NO_PROMPT_CACHE)) as test_client:
        yield test_client


@pytest.mark.slow
@pytest.mark.parametrize("part", [_image(data_url(PNG_A)), _audio(WAV)], ids=["image", "audio"])
def test_a_text_only_model_refuses_media(text_only: TestClient, part: dict[str, Any]) -> None:
    """The embedded Gemma 3 270M takes text only: a 400 naming the part and the model."""
    error = _chat_error(text_only, part)
    kind = "images" if part["type"] == "image_url" else "audio inputs"
    assert f"{kind} are not supported by this model" in error["message"]
    assert "takes: text)" in error["message"]
    card = text_only.get("/v1/models").json()["data"][0]
    assert card["architecture"]["input_modalities"] == ["text"]
