"""Gemma 4 with vision and audio towers as mlx-vlm converts it, loaded by Hearth, against
mlx-vlm's own model on the same directory.

The tiny E2B/E4B-shaped model of test_gemma4_audio_engine.py (both towers, PLE, k_eq_v full
layers twice as wide as sliding ones) is saved by HF transformers and converted by
`mlx_vlm.convert`, in fp32 and with 4-bit affine weights (group 32). mlx-vlm quantizes the
text model only: every module whose path names a tower (`vision`, `audio_tower`) keeps its
float weights, so a 4-bit mlx-vlm checkpoint's towers are float, and Hearth loads them so.

Bounds, fp32 on both sides: the towers' soft tokens within 2e-5 (measured 1.2e-7 for the image,
5.7e-6 for the audio, whose Conformer runs mlx's convolutions and attention against torch's on
values up to ~10); the logits of a prompt holding both within 1e-4 on logits up to ~2 (measured
4.9e-5 float, 8.3e-6 4-bit). test_mlx_gemma4.py's text bound is 5e-5 for the same kernel
differences; here the soft tokens' own differences ride on top. A wrong tower weight layout, a
missed scale or a quantized tower loaded as float moves these by orders of magnitude.

mlx-vlm reads its config fields with its own defaults (a 512-wide full-layer head among them),
so the config.json it converts carries every text field explicitly, as released checkpoints do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_vlm.convert import convert
from mlx_vlm.utils import load_model

import test_gemma4_audio_engine as tiny_multimodal
from hearth.engine import Engine
from hearth.media.image import image_patches
from hearth.runtime.generate import PromptMedia, soft_tokens
from tiny import save_hf

SOFT_ATOL = 2e-5
LOGITS_ATOL = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model saved by HF, then converted by mlx-vlm in fp32 and in 4 bits."""
    root = tmp_path_factory.mktemp("mlx_vlm")
    hf = tiny_multimodal._hf_model()
    source = save_hf(hf, root / "hf")
    tiny_multimodal._write_tokenizer(source)
    config = hf.config.to_dict()
    full_layer = hf.model.language_model.layers[1].self_attn
    config["text_config"].update(
        global_head_dim=full_layer.head_dim,
        num_global_key_value_heads=full_layer.k_proj.out_features // full_layer.head_dim,
    )
    (source / "config.json").write_text(json.dumps(config))
    paths = {}
    for name, quantize in (("float", False), ("4bit", True)):
        paths[name] = root / name
        convert(
            hf_path=str(source),
            mlx_path=str(paths[name]),
            quantize=quantize,
            q_bits=4,
            q_group_size=32,
            dtype="float32",
        )
    return paths


def _as_torch(array: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(array))


@pytest.mark.parametrize("kind", ["float", "4bit"])
def test_towers_and_logits_equal_mlx_vlm(converted: dict[str, Path], kind: str) -> None:
    path = converted[kind]
    weights = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    quantized = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
    assert bool(quantized) == (kind == "4bit")
    assert not any("tower" in name or "embed_vision" in name for name in quantized)

    engine = Engine.load(path, dtype="float32", device="cpu", progress=False)
    assert engine.modalities == ("text", "image", "audio")
    theirs = load_model(path)
    model = engine.model
    image, audio = tiny_multimodal._image(), tiny_multimodal._audio()

    vision = model.config.vision
    patches = image_patches(image, image.max_tokens or 0, vision.patch_size, 3)
    pixels, positions = mx.array(patches.pixels[None]), mx.array(patches.positions[None])
    with torch.inference_mode():
        ours_image = model.embed_media(image).embeddings
        ours_audio = model.embed_media(audio).embeddings
    their_image = _as_torch(theirs.encode_image(pixels, positions)).reshape(ours_image.shape)
    torch.testing.assert_close(ours_image, their_image, rtol=0, atol=SOFT_ATOL)

    features = mx.array(model.audio_encoder().features(audio.samples)[None])
    encoded, _ = theirs.audio_tower(features, mx.zeros(features.shape[:2], dtype=mx.bool_))
    their_audio = _as_torch(theirs.embed_audio(encoded)).reshape(ours_audio.shape)
    torch.testing.assert_close(ours_audio, their_audio, rtol=0, atol=SOFT_ATOL)

    ids = [2, 105, *range(10, 20), tiny_multimodal.IMAGE_TOKEN, 30, 31]
    ids += [tiny_multimodal.AUDIO_TOKEN, 40, 41]
    expanded, spans = model.expand_media(ids, [image, audio])
    soft = soft_tokens(engine.runner, [PromptMedia(*span) for span in spans])
    with torch.inference_mode():
        ours = model(torch.tensor([expanded]), engine.runner.new_caches(), start=0, soft=soft)
    logits = theirs(
        mx.array([expanded]),
        pixel_values=pixels,
        image_position_ids=positions,
        audio_features=features,
    )
    their_logits = _as_torch(getattr(logits, "logits", logits))
    torch.testing.assert_close(ours, their_logits, rtol=0, atol=LOGITS_ATOL)
