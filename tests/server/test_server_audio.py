"""An image and an audio clip through the server end to end, on the tiny Gemma 4 with vision
and audio towers of tests/models/test_gemma4_audio_engine.py (HF transformers'
Gemma4ForConditionalGeneration, E2B/E4B-shaped, saved and read back): the OpenAI SDK sends a
PNG as a data URL and a WAV as `input_audio`, and the reply's tokens are HF's greedy tokens
for the same decoded inputs.

The reply's log-probability records name every generated token (special ones included), which
are compared with HF's up to the first token that ends a chat turn. As in that module, another
clip changes HF's tokens, so the comparison sees the audio; the prompt length (usage) equals
the engine's own expansion of the same decoded inputs."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soundfile
from fastapi.testclient import TestClient

import test_gemma4_audio_engine as audio_model
from hearth.engine import Engine
from hearth.media import decode_audio, decode_image
from hearth.server import create_app

pytestmark = pytest.mark.slow

checkpoint = audio_model.checkpoint  # the module's fixture: the HF model and its saved directory


@pytest.fixture(scope="module")
def served(checkpoint: tuple[Any, Path]) -> Iterator[tuple[Engine, openai.OpenAI]]:
    engine = Engine.load(checkpoint[1], dtype="float32", device="cpu", progress=False)
    with TestClient(create_app(engine)) as client:
        yield (
            engine,
            openai.OpenAI(
                base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0
            ),
        )


def _wav(samples: np.ndarray) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, 16_000, subtype="FLOAT", format="WAV")
    return out.getvalue()


def test_a_chat_image_and_audio_reply_is_hfs_greedy_reply(
    checkpoint: tuple[Any, Path], served: tuple[Engine, openai.OpenAI]
) -> None:
    hf, _ = checkpoint
    engine, client = served
    png = io.BytesIO()
    audio_model._image().pixels.save(png, format="PNG")
    wav = _wav(audio_model._audio().samples)
    url = f"data:image/png;base64,{base64.b64encode(png.getvalue()).decode()}"
    content: Any = [
        {"type": "text", "text": "Look and listen:"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},  # 70 soft tokens
        {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode()}},
        {"type": "text", "text": "What is it?"},
    ]
    content[2]["input_audio"]["format"] = "wav"
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],
        max_tokens=audio_model.DECODE_STEPS,
        temperature=0,
        logprobs=True,
    )
    image, audio = decode_image(png.getvalue(), audio_model.BUDGET), decode_audio(wav)
    parts = [content[0], {"type": "image", "image": image}, {"type": "audio", "audio": audio}]
    messages = [{"role": "user", "content": [*parts, content[3]]}]
    ids, _ = engine.expand_media(engine.encode(messages), [image, audio])
    expected = audio_model._hf_greedy(hf, ids, image, audio)[len(ids) :]
    ends = set(engine.tokenizer.eos_ids) | {audio_model.SPECIAL_IDS["<turn|>"]}
    tokens = []
    for token in expected:
        tokens.append(token)
        if token in ends:  # the turn's end is the reply's last token
            break
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.token for entry in logprobs.content] == [
        engine.tokenizer.decode([token]) for token in tokens
    ]
