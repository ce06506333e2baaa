"""Where an image or audio prompt's first token goes: preprocessing, copy, tower, prefill.

Random weights at real shapes (`gpu_image_ttft.py`'s configs), bf16 on a GPU; medians of 5
after 2 warm-ups, each stage synchronised. With `--profile`, the 15 costliest CUDA kernels of
one tower call and one prefill.

    python benchmarks/lab/gpu_media_breakdown.py --model e4b [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_image_ttft import config_of, prompt_ids, random_image, random_weight_model, synchronize
from hearth.media import Audio
from hearth.media.image import image_patches
from hearth.models.gemma4 import device_pixels
from hearth.runtime.generate import PromptMedia, soft_tokens
from hearth.runtime.runner import ModelRunner


def timed(device: torch.device, work: Callable[[], Any], rounds: int = 5) -> float:
    """Median milliseconds of `work` after two warm-ups."""
    times = []
    for attempt in range(rounds + 2):
        synchronize(device)
        begin = time.perf_counter()
        work()
        synchronize(device)
        if attempt >= 2:
            times.append(time.perf_counter() - begin)
    return statistics.median(times) * 1e3


def profile(label: str, work: Callable[[], Any]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    work()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    print(f"\n### {label}\n```")
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
    )
    print("```")


def synchronizing(label: str, work: Callable[[], Any]) -> None:
    """Each place in `work` where the host waits for the device, with the Python line."""
    import collections
    import warnings

    places: collections.Counter[str] = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        work()
    torch.cuda.set_sync_debug_mode(0)
    for warning in caught:
        places[f"{warning.filename}:{warning.lineno}"] += 1
    print(f"\n### host syncs in {label}: {sum(places.values())}")
    for place, count in places.most_common(20):
        print(f"- {count} x {place}")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="e4b")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--sync-debug", action="store_true", help="list each host sync of one image prompt"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    model = random_weight_model(config_of(args.model), device)
    runner = ModelRunner(model)
    vision = model.config.vision
    image = random_image(0, device)
    budget = image.max_tokens or 0
    rows: list[tuple[str, float]] = []

    patches = image_patches(image, budget, vision.patch_size, vision.pooling_kernel_size)
    rows.append(
        (
            "image: patches on the host",
            timed(
                device,
                lambda: image_patches(image, budget, vision.patch_size, vision.pooling_kernel_size),
            ),
        )
    )
    pixels = device_pixels(patches.values, device)
    positions = torch.from_numpy(patches.positions).to(device)
    rows.append(
        (
            "image: copy to the device and rescale",
            timed(
                device,
                lambda: (
                    device_pixels(patches.values, device),
                    torch.from_numpy(patches.positions).to(device),
                ),
            ),
        )
    )
    rows.append(
        ("image: vision tower", timed(device, lambda: model.vision_tower(pixels, positions)))
    )
    tower_out = model.vision_tower(pixels, positions)
    rows.append(("image: embed_vision", timed(device, lambda: model.embed_vision(tower_out))))
    rows.append(
        ("image: embed_media (all of the above)", timed(device, lambda: model.embed_media(image)))
    )

    ids, spans = model.expand_media(prompt_ids(), [image])
    media = [PromptMedia(*span) for span in spans]
    soft = soft_tokens(runner, media)
    prompt = torch.tensor([ids], device=device)
    rows.append(
        (
            f"prefill of {len(ids)} tokens with the soft tokens",
            timed(device, lambda: runner.prefill(prompt, runner.new_caches(), 0, None, soft)),
        )
    )
    rows.append(
        (
            f"prefill of {len(ids)} text tokens",
            timed(device, lambda: runner.prefill(prompt, runner.new_caches())),
        )
    )

    if model.config.audio is not None:
        rate = 16_000
        samples = np.random.default_rng(0).standard_normal(30 * rate).astype(np.float32) * 0.1
        clip = Audio(samples, "0" * 64)
        encoder = model.audio_encoder()
        rows.append(
            ("audio: log-mel on the host", timed(device, lambda: encoder.features(samples)))
        )
        rows.append(
            (
                "audio: embed_media (features, tower, projection)",
                timed(device, lambda: model.embed_media(clip)),
            )
        )

    if device.type == "cuda":
        print(torch.cuda.get_device_name(device))
    print(f"| {args.model} stage | ms |\n|---|---|")
    for label, ms in rows:
        print(f"| {label} | {ms:.1f} |")
    if args.sync_debug:
        synchronizing(
            "embed_media and prefill",
            lambda: runner.prefill(
                prompt, runner.new_caches(), 0, None, soft_tokens(runner, media)
            ),
        )
    if args.profile:
        profile("vision tower", lambda: model.vision_tower(pixels, positions))
        profile(
            "prefill with soft tokens",
            lambda: runner.prefill(prompt, runner.new_caches(), 0, None, soft),
        )


if __name__ == "__main__":
    main()
