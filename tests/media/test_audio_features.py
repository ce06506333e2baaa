"""Gemma 4's log-mel features and soft-token counts against HF transformers' extractor and
processor arithmetic.

Hearth computes the features with the same numpy operations in the same dtypes (float32
frames and FFT, a float64 mel bank built on its own), so they are compared for equality, not
within a tolerance.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

from hearth.media import AUDIO_SAMPLE_RATE, decode_audio
from hearth.media.audio import LogMelExtractor, LogMelSettings, checkpoint_audio_settings


def _hf_soft_tokens(mask: np.ndarray) -> int:
    """HF's `Gemma4Processor.replace_audio_token`: the mask through two stride-2 steps."""
    t = len(mask)
    for _ in range(2):
        t_out = (t + 2 - 3) // 2 + 1
        mask = mask[::2][:t_out]
        t = len(mask)
    return int(mask.sum())


def _hf(extractor: Gemma4AudioFeatureExtractor, samples: np.ndarray):
    out = extractor([samples], return_tensors="np")
    return out["input_features"][0], out["input_features_mask"][0]


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def test_fixture_wav_features_equal_hf():
    """A chirp with a tone, written as 16-bit WAV at 44.1 kHz and decoded (resampled to
    16 kHz) by `decode_audio`: features, mask and soft-token count equal HF's exactly."""
    rate = 44_100
    t = np.arange(int(1.37 * rate)) / rate
    signal = 0.4 * np.sin(2 * np.pi * (200 + 900 * t) * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)
    audio = decode_audio(_wav_bytes(signal, rate))
    assert abs(audio.seconds - 1.37) < 1e-3

    hf_features, hf_mask = _hf(Gemma4AudioFeatureExtractor(), audio.samples)
    extractor = LogMelExtractor()
    features, mask = extractor.features_and_mask(audio.samples)
    np.testing.assert_array_equal(mask, hf_mask)
    np.testing.assert_array_equal(features, hf_features)
    np.testing.assert_array_equal(extractor(audio.samples), hf_features[hf_mask])
    # 21920 samples: (21920 - 161) // 160 + 1 = 136 real frames, a quarter of them tokens
    assert len(audio.samples) == 21_920
    assert extractor.soft_tokens(len(audio.samples)) == _hf_soft_tokens(hf_mask) == 34
    # the signal is audible in the features: not the log floor everywhere
    assert hf_features[hf_mask].max() > np.log(1e-3) + 5


@pytest.mark.parametrize(
    "length", [0, 100, 160, 161, 320, 321, 480, 1000, 16_000, 16_001, 23_457, 480_000]
)
def test_random_clips_equal_hf(length: int):
    """Random clips around every frame and padding edge (161 samples is the first frame),
    up to the 30 s HF keeps: equal features, masks and soft-token counts."""
    samples = (np.random.default_rng(length).standard_normal(length) * 0.3).astype(np.float32)
    hf_features, hf_mask = _hf(Gemma4AudioFeatureExtractor(), samples)
    extractor = LogMelExtractor()
    features, mask = extractor.features_and_mask(samples)
    np.testing.assert_array_equal(mask, hf_mask)
    np.testing.assert_array_equal(features, hf_features)
    np.testing.assert_array_equal(extractor(samples), hf_features[hf_mask])
    assert extractor.real_frames(length) == hf_mask.sum()
    assert extractor.soft_tokens(length) == _hf_soft_tokens(hf_mask)


def test_optional_steps_equal_hf():
    """Preemphasis (both flavours), input scaling, FFT overdrive, per-bin standardisation and
    another bank size: each setting HF's extractor reads gives HF's features."""
    rng = np.random.default_rng(7)
    samples = (rng.standard_normal(5_000) * 0.2).astype(np.float32)
    bins = 64
    hf_fields = {
        "feature_size": bins,
        "preemphasis": 0.97,
        "input_scale_factor": 2.0,
        "fft_overdrive": True,
        "mel_floor": 1e-5,
        "min_frequency": 125.0,
        "max_frequency": 7600.0,
        "per_bin_mean": list(rng.standard_normal(bins)),
        "per_bin_stddev": list(rng.uniform(0.5, 2.0, bins)),
    }
    for htk in (True, False):
        fields = {**hf_fields, "preemphasis_htk_flavor": htk}
        hf_features, hf_mask = _hf(Gemma4AudioFeatureExtractor(**fields), samples)
        features, mask = LogMelExtractor(LogMelSettings.from_hf(fields)).features_and_mask(samples)
        np.testing.assert_array_equal(mask, hf_mask)
        np.testing.assert_array_equal(features, hf_features)


def test_one_soft_token_per_40_ms():
    """One soft token per 40 ms: 30 s of audio is 750 tokens, HF's `audio_seq_length` cap."""
    extractor = LogMelExtractor()
    assert extractor.soft_tokens(30 * AUDIO_SAMPLE_RATE) == 750
    assert extractor.soft_tokens(AUDIO_SAMPLE_RATE) == 25
    assert extractor.soft_tokens(160) == 0


def test_checkpoint_processor_config_sets_the_features(tmp_path: Path):
    """A checkpoint's saved extractor (preprocessor_config.json as HF writes it, or nested in
    processor_config.json) gives the features HF's extractor loaded from it gives."""
    hf = Gemma4AudioFeatureExtractor(preemphasis=0.97, mel_floor=1e-4)
    hf.save_pretrained(tmp_path / "flat")
    saved = json.loads((tmp_path / "flat" / "preprocessor_config.json").read_text())
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "processor_config.json").write_text(
        json.dumps({"feature_extractor": saved, "image_processor": {}})
    )
    samples = (np.random.default_rng(3).standard_normal(3_000) * 0.2).astype(np.float32)
    loaded = Gemma4AudioFeatureExtractor.from_pretrained(tmp_path / "flat")
    hf_features, _ = _hf(loaded, samples)
    for directory in (tmp_path / "flat", nested):
        settings = checkpoint_audio_settings(directory)
        assert settings is not None and settings.preemphasis == 0.97
        features, _ = LogMelExtractor(settings).features_and_mask(samples)
        np.testing.assert_array_equal(features, hf_features)
    assert checkpoint_audio_settings(tmp_path) is None
