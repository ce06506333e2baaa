"""Gemma 4's audio tower against HF transformers: a tiny random Gemma4ForConditionalGeneration
with an audio tower, saved with `save_pretrained`, loaded through Hearth's reader.

Compared: `Gemma4AudioEncoder.encode(audio)` (Hearth's features, tower, `embed_audio`) with
HF's extractor + `get_audio_features`, the rows its mask keeps, in fp32. Tolerance 3e-6
absolute on outputs of magnitude up to ~4.3: Hearth runs HF's ops in HF's order except the
attention contractions (einsum against HF's batched matmuls) and RMSNorm (torch's fused
`rms_norm` against HF's pow(−½)), which may reorder fp32 sums and roundings by an ulp; the
measured max is 7.2e-7 (1.5 ulp at 4; most clips match bit for bit; Intel Xeon,
2026-12-07), the tolerance about four times that. A window one key wider, no clipping, or
HF's default softcap moves outputs by 8e-2 to 1.9 (`test_clips_and_softcap_bind`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

from hearth.checkpoint import open_checkpoint
from hearth.kv import make_caches
from hearth.media import Audio, MediaError
from hearth.models.gemma4_audio import Gemma4AudioEncoder
from hearth.models.loading import build_model
from hearth.runtime.generate import PromptMedia, soft_tokens
from hearth.runtime.runner import ModelRunner
from tiny import K_EQ_V, randomise_gemma4, save_hf, tiny_gemma4_config

ATOL = 3e-6

# Tower windows: HF's default (chunks of 12, 12 keys back, none ahead) and a small chunk
# with keys ahead, where the relative shift and mask differ most from a plain band.
AUDIO_WINDOWS: dict[str, dict[str, Any]] = {
    "default_window": {},
    "right_context": {
        "attention_chunk_size": 4,
        "attention_context_left": 6,
        "attention_context_right": 3,
    },
}
# Sample counts: 2 soft tokens; 24 (two whole chunks of 12); 25 and 37 (a partial chunk).
LENGTHS = [1_000, 15_361, 16_000, 23_457]
_OUTER_FIELDS = ("audio_token_id", "boa_token_id", "eoa_token_index")


def tiny_audio_model(seed: int = 0, text: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """An fp32 HF Gemma4ForConditionalGeneration with a two-layer audio tower.

    The text model has a full-layer head dim twice the sliding one and k_eq_v on (plus
    `text`'s fields); `overrides` go to the audio config, or to the outer config where they
    are its fields (the audio token ids). In the
    tower, norms are randomised (HF sets them to one), `per_dim_scale` too (HF: zero), the
    linears get std 0.2 so that attention logits reach the softcap (set to 5), and every
    clipped linear gets finite bounds that clamp part of its inputs and outputs.
    """
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration

    audio = Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        # The mel axis is 128 / 4 = 32 wide after subsampling; HF sizes the projection
        # from the first channel count / 4, so that count must be 128.
        subsampling_conv_channels=[128, 8],
        output_proj_dims=24,
        attention_logit_cap=5.0,
        **{k: v for k, v in overrides.items() if k not in _OUTER_FIELDS},
    )
    config = Gemma4Config(
        text_config=tiny_gemma4_config(**K_EQ_V, **(text or {})).to_dict(),
        audio_config=audio.to_dict(),
        **{k: v for k, v in overrides.items() if k in _OUTER_FIELDS},
    )
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(config).eval()
    randomise_gemma4(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if "audio_tower" not in name and "embed_audio" not in name:
                continue
            bound = torch.empty(()).uniform_(0.6, 1.2, generator=generator).item()
            if name.endswith("per_dim_scale"):
                tensor.normal_(0.0, 1.0, generator=generator)
            elif name.endswith("input_min") or name.endswith("input_max"):
                tensor.fill_(bound * 2 * (1 if name.endswith("max") else -1))
            elif name.endswith("output_min") or name.endswith("output_max"):
                tensor.fill_(bound * (1 if name.endswith("max") else -1))
            elif name.endswith(("linear.weight", "relative_k_proj.weight", "projection.weight")):
                tensor.normal_(0.0, 0.2, generator=generator)
    return model


@pytest.fixture(scope="module", params=list(AUDIO_WINDOWS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF model, Hearth's audio encoder of the saved checkpoint)."""
    hf = tiny_audio_model(**AUDIO_WINDOWS[request.param])
    path = save_hf(hf, tmp_path_factory.mktemp(request.param))
    model = build_model(open_checkpoint(path), torch.float32, progress=False)
    encoder = model.audio_encoder()
    assert isinstance(encoder, Gemma4AudioEncoder)
    return hf, encoder


def _clip(length: int) -> Audio:
    rng = np.random.default_rng(length)
    return Audio((rng.standard_normal(length) * 0.3).astype(np.float32), f"clip{length}")


def _hf_encode(hf: Any, audio: Audio) -> torch.Tensor:
    inputs = Gemma4AudioFeatureExtractor()([audio.samples], return_tensors="pt")
    with torch.no_grad():
        out = hf.model.get_audio_features(
            inputs["input_features"], inputs["input_features_mask"], return_dict=True
        )
    return out.pooler_output[out.attention_mask]


@pytest.mark.parametrize("length", LENGTHS)
def test_tower_output_equals_hf(checkpoint: tuple[Any, Gemma4AudioEncoder], length: int):
    hf, encoder = checkpoint
    audio = _clip(length)
    reference = _hf_encode(hf, audio)
    ours = encoder.encode(audio)
    assert ours.shape == (encoder.soft_tokens(audio), 64) == reference.shape
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


def test_clips_and_softcap_bind(checkpoint: tuple[Any, Gemma4AudioEncoder]):
    """The test model exercises what it checks: without the clip bounds, or with HF's
    softcap of 50, the tower's output moves by far more than the tolerance."""
    hf, encoder = checkpoint
    audio = _clip(16_000)
    reference = _hf_encode(hf, audio)
    tower = encoder.tower
    clipped = [m for m in tower.modules() if getattr(m, "clipped", False)]
    attention = [layer.self_attn for layer in tower.layers]
    try:
        for module in clipped:
            module.clipped = False
        assert (encoder.encode(audio) - reference).abs().max() > 1e-2
    finally:
        for module in clipped:
            module.clipped = True
    try:
        for module in attention:
            module.softcap = 50.0
        assert (encoder.encode(audio) - reference).abs().max() > 1e-2
    finally:
        for module in attention:
            module.softcap = 5.0


def test_short_and_long_clips(checkpoint: tuple[Any, Gemma4AudioEncoder]):
    """Under 161 samples a clip has no whole frame: no soft token (HF's count is 0 too);
    over 30 s it is refused, as `decode_audio` refuses it."""
    _, encoder = checkpoint
    short = Audio(np.zeros(160, np.float32), "short")
    assert encoder.soft_tokens(short) == 0
    assert encoder.encode(short).shape == (0, 64)
    long = Audio(np.zeros(30 * 16_000 + 1, np.float32), "long")
    with pytest.raises(MediaError, match="at most 30 s"):
        encoder.soft_tokens(long)


def test_text_only_load_of_multimodal_checkpoint_has_no_tower(tmp_path: Path):
    """A checkpoint without `audio_config` builds no tower: nothing to encode with."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    config = Gemma4Config(text_config=tiny_gemma4_config().to_dict())
    path = save_hf(Gemma4ForConditionalGeneration(config).eval(), tmp_path)
    model = build_model(open_checkpoint(path), torch.float32, progress=False)
    assert model.audio_encoder() is None
    assert not any(name.startswith("audio_tower.") for name, _ in model.named_parameters())


def test_int8_load_keeps_the_float_output_projection(tmp_path: Path):
    """`--quantize int8` quantizes the tower's bias-free linears and keeps the biased output
    projection in bf16. bf16 activations alone move this tiny tower's outputs (up to ~4) by
    0.086 against fp32, with int8 weights 0.14 (measured): bound 0.3, so a dropped bias or
    a wrong weight (outputs move by 1 or more) still fails."""
    hf = tiny_audio_model()
    path = save_hf(hf, tmp_path)
    model = build_model(open_checkpoint(path), torch.bfloat16, progress=False, quantize="int8")
    encoder = model.audio_encoder()
    assert encoder is not None
    assert isinstance(encoder.tower.output_proj, torch.nn.Linear)
    audio = _clip(16_000)
    ours = encoder.encode(audio).float()
    torch.testing.assert_close(ours, _hf_encode(hf, audio), atol=0.3, rtol=0)


# Audio prompts through the text model. The tiny vocabulary's last three ids stand for
# `<|audio>`, `<|audio|>` and `<audio|>`.
BOA, AUDIO_TOKEN, EOA = 253, 254, 255
DECODE_STEPS = 10
# Logits: 1.2e-4 absolute (MULTIMODAL_ATOL of test_gemma4.py: the same HF path, where
# text-only prompts measured 5.8e-5), on logits up to ~25. Soft tokens at the wrong
# positions, scaled by √hidden, or per-layer inputs read at the audio token's id move them by
# more than 1e-2 (`test_audio_soft_tokens_matter`).
LOGITS_ATOL = 1.2e-4


@pytest.fixture(scope="module")
def audio_lm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """(HF model, Hearth model): PLE on, k_eq_v full layers twice as wide as sliding ones."""
    hf = tiny_audio_model(
        seed=5,
        text={"hidden_size_per_layer_input": 8},
        audio_token_id=AUDIO_TOKEN,
        boa_token_id=BOA,
        eoa_token_index=EOA,
    )
    path = save_hf(hf, tmp_path_factory.mktemp("audio_lm"))
    return hf, build_model(open_checkpoint(path), torch.float32, progress=False)


def _hf_audio_logits(hf: Any, ids: list[int], clips: list[Audio]) -> torch.Tensor:
    """HF's logits [positions, vocab] for an expanded prompt with its clips (the extractor
    pads them to the longest as HF's processor does)."""
    inputs = Gemma4AudioFeatureExtractor()([clip.samples for clip in clips], return_tensors="pt")
    with torch.no_grad():
        return hf(
            input_ids=torch.tensor([ids]),
            input_features=inputs["input_features"],
            input_features_mask=inputs["input_features_mask"],
        ).logits[0]


def _hf_audio_greedy(hf: Any, ids: list[int], clips: list[Audio]) -> tuple[list[int], Any]:
    """HF's greedy continuation of DECODE_STEPS tokens and the final sequence's logits."""
    ids = list(ids)
    for _ in range(DECODE_STEPS):
        ids.append(int(_hf_audio_logits(hf, ids, clips)[-1].argmax()))
    return ids, _hf_audio_logits(hf, ids, clips)


CLIPS = [_clip(9_000), _clip(4_321)]


def _audio_prompt(model: Any, clips: list[Audio]) -> tuple[list[int], Any]:
    """A rendered-prompt shape: text, each clip's one `<|audio|>`, text; expanded."""
    ids = [2, 105, *range(120, 126)]
    for index, _ in enumerate(clips):
        ids += [10, AUDIO_TOKEN, 10, 130 + index]
    ids += [106, 105, 140, 141]
    return model.expand_media(ids, clips)


@pytest.mark.parametrize("chunk", [512, 16])
def test_audio_prompt_logits_equal_hf_through_prefill_and_decode(
    audio_lm: tuple[Any, Any], chunk: int
) -> None:
    """Two clips (14 and 7 soft tokens) in a prompt prefilled whole or in chunks of 16 (which
    split a clip: audio attends causally, so a chunk may end inside it), then 10 cached
    decode steps teacher-forced with HF's greedy tokens: the uncached logits of the whole
    sequence, the prompt's last position and every step equal HF's."""
    hf, model = audio_lm
    ids, spans = _audio_prompt(model, CLIPS)
    assert [length for _, length, _ in spans] == [14, 7]
    assert [ids[start - 1] for start, _, _ in spans] == [BOA, BOA]
    assert [ids[start + length] for start, length, _ in spans] == [EOA, EOA]
    tokens, reference = _hf_audio_greedy(hf, ids, CLIPS)
    runner = ModelRunner(model)
    media = tuple(PromptMedia(start, length, item) for start, length, item in spans)
    with torch.inference_mode():
        soft = soft_tokens(runner, media)
        full = model(torch.tensor([tokens]), soft=soft)[0]
        caches = make_caches(model.cache_specs())
        rows = [runner.prefill(torch.tensor([ids]), caches, 0, chunk, soft)[0]]
        for position in range(len(ids), len(tokens) - 1):
            rows.append(runner.decode(tokens[position], caches, position)[0])
    torch.testing.assert_close(full, reference, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(
        torch.stack(rows), reference[len(ids) - 1 : -1], atol=LOGITS_ATOL, rtol=0
    )


def test_audio_soft_tokens_matter(audio_lm: tuple[Any, Any]) -> None:
    """The comparison can fail: the prompt with the clips' soft tokens swapped, or scaled by
    √hidden as token rows are, moves the logits far past the tolerance."""
    hf, model = audio_lm
    ids, spans = _audio_prompt(model, CLIPS[:1])
    reference = _hf_audio_logits(hf, ids, CLIPS[:1])
    runner = ModelRunner(model)
    media = tuple(PromptMedia(start, length, item) for start, length, item in spans)
    with torch.inference_mode():
        (soft,) = soft_tokens(runner, media)
        scaled = dataclasses.replace(soft, embeddings=soft.embeddings * 8.0)
        reversed_rows = dataclasses.replace(soft, embeddings=soft.embeddings.flip(0))
        for wrong in (scaled, reversed_rows):
            logits = model(torch.tensor([ids]), soft=[wrong])[0]
            assert (logits - reference).abs().max() > 100 * LOGITS_ATOL
        right = model(torch.tensor([ids]), soft=[soft])[0]
    torch.testing.assert_close(right, reference, atol=LOGITS_ATOL, rtol=0)


def test_audio_on_a_model_without_the_tower_is_refused(tmp_path: Path) -> None:
    hf = tiny_audio_model(seed=1)
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, progress=False)
    assert model.media_kinds == ("audio",)
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text_only = Gemma4ForConditionalGeneration(
        Gemma4Config(text_config=tiny_gemma4_config().to_dict())
    ).eval()
    bare = build_model(
        open_checkpoint(save_hf(text_only, tmp_path / "bare")), torch.float32, progress=False
    )
    assert bare.media_kinds == ()
    with pytest.raises(MediaError, match="no audio input"):
        bare.soft_token_count(_clip(1_000))


def test_checkpoint_without_tower_weights_loads_as_text(tmp_path: Path) -> None:
    """mlx-lm's conversions keep the multimodal config.json (with `audio_config`) but drop the
    towers' weights: such a checkpoint loads as a text model that takes no audio."""
    from safetensors.torch import load_file, save_file

    path = save_hf(tiny_audio_model(seed=2), tmp_path)
    file = path / "model.safetensors"
    tensors = {k: v for k, v in load_file(file).items() if "audio" not in k}
    save_file(tensors, file, metadata={"format": "pt"})
    model = build_model(open_checkpoint(path), torch.float32, progress=False)
    assert model.audio_encoder() is None
    assert model.media_kinds == ()


def test_mlx_vlm_conv_layouts_load(tmp_path: Path) -> None:
    """mlx-vlm re-lays the tower's convolution weights channels-last ([out, kH, kW, in],
    [out, k, in]) and roots tensors without HF's `model.`: the reader puts them back, and
    the tower's output is HF's as from the HF layout."""
    from safetensors.torch import load_file, save_file

    hf = tiny_audio_model(seed=4)
    path = save_hf(hf, tmp_path)
    file = path / "model.safetensors"
    relaid = {}
    for name, tensor in load_file(file).items():
        if name.endswith(".conv.weight"):
            tensor = tensor.permute(0, 2, 3, 1)
        elif name.endswith("depthwise_conv1d.weight"):
            tensor = tensor.permute(0, 2, 1)
        if name.startswith("model.audio_tower.") or name.startswith("model.embed_audio."):
            name = name.removeprefix("model.")
        relaid[name] = tensor.contiguous()
    save_file(relaid, file, metadata={"format": "pt"})
    encoder = build_model(open_checkpoint(path), torch.float32, progress=False).audio_encoder()
    assert encoder is not None
    audio = _clip(16_000)
    torch.testing.assert_close(encoder.encode(audio), _hf_encode(hf, audio), atol=ATOL, rtol=0)
