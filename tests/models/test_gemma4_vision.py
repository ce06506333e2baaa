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

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.engine import Engine
from hearth.kv import make_caches
from hearth.kv.prompt_cache import PromptCache, common_prefix_length
from hearth.media import Image, MediaError, content_digest
from hearth.media.image import image_patches, resized_size, soft_token_count
from hearth.models.loading import build_model
from hearth.runtime.generate import GenerationRequest, PromptMedia, soft_tokens
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from scripted_gemma4 import SPECIAL_IDS, VOCAB_SIZE, template_path
from tiny import FULL, PLE, SLIDING, randomise_gemma4, save_hf, tiny_gemma4_config

TOWER_ATOL = 2e-5
LOGITS_ATOL = 1.2e-4
# The scripted Gemma 4 tokenizer's specials and bytes, then the three image tokens.
BOI, IMAGE_TOKEN, EOI = VOCAB_SIZE, VOCAB_SIZE + 1, VOCAB_SIZE + 2
IMAGE_SPECIALS = {"<|image>": BOI, "<|image|>": IMAGE_TOKEN, "<image|>": EOI}
VOCAB = VOCAB_SIZE + 3
DECODE_STEPS = 10
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
            "vocab_size": VOCAB,
            "vocab_size_per_layer_input": VOCAB,
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


def _write_tokenizer(directory: Path) -> None:
    """Gemma 4's specials at their ids, one token per byte, and the image tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    specials = {**SPECIAL_IDS, **IMAGE_SPECIALS}
    symbols = iter(sorted(pre_tokenizers.ByteLevel.alphabet()))
    vocab = dict(specials)
    taken = set(specials.values())
    vocab.update({next(symbols): i for i in range(VOCAB) if i not in taken})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(template_path().read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """PLE on, k_eq_v full layers twice as wide as sliding ones, bidirectional images."""
    hf = _hf_model(**PLE, layer_types=[SLIDING, FULL, SLIDING, FULL])
    path = save_hf(hf, tmp_path_factory.mktemp("vision"))
    _write_tokenizer(path)
    return hf, path


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


def _hf_inputs(ids: list[int], images: list[Image]) -> dict[str, torch.Tensor]:
    """HF's model inputs for an expanded prompt: pixels and positions of each image (each
    padded to its own budget, then to the longest) and the token types."""
    processed = [_hf_pixels(image, image.max_tokens or 280) for image in images]
    longest = max(p["pixel_values"].shape[1] for p in processed)

    def pad(t: torch.Tensor, value: float) -> torch.Tensor:
        extra = longest - t.shape[1]
        return torch.nn.functional.pad(t, (0, 0, 0, extra), value=value)

    tensor = torch.tensor([ids])
    return {
        "input_ids": tensor,
        "pixel_values": torch.cat([pad(p["pixel_values"], 0.0) for p in processed]),
        "image_position_ids": torch.cat([pad(p["image_position_ids"], -1) for p in processed]),
        "mm_token_type_ids": (tensor == IMAGE_TOKEN).long(),
    }


def _hf_greedy(hf: Any, ids: list[int], images: list[Image]) -> tuple[list[int], torch.Tensor]:
    """HF's greedy continuation of DECODE_STEPS tokens (each from an uncached forward over
    the whole sequence) and the logits [positions, vocab] of that final sequence."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(DECODE_STEPS):
            logits = hf(**_hf_inputs(ids, images)).logits[0]
            ids.append(int(logits[-1].argmax()))
        return ids, hf(**_hf_inputs(ids, images)).logits[0]


def _prompt(model: Any, images: list[Image]) -> tuple[list[int], Any]:
    """A rendered-prompt shape: text, each image's placeholder, text; expanded by the model."""
    ids = [2, 105, *range(120, 126)]
    for index, _ in enumerate(images):
        ids += [10, 10, IMAGE_TOKEN, 10, 10, 130 + index]
    ids += [106, 105, 140, 141]
    return model.expand_media(ids, images)


IMAGES = [_image(40, 28, seed=1, budget=70), _image(17, 30, seed=2, budget=70)]


@pytest.mark.parametrize("chunk", [512, 16])
def test_image_prompt_logits_equal_hf_through_prefill_and_decode(
    checkpoint: tuple[Any, Path], model: Any, chunk: int
) -> None:
    """Two images (70 soft tokens each, window 8) in a prompt prefilled whole or in chunks of
    16 (whose ends move off the images), then 10 cached decode steps teacher-forced with HF's
    greedy tokens: every logit of the prompt's last position and the steps equals HF's."""
    hf, _ = checkpoint
    ids, spans = _prompt(model, IMAGES)
    assert [ids[start - 1] for start, _, _ in spans] == [BOI, BOI]
    assert [ids[start + length] for start, length, _ in spans] == [EOI, EOI]
    tokens, reference = _hf_greedy(hf, ids, IMAGES)
    prompt = len(ids)
    runner = ModelRunner(model)
    media = GenerationRequest(ids, media=_media(spans)).media
    with torch.inference_mode():
        soft = soft_tokens(runner, media)
        full = model(torch.tensor([tokens]), soft=soft)[0]
        caches = make_caches(model.cache_specs())
        rows = [runner.prefill(torch.tensor([ids]), caches, 0, chunk, soft)[0]]
        for position in range(prompt, len(tokens) - 1):
            rows.append(runner.decode(tokens[position], caches, position)[0])
    torch.testing.assert_close(full, reference, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(
        torch.stack(rows), reference[prompt - 1 : -1], atol=LOGITS_ATOL, rtol=0
    )


def _media(spans: Any) -> Any:
    return tuple(PromptMedia(start, length, item) for start, length, item in spans)


def test_bidirectional_mask_matters(checkpoint: tuple[Any, Path], model: Any) -> None:
    """The same prompt with the images attending causally moves the logits past the
    tolerance many times over: the comparison above can tell the masks apart."""
    hf, _ = checkpoint
    ids, spans = _prompt(model, IMAGES[:1])
    _, reference = _hf_greedy(hf, ids, IMAGES[:1])
    runner = ModelRunner(model)
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
        causal = [dataclasses.replace(s, bidirectional=False) for s in soft]
        logits = model(torch.tensor([ids]), soft=causal)[0]
    assert (logits - reference[: len(ids)]).abs().max() > 100 * LOGITS_ATOL


@pytest.fixture(scope="module")
def engine(checkpoint: tuple[Any, Path]) -> Engine:
    return Engine.load(checkpoint[1], dtype="float32", device="cpu", progress=False)


def _messages(*images: Image) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "Look at this picture:"}]
    parts += [{"type": "image", "image": image} for image in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is it?"}]}]


def test_engine_generates_hf_greedy_tokens_from_chat_messages(
    checkpoint: tuple[Any, Path], engine: Engine
) -> None:
    """`Engine.stream` renders the real template, expands the image and decodes HF's tokens;
    the scheduler (the server's path) decodes the same."""
    hf, _ = checkpoint
    assert engine.modalities == ("text", "image")
    messages = _messages(IMAGES[0])
    ids, media = engine.expand_media(engine.encode(messages), [IMAGES[0]])
    expected, _ = _hf_greedy(hf, ids, [IMAGES[0]])
    greedy = SamplingParams(temperature=0.0)
    stop_ids: tuple[int, ...] = ()
    chunks = list(
        engine.run(GenerationRequest(ids, DECODE_STEPS, greedy, stop_ids=stop_ids, media=media))
    )
    assert [c.token for c in chunks if c.token is not None] == expected[len(ids) :]
    streamed = engine.generate(messages, DECODE_STEPS, greedy)
    assert streamed == engine.tokenizer.decode(expected[len(ids) :])
    scheduler = engine.scheduler(2)
    got: list[Any] = []
    request = GenerationRequest(ids, DECODE_STEPS, greedy, stop_ids=stop_ids, media=media)
    scheduler.submit(request, got.append, lambda: False)
    while not scheduler.idle:
        scheduler.step()
    assert [c.token for c in got if c.token is not None] == expected[len(ids) :]


def test_prompt_cache_keys_images_on_content(engine: Engine) -> None:
    """The same image again hits (past the image); a different image of the same size, whose
    placeholder ids are the same, shares no key past its first soft token. (Its request then
    misses: the tiny model's window of 8 cannot trim back that far.)"""
    cache = PromptCache()
    greedy = SamplingParams(temperature=0.0)
    other = _image(40, 28, seed=9, budget=70)

    def request(image: Image) -> GenerationRequest:
        ids, media = engine.expand_media(engine.encode(_messages(image)), [image])
        return GenerationRequest(ids, 2, greedy, stop_ids=(), media=media)

    def run(image: Image) -> Any:
        chunks = list(engine.run(request(image), prompt_cache=cache))
        return chunks[-1].stats, [c.token for c in chunks if c.token is not None]

    first, second = request(IMAGES[0]), request(other)
    span = first.media[0]
    assert first.prompt_ids == second.prompt_ids  # the placeholders alone cannot tell them apart
    assert common_prefix_length(first.cache_ids, second.cache_ids) == span.start
    same = dataclasses.replace(IMAGES[0], pixels=IMAGES[0].pixels.copy())
    assert request(same).cache_ids == first.cache_ids
    stats, tokens = run(IMAGES[0])
    assert stats.cached_tokens == 0
    again, tokens_again = run(same)
    assert again.cached_tokens == len(first.prompt_ids) - 1 and tokens_again == tokens
    different, _ = run(other)
    assert different.cached_tokens == 0
