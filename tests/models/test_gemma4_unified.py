"""The 12B "unified" Gemma 4 (`gemma4_unified`: no vision tower, raw 48x48 patches through
LayerNorm / Linear / LayerNorm / x-y position rows / LayerNorm, then `embed_vision`) against HF
transformers' Gemma4UnifiedForConditionalGeneration in fp32.

The tiny model has a full-layer head dim twice the sliding one, k_eq_v on, a sliding window
(8) shorter than its images, bidirectional images (the unified default, "vision") and random
LayerNorm weights and biases and position tables, saved with `save_pretrained` and read back
through Hearth's loader (config.json's `text_config` flattened, `vision_embedder.*` tensors).

The mask: HF's `Gemma4UnifiedModel.forward` (which its `generate` runs, prefill included)
passes the image blocks to every layer's mask, as Gemma 3 does: an image's soft tokens see the
whole image on full-attention layers too, and on sliding layers whatever the window. Its
`create_masks_for_vision_model` (the 26B/31B rule: sliding layers only, inside the window) is
not what it runs. Hearth follows what HF runs (`unbounded_image_blocks`).

Tolerances:
- embedder soft tokens: 1e-6 absolute on values up to ~2 (std ~0.5): the same fp32 ops in the
  same order on the same patches, HF's padding patches aside (their rows are dropped). A
  swapped x/y table or a missed LayerNorm bias moves them by more than 0.1.
- logits: 1.2e-4 absolute (LOGITS_ATOL of test_gemma4_vision.py, the same decoder maths), on
  logits up to ~30 (softcap). A causal image, a √hidden scale on the soft tokens or the
  26B/31B mask moves them by 0.1 or more (`test_the_mask_is_hfs_forward_mask`).
"""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.config import Gemma4UnifiedAudioConfig, Gemma4UnifiedVisionConfig, parse_config
from hearth.engine import Engine
from hearth.kv import make_caches
from hearth.media import Audio, Image, content_digest
from hearth.media.audio import waveform_frames
from hearth.media.image import soft_token_count, unified_image_patches
from hearth.models.gemma4 import device_pixels
from hearth.models.loading import build_model
from hearth.runtime.generate import GenerationRequest, PromptMedia, soft_tokens
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from scripted_gemma4 import SPECIAL_IDS, VOCAB_SIZE, template_path, write_byte_tokenizer
from tiny import FULL, SLIDING, randomise_gemma4, save_hf

EMBEDDER_ATOL = 1e-6
LOGITS_ATOL = 1.2e-4
BOI, IMAGE_TOKEN, EOI = VOCAB_SIZE, VOCAB_SIZE + 1, VOCAB_SIZE + 2
BOA, AUDIO_TOKEN, EOA = VOCAB_SIZE + 3, VOCAB_SIZE + 4, VOCAB_SIZE + 5
VOCAB = VOCAB_SIZE + 6
FRAME = 40  # samples per audio soft token (640 in the release)
MEDIA_SPECIALS = {
    "<|image>": BOI,
    "<|image|>": IMAGE_TOKEN,
    "<image|>": EOI,
    "<|audio>": BOA,
    "<|audio|>": AUDIO_TOKEN,
    "<audio|>": EOA,
}
DECODE_STEPS = 10
PATCH = 4  # 12-pixel model patches keep the inputs small; the maths is HF's


def _hf_model(**text_overrides: Any) -> Any:
    from transformers import (
        Gemma4UnifiedAudioConfig,
        Gemma4UnifiedConfig,
        Gemma4UnifiedForConditionalGeneration,
        Gemma4UnifiedTextConfig,
        Gemma4UnifiedVisionConfig,
    )

    text = Gemma4UnifiedTextConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 32,
            "sliding_window": 8,
            "layer_types": [SLIDING, FULL, SLIDING, FULL],
            "final_logit_softcapping": 30.0,
            "max_position_embeddings": 512,
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            **text_overrides,
        }
    )
    vision = Gemma4UnifiedVisionConfig(
        patch_size=PATCH, mm_embed_dim=48, mm_posemb_size=32, output_proj_dims=48
    )
    config = Gemma4UnifiedConfig(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        audio_config=Gemma4UnifiedAudioConfig(audio_embed_dim=FRAME).to_dict(),
        image_token_id=IMAGE_TOKEN,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        audio_token_id=AUDIO_TOKEN,
        boa_token_id=BOA,
        eoa_token_index=EOA,
    )
    torch.manual_seed(5)
    model = Gemma4UnifiedForConditionalGeneration(config).eval()
    randomise_gemma4(model)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not name.startswith("model.embed_vision.") or "projection" in name:
                continue
            # LayerNorms (HF: ones and zeros) and the position tables (HF: zeros).
            if name.endswith("weight") and tensor.ndim == 1:
                tensor.uniform_(0.5, 1.5)
            elif name.endswith("bias") or name.endswith("pos_embedding"):
                tensor.normal_(0.0, 0.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """Also Gemma 4's tokenizer specials, one token per byte, the media tokens and the real
    chat template, for the engine."""
    hf = _hf_model()
    path = save_hf(hf, tmp_path_factory.mktemp("unified"))
    write_byte_tokenizer(path, {**SPECIAL_IDS, **MEDIA_SPECIALS}, VOCAB)
    (path / "chat_template.jinja").write_text(template_path().read_text())
    return hf, path


@pytest.fixture(scope="module")
def model(checkpoint: tuple[Any, Path]) -> Any:
    return build_model(open_checkpoint(checkpoint[1]), torch.float32, progress=False)


def test_config_maps_onto_gemma4(checkpoint: tuple[Any, Path]) -> None:
    """The flattened text config reads as Gemma 4 without PLE or MoE, with HF's per-layer
    full-attention widths, and the embedder's fields and tokens from the top level."""
    hf, path = checkpoint
    config = parse_config(open_checkpoint(path).config)
    text = hf.config.text_config
    assert config.model_type == "gemma4_unified"
    assert (config.hidden_size_per_layer_input, config.moe) == (0, None)
    assert (config.head_dim, config.global_head_dim) == (16, 32)
    assert (config.num_key_value_heads, config.num_global_key_value_heads) == (2, 1)
    assert config.sliding_window == text.sliding_window
    assert config.bidirectional_vision
    assert config.vision == Gemma4UnifiedVisionConfig(PATCH, 3, 48, 32, 1e-6, IMAGE_TOKEN, BOI, EOI)
    assert config.audio == Gemma4UnifiedAudioConfig(FRAME, 1e-6, AUDIO_TOKEN, BOA, EOA)


def test_unified_defaults_apply_to_absent_fields() -> None:
    """HF's unified text defaults (window 1024, 30 layers, bidirectional images) fill fields a
    config.json leaves out, not Gemma 4's (window 512, one of them required); a null stays."""
    from transformers import Gemma4UnifiedTextConfig

    defaults = Gemma4UnifiedTextConfig()
    config = parse_config({"model_type": "gemma4_unified", "text_config": {}})
    assert config.sliding_window == defaults.sliding_window == 1024
    assert config.num_hidden_layers == defaults.num_hidden_layers
    assert config.hidden_size == defaults.hidden_size
    assert config.bidirectional_vision and config.vision is None
    causal = {"use_bidirectional_attention": None}
    config = parse_config({"model_type": "gemma4_unified", "text_config": causal})
    assert not config.bidirectional_vision and not config.unbounded_image_blocks


def test_text_prompt_logits_equal_hf(checkpoint: tuple[Any, Path], model: Any) -> None:
    hf, _ = checkpoint
    ids = torch.tensor([[2, 105, *range(120, 150), 106, 105, 140]])
    with torch.no_grad():
        reference = hf(input_ids=ids).logits[0]
    with torch.inference_mode():
        logits = model(ids)[0]
    torch.testing.assert_close(logits, reference, atol=LOGITS_ATOL, rtol=0)


def _pil(width: int, height: int, seed: int = 0) -> Any:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:height, 0:width]
    base = np.stack([xs * 255 / max(width, 1), ys * 255 / max(height, 1), (xs + ys) % 256], -1)
    noisy = base + rng.normal(0, 20, base.shape)
    return PILImage.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def _image(width: int, height: int, seed: int = 0, budget: int | None = None) -> Image:
    pixels = _pil(width, height, seed)
    return Image(pixels, content_digest(pixels.tobytes() + bytes([seed])), budget)


def _hf_unified_helpers() -> dict[str, Any]:
    """HF's `get_aspect_ratio_preserving_size`, `convert_image_to_patches` and `patches_merge`
    from the installed image_processing_gemma4_unified.py, run as they are. The module imports
    torchvision (for its resize), which has no build for this torch, so only these functions
    are taken from it."""
    import transformers.models.gemma4_unified as package

    source = (Path(package.__file__).parent / "image_processing_gemma4_unified.py").read_text()
    wanted = {"get_aspect_ratio_preserving_size", "patches_merge", "convert_image_to_patches"}
    tree = ast.parse(source)
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {n.name for n in body} == wanted
    namespace: dict[str, Any] = {"math": math, "torch": torch}
    exec(compile(ast.Module(body, []), "image_processing_gemma4_unified.py", "exec"), namespace)
    return namespace


def _hf_patches(values: np.ndarray, patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's unified pipeline after its resize, on resized 8-bit [H, W, 3] `values`: its
    torchvision backend's rescale (a uint8 tensor times 1/255), its 16-pixel patches and
    positions, merged 3x3 by its `patches_merge`."""
    from transformers.image_processing_backends import TorchvisionBackend

    helpers = _hf_unified_helpers()
    image = torch.from_numpy(np.ascontiguousarray(values.transpose(2, 0, 1)))
    image = TorchvisionBackend.rescale(None, image, 1 / 255)  # type: ignore[arg-type]
    pixels = helpers["convert_image_to_patches"](image, patch)
    rows, columns = values.shape[0] // patch, values.shape[1] // patch
    grid = torch.meshgrid(torch.arange(columns), torch.arange(rows), indexing="xy")
    positions = torch.stack(grid, dim=-1).reshape(pixels.shape[0], 2)
    merged, merged_positions = helpers["patches_merge"](
        pixels[None], positions[None], pixels.shape[0] // 9
    )
    return merged[0], merged_positions[0]


SIZES = [(64, 64), (200, 90), (37, 301), (640, 480), (1000, 7)]


@pytest.mark.parametrize("budget", [70, 280, 1120])
@pytest.mark.parametrize("size", SIZES)
def test_preprocessing_equals_hf(size: tuple[int, int], budget: int) -> None:
    """Exact after the resize: HF's size rule, and HF's rescale (float32), patchify and merge
    of the same resized 8-bit values against Hearth's direct cut into 48-pixel squares, on
    the host and after the copy to a device. The resize itself is checked below."""
    image = _image(*size)
    width, height = size
    hf_size = _hf_unified_helpers()["get_aspect_ratio_preserving_size"](
        height, width, 16, budget * 9, 3
    )
    patches = unified_image_patches(image, budget)
    columns, rows = patches.grid
    assert (rows * 48, columns * 48) == hf_size
    assert patches.pixels.shape == (soft_token_count(size, budget), 48 * 48 * 3)
    resized = _resized_like_hearth(image, budget)
    pixels, positions = _hf_patches(resized, 16)
    assert np.array_equal(pixels.numpy(), patches.pixels)
    on_device = device_pixels(patches.values, torch.device("cpu"), patches.rescale_in_float64)
    assert np.array_equal(pixels.numpy(), on_device.numpy())
    assert np.array_equal(positions.numpy(), patches.positions)


def _resized_like_hearth(image: Image, budget: int, patch: int = 16) -> np.ndarray:
    """The 8-bit image at its target size: the values Hearth's unified squares hold, put back
    into [H, W, 3] (each square of 3 · patch pixels a side runs row, column, channel)."""
    patches = unified_image_patches(image, budget, patch)
    columns, rows = patches.grid
    side = 3 * patch
    squares = patches.values.reshape(rows, columns, side, side, 3)
    return squares.transpose(0, 2, 1, 3, 4).reshape(rows * side, columns * side, 3)


@pytest.mark.parametrize("size", [(200, 90), (640, 480), (1000, 700)])
def test_resize_is_pillows_bicubic_up_to_rounding(size: tuple[int, int]) -> None:
    """HF's unified processor resizes with torchvision, which for a uint8 image on the CPU
    runs torch's antialiased bicubic; torchvision has no build for the CPU torch pinned here,
    so that call is not the oracle. Torch's kernel is a port of Pillow's (the same a = -0.5
    cubic and support), differing in the fixed-point rounding of its weights: against
    Pillow, no value may move by more than 2 of 255 and under 1% may move at all."""
    from PIL import Image as PILImage

    image = _image(*size)
    for budget in (70, 280, 1120):
        width, height = soft_size = unified_size(image, budget)
        ours = _resized_like_hearth(image, budget).astype(int)
        if soft_size == image.size:
            continue
        pillow = image.pixels.resize((width, height), resample=PILImage.Resampling.BICUBIC)
        difference = np.abs(ours - np.asarray(pillow, dtype=np.uint8).astype(int))
        assert difference.max() <= 2
        assert (difference > 0).mean() < 0.01


def unified_size(image: Image, budget: int) -> tuple[int, int]:
    from hearth.media.image import resized_size

    return resized_size(*image.size, budget)


def _hf_inputs(ids: list[int], images: list[Image]) -> dict[str, torch.Tensor]:
    """HF's model inputs: each image's merged patches and positions padded to the longest
    with HF's padding (zeros, position −1), and the token types."""
    merged = [
        _hf_patches(_resized_like_hearth(image, image.max_tokens or 280, PATCH), PATCH)
        for image in images
    ]
    longest = max(p.shape[0] for p, _ in merged)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, longest - t.shape[0]), value=value)[None]

    tensor = torch.tensor([ids])
    return {
        "input_ids": tensor,
        "pixel_values": torch.cat([pad(p, 0.0) for p, _ in merged]),
        "image_position_ids": torch.cat([pad(q, -1) for _, q in merged]),
        "mm_token_type_ids": (tensor == IMAGE_TOKEN).long(),
    }


@pytest.mark.parametrize(("size", "budget"), [((40, 28), 70), ((25, 70), 140)])
def test_embedder_equals_hf(
    checkpoint: tuple[Any, Path], model: Any, size: Any, budget: int
) -> None:
    hf, _ = checkpoint
    image = _image(*size, budget=budget)
    inputs = _hf_inputs([IMAGE_TOKEN], [image, _image(60, 60, budget=budget)])
    with torch.no_grad():
        reference = hf.model.get_image_features(
            inputs["pixel_values"], inputs["image_position_ids"], return_dict=True
        ).pooler_output[0]
    with torch.inference_mode():
        soft = model.embed_media(image)
    assert soft.bidirectional
    assert soft.embeddings.shape == reference.shape == (model.soft_token_count(image), 64)
    torch.testing.assert_close(soft.embeddings, reference, atol=EMBEDDER_ATOL, rtol=0)


def _prompt(model: Any, images: list[Image]) -> tuple[list[int], Any]:
    ids = [2, 105, *range(120, 126)]
    for index, _ in enumerate(images):
        ids += [10, 10, IMAGE_TOKEN, 10, 10, 130 + index]
    ids += [106, 105, 140, 141]
    return model.expand_media(ids, images)


def _hf_generate(
    hf: Any, ids: list[int], images: list[Image], audio: Audio | None = None
) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation (cached prefill and DECODE_STEPS steps, its generate masks):
    the tokens and the raw logits of the prompt's last position and of each step."""
    from transformers import GenerationConfig

    greedy = GenerationConfig(
        do_sample=False,
        max_new_tokens=DECODE_STEPS + 1,
        min_new_tokens=DECODE_STEPS + 1,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    inputs = _hf_inputs(ids, images)
    if audio is not None:
        frames = _hf_frames(audio, FRAME)
        inputs["input_features"] = frames["input_features"]
        inputs["input_features_mask"] = frames["input_features_mask"]
    with torch.no_grad():
        out = hf.generate(**inputs, generation_config=greedy)
    tokens = out.sequences[0, len(ids) : len(ids) + DECODE_STEPS].tolist()
    return tokens, torch.cat(out.logits)


def _cached_greedy(runner: ModelRunner, ids: list[int], soft: Any, chunk: int) -> Any:
    caches = make_caches(runner.model.cache_specs())
    tokens: list[int] = []
    with torch.inference_mode():
        rows = [runner.prefill(torch.tensor([ids]), caches, 0, chunk, soft)[0]]
        for position in range(len(ids), len(ids) + DECODE_STEPS):
            tokens.append(int(rows[-1].argmax()))
            rows.append(runner.decode(tokens[-1], caches, position)[0])
    return tokens, torch.stack(rows)


def _media(spans: Any) -> Any:
    return tuple(PromptMedia(start, length, item) for start, length, item in spans)


IMAGES = [_image(40, 28, seed=1, budget=70), _image(17, 30, seed=2, budget=70)]


@pytest.fixture(scope="module")
def reference(checkpoint: tuple[Any, Path], model: Any) -> tuple[list[int], list[int], Any]:
    ids, _ = _prompt(model, IMAGES)
    return ids, *_hf_generate(checkpoint[0], ids, IMAGES)


@pytest.mark.parametrize("chunk", [512, 16])
def test_image_prompt_logits_equal_hf_through_prefill_and_decode(
    checkpoint: tuple[Any, Path], model: Any, reference: Any, chunk: int
) -> None:
    """Two images (70 soft tokens each, window 8), prefilled whole or in chunks of 16, then
    10 greedy cached decode steps: HF's generate tokens, and its logits at each step; and
    Hearth's uncached forward over prompt and tokens equals HF's at every position."""
    ids, spans = _prompt(model, IMAGES)
    assert [ids[start - 1] for start, _, _ in spans] == [BOI, BOI]
    hf_ids, hf_tokens, hf_rows = reference
    assert ids == hf_ids
    runner = ModelRunner(model)
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
    tokens, rows = _cached_greedy(runner, ids, soft, chunk)
    assert tokens == hf_tokens
    torch.testing.assert_close(rows, hf_rows, atol=LOGITS_ATOL, rtol=0)
    with torch.no_grad():
        whole = checkpoint[0](**_hf_inputs(ids + tokens, IMAGES)).logits[0]
    with torch.inference_mode():
        full = model(torch.tensor([ids + tokens]), soft=soft)[0]
    torch.testing.assert_close(full, whole, atol=LOGITS_ATOL, rtol=0)


def test_the_mask_is_hfs_forward_mask(
    checkpoint: tuple[Any, Path], model: Any, reference: Any
) -> None:
    """HF's `create_masks_for_vision_model` (blocks on sliding layers, inside the window) and a
    causal image both differ from what HF's generate ran at the prompt's last position by far
    more than the tolerance, so the comparison above tells the three masks apart."""
    import dataclasses

    hf, _ = checkpoint
    ids, spans = _prompt(model, IMAGES)
    _, _, hf_rows = reference
    inputs = _hf_inputs(ids, IMAGES)
    with torch.no_grad():
        embedded = hf.model.get_input_embeddings()(inputs["input_ids"])
        positions = torch.arange(len(ids))[None]
        masks = hf.create_masks_for_generate(
            hf.config, embedded, None, None, positions, inputs["mm_token_type_ids"]
        )
        sliding_only = hf(**inputs, attention_mask=masks).logits[0, -1]
    assert (sliding_only - hf_rows[0]).abs().max() > 100 * LOGITS_ATOL
    runner = ModelRunner(model)
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
        causal = [dataclasses.replace(s, bidirectional=False) for s in soft]
        logits = model(torch.tensor([ids]), soft=causal)[0, -1]
    assert (logits - hf_rows[0]).abs().max() > 100 * LOGITS_ATOL


def test_checkpoint_without_the_embedder_loads_as_text(tmp_path: Path) -> None:
    """A config naming the image and audio embedders whose file lacks their tensors (as
    mlx-lm's text conversions keep config.json whole) loads as text."""
    from safetensors.torch import load_file, save_file

    hf = _hf_model()
    path = save_hf(hf, tmp_path)
    tensors = load_file(path / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if "vision" not in k and "audio" not in k}
    save_file(kept, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    assert config["vision_config"] is not None and config["audio_config"] is not None
    model = build_model(open_checkpoint(path), torch.float32, progress=False)
    assert model.config.vision is None and model.config.audio is None
    assert model.media_kinds == ()


def _audio(samples: int, seed: int = 0) -> Audio:
    rng = np.random.default_rng(seed)
    wave = (0.5 * np.sin(np.arange(samples) * 0.05) + rng.normal(0, 0.1, samples)).astype(
        np.float32
    )
    return Audio(wave, content_digest(wave.tobytes()))


def _hf_frames(audio: Audio, frame: int) -> Any:
    from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
        Gemma4UnifiedAudioFeatureExtractor,
    )

    extractor = Gemma4UnifiedAudioFeatureExtractor(
        feature_size=frame, audio_samples_per_token=frame
    )
    return extractor(audio.samples, return_tensors="pt")


@pytest.mark.parametrize("samples", [1, 639, 640, 641, 16_123])
def test_audio_frames_equal_hf_extractor(samples: int) -> None:
    """Exact: the same zero padding and the same float32 samples, one soft token a frame."""
    audio = _audio(samples)
    reference = _hf_frames(audio, 640)
    frames = waveform_frames(audio.samples, 640)
    assert int(reference["input_features_mask"][0].sum()) == len(frames) == -(-samples // 640)
    assert np.array_equal(reference["input_features"][0].numpy(), frames)


def test_audio_embedding_equals_hf(checkpoint: tuple[Any, Path], model: Any) -> None:
    """`embed_audio` of the frames; 1e-6 absolute, as for the image embedder (one RMSNorm
    and one Linear, the same fp32 ops); the soft tokens stay causal."""
    hf, _ = checkpoint
    audio = _audio(1000)
    inputs = _hf_frames(audio, FRAME)
    with torch.no_grad():
        reference = hf.model.get_audio_features(
            inputs["input_features"], inputs["input_features_mask"], return_dict=True
        ).pooler_output[0]
    with torch.inference_mode():
        soft = model.embed_media(audio)
    assert not soft.bidirectional
    assert soft.embeddings.shape == reference.shape == (model.soft_token_count(audio), 64)
    torch.testing.assert_close(soft.embeddings, reference, atol=EMBEDDER_ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [512, 16])
def test_image_and_audio_prompt_equals_hf_through_prefill_and_decode(
    checkpoint: tuple[Any, Path], model: Any, chunk: int
) -> None:
    """An image (bidirectional) then a clip of 50 frames (causal) in one prompt, prefilled
    whole or in chunks of 16, then 10 greedy cached decode steps: HF's generate tokens and
    its logits at each step (LOGITS_ATOL, as above)."""

    hf, _ = checkpoint
    image, audio = IMAGES[0], _audio(50 * FRAME - 7, seed=3)
    placeholders = [2, 105, 120, 10, IMAGE_TOKEN, 10, 121, AUDIO_TOKEN, 10, 106, 105, 140]
    ids, spans = model.expand_media(placeholders, [image, audio])
    assert ids.count(AUDIO_TOKEN) == 50 and ids[spans[1][0] - 1] == BOA
    hf_tokens, hf_rows = _hf_generate(hf, ids, [image], audio)
    runner = ModelRunner(model)
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
    tokens, rows = _cached_greedy(runner, ids, soft, chunk)
    assert tokens == hf_tokens
    torch.testing.assert_close(rows, hf_rows, atol=LOGITS_ATOL, rtol=0)


def test_engine_generates_hf_greedy_tokens_from_chat_messages(
    checkpoint: tuple[Any, Path],
) -> None:
    """`Engine.run` renders the real chat template, expands an image and a clip and decodes
    HF's greedy tokens; the scheduler (the server's path) decodes the same."""
    hf, path = checkpoint
    engine = Engine.load(path, dtype="float32", device="cpu", progress=False)
    assert engine.modalities == ("text", "image", "audio")
    image, audio = IMAGES[1], _audio(30 * FRAME, seed=4)
    parts = [
        {"type": "text", "text": "Look and listen:"},
        {"type": "image", "image": image},
        {"type": "audio", "audio": audio},
        {"type": "text", "text": "What is it?"},
    ]
    messages = [{"role": "user", "content": parts}]
    ids, media = engine.expand_media(engine.encode(messages), [image, audio])
    assert [ids[span.start - 1] for span in media] == [BOI, BOA]
    assert [span.length for span in media] == [engine.model.soft_token_count(image), 30]
    expected, _ = _hf_generate(hf, ids, [image], audio)
    greedy = SamplingParams(temperature=0.0)
    request = GenerationRequest(ids, DECODE_STEPS, greedy, stop_ids=(), media=media)
    assert [c.token for c in engine.run(request) if c.token is not None] == expected
    scheduler = engine.scheduler(2)
    got: list[Any] = []
    scheduler.submit(request, got.append, lambda: False)
    while not scheduler.idle:
        scheduler.step()
    assert [c.token for c in got if c.token is not None] == expected
