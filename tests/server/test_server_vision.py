"""An image through the server end to end, on the tiny Gemma 4 with a vision tower of
tests/models/test_gemma4_vision.py (HF transformers' Gemma4ForConditionalGeneration, saved and
read back): the OpenAI SDK sends a PNG as a data URL, the server decodes it, the real Gemma 4
template renders it, the engine expands and encodes it, and the reply's tokens are HF's greedy
tokens for the same image and prompt.

The oracle is HF's greedy continuation (one uncached HF forward per step), compared token for
token and log-probability for log-probability (the reply's log-probability records name every
generated token, special ones included: a random model's text may be all channel markers the
reply parser removes) up to the first token that ends a chat turn; the prompt length (usage) equals
the engine's own expansion of the same decoded image."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from fastapi.testclient import TestClient

import test_gemma4_vision as vision
from hearth.engine import Engine
from hearth.media import decode_image
from hearth.server import create_app

pytestmark = pytest.mark.slow

PROMPT = "What is it?"
# Twice the logits' tolerance (LOGITS_ATOL of test_gemma4_vision.py): a log-probability is a
# logit minus the log-sum-exp of all, each off by at most that much. An image left out of the
# prompt, or encoded wrongly, moves them by far more (its soft tokens change every logit).
LOGPROB_ATOL = 2 * 1.2e-4
TOP = 5


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


checkpoint = vision.checkpoint  # the module's fixture: the HF model and its saved directory


def test_a_chat_image_reply_is_hfs_greedy_reply(
    checkpoint: tuple[Any, Path], served: tuple[Engine, openai.OpenAI]
) -> None:
    hf, _ = checkpoint
    engine, client = served
    out = io.BytesIO()
    vision._pil(40, 28, seed=1).save(out, format="PNG")
    png = out.getvalue()
    url = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    content: Any = [
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},  # 70 soft tokens
        {"type": "text", "text": PROMPT},
    ]
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": content}],
        max_tokens=vision.DECODE_STEPS,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
    )
    image = decode_image(png, 70)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, content[1]]}]
    ids, _ = engine.expand_media(engine.encode(messages), [image])
    expected = list(ids)
    for _ in range(vision.DECODE_STEPS):
        logits = vision._hf_logits(hf, expected, [image])
        expected.append(int(logits[-1].argmax()))
    ends = set(engine.tokenizer.eos_ids) | {vision.SPECIAL_IDS["<turn|>"]}
    tokens = []
    for token in expected[len(ids) :]:
        tokens.append(token)
        if token in ends:  # the turn's end is the reply's last token
            break
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [entry.token for entry in logprobs.content] == [
        engine.tokenizer.decode([token]) for token in tokens
    ]
    # Each step's TOP most likely tokens and their log-probabilities, from HF's logits at the
    # position before it (the chosen token's own is near 0 on a random model: the
    # alternatives are what an image left out or encoded wrongly would move).
    hf_logprobs = torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(tokens)], dim=-1)
    for entry, step in zip(logprobs.content, hf_logprobs, strict=True):
        values, indices = step.topk(TOP)
        served = sorted(entry.top_logprobs, key=lambda alternative: -alternative.logprob)
        assert [a.token for a in served] == [engine.tokenizer.decode([i]) for i in indices]
        got = torch.tensor([a.logprob for a in served])
        torch.testing.assert_close(got, values, atol=LOGPROB_ATOL, rtol=0)
