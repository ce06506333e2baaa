"""Gemma 4's audio features: log-mel frames of 16 kHz samples, and how many soft tokens a clip
becomes.

The arithmetic is that of HF transformers' `Gemma4AudioFeatureExtractor` (a port of the
USM front end), step by step and in the same dtypes, so the features are equal:

- semicausal framing: `frame // 2` zeros before the clip, frames of `frame + 1` samples every
  `hop` (the extra sample feeds the optional preemphasis; without it the last one is dropped);
- a periodic Hann window of `frame` samples, a real FFT of the next power of two (twice that
  with `fft_overdrive`), the magnitude;
- a triangular HTK mel bank over [min_hz, max_hz] without area normalisation, then
  log(mel + mel_floor), and the optional per-bin mean/stddev standardisation.

A frame is real when every sample of its window is real audio; HF pads a clip to a multiple
of 128 samples and marks the padded frames invalid (and zeroes them). Only the real frames
reach the model, and the tower's outputs at real positions do not depend on the padded ones,
so `log_mel_frames` returns the real frames alone. Dither (random noise HF can add to each
frame) is a training aid, off by default in HF and never applied here: features are a
function of the samples.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hearth.media import AUDIO_SAMPLE_RATE

# HF's extractor pads a clip to a multiple of this many samples (`pad_to_multiple_of`).
_PAD_TO_SAMPLES = 128
# The tower's two subsampling convolutions: kernel 3, stride 2, padding 1 along time.
_SUBSAMPLING_STEPS = 2


@dataclass(frozen=True)
class LogMelSettings:
    """The fields of HF's `Gemma4AudioFeatureExtractor` that change the features; defaults
    are HF's (and the released checkpoints')."""

    sample_rate: int = AUDIO_SAMPLE_RATE
    mel_bins: int = 128
    frame_ms: float = 20.0
    hop_ms: float = 10.0
    min_hz: float = 0.0
    max_hz: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk: bool = True
    fft_overdrive: bool = False
    input_scale: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None

    @classmethod
    def from_hf(cls, extractor: Mapping[str, object]) -> LogMelSettings:
        """Settings from the `feature_extractor` entry of an HF processor config (absent
        fields: HF's defaults)."""
        names = {
            "sampling_rate": "sample_rate",
            "feature_size": "mel_bins",
            "frame_length_ms": "frame_ms",
            "hop_length_ms": "hop_ms",
            "min_frequency": "min_hz",
            "max_frequency": "max_hz",
            "preemphasis": "preemphasis",
            "preemphasis_htk_flavor": "preemphasis_htk",
            "fft_overdrive": "fft_overdrive",
            "input_scale_factor": "input_scale",
            "mel_floor": "mel_floor",
            "per_bin_mean": "per_bin_mean",
            "per_bin_stddev": "per_bin_stddev",
        }
        given = {}
        for hf_name, name in names.items():
            value = extractor.get(hf_name)
            if value is None:
                continue
            given[name] = tuple(value) if isinstance(value, Sequence) else value
        return cls(**given)  # type: ignore[arg-type]

    @property
    def frame_length(self) -> int:
        return round(self.sample_rate * self.frame_ms / 1000.0)

    @property
    def hop_length(self) -> int:
        return round(self.sample_rate * self.hop_ms / 1000.0)

    @property
    def fft_length(self) -> int:
        length = 2 ** math.ceil(math.log2(self.frame_length))
        return 2 * length if self.fft_overdrive else length


def hann_window(length: int) -> np.ndarray:
    """The periodic Hann window, 0.5 − 0.5·cos(2πn/length), as float32 (HF takes numpy's
    symmetric window of length + 1 and drops its last point: the same numbers)."""
    return np.hanning(length + 1)[:-1].astype(np.float32)


def _hz_to_mel(hz: float | np.ndarray) -> float | np.ndarray:
    return 2595.0 * np.log10(1.0 + hz / 700.0)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    return 700.0 * (np.power(10, mel / 2595.0) - 1.0)


def mel_filter_bank(settings: LogMelSettings) -> np.ndarray:
    """[fft_length // 2 + 1, mel_bins] float64: triangles on the HTK mel scale, each rising
    from the centre below it to its own centre and falling to the centre above, in Hz; bins
    are evenly spaced from 0 to sample_rate // 2. The top filters of the 512-point FFT fall
    between bins and are all zero, as in HF."""
    bins = settings.fft_length // 2 + 1
    edges_mel = np.linspace(
        _hz_to_mel(settings.min_hz), _hz_to_mel(settings.max_hz), settings.mel_bins + 2
    )
    edges_hz = _mel_to_hz(edges_mel)
    bin_hz = np.linspace(0, settings.sample_rate // 2, bins)
    widths = np.diff(edges_hz)
    # distance from each bin to each edge: positive where the edge lies above the bin
    to_edge = edges_hz[None, :] - bin_hz[:, None]
    rising = -to_edge[:, :-2] / widths[:-1]
    falling = to_edge[:, 2:] / widths[1:]
    return np.maximum(np.zeros(1), np.minimum(rising, falling))


class LogMelExtractor:
    """Log-mel frames of a clip, with the window and mel bank made once."""

    def __init__(self, settings: LogMelSettings | None = None) -> None:
        self.settings = settings or LogMelSettings()
        self.window = hann_window(self.settings.frame_length)
        self.mel_bank = mel_filter_bank(self.settings)
        bins = self.settings.mel_bins
        self.mean = _per_bin(self.settings.per_bin_mean, bins)
        self.stddev = _per_bin(self.settings.per_bin_stddev, bins)

    def real_frames(self, num_samples: int) -> int:
        """How many frames lie wholly on real samples: those HF's mask keeps."""
        s = self.settings
        span = s.frame_length + 1
        return max(0, (num_samples + s.frame_length // 2 - span) // s.hop_length + 1)

    def soft_tokens(self, num_samples: int) -> int:
        """The audio soft tokens of a clip: HF's `replace_audio_token`, which halves the
        frame mask twice (keeping every other frame, from the first), i.e. ⌈real frames/4⌉
        since the real frames are a prefix of the mask."""
        tokens = self.real_frames(num_samples)
        for _ in range(_SUBSAMPLING_STEPS):
            tokens = (tokens + 1) // 2
        return tokens

    def features_and_mask(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What HF's extractor returns for this one clip: [frames, mel_bins] float32 features
        (zero where invalid) and the [frames] bool mask, the clip padded with zeros to a
        multiple of 128 samples as HF does."""
        samples = np.asarray(samples, dtype=np.float32)
        padded_length = -(-len(samples) // _PAD_TO_SAMPLES) * _PAD_TO_SAMPLES
        padded = np.zeros(padded_length, dtype=np.float32)
        padded[: len(samples)] = samples
        features = self._log_mel(padded)
        mask = np.arange(len(features)) < self.real_frames(len(samples))
        return features * mask[:, None], mask

    def __call__(self, samples: np.ndarray) -> np.ndarray:
        """[real frames, mel_bins] float32: the frames of the clip that HF's mask keeps."""
        samples = np.asarray(samples, dtype=np.float32)
        return self._log_mel(samples)[: self.real_frames(len(samples))]

    def _log_mel(self, samples: np.ndarray) -> np.ndarray:
        s = self.settings
        if s.input_scale != 1.0:
            samples = samples * s.input_scale
        span = s.frame_length + 1
        padded = np.concatenate([np.zeros(s.frame_length // 2, samples.dtype), samples])
        count = max(0, (len(padded) - span) // s.hop_length + 1)
        starts = np.arange(count)[:, None] * s.hop_length
        frames = padded[starts + np.arange(span)[None, :]]
        frames = self._preemphasize(frames)
        spectrum = np.abs(np.fft.rfft(frames * self.window, n=s.fft_length, axis=-1))
        log_mel = np.log(spectrum @ self.mel_bank + np.float64(s.mel_floor))
        if self.mean is not None:
            log_mel = log_mel - self.mean
        if self.stddev is not None:
            log_mel = log_mel / self.stddev
        return log_mel.astype(np.float32)

    def _preemphasize(self, frames: np.ndarray) -> np.ndarray:
        """The frame's `frame_length` samples, each minus `preemphasis` times the one before
        (HTK: the first scaled by 1 − preemphasis); without preemphasis, the first
        `frame_length` samples as they are."""
        k = self.settings.preemphasis
        if k <= 0.0:
            return frames[:, :-1]
        if self.settings.preemphasis_htk:
            first = frames[:, :1] * (1.0 - k)
            return np.concatenate([first, frames[:, 1:-1] - k * frames[:, :-2]], axis=-1)
        return frames[:, 1:] - k * frames[:, :-1]


def _per_bin(values: tuple[float, ...] | None, bins: int) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.float64).reshape(1, bins)


def checkpoint_audio_settings(directory: Path) -> LogMelSettings | None:
    """The feature settings a checkpoint's processor config names (the `feature_extractor`
    of processor_config.json, or a preprocessor_config.json of Gemma 4's extractor), if any."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        try:
            config = json.loads((directory / name).read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict):
            continue
        extractor = config.get("feature_extractor", config)
        kind = extractor.get("feature_extractor_type") if isinstance(extractor, dict) else None
        if kind == "Gemma4AudioFeatureExtractor":
            return LogMelSettings.from_hf(extractor)
    return None


def waveform_frames(samples: np.ndarray, samples_per_token: int) -> np.ndarray:
    """The 12B unified model's audio features (HF's `Gemma4UnifiedAudioFeatureExtractor`): the
    samples zero-padded to whole frames and cut into rows of `samples_per_token` (640 = 40 ms
    at 16 kHz), float32 [frames, samples_per_token]; each row becomes one soft token."""
    count = -(-len(samples) // samples_per_token)
    frames = np.zeros(count * samples_per_token, dtype=np.float32)
    frames[: len(samples)] = samples
    return frames.reshape(count, samples_per_token)
