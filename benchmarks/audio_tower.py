"""Time Gemma 4's audio tower on one clip: Hearth's encoder (log-mel features, Conformer
tower, embed_audio) against HF transformers' extractor + Gemma4AudioModel + embed_audio with
the same random weights, at E2B/E4B's real tower sizes. Prints a markdown table.

    python benchmarks/audio_tower.py --device cpu --dtype float32 --seconds 30
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from hearth.config import gemma4_config
from hearth.media import AUDIO_SAMPLE_RATE, Audio
from hearth.models.gemma4_audio import Gemma4AudioEncoder
from hearth.models.presets import GEMMA4_PRESETS


def _hf_parts(text_hidden: int, dtype: torch.dtype, device: str):
    from transformers import Gemma4AudioConfig, Gemma4TextConfig
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.modeling_gemma4 import (
        Gemma4AudioModel,
        Gemma4MultimodalEmbedder,
    )

    config = Gemma4AudioConfig()  # E2B's and E4B's tower: HF's defaults
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    tower = Gemma4AudioModel(config).to(device, dtype).eval()
    text = Gemma4TextConfig(hidden_size=text_hidden)
    embedder = Gemma4MultimodalEmbedder(config, text).to(device, dtype).eval()
    return Gemma4AudioFeatureExtractor(), tower, embedder, config


def _hearth_encoder(hf_config, text_hidden: int, hf_tower, hf_embedder, dtype, device: str):
    """Hearth's encoder holding HF's weights (norm weights in fp32, as the loader keeps them)."""
    config = gemma4_config(
        {**GEMMA4_PRESETS["e4b"], "hidden_size": text_hidden, "audio_config": hf_config.to_dict()}
    ).audio
    assert config is not None
    encoder = Gemma4AudioEncoder.create(config, text_hidden)
    for ours, theirs in ((encoder.tower, hf_tower), (encoder.embedder, hf_embedder)):
        ours.to(device, dtype)
        state = theirs.state_dict()
        missing = set(ours.state_dict()) - set(state)
        assert not missing, sorted(missing)[:3]
        ours.load_state_dict({name: state[name] for name in ours.state_dict()})
        for name, parameter in ours.named_parameters():
            if "norm" in name.rpartition(".")[0].rpartition(".")[2]:
                parameter.data = parameter.data.float()
    return encoder


def _seconds(run: Callable[[], torch.Tensor], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _interleaved_medians(
    runs: tuple[Callable[[], torch.Tensor], ...], repeats: int, device: str
) -> list[float]:
    """Each run's median time, the runs alternating so that a busy spell of a shared machine
    falls on both alike; one warm-up each first."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(repeats):
        for index, run in enumerate(runs):
            times[index].append(_seconds(run, device))
    return [statistics.median(column) for column in times]


def _hardware(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
        name = next(line.split(":", 1)[1].strip() for line in lines if "Model name" in line)
    except (OSError, StopIteration):
        name = platform.processor()
    return f"{name}, {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--seconds", type=float, nargs="+", default=[30.0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--text-hidden", type=int, default=2560, help="E4B: 2560, E2B: 1536")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    extractor, hf_tower, hf_embedder, hf_config = _hf_parts(args.text_hidden, dtype, args.device)
    encoder = _hearth_encoder(
        hf_config, args.text_hidden, hf_tower, hf_embedder, dtype, args.device
    )

    def hf_encode(samples: np.ndarray) -> torch.Tensor:
        inputs = extractor([samples], return_tensors="pt")
        features = inputs["input_features"].to(args.device, dtype)
        mask = inputs["input_features_mask"].to(args.device)
        with torch.inference_mode():
            out = hf_tower(features, mask, return_dict=True)
            return hf_embedder(out.last_hidden_state)[out.attention_mask]

    hardware = _hardware(args.device)
    print(f"Gemma 4 audio tower (E4B sizes, random weights), {args.dtype}, {hardware}")
    print()
    print("| clip | soft tokens | Hearth s | HF s | HF / Hearth | max abs diff | max abs HF |")
    print("|---|---|---|---|---|---|---|")
    for seconds in args.seconds:
        rng = np.random.default_rng(0)
        samples = (rng.standard_normal(int(seconds * AUDIO_SAMPLE_RATE)) * 0.3).astype(np.float32)
        audio = Audio(samples, "bench")
        ours, theirs = _interleaved_medians(
            (partial(encoder.encode, audio), partial(hf_encode, samples)),
            args.repeats,
            args.device,
        )
        reference = hf_encode(samples).float()
        diff = (encoder.encode(audio).float() - reference).abs().max().item()
        largest = reference.abs().max().item()
        print(
            f"| {seconds:g} s | {encoder.soft_tokens(audio)} | {ours:.3f} | {theirs:.3f} "
            f"| {theirs / ours:.2f}x | {diff:.2e} | {largest:.2f} |"
        )


if __name__ == "__main__":
    main()
