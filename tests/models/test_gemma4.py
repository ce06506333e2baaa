"""Tiny random Gemma 4 checkpoints on disk, loaded through Hearth's readers, against HF logits.

Tolerance: 5e-5 absolute on fp32 logits of magnitude up to ~25 (std ~4), i.e. ~2e-6 relative,
a dozen fp32 ulps. The uncached forward runs HF's ops in HF's order and matches bit for bit;
cached prefill and decode attend over padded or ring-ordered K/V, a different summation order.
Attention has scale 1 on normed q/k (scores reach ~±20, no 1/√d damping), so softmax amplifies
those last-bit differences more than in Gemma 3 (measured max 2.9e-5, KV sharing). A
wrong RoPE rotation, sliding window edge or V norm moves logits by more than 1.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hearth.checkpoint import open_checkpoint
from hearth.config import Gemma4Config, parse_config
from hearth.errors import CheckpointError, UnsupportedModelError
from hearth.kv import make_caches
from hearth.kv.footprint import KVFootprint
from hearth.models import cache_specs
from hearth.models.gemma4 import Gemma4Model
from hearth.models.loading import build_model
from hearth.models.presets import GEMMA4_PRESETS
from hearth.runtime.generate import GenerationStats, generate_tokens
from hearth.runtime.sampling import Sampler, SamplingParams
from tiny import (
    FULL,
    K_EQ_V,
    MOE,
    PLE,
    SLIDING,
    TINY_VOCAB,
    randomise_gemma4,
    save_hf,
    tiny_gemma4_config,
    tiny_gemma4_model,
)

ATOL = 5e-5
# The multimodal checkpoint goes through HF's Gemma4ForConditionalGeneration, whose text path
# differs most from Hearth's chunked-and-cached one in fp32 op order: 5.8e-5 measured (3.1e-6
# of its largest logit, 19; AMD EPYC, 2026-12-03) where the CausalLM comparisons here stay
# within 3.4e-5. Twice that measured value; a real error (a wrong scale, mask or weight) moves
# logits by 1e-2 or more.
MULTIMODAL_ATOL = 1.2e-4
PROMPT, TOTAL = 30, 50  # prompt longer than the sliding window of 8, then 20 decode steps

# HF needs PLE on for KV sharing. Owners: 0-3 (sliding donor 3, full donor 2); sharers 4, 5.
SHARING = {
    **PLE,
    "num_hidden_layers": 6,
    "num_kv_shared_layers": 2,
    "layer_types": [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
}
# Double width exists only on sharing layers: 3, 4, 5 here.
DOUBLE_WIDE = {
    **SHARING,
    "num_kv_shared_layers": 3,
    "use_double_wide_mlp": True,
    "layer_types": [SLIDING, FULL, SLIDING, SLIDING, FULL, FULL],
}
CONFIGS: dict[str, dict[str, Any]] = {
    "windows": {},  # mixed sliding/full layers, window 8 < prompt
    "ple": PLE,
    "kv_sharing": SHARING,
    "ple_sharing_double_wide": DOUBLE_WIDE,
    "k_eq_v": K_EQ_V,
    "moe": MOE,
    "k_eq_v_moe": {**K_EQ_V, **MOE},
}

Checkpoints = Callable[[str], tuple[Any, Path]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """The HF model and its saved directory for a config of CONFIGS, each built once."""
    built: dict[str, tuple[Any, Path]] = {}

    def get(name: str) -> tuple[Any, Path]:
        if name not in built:
            hf = tiny_gemma4_model(seed=list(CONFIGS).index(name), **CONFIGS[name])
            built[name] = hf, save_hf(hf, tmp_path_factory.mktemp(name))
        return built[name]

    return get


def _ids(length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, len(TINY_VOCAB), (1, length), generator=generator)
    ids[0, 0] = 2
    return ids


def _hf_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _hearth(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    return build_model(open_checkpoint(path), dtype, progress=False)


def _cached_logits(model: Any, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Prefill of PROMPT tokens in chunks, then one cached decode step per remaining token."""
    caches = make_caches(model.cache_specs())
    pieces = []
    with torch.inference_mode():
        for start in range(0, PROMPT, chunk):
            pieces.append(model(ids[:, start : min(start + chunk, PROMPT)], caches, start=start))
        for position in range(PROMPT, ids.shape[1]):
            pieces.append(model(ids[:, position : position + 1], caches, start=position))
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_prefill_and_decode_match_hf(checkpoints: Checkpoints, name: str) -> None:
    hf, path = checkpoints(name)
    model = _hearth(path)
    ids = _ids(TOTAL)
    reference = _hf_logits(hf, ids)
    with torch.inference_mode():
        full = model(ids)
        last = model(ids[:, :PROMPT], make_caches(model.cache_specs()), last_only=True)
    torch.testing.assert_close(full, reference, atol=ATOL, rtol=0)
    torch.testing.assert_close(last[:, 0], reference[:, PROMPT - 1], atol=ATOL, rtol=0)
    cached = _cached_logits(model, ids, chunk=13)
    torch.testing.assert_close(cached, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("chunk", [5, 30])
def test_sharers_read_donor_caches_across_prefill_chunks(
    checkpoints: Checkpoints, chunk: int
) -> None:
    """Chunks shorter than the window and one longer: donors' ring caches seen from sharers."""
    hf, path = checkpoints("kv_sharing")
    model = _hearth(path)
    ids = _ids(TOTAL, seed=2)
    assert len(make_caches(model.cache_specs())) == 4  # sharing layers 4 and 5 own no cache
    reference = _hf_logits(hf, ids)
    torch.testing.assert_close(_cached_logits(model, ids, chunk), reference, atol=ATOL, rtol=0)


def test_greedy_generation_follows_hf_argmax(checkpoints: Checkpoints) -> None:
    """generate.py unchanged: chunked last-only prefill, then cached decode of 20 tokens."""
    hf, path = checkpoints("ple_sharing_double_wide")
    model = _hearth(path)
    prompt = _ids(PROMPT, seed=3)[0].tolist()
    sampler = Sampler(SamplingParams(), device=model.device)
    produced = list(generate_tokens(model, prompt, sampler, 20, GenerationStats(), prefill_step=7))
    reference = _hf_logits(hf, torch.tensor([prompt + produced]))
    assert produced == reference[0, PROMPT - 1 : -1].argmax(dim=-1).tolist()


def test_generation_refuses_prompt_ids_outside_the_vocabulary(checkpoints: Checkpoints) -> None:
    """The GPU's embedding kernels read a table's rows unchecked, so ids are checked first."""
    model = _hearth(checkpoints("ple_sharing_double_wide")[1])
    sampler = Sampler(SamplingParams(), device=model.device)
    for bad in (model.config.vocab_size, -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary"):
            next(generate_tokens(model, [1, bad, 2], sampler, 4, GenerationStats()))


@pytest.mark.parametrize("name", ["kv_sharing", "k_eq_v_moe"])
def test_bf16_runs_close_to_fp32(checkpoints: Checkpoints, name: str) -> None:
    """bf16 keeps 8 bits of mantissa: logits within 5% of the fp32 logit range.

    The cached path takes the CPU's half-precision decode attention, on donor views too; a few
    steps suffice (CPU bf16 kernels are slow to warm up per shape).
    """
    hf, path = checkpoints(name)
    ids = _ids(PROMPT + 4)
    low = _cached_logits(_hearth(path, torch.bfloat16), ids, chunk=13).float()
    reference = _hf_logits(hf, ids)
    assert (low - reference).abs().max() < 0.05 * reference.abs().max()


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))


def _plain_fields_dialect(config: dict[str, Any]) -> None:
    """Older HF / MLX form: top-level global widths instead of HF 5's per-layer overrides."""
    full_layer = config.pop("per_layer_config")["1"]
    config["global_head_dim"] = full_layer["head_dim"]
    config["num_global_key_value_heads"] = full_layer["num_key_value_heads"]


def test_both_config_dialects_give_one_model(checkpoints: Checkpoints, tmp_path: Path) -> None:
    hf, path = checkpoints("k_eq_v")
    per_layer = open_checkpoint(path).config
    assert per_layer["per_layer_config"]["1"] == {"head_dim": 32, "num_key_value_heads": 1}
    plain = save_hf(hf, tmp_path)
    _edit_config(plain, _plain_fields_dialect)
    config = parse_config(open_checkpoint(plain).config)
    assert config == parse_config(per_layer)
    assert (config.global_head_dim, config.num_global_key_value_heads) == (32, 1)
    ids = _ids(TOTAL)
    torch.testing.assert_close(
        _cached_logits(_hearth(plain), ids, chunk=13), _hf_logits(hf, ids), atol=ATOL, rtol=0
    )


def test_double_wide_mlp_is_read_from_the_weights(checkpoints: Checkpoints, tmp_path: Path) -> None:
    """A config without `use_double_wide_mlp`: the sharing layers' MLP shapes decide."""
    hf, original = checkpoints("ple_sharing_double_wide")
    path = Path(shutil.copytree(original, tmp_path / "copy"))
    _edit_config(path, lambda config: config.pop("use_double_wide_mlp"))
    assert open_checkpoint(path).config["use_double_wide_mlp"] is True
    ids = _ids(TOTAL)
    torch.testing.assert_close(_hearth(path)(ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def _tiny_multimodal(text_overrides: dict[str, Any]) -> Any:
    """Gemma4ForConditionalGeneration with one-layer vision and audio towers."""
    from transformers import (
        Gemma4AudioConfig,
        Gemma4Config,
        Gemma4ForConditionalGeneration,
        Gemma4VisionConfig,
    )

    vision = Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        position_embedding_size=64,
    )
    audio = Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        subsampling_conv_channels=[4, 4],
        output_proj_dims=32,
    )
    config = Gemma4Config(
        text_config=tiny_gemma4_config(**text_overrides).to_dict(),
        vision_config=vision.to_dict(),
        audio_config=audio.to_dict(),
    )
    torch.manual_seed(7)
    model = Gemma4ForConditionalGeneration(config).eval()
    randomise_gemma4(model)
    return model


def _add_sharer_kv_weights(path: Path) -> None:
    """Google's releases keep k_proj/v_proj/k_norm on sharing layers; HF's save drops them."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    prefix = "model.language_model.layers"
    for layer in (4, 5):
        head_dim = 16 if layer == 4 else 32
        for name, shape in (("k_proj", (2 * head_dim, 64)), ("v_proj", (2 * head_dim, 64))):
            tensors[f"{prefix}.{layer}.self_attn.{name}.weight"] = torch.randn(shape)
        tensors[f"{prefix}.{layer}.self_attn.k_norm.weight"] = torch.randn(head_dim)
    save_file(tensors, file, metadata={"format": "pt"})


def test_multimodal_checkpoint_skips_audio_tower_and_sharer_kv(tmp_path: Path) -> None:
    hf = _tiny_multimodal(SHARING)
    path = save_hf(hf, tmp_path)
    _add_sharer_kv_weights(path)
    names = load_file(path / "model.safetensors").keys()
    assert any(name.startswith("model.audio_tower.") for name in names)
    outer = json.loads((path / "config.json").read_text())
    assert outer["model_type"] == "gemma4"
    assert parse_config(outer) == parse_config(open_checkpoint(path).config)
    ids = _ids(TOTAL)
    torch.testing.assert_close(
        _cached_logits(_hearth(path), ids, chunk=13),
        _hf_logits(hf, ids),
        atol=MULTIMODAL_ATOL,
        rtol=0,
    )


def _set(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda config: config.__setitem__(field, value)


BAD_CONFIGS = {
    "mlp width": (_set("intermediate_size", 80), r"'layers\.\d\.mlp\.\w+\.weight' has shape"),
    "global head_dim": (
        lambda c: (_plain_fields_dialect(c), c.__setitem__("global_head_dim", 64)),
        r"'layers\.[13]\.self_attn\.[\w.]+' has shape",
    ),
    "model type": (_set("model_type", "gemma5_text"), "'gemma5_text' is not supported"),
    "missing field": (
        lambda c: c.pop("num_attention_heads"),
        "lacks the field 'num_attention_heads'",
    ),
    "moe without experts": (_set("enable_moe_block", True), "lacks the field 'num_experts'"),
    "sharer without donor": (
        _set("num_kv_shared_layers", 3),
        r"layer 1 \(full_attention\) has no earlier layer of its type",
    ),
    "per-layer override on a sliding layer": (
        lambda c: c["per_layer_config"].__setitem__("0", {"head_dim": 32}),
        "must override every full-attention layer alike",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_is_one_clear_error(checkpoints: Checkpoints, tmp_path: Path, name: str) -> None:
    hf, _ = checkpoints("k_eq_v")
    path = save_hf(hf, tmp_path)
    edit, message = BAD_CONFIGS[name]
    _edit_config(path, edit)
    with pytest.raises(CheckpointError, match=message):
        _hearth(path)


def test_unknown_model_type_is_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match=r"supported: .*gemma4_text"):
        parse_config({"model_type": "gemma4_vision"})


def _meta_model(preset: str) -> tuple[Gemma4Config, Gemma4Model]:
    config = parse_config(GEMMA4_PRESETS[preset])
    assert isinstance(config, Gemma4Config)
    with torch.device("meta"):
        return config, Gemma4Model(config)


def _last_owner(config: Gemma4Config, kind: str) -> int:
    types = config.cache_layer_types
    return len(types) - 1 - types[::-1].index(kind)


def _qkv(model: Gemma4Model, layer: int) -> dict[str, int]:
    return model.layers[layer].self_attn.qkv_proj.parts


def test_presets_have_the_released_shapes() -> None:
    config, e2b = _meta_model("e2b")
    assert e2b.embed_tokens_per_layer.weight.shape == (262_144, 35 * 256)
    assert (config.mlp_width(14), config.mlp_width(15)) == (6144, 12288)
    assert len(make_caches(cache_specs(config))) == 15
    assert (_last_owner(config, SLIDING), _last_owner(config, FULL)) == (13, 14)
    assert _qkv(e2b, 15) == {"q_proj": 8 * 256}
    config, e4b = _meta_model("e4b")
    assert e4b.embed_tokens_per_layer.weight.shape == (262_144, 42 * 256)
    assert len(make_caches(cache_specs(config))) == 24
    assert (_last_owner(config, SLIDING), _last_owner(config, FULL)) == (22, 23)
    _, moe = _meta_model("26b-a4b")
    assert moe.layers[0].experts.gate_up_proj.shape == (128, 2 * 704, 2816)
    assert _qkv(moe, 5) == {"q_proj": 16 * 512, "k_proj": 2 * 512}
    assert _qkv(moe, 0) == {"q_proj": 16 * 256, "k_proj": 8 * 256, "v_proj": 8 * 256}
    config, dense = _meta_model("31b")
    assert _qkv(dense, 59) == {"q_proj": 32 * 512, "k_proj": 4 * 512}
    dense_token = sum(
        layer.dense for layer in KVFootprint.of(cache_specs(config), torch.bfloat16).layers
    )
    assert dense_token == 2 * 2 * (50 * 16 * 256 + 10 * 4 * 512)  # 50 sliding, 10 full layers
    _, unified = _meta_model("12b")
    assert _qkv(unified, 47) == {"q_proj": 16 * 512, "k_proj": 512}
