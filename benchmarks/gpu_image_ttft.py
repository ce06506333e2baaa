"""Time to first token of an image prompt: Hearth against HF transformers, random weights at
real shapes (Gemma 4 E4B and 31B with their vision towers, bf16 on a GPU), one model on the
device at a time; on a CPU, `--models small` (a 4-layer text model of width 512 and a 4-layer
tower of width 256, fp32) at a 280-token image.

The GPU prompt is a 1680x1536 image at the 1120 budget (exactly 1120 soft tokens, 10080
patches) between a few text tokens. Hearth's time runs from the decoded image to the first
sampled token on the host (preprocessing, tower, prefill); HF's from the processor's tensors
to its first token (preprocessing not counted), one forward with a cache, as users
call it.

    python benchmarks/gpu_image_ttft.py --models e4b,31b
    python benchmarks/gpu_image_ttft.py --models small --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hearth.bench.random_model import PRESETS, build_random_model
from hearth.layers.clipped import ClippedLinear
from hearth.media import Audio, Image
from hearth.media.image import image_patches
from hearth.runtime.generate import GenerationStats, PromptMedia, generate_tokens
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import Sampler, SamplingParams

# The towers' shapes (gemma4-architecture.md §4.1).
VISION = {
    "e4b": {
        "num_hidden_layers": 16,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
        "head_dim": 64,
        "intermediate_size": 3072,
        "use_clipped_linears": True,
    },
    "31b": {
        "num_hidden_layers": 27,
        "hidden_size": 1152,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 72,
        "intermediate_size": 4304,
        "standardize": True,
    },
    "small": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "intermediate_size": 1024,
        "use_clipped_linears": True,
    },
}
SMALL_TEXT = {
    **PRESETS["e4b"],
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 0,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "hidden_size_per_layer_input": 0,
}
BIDIRECTIONAL = {"e4b": None, "31b": "vision", "small": "vision"}
BOI, IMAGE_TOKEN, EOI = 255_999, 258_880, 258_882
SIZES = {"cuda": ((1680, 1536), 1120), "cpu": ((960, 672), 280)}  # (width, height), budget
WARM_UP, TIMED = 2, 5


def config_of(name: str) -> dict[str, Any]:
    text = {**(SMALL_TEXT if name == "small" else PRESETS[name])}
    text["use_bidirectional_attention"] = BIDIRECTIONAL[name]
    return {
        "model_type": "gemma4",
        "text_config": text,
        "vision_config": {
            "model_type": "gemma4_vision",
            "patch_size": 16,
            "pooling_kernel_size": 3,
            "position_embedding_size": 10240,
            "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
            **VISION[name],
        },
        "image_token_id": IMAGE_TOKEN,
        "boi_token_id": BOI,
        "eoi_token_id": EOI,
        "tie_word_embeddings": True,
    }


def random_image(seed: int, device: torch.device) -> Image:
    from PIL import Image as PILImage

    (width, height), budget = SIZES[device.type]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)
    return Image(PILImage.fromarray(pixels, "RGB"), f"{seed:064x}", budget)


def dtype_of(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prompt_ids() -> list[int]:
    return [2, 105, *range(1000, 1010), IMAGE_TOKEN, *range(1010, 1020), 106, 105]


def random_weight_model(config: dict[str, Any], device: torch.device) -> Any:
    """Hearth's model of `config` with random weights, its clip bounds opened: random bounds
    near one would clamp every activation of the towers."""
    model = build_random_model(config, device, dtype=dtype_of(device))
    for module in model.modules():
        if isinstance(module, ClippedLinear) and module.clipped:
            for side in ("input", "output"):
                getattr(module, f"{side}_min").data.fill_(-1e4)
                getattr(module, f"{side}_max").data.fill_(1e4)
    return model


def first_token_seconds(
    runner: ModelRunner, prompt: list[int], item: Image | Audio, soft_tokens: int
) -> float:
    """Hearth's time from a decoded input to the first token of `prompt` (its one placeholder
    expanded to `soft_tokens`): preprocessing, tower and prefill."""
    ids, spans = runner.model.expand_media(prompt, [item])
    assert spans[0][1] == soft_tokens
    stats = GenerationStats()
    sampler = Sampler(SamplingParams(temperature=0.0), device=runner.device)
    media = tuple(PromptMedia(*span) for span in spans)
    tokens = generate_tokens(runner, ids, sampler, 1, stats, media=media)
    next(tokens)
    tokens.close()
    return stats.prefill_seconds


def hf_model(config: dict[str, Any], device: torch.device) -> Any:
    """HF's Gemma4ForConditionalGeneration of `config`, random weights in `dtype_of(device)`
    (ImportError without transformers)."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype_of(device))
    try:
        with torch.device(device):
            return Gemma4ForConditionalGeneration(Gemma4Config(**config)).eval()
    finally:
        torch.set_default_dtype(previous)


def hearth_seconds(name: str, device: torch.device) -> list[float]:
    model = random_weight_model(config_of(name), device)
    runner = ModelRunner(model)
    times = []
    for attempt in range(WARM_UP + TIMED):
        image = random_image(attempt, device)
        seconds = first_token_seconds(runner, prompt_ids(), image, image.max_tokens or 0)
        if attempt >= WARM_UP:
            times.append(seconds)
    del runner, model
    release(device)
    return times


def hf_seconds(name: str, device: torch.device) -> list[float] | str:
    try:
        model = hf_model(config_of(name), device)
    except ImportError as error:
        return f"unavailable: {error}"
    budget = SIZES[device.type][1]
    ids = [2, 105, *range(1000, 1010), BOI, *[IMAGE_TOKEN] * budget, EOI]
    ids += [*range(1010, 1020), 106, 105]
    tensor = torch.tensor([ids], device=device)
    times = []
    for attempt in range(WARM_UP + TIMED):
        # The processor's tensors (image_patches equals HF's PIL processor exactly; the image
        # fills its budget, so HF would add no padding patches).
        patches = image_patches(random_image(attempt, device), budget)
        pixels = torch.from_numpy(patches.pixels)[None].to(device)
        positions = torch.from_numpy(patches.positions)[None].to(device)
        synchronize(device)
        begin = time.perf_counter()
        with torch.inference_mode():
            out = model(
                input_ids=tensor,
                pixel_values=pixels,
                image_position_ids=positions,
                mm_token_type_ids=(tensor == IMAGE_TOKEN).long(),
                use_cache=True,
                logits_to_keep=1,
            )
            int(out.logits[0, -1].argmax())
        if attempt >= WARM_UP:
            times.append(time.perf_counter() - begin)
    del model
    release(device)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="e4b,31b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), flush=True)
    budget = SIZES[device.type][1]
    print("| model | image tokens | Hearth TTFT (ms) | HF TTFT (ms) | HF / Hearth |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        ours = statistics.median(hearth_seconds(name, device))
        theirs = hf_seconds(name, device)
        if isinstance(theirs, str):
            print(f"| {name} | {budget} | {ours * 1e3:.1f} | {theirs} | |", flush=True)
            continue
        peer = statistics.median(theirs)
        print(
            f"| {name} | {budget} | {ours * 1e3:.1f} | {peer * 1e3:.1f} | {peer / ours:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
