"""A prompt with an image and an audio clip through the Engine (the real Gemma 4 chat
template, `Engine.run`, `Engine.generate` and the scheduler the server uses) against HF
transformers' Gemma4ForConditionalGeneration with both towers, greedy, in fp32.

The tiny model is E2B/E4B-shaped: vision and audio towers, PLE, k_eq_v full layers twice as
wide as sliding ones, images causal (`use_bidirectional_attention` unset, as on E2B/E4B).
Greedy tokens must equal HF's exactly (compared as their text): the logits agree within 1.2e-4
(test_gemma4_audio.py), and a tie that close would be a coincidence the fixed seeds do not hit;
another clip changes HF's tokens, so the comparison sees the audio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

from hearth.engine import Engine
from hearth.media import Audio, Image, content_digest
from hearth.runtime.generate import GenerationRequest
from hearth.runtime.sampling import SamplingParams
from scripted_gemma4 import SPECIAL_IDS, VOCAB_SIZE, template_path, write_byte_tokenizer
from tiny import FULL, PLE, SLIDING, randomise_gemma4, save_hf, tiny_gemma4_config

# The scripted Gemma 4 tokenizer's specials and bytes, then the image and audio tokens.
BOI, IMAGE_TOKEN, EOI = VOCAB_SIZE, VOCAB_SIZE + 1, VOCAB_SIZE + 2
BOA, AUDIO_TOKEN, EOA = VOCAB_SIZE + 3, VOCAB_SIZE + 4, VOCAB_SIZE + 5
MEDIA_SPECIALS = {
    "<|image>": BOI,
    "<|image|>": IMAGE_TOKEN,
    "<image|>": EOI,
    "<|audio>": BOA,
    "<|audio|>": AUDIO_TOKEN,
    "<audio|>": EOA,
}
VOCAB = VOCAB_SIZE + 6
DECODE_STEPS = 10
PATCH, BUDGET = 4, 70  # tiny patches keep the vision tower's inputs small


def _hf_model() -> Any:
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
    )

    vision = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH,
        position_embedding_size=64,
        use_clipped_linears=True,
    )
    audio = Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[128, 8],
        output_proj_dims=24,
    )
    text = tiny_gemma4_config(
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        attention_k_eq_v=True,
        num_global_key_value_heads=1,
        layer_types=[SLIDING, FULL, SLIDING, FULL],
        **PLE,
    )
    config = Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        audio_config=audio.to_dict(),
        image_token_id=IMAGE_TOKEN,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        audio_token_id=AUDIO_TOKEN,
        boa_token_id=BOA,
        eoa_token_index=EOA,
    )
    torch.manual_seed(13)
    model = Gemma4ForConditionalGeneration(config).eval()
    randomise_gemma4(model)
    generator = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if name.endswith(("input_min", "output_min")):
                tensor.fill_(-2.0)
            elif name.endswith(("input_max", "output_max")):
                tensor.fill_(2.0)
            elif name.endswith("per_dim_scale"):
                tensor.normal_(0.0, 1.0, generator=generator)
            elif "audio_tower" in name and name.endswith("linear.weight"):
                tensor.normal_(0.0, 0.2, generator=generator)
            elif name.endswith("embed_audio.embedding_projection.weight"):
                tensor.normal_(0.0, 0.5, generator=generator)
            elif name.endswith("language_model.embed_tokens.weight"):
                # Small token rows: with `randomise_gemma4`'s std 0.5 the tied head repeats
                # the last token whatever the media say, and the tokens would test nothing.
                tensor.normal_(0.0, 0.05, generator=generator)
    return model


def _write_tokenizer(directory: Path) -> None:
    """Gemma 4's specials at their ids, one token per byte, the media tokens, the template."""
    write_byte_tokenizer(directory, {**SPECIAL_IDS, **MEDIA_SPECIALS}, VOCAB)
    (directory / "chat_template.jinja").write_text(template_path().read_text())


def _image() -> Image:
    from PIL import Image as PILImage

    rng = np.random.default_rng(3)
    pixels = PILImage.fromarray(rng.integers(0, 256, (30, 44, 3), dtype=np.uint8), "RGB")
    return Image(pixels, content_digest(pixels.tobytes()), BUDGET)


def _audio() -> Audio:
    samples = (np.random.default_rng(4).standard_normal(7_777) * 0.3).astype(np.float32)
    return Audio(samples, content_digest(samples.tobytes()))


def _hf_greedy(hf: Any, ids: list[int], image: Image, audio: Audio) -> list[int]:
    """HF's greedy continuation (an uncached forward over the whole sequence per token)."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    pixels = Gemma4ImageProcessorPil(max_soft_tokens=BUDGET, patch_size=PATCH)(
        images=[image.pixels], return_tensors="pt"
    )
    features = Gemma4AudioFeatureExtractor()([audio.samples], return_tensors="pt")
    ids = list(ids)
    with torch.no_grad():
        for _ in range(DECODE_STEPS):
            logits = hf(
                input_ids=torch.tensor([ids]),
                pixel_values=pixels["pixel_values"],
                image_position_ids=pixels["image_position_ids"],
                input_features=features["input_features"],
                input_features_mask=features["input_features_mask"],
            ).logits[0]
            ids.append(int(logits[-1].argmax()))
    return ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = _hf_model()
    path = save_hf(hf, tmp_path_factory.mktemp("image_audio"))
    _write_tokenizer(path)
    return hf, path


def test_image_and_audio_prompt_generates_hf_greedy_tokens(checkpoint: tuple[Any, Path]):
    hf, path = checkpoint
    engine = Engine.load(path, dtype="float32", device="cpu", progress=False)
    assert engine.modalities == ("text", "image", "audio")
    image, audio = _image(), _audio()
    parts = [
        {"type": "text", "text": "Look and listen:"},
        {"type": "image", "image": image},
        {"type": "audio", "audio": audio},
        {"type": "text", "text": "What is it?"},
    ]
    messages = [{"role": "user", "content": parts}]
    ids, media = engine.expand_media(engine.encode(messages), [image, audio])
    assert [span.item for span in media] == [image, audio]
    assert [ids[span.start - 1] for span in media] == [BOI, BOA]
    assert [ids[span.start + span.length] for span in media] == [EOI, EOA]
    assert media[1].length == 12  # 7777 samples: 48 real frames, a quarter of them tokens
    expected = _hf_greedy(hf, ids, image, audio)[len(ids) :]
    other = Audio((np.random.default_rng(99).standard_normal(7_777) * 0.3).astype(np.float32), "b")
    assert _hf_greedy(hf, ids, image, other)[len(ids) :] != expected  # the clip matters

    # Chunks carry text (a byte token may complete no character): compare the texts.
    text = engine.tokenizer.decode(expected)
    greedy = SamplingParams(temperature=0.0)
    request = GenerationRequest(ids, DECODE_STEPS, greedy, stop_ids=(), media=media)
    assert "".join(c.text for c in engine.run(request)) == text
    assert engine.generate(messages, DECODE_STEPS, greedy) == text
    scheduler = engine.scheduler(2)
    got: list[Any] = []
    scheduler.submit(request, got.append, lambda: False)
    while not scheduler.idle:
        scheduler.step()
    assert "".join(c.text for c in got) == text
