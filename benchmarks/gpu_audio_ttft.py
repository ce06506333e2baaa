"""Time to first token of an audio prompt: Hearth against HF transformers, random weights at
real shapes (Gemma 4 E4B with its audio tower, bf16 on a GPU); on a CPU, `--models small` (a
4-layer text model of width 512 with E4B's audio tower, fp32).

The prompt is 30 s of audio (750 soft tokens, the most Gemma 4 takes) between a few text
tokens. Hearth's time runs from the decoded samples to the first sampled token on the host
(log-mel features, tower, prefill); HF's from its extractor's tensors to its first token
(features not counted), one forward with a cache, as users call it. Both models are on the
device at once and their attempts alternate.

    python benchmarks/gpu_audio_ttft.py --models e4b
    python benchmarks/gpu_audio_ttft.py --models small --device cpu
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpu_image_ttft import (  # the image script's timing and model helpers, shared
    dtype_of,
    first_token_seconds,
    hf_model,
    random_weight_model,
    release,
    synchronize,
)
from hearth.bench.random_model import PRESETS
from hearth.media import AUDIO_SAMPLE_RATE, Audio
from hearth.runtime.runner import ModelRunner

SMALL_TEXT = {
    **PRESETS["e4b"],
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 0,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "hidden_size_per_layer_input": 0,
}
# E2B's and E4B's audio tower (HF's Gemma4AudioConfig defaults, spelled out).
AUDIO = {
    "model_type": "gemma4_audio",
    "hidden_size": 1024,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "subsampling_conv_channels": [128, 32],
    "output_proj_dims": 1536,
}
BOA, AUDIO_TOKEN, EOA = 256_000, 258_881, 258_883
SECONDS = 30.0
WARM_UP, TIMED = 2, 5


def config_of(name: str) -> dict[str, Any]:
    return {
        "model_type": "gemma4",
        "text_config": {**(SMALL_TEXT if name == "small" else PRESETS[name])},
        "audio_config": AUDIO,
        "audio_token_id": AUDIO_TOKEN,
        "boa_token_id": BOA,
        "eoa_token_index": EOA,
        "tie_word_embeddings": True,
    }


def random_clip(seed: int) -> Audio:
    samples = np.random.default_rng(seed).standard_normal(int(SECONDS * AUDIO_SAMPLE_RATE))
    return Audio((samples * 0.3).astype(np.float32), f"{seed:064x}")


def prompt_ids() -> list[int]:
    return [2, 105, *range(1000, 1010), AUDIO_TOKEN, *range(1010, 1020), 106, 105]


def hearth_run(name: str, device: torch.device) -> Callable[[int], float]:
    """Hearth's model; the returned call times one prompt's first token (clip `seed`)."""
    runner = ModelRunner(random_weight_model(config_of(name), device))
    return lambda seed: first_token_seconds(runner, prompt_ids(), random_clip(seed), 750)


def hf_run(name: str, device: torch.device) -> Callable[[int], float] | str:
    """HF's model, or why there is none; the call times one forward to the first token."""
    try:
        from transformers.models.gemma4.feature_extraction_gemma4 import (
            Gemma4AudioFeatureExtractor,
        )

        model = hf_model(config_of(name), device)
    except ImportError as error:
        return f"unavailable: {error}"
    extractor = Gemma4AudioFeatureExtractor()
    ids = [2, 105, *range(1000, 1010), BOA, *[AUDIO_TOKEN] * 750, EOA]
    ids += [*range(1010, 1020), 106, 105]
    tensor = torch.tensor([ids], device=device)

    def run(seed: int) -> float:
        inputs = extractor([random_clip(seed).samples], return_tensors="pt")
        features = inputs["input_features"].to(device, dtype_of(device))
        mask = inputs["input_features_mask"].to(device)
        synchronize(device)
        begin = time.perf_counter()
        with torch.inference_mode():
            out = model(
                input_ids=tensor,
                input_features=features,
                input_features_mask=mask,
                use_cache=True,
                logits_to_keep=1,
            )
            int(out.logits[0, -1].argmax())
        return time.perf_counter() - begin

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="e4b")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), flush=True)
    print("| model | audio | Hearth TTFT (ms) | HF TTFT (ms) | HF / Hearth |")
    print("|---|---|---|---|---|")
    for name in args.models.split(","):
        ours = hearth_run(name, device)
        theirs = hf_run(name, device)
        # Attempts alternate, so that a busy spell of a shared machine falls on both alike.
        times: tuple[list[float], list[float]] = ([], [])
        for attempt in range(WARM_UP + TIMED):
            for index, run in enumerate((ours, theirs)):
                if callable(run):
                    seconds = run(attempt)
                    if attempt >= WARM_UP:
                        times[index].append(seconds)
        hearth = statistics.median(times[0])
        if isinstance(theirs, str):
            print(f"| {name} | {SECONDS:g} s | {hearth * 1e3:.1f} | {theirs} | |", flush=True)
        else:
            peer = statistics.median(times[1])
            print(
                f"| {name} | {SECONDS:g} s | {hearth * 1e3:.1f} | {peer * 1e3:.1f} "
                f"| {peer / hearth:.2f}x |",
                flush=True,
            )
        del ours, theirs
        release(device)


if __name__ == "__main__":
    main()
