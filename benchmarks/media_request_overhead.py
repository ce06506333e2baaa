"""What the faces add to an image or audio input, per request: the JSON body parsed, the
request validated (pydantic), the base64 decoded, against decoding the file's bytes alone
(`hearth.media.decode_image` / `decode_audio`, Pillow and soundfile + soxr). Median of REPEATS.

    python benchmarks/media_request_overhead.py [--out FILE]
"""

from __future__ import annotations

import argparse
import base64
import datetime
import io
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import soundfile
from PIL import Image as PILImage

from hearth.media import decode_audio, decode_image
from hearth.media.fetch import FetchPolicy
from hearth.server.errors import parse_request
from hearth.server.schemas import ChatCompletionRequest

REPEATS = 9


def photo_jpeg(width: int, height: int) -> bytes:
    """A smooth gradient with noise: compresses like a photo, not like flat colour."""
    y, x = np.mgrid[0:height, 0:width]
    noise = np.random.default_rng(0).integers(0, 24, (height, width, 3))
    pixels = np.stack([x * 255 // width, y * 255 // height, (x + y) % 256], axis=-1) + noise
    out = io.BytesIO()
    PILImage.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def screenshot_png(width: int, height: int) -> bytes:
    pixels = np.full((height, width, 3), 245, dtype=np.uint8)
    pixels[::16, :, :] = 40  # text-like lines
    out = io.BytesIO()
    PILImage.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def speech_wav(seconds: float, rate: int = 44_100) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    out = io.BytesIO()
    samples = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    soundfile.write(out, samples, rate, subtype="PCM_16", format="WAV")
    return out.getvalue()


def median_ms(action: Callable[[], Any]) -> float:
    times = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def body(kind: str, data: bytes) -> str:
    encoded = base64.b64encode(data).decode()
    if kind == "image":
        part = {"type": "image_url", "image_url": {"url": f"data:image/x;base64,{encoded}"}}
    else:
        part = {"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}}
    content = [part, {"type": "text", "text": "Describe it."}]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]})


def face(text: str) -> None:
    """What a chat route does with the body before the template renders."""
    request = parse_request(ChatCompletionRequest, json.loads(text))
    [message] = request.neutral_messages()
    message["content"][0]["source"].decode(FetchPolicy(), None)


def row(name: str, kind: str, data: bytes) -> str:
    decode = decode_image if kind == "image" else decode_audio
    alone = median_ms(lambda: decode(data))
    text = body(kind, data)
    through = median_ms(lambda: face(text))
    return (
        f"| {name} | {len(data) / 1e6:.2f} MB | {alone:.1f} | {through:.1f} | "
        f"{through - alone:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", help="also write the Markdown table to this file")
    args = parser.parse_args()
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next(
        (line.split(":", 1)[1].strip() for line in cpu.splitlines() if "Model name" in line),
        platform.processor(),
    )
    lines = [
        f"# Media request overhead ({datetime.date.today()}, {model})",
        "",
        f"Median of {REPEATS}, milliseconds. `decode`: the file's bytes decoded alone; `face`: "
        "the JSON body parsed, validated and its base64 decoded, then the same decode.",
        "",
        "| input | file | decode ms | face ms | face - decode ms |",
        "|---|---|---|---|---|",
        row("JPEG 1920x1080 (photo)", "image", photo_jpeg(1920, 1080)),
        row("PNG 1280x800 (screenshot)", "image", screenshot_png(1280, 800)),
        row("WAV 30 s, 44.1 kHz mono", "audio", speech_wav(30.0)),
    ]
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(table)


if __name__ == "__main__":
    main()
