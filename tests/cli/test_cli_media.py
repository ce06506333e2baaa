"""`hearth generate --image/--audio` and `/image`, `/audio` in `hearth chat`: inputs decoded in
the order given and handed to the engine's `expand_media`; every refusal (a missing, corrupt
or truncated file, a URL without --allow-fetch, a text-only model) is exit code 2 with one
readable line. The refusals by a text-only model run on the embedded Gemma 3 270M; the order
of the parts is checked on a stand-in engine that takes images and audio (the towers are
another test's subject). Pillow and soundfile write the inputs; hashlib names their bytes."""

from __future__ import annotations

import builtins
import hashlib
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from PIL import Image as PILImage

from hearth import cli
from hearth.chat import TerminalChat
from hearth.media import MAX_MEDIA_BYTES, Audio, Image
from hearth.media.fetch import FetchPolicy
from hearth.runtime.generate import GenerationChunk, GenerationRequest, PromptMedia
from hearth.runtime.sampling import SamplingParams
from test_cli import assert_usage_error, run, run_in_process


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("media")
    image = io.BytesIO()
    PILImage.fromarray(np.full((12, 30, 3), 200, dtype=np.uint8)).save(image, format="PNG")
    audio = io.BytesIO()
    soundfile.write(audio, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    contents = {
        "image": ("image.png", image.getvalue()),
        "sound": ("sound.wav", audio.getvalue()),
        "corrupt": ("corrupt.png", b"this is no image"),
        "truncated": ("truncated.wav", audio.getvalue()[:30]),
    }
    for name, data in contents.values():
        (folder / name).write_bytes(data)
    with (folder / "huge.png").open("wb") as huge:  # sparse: one byte past the limit
        huge.truncate(MAX_MEDIA_BYTES + 1)
    contents["huge"] = ("huge.png", b"")
    return {key: folder / name for key, (name, _) in contents.items()}


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--image", "missing.png"], ["cannot read missing.png", "No such file"]),
        (["--image", "{corrupt}"], ["corrupt.png: the image is not in a format"]),
        (["--audio", "{truncated}"], ["truncated.wav: the audio could not be decoded"]),
        (["--image", "https://example.com/cat.png"], ["--allow-fetch"]),
        (["--image", "{huge}"], [f"has {MAX_MEDIA_BYTES + 1} bytes; at most {MAX_MEDIA_BYTES}"]),
        (["--image", "{image}", "--raw"], ["leave out --raw"]),
        (["--image-max-tokens", "100"], ["--image-max-tokens", "invalid choice"]),
    ],
)
def test_bad_inputs_are_refused_before_the_model_loads(
    files: dict[str, Path],
    args: list[str],
    needles: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_load(*_: Any) -> None:
        raise AssertionError("the model loaded before the input was checked")

    monkeypatch.setattr(cli, "_load", no_load)
    args = [arg.format(**{name: str(path) for name, path in files.items()}) for arg in args]
    result = run_in_process(capsys, "generate", *args, "Describe it.")
    assert_usage_error(result, *needles)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "name"), [("image", "image"), ("audio", "sound")])
def test_a_text_only_model_refuses_media(
    hearth_270m: Any,
    files: dict[str, Path],
    kind: str,
    name: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The embedded 270M (loaded once for the session) takes text only: exit 2 naming the
    kind and the model."""
    monkeypatch.setattr(cli, "_load", lambda *_: hearth_270m)
    result = run_in_process(capsys, "generate", f"--{kind}", str(files[name]), "Describe it.")
    kinds = "images" if kind == "image" else "audio inputs"
    assert_usage_error(result, f"{kinds} are not supported by this model", "takes: text")


def test_the_real_command_refuses_a_missing_file_in_one_line() -> None:
    assert_usage_error(run("generate", "--image", "missing.png", "Hi"), "cannot read missing.png")


class StandIn:
    """An engine that takes images and audio: records what the face hands it."""

    modalities = ("text", "image", "audio")
    path = Path("stand-in")

    class model:
        class config:
            max_position_embeddings = 4096

    class tokenizer:
        has_own_chat_template = True

    def __init__(self) -> None:
        self.rendered: list[list[dict[str, Any]]] = []
        self.expanded: list[list[Image | Audio]] = []
        self.requests: list[GenerationRequest] = []

    def encode(self, messages: list[dict[str, Any]], chat: bool | None = None) -> list[int]:
        self.rendered.append(messages)
        return [2, 3, 4]

    def expand_media(self, ids: list[int], media: Any) -> tuple[list[int], tuple[Any, ...]]:
        self.expanded.append(list(media))
        return ids, tuple(PromptMedia(i, 1, item) for i, item in enumerate(media))

    def run(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        self.requests.append(request)
        yield GenerationChunk("Seen.", None, "stop")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_generate_hands_the_inputs_in_order(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = StandIn()
    monkeypatch.setattr(cli, "_load", lambda *_: engine)
    image, sound = str(files["image"]), str(files["sound"])
    args = ["--image", image, "--audio", sound, "--image", image, "--image-max-tokens", "1120"]
    result = run_in_process(capsys, "generate", *args, "Describe it.")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Seen.\n"
    [media] = engine.expanded
    assert [type(item) for item in media] == [Image, Audio, Image]
    assert [item.digest for item in media] == [
        _digest(files["image"]),
        _digest(files["sound"]),
        _digest(files["image"]),
    ]
    assert media[0].max_tokens == 1120 and media[0].size == (30, 12)  # type: ignore[union-attr]
    [messages] = engine.rendered
    kinds = [part["type"] for part in messages[0]["content"]]
    assert kinds == ["image", "audio", "image", "text"]
    assert messages[0]["content"][-1]["text"] == "Describe it."
    [request] = engine.requests
    assert [span.item for span in request.media] == media


def test_chat_attaches_media_to_the_next_message(
    files: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = StandIn()
    lines = iter(
        [
            f"/audio {files['sound']}",
            f"/image {files['image']}",
            "What is this?",
            "And now?",
            "/exit",
        ]
    )
    monkeypatch.setattr(builtins, "input", lambda _: next(lines))
    chat = TerminalChat(engine, None, 16, SamplingParams(), (), FetchPolicy(), 70)
    assert chat.run() == 0
    err = capsys.readouterr().err
    assert "audio attached" in err and "image attached" in err
    first = engine.requests[0]
    assert [type(span.item) for span in first.media] == [Audio, Image]
    assert first.media[1].item.max_tokens == 70  # type: ignore[union-attr]
    # The next message carries no new input; the conversation still shows the earlier ones.
    assert [type(span.item) for span in engine.requests[1].media] == [Audio, Image]
    assert [p["type"] for p in chat.messages[0]["content"]] == ["audio", "image", "text"]
    assert chat.messages[2] == {"role": "user", "content": "And now?"}


@pytest.mark.slow
def test_chat_refuses_media_a_text_only_model_cannot_take(
    hearth_270m: Any,
    files: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lines = iter([f"/image {files['image']}", f"/audio {files['corrupt']}", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda _: next(lines))
    chat = TerminalChat(hearth_270m, None, 16, SamplingParams(), ())
    assert chat.run() == 0
    err = capsys.readouterr().err
    assert "not attached: images are not supported by this model" in err
    assert "not attached: audio inputs are not supported by this model" in err
    assert chat.attached == [] and chat.messages == []


def test_serve_takes_the_media_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = cli.parse_arguments(["serve", "--allow-fetch", "--image-max-tokens", "560"])
    assert args.allow_fetch is True and args.image_max_tokens == 560
    assert cli.parse_arguments(["serve"]).allow_fetch is False  # off unless asked for
    help_text = run_in_process(capsys, "generate", "--help").stdout
    assert "--image FILE" in help_text and "--audio FILE" in help_text
