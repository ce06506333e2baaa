"""Gemma 4 with a vision tower, against HF transformers' Gemma4ForConditionalGeneration in fp32.

The tiny model has a full-layer head dim twice the sliding one, k_eq_v on, finite clip values
in every vision linear, standardization, and bidirectional image attention on sliding layers
(`use_bidirectional_attention: "vision"`, as on 26B/31B), saved with `save_pretrained` and
read back through Hearth's loader.

Tolerances:
- tower soft tokens: 2e-5 absolute on values of std ~1 (max ~4). HF runs the tower over the
  image padded to the budget's 630 patches and masks the padding; Hearth runs the real
  patches only, so attention's and pooling's fp32 sums run over other lengths and orders
  (measured max 2.4e-6). A wrong RoPE axis, clip or pooling slot moves them by more than 0.1.
- logits: 1.2e-4 absolute (MULTIMODAL_ATOL of test_gemma4.py, the same HF path, where text-only
  prompts measured 5.8e-5), on logits up to ~25. A mask that is causal where HF's is
  bidirectional, a √hidden scale on the soft tokens or per-layer inputs read at the image
  token's id move them by more than 1e-2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.media import Image, MediaError, content_digest
from hearth.media.image import image_patches, resized_size, soft_token_count
from hearth.models.loading import build_model
from tiny import FULL, PLE, SLIDING, randomise_gemma4, save_hf, tiny_gemma4_config

TOWER_ATOL = 2e-5
LOGITS_ATOL = 1.2e-4
IMAGE_TOKEN, BOI, EOI = 250, 251, 252
PATCH, POOLING = 4, 3  # tiny patches keep the tower's inputs small; the maths is HF's


def _pil(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    # A smooth gradient plus noise: resizing filters see real structure, not only noise.
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / max(width, 1), ys * 255 / max(height, 1), (xs + ys) % 256], -1)
    noisy = base + rng.normal(0, 20, base.shape)
    return PILImage.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def _image(width: int, height: int, seed: int = 0, budget: int | None = None) -> Image:
    pixels = _pil(width, height, seed)
    return Image(pixels, content_digest(pixels.tobytes() + bytes([seed])), budget)


def _hf_model(**text_overrides: Any) -> Any:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    vision = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=PATCH,
        position_embedding_size=64,
        use_clipped_linears=True,
        standardize=True,
    )
    text = tiny_gemma4_config(
        **{
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "use_bidirectional_attention": "vision",
            **text_overrides,
        }
    )
    config = Gemma4Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        image_token_id=IMAGE_TOKEN,
        boi_token_id=BOI,
        eoi_token_id=EOI,
    )
    torch.manual_seed(11)
    model = Gemma4ForConditionalGeneration(config).eval()
    randomise_gemma4(model)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            # Finite clips that bind on some values, so a missed clamp shows.
            if name.endswith(("input_min", "output_min")):
                tensor.fill_(-float(torch.empty(()).uniform_(0.5, 2.0)))
            elif name.endswith(("input_max", "output_max")):
                tensor.fill_(float(torch.empty(()).uniform_(0.5, 2.0)))
            elif name.endswith("std_bias"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("std_scale"):
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("position_embedding_table"):
                tensor.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = _hf_model(**PLE, layer_types=[SLIDING, FULL, SLIDING, FULL])
    return hf, save_hf(hf, tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def model(checkpoint: tuple[Any, Path]) -> Any:
    return build_model(open_checkpoint(checkpoint[1]), torch.float32, progress=False)


def _hf_processor(budget: int) -> Any:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil(max_soft_tokens=budget, patch_size=PATCH)


def _hf_pixels(image: Image, budget: int, patch: int = PATCH) -> Any:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    processor = Gemma4ImageProcessorPil(max_soft_tokens=budget, patch_size=patch)
    return processor(images=[image.pixels], return_tensors="pt")


SIZES = [(64, 64), (200, 90), (37, 301), (640, 480), (1000, 7)]


@pytest.mark.parametrize("budget", [70, 280, 1120])
@pytest.mark.parametrize("size", SIZES)
def test_preprocessing_equals_hf_processor(size: tuple[int, int], budget: int) -> None:
    """Exact: the same Pillow bicubic resize of the same 8-bit values, the same float64
    rescale to float32 and the same patch order; HF's padding patches (position −1) aside."""
    image = _image(*size)
    reference = _hf_pixels(image, budget, patch=16)
    patches = image_patches(image, budget)
    count = patches.pixels.shape[0]
    real = reference["image_position_ids"][0][:, 0] >= 0
    assert int(real.sum()) == count
    assert reference["num_soft_tokens_per_image"][0] == soft_token_count(image.size, budget)
    assert np.array_equal(reference["pixel_values"][0][:count].numpy(), patches.pixels)
    assert np.array_equal(reference["image_position_ids"][0][:count].numpy(), patches.positions)


def test_budget_is_checked() -> None:
    with pytest.raises(MediaError, match="one of 70, 140, 280, 560, 1120"):
        resized_size(100, 100, 300)


def _hf_tower(hf: Any, image: Image, budget: int) -> torch.Tensor:
    inputs = _hf_pixels(image, budget)
    with torch.no_grad():
        features = hf.model.get_image_features(
            inputs["pixel_values"], inputs["image_position_ids"], return_dict=True
        )
    return features.pooler_output[0]


@pytest.mark.parametrize(("size", "budget"), [((40, 28), 70), ((25, 70), 140)])
def test_tower_equals_hf(checkpoint: tuple[Any, Path], model: Any, size: Any, budget: int) -> None:
    hf, _ = checkpoint
    image = _image(*size, budget=budget)
    reference = _hf_tower(hf, image, budget)
    with torch.inference_mode():
        soft = model.embed_media(image).embeddings
    assert soft.shape == reference.shape == (model.soft_token_count(image), 64)
    torch.testing.assert_close(soft, reference, atol=TOWER_ATOL, rtol=0)
