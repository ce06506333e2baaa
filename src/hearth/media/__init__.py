"""Images and audio as a prompt carries them: decoded, checked, and named by their content.

The faces (CLI, server) turn what a client sends into these objects and put them into chat
messages as content parts, the shape chat templates expect:

    {"type": "image", "image": Image}     {"type": "audio", "audio": Audio}

The engine expands each into the model's soft tokens. Every problem with the input itself (a
corrupt file, an unknown codec, too many bytes) is a `MediaError` with a message fit for a
client: the server answers it with a 400, the CLI with exit code 2.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field

import numpy as np

MAX_MEDIA_BYTES = 20 * 1024 * 1024  # one image or audio file, encoded
AUDIO_SAMPLE_RATE = 16_000  # what the Gemma audio towers take
MAX_AUDIO_SECONDS = 30.0  # Gemma 4's audio context: 750 soft tokens of 40 ms
MAX_IMAGE_PIXELS = 64_000_000  # a decompression bomb is refused before it is decoded


class MediaError(ValueError):
    """An image or audio input Hearth cannot use; the message names the problem."""


def content_digest(data: bytes) -> str:
    """An input named by its content: equal bytes, equal name (the prompt cache keys on it)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, eq=False)
class Image:
    """A decoded RGB image. `max_tokens`: this request's soft-token budget (None: the server's)."""

    pixels: object  # a PIL.Image.Image in mode RGB
    digest: str
    max_tokens: int | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) in pixels."""
        return self.pixels.size  # type: ignore[attr-defined]


@dataclass(frozen=True, eq=False)
class Audio:
    """Decoded audio: mono float32 samples in [-1, 1] at `AUDIO_SAMPLE_RATE`."""

    samples: np.ndarray = field(repr=False)
    digest: str

    @property
    def seconds(self) -> float:
        return len(self.samples) / AUDIO_SAMPLE_RATE

    def checked_samples(self) -> np.ndarray:
        """The samples, if the clip fits Gemma 4's audio context (else a `MediaError`)."""
        check_audio_length(self.seconds)
        return self.samples


def check_audio_length(seconds: float) -> None:
    """Refuse a clip longer than Gemma 4's audio context."""
    if seconds > MAX_AUDIO_SECONDS:
        raise MediaError(
            f"the audio lasts {seconds:.1f} s; at most {MAX_AUDIO_SECONDS:.0f} s are accepted"
        )


def _check_size(data: bytes, what: str) -> None:
    if not data:
        raise MediaError(f"the {what} is empty")
    if len(data) > MAX_MEDIA_BYTES:
        raise MediaError(
            f"the {what} has {len(data)} bytes; at most {MAX_MEDIA_BYTES} are accepted"
        )


def decode_image(data: bytes, max_tokens: int | None = None) -> Image:
    """An image from the bytes of a PNG, JPEG, GIF (first frame), WebP or BMP file."""
    from PIL import Image as PILImage
    from PIL import ImageOps, UnidentifiedImageError

    _check_size(data, "image")
    try:
        with PILImage.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            if width * height > MAX_IMAGE_PIXELS:
                raise MediaError(
                    f"the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} are accepted"
                )
            opened.load()
            # Photos carry their rotation in EXIF; what the user sees is the rotated image.
            pixels = ImageOps.exif_transpose(opened).convert("RGB")
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(
            "the image is not in a format Hearth reads (PNG, JPEG, GIF, WebP, BMP)"
        ) from None
    except PILImage.DecompressionBombError:
        raise MediaError("the image has too many pixels to decode") from None
    except (OSError, ValueError, SyntaxError) as error:
        raise MediaError(f"the image could not be decoded: {error}") from None
    return Image(pixels, content_digest(data), max_tokens)


def decode_audio(data: bytes) -> Audio:
    """Audio from the bytes of a WAV, FLAC, OGG/Vorbis/Opus or MP3 file: channels averaged to
    mono, resampled to 16 kHz."""
    import soundfile
    import soxr

    _check_size(data, "audio")
    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        raise MediaError(
            "the audio could not be decoded (WAV, FLAC, OGG and MP3 are read): "
            + str(error).rpartition(": ")[2]
        ) from None
    if samples.shape[0] == 0:
        raise MediaError("the audio has no samples")
    check_audio_length(samples.shape[0] / rate)
    mono = samples.mean(axis=1)
    if rate != AUDIO_SAMPLE_RATE:
        mono = soxr.resample(mono, rate, AUDIO_SAMPLE_RATE, quality="HQ")
    return Audio(np.ascontiguousarray(mono, dtype=np.float32), content_digest(data))
