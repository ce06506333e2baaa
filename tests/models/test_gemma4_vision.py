"""Gemma 4 with a vision tower, against HF transformers' Gemma4ForConditionalGeneration in fp32.

The tiny model has a full-layer head dim twice the sliding one, k_eq_v on, finite clip values
in every vision linear, standardization, and bidirectional image attention on sliding layers
(`use_bidirectional_attention: "vision"`, as on 26B/31B), saved with `save_pretrained` and
read back through Hearth's loader.

Tolerances:
- tower soft tokens: 1e-6 absolute on values up to ~0.4 (std ~0.12). HF runs the tower over
  the image padded to the budget's patches and masks the padding; Hearth runs the real
  patches only, so attention's and pooling's fp32 sums run over other lengths and orders
  (measured max 3.4e-7, Xeon, 2026-12-07). A wrong RoPE axis, clip or pooling slot moves them
  by more than 1e-2.
- logits: 1.2e-4 absolute (MULTIMODAL_ATOL of test_gemma4.py, the same HF path), on logits up
  to ~24. Measured: 9.4e-5 for the uncached forward over prompt and reply, 1.0e-5 through the
  cached prefill and decode. A mask that is causal where HF's is bidirectional, a √hidden scale
  on the soft tokens or per-layer inputs read at the image token's id move them by 0.4 or more.
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
from hearth.media.image import (
    checkpoint_image_tokens,
    image_patches,
    resized_size,
    scaled,
    soft_token_count,
)
from hearth.models.gemma4 import device_pixels
from hearth.models.loading import build_model
from hearth.runtime.generate import GenerationRequest, PromptMedia, soft_tokens
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import SamplingParams
from scripted_gemma4 import SPECIAL_IDS, VOCAB_SIZE, template_path, write_byte_tokenizer
from tiny import FULL, PLE, SLIDING, randomise_gemma4, save_hf, tiny_gemma4_config

CUDA = torch.cuda.is_available()
TOWER_ATOL = 1e-6
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
    """Gemma 4's specials at their ids, one token per byte, the image tokens, the template."""
    write_byte_tokenizer(directory, {**SPECIAL_IDS, **IMAGE_SPECIALS}, VOCAB)
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
    on_device = device_pixels(patches.values, torch.device("cpu"))
    assert np.array_equal(reference["pixel_values"][0][:count].numpy(), on_device.numpy())
    assert np.array_equal(reference["image_position_ids"][0][:count].numpy(), patches.positions)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA"))],
)
def test_device_rescale_equals_host_rescale(device: str) -> None:
    """Every 8-bit value: the model's rescale after the copy (float64 on the device) gives the
    host's float32 bit for bit; both are one IEEE float64 product rounded once to float32."""
    values = np.arange(256, dtype=np.uint8).reshape(1, 256)
    assert np.array_equal(device_pixels(values, torch.device(device)).cpu().numpy(), scaled(values))


def test_budget_is_checked() -> None:
    with pytest.raises(MediaError, match="one of 70, 140, 280, 560, 1120"):
        resized_size(100, 100, 300)


def test_default_budget_comes_from_the_processor_config(tmp_path: Path) -> None:
    """HF's processor_config.json nests the image processor; older preprocessor_config.json
    files do not; a budget Gemma 4 does not take is ignored (280 then applies)."""
    assert checkpoint_image_tokens(tmp_path) is None
    nested = {"image_processor": {"max_soft_tokens": 1120}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert checkpoint_image_tokens(tmp_path) == 1120
    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 70}))
    assert checkpoint_image_tokens(tmp_path) == 70
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 300}))
    assert checkpoint_image_tokens(tmp_path) is None


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


def _hf_logits(hf: Any, ids: list[int], images: list[Image]) -> torch.Tensor:
    """HF's logits [positions, vocab] of one uncached forward over `ids`."""
    with torch.no_grad():
        return hf(**_hf_inputs(ids, images)).logits[0]


def _assert_hf_greedy(reference: torch.Tensor, prompt: int, tokens: list[int]) -> None:
    """`tokens` (after a prompt of `prompt` ids) are HF's greedy picks: at each step, the
    argmax of HF's logits over the prompt and the tokens before it."""
    assert reference[prompt - 1 : prompt - 1 + len(tokens)].argmax(-1).tolist() == tokens


def _cached_greedy(
    runner: ModelRunner, ids: list[int], soft: Any, chunk: int
) -> tuple[list[int], torch.Tensor]:
    """Hearth's greedy continuation through its caches: the prompt prefilled in chunks of
    `chunk`, then DECODE_STEPS decode steps; the tokens, and the logits of the prompt's last
    position and of each step [DECODE_STEPS + 1, vocab]."""
    caches = make_caches(runner.model.cache_specs())
    tokens: list[int] = []
    with torch.inference_mode():
        rows = [runner.prefill(torch.tensor([ids]), caches, 0, chunk, soft)[0]]
        for position in range(len(ids), len(ids) + DECODE_STEPS):
            tokens.append(int(rows[-1].argmax()))
            rows.append(runner.decode(tokens[-1], caches, position)[0])
    return tokens, torch.stack(rows)


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
    16 (whose ends move off the images), then 10 greedy cached decode steps: the tokens are
    HF's greedy picks, and the logits of the prompt's last position and of every step equal
    those of HF's forward over prompt and tokens, as do those of Hearth's uncached forward."""
    hf, _ = checkpoint
    ids, spans = _prompt(model, IMAGES)
    assert [ids[start - 1] for start, _, _ in spans] == [BOI, BOI]
    assert [ids[start + length] for start, length, _ in spans] == [EOI, EOI]
    runner = ModelRunner(model)
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
    tokens, rows = _cached_greedy(runner, ids, soft, chunk)
    reference = _hf_logits(hf, ids + tokens, IMAGES)
    _assert_hf_greedy(reference, len(ids), tokens)
    torch.testing.assert_close(rows, reference[len(ids) - 1 :], atol=LOGITS_ATOL, rtol=0)
    with torch.inference_mode():
        full = model(torch.tensor([ids + tokens]), soft=soft)[0]
    torch.testing.assert_close(full, reference, atol=LOGITS_ATOL, rtol=0)


def test_causal_images_with_kv_sharing_equal_hf(tmp_path: Path) -> None:
    """E2B's shape: no bidirectional images, PLE and KV-sharing layers (which run the last
    position only at a prefill): the prompt's last logits and 10 decode steps equal HF's."""
    hf = _hf_model(
        **PLE,
        use_bidirectional_attention=None,
        attention_k_eq_v=False,
        num_hidden_layers=5,
        num_kv_shared_layers=2,
        layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL],
    )
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, progress=False)
    ids, spans = _prompt(model, IMAGES[:1])
    runner = ModelRunner(model)
    assert not model.config.bidirectional_vision
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
    tokens, rows = _cached_greedy(runner, ids, soft, 16)
    reference = _hf_logits(hf, ids + tokens, IMAGES[:1])
    _assert_hf_greedy(reference, len(ids), tokens)
    torch.testing.assert_close(rows, reference[len(ids) - 1 :], atol=LOGITS_ATOL, rtol=0)


def _media(spans: Any) -> Any:
    return tuple(PromptMedia(start, length, item) for start, length, item in spans)


def test_bidirectional_mask_matters(checkpoint: tuple[Any, Path], model: Any) -> None:
    """The same prompt with the images attending causally moves the logits past the
    tolerance many times over: the comparison above can tell the masks apart."""
    hf, _ = checkpoint
    ids, spans = _prompt(model, IMAGES[:1])
    reference = _hf_logits(hf, ids, IMAGES[:1])
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
    greedy = SamplingParams(temperature=0.0)
    request = GenerationRequest(ids, DECODE_STEPS, greedy, stop_ids=(), media=media)
    tokens = [c.token for c in engine.run(request) if c.token is not None]
    assert len(tokens) == DECODE_STEPS
    _assert_hf_greedy(_hf_logits(hf, ids + tokens, [IMAGES[0]]), len(ids), tokens)
    assert engine.generate(messages, DECODE_STEPS, greedy) == engine.tokenizer.decode(tokens)
    scheduler = engine.scheduler(2)
    got: list[Any] = []
    scheduler.submit(request, got.append, lambda: False)
    while not scheduler.idle:
        scheduler.step()
    assert [c.token for c in got if c.token is not None] == tokens


def test_prompt_cache_keys_images_on_content(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    encoded: list[Any] = []
    embed_media = engine.model.embed_media
    monkeypatch.setattr(
        engine.model, "embed_media", lambda item: encoded.append(item) or embed_media(item)
    )
    again, tokens_again = run(same)
    assert again.cached_tokens == len(first.prompt_ids) - 1 and tokens_again == tokens
    assert encoded == []  # the hit holds the image: its tower does not run
    different, _ = run(other)
    assert different.cached_tokens == 0


def test_a_config_with_a_tower_the_file_lacks_loads_as_text(
    checkpoint: tuple[Any, Path], model: Any, tmp_path: Path
) -> None:
    """mlx-lm's conversions keep the multimodal config.json and drop the towers: such a
    checkpoint loads as a text model, with the same text weights."""
    from safetensors.torch import load_file, save_file

    _, path = checkpoint
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(path / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if "vision" not in k}
    assert len(kept) < len(tensors)
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    text = build_model(open_checkpoint(tmp_path), torch.float32, progress=False)
    assert text.media_kinds == () and text.config.vision is None
    ids = torch.tensor([[2, 105, 120, 121, 122]])
    with torch.inference_mode():
        torch.testing.assert_close(text(ids), model(ids), atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decoding_of_an_image_prompt_matches_the_cpu(
    checkpoint: tuple[Any, Path], engine: Engine
) -> None:
    """On a GPU the prompt with two images prefills eagerly (kernels, the bidirectional mask
    by SDPA) and decodes from CUDA graphs: the CPU's greedy tokens (HF's, by the tests above)."""
    gpu = Engine.load(checkpoint[1], dtype="float32", device="cuda", progress=False)
    assert gpu.runner.decodes_with_graphs
    ids, media = gpu.expand_media(gpu.encode(_messages(*IMAGES)), IMAGES)
    greedy = SamplingParams(temperature=0.0)
    request = GenerationRequest(ids, DECODE_STEPS, greedy, stop_ids=(), media=media)
    on_cpu = [c.token for c in engine.run(request) if c.token is not None]
    on_gpu = [c.token for c in gpu.run(request) if c.token is not None]
    assert len(on_gpu) == DECODE_STEPS and on_gpu == on_cpu


def test_placeholders_and_images_must_pair_up(model: Any) -> None:
    with pytest.raises(MediaError, match="fewer media placeholders"):
        model.expand_media([2, 120, 121], [IMAGES[0]])
    with pytest.raises(MediaError, match="more image placeholders"):
        model.expand_media([2, IMAGE_TOKEN, 120, IMAGE_TOKEN], [IMAGES[0]])
    with pytest.raises(MediaError, match="one of 70, 140, 280, 560, 1120"):
        model.expand_media([2, IMAGE_TOKEN], [_image(40, 28, budget=100)])
