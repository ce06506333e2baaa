"""Gemma 4's vision tower from a llama.cpp mmproj GGUF beside a Gemma 4 text GGUF, against HF
transformers' Gemma4ForConditionalGeneration on the same weights, in fp32.

The mmproj file is written here as llama.cpp's converter writes it (its Gemma 4 mmproj class):
HF names with `model.vision_tower.encoder.` read as `vision_model.model.` and `.linear.weight`
as `.weight`, then mapped by the `gguf` package's TensorNameMap for the MMPROJ architecture;
the patch embedding re-laid as a conv kernel [hidden, 3, p, p]; the clip scalars made 1-D;
norms, scalars and the position table in F32, matrices in the file type (F16 where a row is
not whole blocks). Hearth's reader has its own name table, so a name it reads differently from
the `gguf` package fails the load. The text model is written by Hearth's GGUF writer
(tests/models/test_gemma4_gguf.py checks it against llama.cpp).

Tolerances are those of tests/models/test_gemma4_vision.py, for the same computation (the
tower's weights are the HF checkpoint's exactly in an F32 file):
- tower soft tokens: 1e-6 absolute on values up to ~0.4 (HF runs the padded image, Hearth the
  real patches: fp32 sums in other orders; measured ~3e-7). A patch kernel re-laid in the wrong
  order or a clip scalar lost moves them by more than 1e-2.
- logits: 1.2e-4 absolute on logits up to ~24 (the multimodal HF path's bound). A causal mask
  where HF's is bidirectional moves them by 0.4 or more.
- a quantized mmproj (Q8_0, F16, BF16): every tensor equals the `gguf` package's dequantization
  of the stored bytes exactly (no tolerance).
- llama.cpp (mtmd, through llama-cpp-python) running the file written here: its soft tokens
  within 2e-2 of HF's largest |value| (LLAMA_RTOL below): the oracle that the file is laid out
  as llama.cpp's own converter lays it out.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hearth.checkpoint import open_checkpoint
from hearth.checkpoint.gguf_writer import minimal_tokenizer, write_gguf
from hearth.checkpoint.mmproj import MmprojFile
from hearth.config import parse_config
from hearth.engine import Engine
from hearth.errors import CheckpointError, UnsupportedModelError
from hearth.models.loading import build_model
from hearth.runtime.generate import soft_tokens
from hearth.runtime.runner import ModelRunner
from scripted_gemma4 import SPECIAL_IDS, template_path
from test_gemma4_audio import _clip, _hf_audio_logits, _hf_encode
from test_gemma4_vision import (
    BOI,
    EOI,
    IMAGE_TOKEN,
    VOCAB,
    _assert_hf_greedy,
    _cached_greedy,
    _hf_logits,
    _hf_model,
    _hf_tower,
    _image,
    _media,
    _pil,
    _prompt,
)
from tiny import FULL, PLE, SLIDING, TINY_VOCAB, randomise_gemma4, save_hf, tiny_gemma3_model

TOWER_ATOL = 1e-6
LOGITS_ATOL = 1.2e-4
CLIP_SUFFIXES = (".weight", ".bias", ".input_max", ".input_min", ".output_max", ".output_min")
TOWER_PREFIXES = ("vision_tower.", "embed_vision.", "audio_tower.", "embed_audio.")
# The audio model's vocabulary: the image model's, then the three audio tokens.
BOA, AUDIO_TOKEN, EOA = VOCAB, VOCAB + 1, VOCAB + 2
# llama.cpp's soft tokens against HF's on the same pixels, relative to the largest |value|:
# 7.0e-3 measured (ggml's kernels sum in their own order; flash attention on or off alike).
# A patch kernel with its rows and columns swapped moves them by 1.6e-1.
LLAMA_RTOL = 2e-2
# The same for audio clips, where llama.cpp computes its own log-mel features: 1.0e-3
# measured. per_dim_scale stored without the converter's softplus moves them by 1.6e-1.
LLAMA_AUDIO_RTOL = 1e-2
AUDIO_ATOL = 3e-6  # tests/models/test_gemma4_audio.py's tower bound (measured 7.2e-7 there)
HEARTH_GENERATE = [sys.executable, "-m", "hearth.cli", "generate"]


def write_mmproj(
    path: Path,
    hf: Any,
    matrix_type: str = "F32",
    projector: str = "gemma4v",
    kernel_order: tuple[int, ...] = (0, 3, 1, 2),
    softplus_scale: bool = True,
) -> dict[str, str]:
    """`hf`'s towers as llama.cpp's converter writes a Gemma 4 mmproj file (the audio tower
    too where `hf` has one); returns each written tensor's HF name (without `model.`) by its
    GGUF name. `kernel_order`: the permutation of the patch kernel [hidden, p, p, 3] (the
    converter's; another one makes a wrong file for llama.cpp to tell apart), `softplus_scale`
    (the converter's; off, another wrong file)."""
    vision, text = hf.config.vision_config, hf.config.text_config
    audio = hf.config.audio_config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_vision_projection_dim(text.hidden_size)
    writer.add_vision_image_size(224)  # the converter's placeholder: Gemma 4 sizes vary
    writer.add_vision_patch_size(vision.patch_size)
    writer.add_vision_embedding_length(vision.hidden_size)
    writer.add_vision_feed_forward_length(vision.intermediate_size)
    writer.add_vision_block_count(vision.num_hidden_layers)
    writer.add_vision_head_count(vision.num_attention_heads)
    writer.add_vision_image_mean([0.0, 0.0, 0.0])
    writer.add_vision_image_std([1.0, 1.0, 1.0])
    writer.add_clip_vision_projector_type(projector)
    writer.add_vision_attention_layernorm_eps(vision.rms_norm_eps)
    if audio is not None:
        writer.add_clip_has_audio_encoder(True)
        writer.add_audio_projection_dim(text.hidden_size)
        writer.add_audio_embedding_length(audio.hidden_size)
        writer.add_audio_feed_forward_length(audio.hidden_size * 4)
        writer.add_audio_block_count(audio.num_hidden_layers)
        writer.add_audio_head_count(audio.num_attention_heads)
        writer.add_clip_audio_projector_type("gemma4a")
        writer.add_audio_num_mel_bins(128)
        writer.add_audio_attention_layernorm_eps(1e-5)  # the converter's constant
    layers = max(vision.num_hidden_layers, audio.num_hidden_layers if audio else 0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, layers)
    written = {}
    for hf_name, tensor in hf.state_dict().items():
        if hf_name.startswith(("model.audio_tower.", "model.embed_audio.")):
            name, data, float_only = _audio_tensor(hf_name, tensor.detach().float())
            if name.endswith("per_dim_scale.weight") and not softplus_scale:
                data = tensor.detach().float()
        elif hf_name.startswith(("model.vision_tower.", "model.embed_vision.")):
            name, data = _vision_tensor(hf_name, tensor.detach().float(), kernel_order)
            float_only = "position_embedding_table" in hf_name
        else:
            continue
        mapped = names.get_name(name, try_suffixes=CLIP_SUFFIXES)
        assert mapped is not None, f"the gguf package does not map {name}"
        _add(writer, mapped, data.numpy(), "F32" if float_only else matrix_type)
        written[mapped] = hf_name.removeprefix("model.")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def _vision_tensor(
    hf_name: str, data: torch.Tensor, kernel_order: tuple[int, ...]
) -> tuple[str, torch.Tensor]:
    """The converter's name (before its map) and value of a vision tensor."""
    if data.ndim == 0:
        data = data.unsqueeze(0)
    name = hf_name.replace("model.vision_tower.encoder.", "vision_model.model.")
    name = name.replace(".linear.weight", ".weight")
    if name.endswith("position_embedding_table"):
        name += ".weight"
    if name.endswith("patch_embedder.input_proj.weight"):
        hidden, flat = data.shape
        side = int((flat // 3) ** 0.5)
        data = data.reshape(hidden, side, side, 3).permute(*kernel_order).contiguous()
    return name, data


def _audio_tensor(hf_name: str, data: torch.Tensor) -> tuple[str, torch.Tensor, bool]:
    """The converter's name (before its map), value, and whether it forces F32."""
    if data.ndim == 0:
        data = data.unsqueeze(0)
    name = hf_name.replace("model.audio_tower.", "conformer.").replace(".linear.", ".")
    if name.endswith("per_dim_scale"):
        name += ".weight"
        data = torch.nn.functional.softplus(data)
    if "lconv1d.depthwise_conv1d" in name and name.endswith(".weight"):
        data = data.reshape(data.shape[0], data.shape[2])
    float_only = ".conv" in hf_name or ("_conv" in hf_name and ".weight" in hf_name)
    return name, data, float_only


def _add(writer: Any, name: str, values: np.ndarray, matrix_type: str) -> None:
    """F32 for 1-D tensors (and those the caller says the converter forces), the file type
    for matrices whose rows are whole blocks, else F16 (F32 in an F32 file)."""
    kind = gguf.GGMLQuantizationType[matrix_type]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if values.ndim <= 1 or kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif values.shape[-1] % block:
        writer.add_tensor(name, values.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)


def _vocabulary(size: int) -> list[str]:
    """Gemma 4's specials, image and audio tokens at the HF models' ids; plain tokens
    elsewhere."""
    tokens = [f"t{i}" for i in range(size)]
    media = {"<|image>": BOI, "<|image|>": IMAGE_TOKEN, "<image|>": EOI}
    media |= {"<|audio>": BOA, "<|audio|>": AUDIO_TOKEN, "<audio|>": EOA}
    for token, index in {**SPECIAL_IDS, **media}.items():
        if index < size:
            tokens[index] = token
    return tokens


def write_text_gguf(hf: Any, directory: Path) -> Path:
    """The text decoder of `hf` as a Gemma 4 GGUF (F32), with the real chat template."""
    checkpoint = open_checkpoint(save_hf(hf, directory / "hf"))
    tensors = {
        name: tensor for name, tensor in checkpoint.tensors() if not name.startswith(TOWER_PREFIXES)
    }
    tokenizer = {
        **minimal_tokenizer(_vocabulary(hf.config.text_config.vocab_size)),
        "tokenizer.chat_template": template_path().read_text(),
    }
    path = directory / "model.gguf"
    return write_gguf(path, checkpoint.config, tensors, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def causal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """E2B's shape: PLE, causal images; finite clips binding, standardization, k_eq_v full
    layers twice as wide as sliding ones. (HF model, text GGUF, F32 mmproj)."""
    directory = tmp_path_factory.mktemp("causal")
    hf = _hf_model(**PLE, use_bidirectional_attention=None, layer_types=[SLIDING, FULL] * 2)
    write_mmproj(directory / "mmproj.gguf", hf)
    return hf, write_text_gguf(hf, directory), directory / "mmproj.gguf"


@pytest.fixture(scope="module")
def bidirectional(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    """26B/31B's shape: no PLE, images bidirectional on sliding layers; a text width (48)
    other than the causal model's (64)."""
    directory = tmp_path_factory.mktemp("bidirectional")
    hf = _hf_model(hidden_size=48, use_bidirectional_attention="vision")
    write_mmproj(directory / "mmproj.gguf", hf)
    return hf, write_text_gguf(hf, directory), directory / "mmproj.gguf"


def _load(text: Path, mmproj: Path | None) -> Any:
    return build_model(open_checkpoint(text, mmproj), torch.float32, progress=False)


def test_config_and_tensors_equal_the_hf_checkpoint(causal: tuple[Any, Path, Path]) -> None:
    """The tower's config from the mmproj metadata and shapes is the one Hearth reads from the
    HF checkpoint, and every tensor is HF's, value for value (an F32 file)."""
    hf, text, mmproj = causal
    joined = open_checkpoint(text, mmproj)
    parsed = parse_config(joined.config)
    reference = parse_config(hf.config.to_dict())
    assert parsed.vision == reference.vision
    assert parsed.bidirectional_vision is False
    state = {name.removeprefix("model."): t for name, t in hf.state_dict().items()}
    tower = dict(MmprojFile(mmproj).tensors())
    assert set(tower) == {name for name in state if name.startswith(TOWER_PREFIXES)}
    for name, values in tower.items():
        assert torch.equal(values, state[name]), name


@pytest.mark.parametrize(("size", "budget"), [((40, 28), 70), ((25, 70), 140)])
def test_tower_equals_hf(causal: tuple[Any, Path, Path], size: Any, budget: int) -> None:
    hf, text, mmproj = causal
    model = _load(text, mmproj)
    image = _image(*size, budget=budget)
    with torch.inference_mode():
        soft = model.embed_media(image).embeddings
    reference = _hf_tower(hf, image, budget)
    assert soft.shape == reference.shape
    torch.testing.assert_close(soft, reference, atol=TOWER_ATOL, rtol=0)


@pytest.mark.parametrize("fixture", ["causal", "bidirectional"])
def test_image_prompt_logits_equal_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    """Two images in a prompt prefilled in chunks of 16, then 10 greedy decode steps: the
    tokens are HF's greedy picks and every logit equals HF's forward over prompt and reply.
    The causal model (PLE) and the bidirectional one (no PLE) tell the mask rule apart."""
    hf, text, mmproj = request.getfixturevalue(fixture)
    model = _load(text, mmproj)
    assert model.config.bidirectional_vision is (fixture == "bidirectional")
    images = [_image(40, 28, seed=1, budget=70), _image(17, 30, seed=2, budget=70)]
    ids, spans = _prompt(model, images)
    runner = ModelRunner(model)
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
    tokens, rows = _cached_greedy(runner, ids, soft, 16)
    reference = _hf_logits(hf, ids + tokens, images)
    _assert_hf_greedy(reference, len(ids), tokens)
    torch.testing.assert_close(rows, reference[len(ids) - 1 :], atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("matrix_type", ["Q8_0", "F16", "BF16"])
def test_quantized_mmproj_dequantizes_exactly(
    causal: tuple[Any, Path, Path], tmp_path: Path, matrix_type: str
) -> None:
    """Each tensor of a quantized mmproj equals the `gguf` package's reading of the stored
    bytes (its own reader and dequantizer), put back in HF's layout by the converter's
    inverse; the loaded model holds those values."""
    hf, text, _ = causal
    path = tmp_path / f"mmproj-{matrix_type}.gguf"
    hf_names = write_mmproj(path, hf, matrix_type)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    assert matrix_type in {t.tensor_type.name for t in stored.values()}
    read = dict(MmprojFile(path).tensors())
    assert set(read) == set(hf_names.values())
    parameters = dict(_load(text, path).named_parameters())
    for name, tensor in stored.items():
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        shape = tuple(int(d) for d in reversed(tensor.shape))
        values = values.reshape(shape)
        if name == "v.patch_embd.weight":
            values = values.permute(0, 2, 3, 1).reshape(shape[0], -1)
        if name.endswith(("_min", "_max")):
            values = values.reshape(())
        canonical = hf_names[name]
        assert torch.equal(read[canonical], values), name
        assert torch.equal(parameters[canonical].detach(), values), name


def test_an_mmproj_of_another_projector_is_refused(
    causal: tuple[Any, Path, Path], tmp_path: Path
) -> None:
    hf, text, _ = causal
    write_mmproj(tmp_path / "mmproj-gemma3.gguf", hf, projector="gemma3")
    with pytest.raises(UnsupportedModelError, match="projector type 'gemma3' is not supported"):
        open_checkpoint(text, tmp_path / "mmproj-gemma3.gguf")


def test_a_tower_of_another_width_is_refused(
    causal: tuple[Any, Path, Path], bidirectional: tuple[Any, Path, Path]
) -> None:
    """The 48-wide model's tower into the 64-wide text model: named before any tensor is read."""
    _, text, _ = causal
    _, _, other = bidirectional
    with pytest.raises(CheckpointError, match=r"projects into 48 dims.*hidden size is 64"):
        open_checkpoint(text, other)


def test_a_text_only_architecture_is_refused(
    causal: tuple[Any, Path, Path], tmp_path: Path
) -> None:
    """A Gemma 3 GGUF (text only in Hearth) with a Gemma 4 tower; the mmproj file given as the
    model; an mmproj beside a safetensors checkpoint."""
    _, _, mmproj = causal
    gemma3 = open_checkpoint(save_hf(tiny_gemma3_model(), tmp_path / "gemma3"))
    path = write_gguf(tmp_path / "gemma3.gguf", gemma3.config, dict(gemma3.tensors()), TINY_VOCAB)
    with pytest.raises(UnsupportedModelError, match="is a gemma3 model, which Hearth runs as text"):
        open_checkpoint(path, mmproj)
    with pytest.raises(UnsupportedModelError, match=r"is an mmproj file.*--mmproj"):
        open_checkpoint(mmproj)
    with pytest.raises(CheckpointError, match="--mmproj goes with a GGUF model file"):
        open_checkpoint(tmp_path / "gemma3", mmproj)


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    command = [*HEARTH_GENERATE, *args, "--max-tokens", "3"]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def png(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("image") / "x.png"
    _pil(40, 28, seed=3).save(path)
    return path


def test_cli_takes_an_image_with_mmproj_and_from_a_sibling(
    causal: tuple[Any, Path, Path], png: Path, tmp_path: Path
) -> None:
    """`hearth generate model.gguf --mmproj mmproj.gguf --image x.png`; then the same folder
    laid out as LM Studio does (one mmproj*.gguf beside the model): picked up, and said so."""
    _, text, mmproj = causal
    given = _generate(str(text), "--mmproj", str(mmproj), "--image", str(png), "What is it?")
    assert given.returncode == 0, given.stderr
    assert "generation: 3 tokens" in given.stderr
    folder = tmp_path / "lmstudio"
    folder.mkdir()
    (folder / "model-F32.gguf").symlink_to(text)
    (folder / "mmproj-model-F32.gguf").symlink_to(mmproj)
    found = _generate(str(folder / "model-F32.gguf"), "--image", str(png), "What is it?")
    assert found.returncode == 0, found.stderr
    assert "using mmproj-model-F32.gguf, found beside the model, for image input" in found.stderr
    assert found.stdout == given.stdout  # greedy: the same tokens either way


def test_cli_refuses_a_tower_that_does_not_fit(
    causal: tuple[Any, Path, Path], bidirectional: tuple[Any, Path, Path], png: Path
) -> None:
    _, text, _ = causal
    _, _, other = bidirectional
    result = _generate(str(text), "--mmproj", str(other), "--image", str(png), "What is it?")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not fit model.gguf" in lines[0], result.stderr


def _hf_audio_visual_model() -> Any:
    """E2B's shape with both towers: the vision model of test_gemma4_vision plus a two-layer
    audio tower whose clips bind and whose per_dim_scale is random. The audio fields an mmproj
    does not store (chunking, logit cap 50) keep HF's defaults, as llama.cpp fixes them."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration

    vision = _hf_model(**PLE, use_bidirectional_attention=None)
    text = vision.config.text_config.to_dict() | {
        "vocab_size": VOCAB + 3,
        "vocab_size_per_layer_input": VOCAB + 3,
    }
    audio = Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        subsampling_conv_channels=[128, 8],  # HF sizes its projection from 128 / 4
        output_proj_dims=24,
    )
    config = Gemma4Config(
        text_config=text,
        vision_config=vision.config.vision_config.to_dict(),
        audio_config=audio.to_dict(),
        image_token_id=IMAGE_TOKEN,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        audio_token_id=AUDIO_TOKEN,
        boa_token_id=BOA,
        eoa_token_index=EOA,
    )
    torch.manual_seed(7)
    model = Gemma4ForConditionalGeneration(config).eval()
    randomise_gemma4(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        own = vision.state_dict()
        for name, tensor in model.state_dict(keep_vars=True).items():
            if "vision" in name:
                tensor.copy_(own[name])  # the vision test's clips, standardization, table
            elif "audio" not in name:
                continue
            elif name.endswith("per_dim_scale"):
                tensor.normal_(0.0, 1.0, generator=generator)
            elif name.endswith(("_min", "_max")):
                bound = torch.empty(()).uniform_(0.6, 1.2, generator=generator).item()
                bound *= 2 if "input" in name else 1
                tensor.fill_(bound if name.endswith("max") else -bound)
            elif name.endswith(("linear.weight", "relative_k_proj.weight", "projection.weight")):
                tensor.normal_(0.0, 0.2, generator=generator)
    return model


@pytest.fixture(scope="module")
def audio_visual(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, Path]:
    directory = tmp_path_factory.mktemp("audio_visual")
    hf = _hf_audio_visual_model()
    write_mmproj(directory / "mmproj.gguf", hf)
    return hf, write_text_gguf(hf, directory), directory / "mmproj.gguf"


def test_audio_tower_config_and_output_equal_hf(audio_visual: tuple[Any, Path, Path]) -> None:
    """The audio tower of an E2B-shaped mmproj: the config Hearth reads from the HF checkpoint,
    every tensor HF's (per_dim_scale as the value whose softplus is the stored one, bit for
    bit), and soft tokens within AUDIO_ATOL of HF's for clips of 4 and 25 soft tokens."""
    hf, text, mmproj = audio_visual
    joined = parse_config(open_checkpoint(text, mmproj).config)
    assert joined.audio == parse_config(hf.config.to_dict()).audio
    state = {name.removeprefix("model."): t for name, t in hf.state_dict().items()}
    for name, values in MmprojFile(mmproj).tensors():
        if name.endswith("per_dim_scale"):
            values, expected = F.softplus(values), F.softplus(state[name])
        else:
            expected = state[name]
        assert torch.equal(values, expected), name
    encoder = _load(text, mmproj).audio_encoder()
    for length in (2_500, 16_000):
        clip = _clip(length)
        reference = _hf_encode(hf, clip)
        assert encoder.soft_tokens(clip) == reference.shape[0]
        torch.testing.assert_close(encoder.encode(clip), reference, atol=AUDIO_ATOL, rtol=0)


def test_audio_prompt_logits_equal_hf(audio_visual: tuple[Any, Path, Path]) -> None:
    """A prompt with a clip, prefilled in chunks of 16 (one ends inside the clip), then 10
    greedy decode steps: HF's greedy tokens, and every logit within LOGITS_ATOL of HF's."""
    hf, text, mmproj = audio_visual
    model = _load(text, mmproj)
    clips = [_clip(9_000)]
    ids = [2, 105, *range(120, 126), 10, AUDIO_TOKEN, 10, 130, 106, 105, 140, 141]
    ids, spans = model.expand_media(ids, clips)
    runner = ModelRunner(model)
    with torch.inference_mode():
        soft = soft_tokens(runner, _media(spans))
    tokens, rows = _cached_greedy(runner, ids, soft, 16)
    reference = _hf_audio_logits(hf, ids + tokens, clips)
    _assert_hf_greedy(reference, len(ids), tokens)
    torch.testing.assert_close(rows, reference[len(ids) - 1 :], atol=LOGITS_ATOL, rtol=0)


def _llama_soft_tokens(text: Path, mmproj: Path, media: np.ndarray) -> torch.Tensor:
    """llama.cpp's (mtmd's) soft tokens [n, hidden] for an 8-bit RGB image [h, w, 3] or a clip
    of 16 kHz float32 samples [n]."""
    pytest.importorskip("llama_cpp")
    mtmd = pytest.importorskip("llama_cpp.mtmd_cpp")
    from hearth.bench.llama_peer import open_llama

    llama = open_llama(text, n_ctx=256, verbose=False)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 2, False, False
    context = mtmd.mtmd_init_from_file(str(mmproj).encode(), llama.model, params)
    assert context, "llama.cpp could not load the mmproj file"
    media = np.array(media)  # a writable copy that ctypes can point into
    if media.dtype == np.uint8:
        height, width, _ = media.shape
        data = (ctypes.c_uint8 * media.size).from_buffer(media)
        bitmap = mtmd.mtmd_bitmap_init(width, height, data)
        kind = mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE
    else:
        samples = (ctypes.c_float * media.size).from_buffer(media)
        bitmap = mtmd.mtmd_bitmap_init_from_audio(media.size, samples)
        kind = mtmd.MTMD_INPUT_CHUNK_TYPE_AUDIO
    chunks = mtmd.mtmd_input_chunks_init()
    marker = mtmd.mtmd_default_marker()
    prompt = mtmd.mtmd_input_text(marker, len(marker), False, True)
    try:
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        assert mtmd.mtmd_tokenize(context, chunks, ctypes.byref(prompt), bitmaps, 1) == 0
        parts = [
            mtmd.mtmd_input_chunks_get(chunks, i)
            for i in range(mtmd.mtmd_input_chunks_size(chunks))
        ]
        (chunk,) = [part for part in parts if mtmd.mtmd_input_chunk_get_type(part) == kind]
        assert mtmd.mtmd_encode_chunk(context, chunk) == 0
        count = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
        width_out = llama.n_embd()
        out = mtmd.mtmd_get_output_embd(context)
        values = np.ctypeslib.as_array(out, shape=(count * width_out,)).copy()
    finally:
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_free(context)
        llama.close()
    return torch.from_numpy(values).reshape(count, width_out)


def _hf_soft_tokens_of_pixels(hf: Any, pixels: np.ndarray) -> torch.Tensor:
    """HF's tower on the image's own pixels, cut into patches as its processor cuts them
    (rows of patches; within a patch rows, then columns, then channels), not resized."""
    side = hf.config.vision_config.patch_size
    height, width, _ = pixels.shape
    rows, columns = height // side, width // side
    patches = pixels.reshape(rows, side, columns, side, 3).transpose(0, 2, 1, 3, 4)
    values = torch.from_numpy(patches.reshape(1, rows * columns, -1).astype(np.float32) / 255)
    ys, xs = np.mgrid[0:rows, 0:columns]
    positions = torch.from_numpy(np.stack([xs.reshape(-1), ys.reshape(-1)], -1))[None]
    with torch.no_grad():
        return hf.model.get_image_features(values, positions, return_dict=True).pooler_output[0]


def test_llama_cpp_runs_the_mmproj_as_hf_runs_the_tower(
    causal: tuple[Any, Path, Path], tmp_path: Path
) -> None:
    """llama.cpp reads the file written here as its converter would and computes HF's soft
    tokens from it: the layout Hearth reads is llama.cpp's. The image is 120x96, a size
    llama.cpp keeps (80 soft tokens, within its limits), so both see the same pixels; the
    same file with the patch kernel's rows and columns swapped is told apart."""
    hf, text, mmproj = causal
    pixels = np.asarray(_pil(120, 96, seed=3))
    reference = _hf_soft_tokens_of_pixels(hf, pixels)
    bound = LLAMA_RTOL * reference.abs().max()
    ours = _llama_soft_tokens(text, mmproj, pixels)
    assert ours.shape == reference.shape == (80, hf.config.text_config.hidden_size)
    assert (ours - reference).abs().max() <= bound
    wrong = tmp_path / "mmproj-swapped.gguf"
    write_mmproj(wrong, hf, kernel_order=(0, 3, 2, 1))
    assert (_llama_soft_tokens(text, wrong, pixels) - reference).abs().max() > 3 * bound


def test_llama_cpp_runs_the_audio_tower_as_hf_runs_it(
    audio_visual: tuple[Any, Path, Path], tmp_path: Path
) -> None:
    """The audio tower of the file written here: llama.cpp's soft tokens for a 1 s clip (its
    own features) are HF's; a file with per_dim_scale stored without softplus is told apart."""
    hf, text, mmproj = audio_visual
    clip = _clip(16_000)
    reference = _hf_encode(hf, clip)
    bound = LLAMA_AUDIO_RTOL * reference.abs().max()
    ours = _llama_soft_tokens(text, mmproj, clip.samples.astype(np.float32))
    assert ours.shape == reference.shape == (25, hf.config.text_config.hidden_size)
    assert (ours - reference).abs().max() <= bound
    wrong = tmp_path / "mmproj-raw-scale.gguf"
    write_mmproj(wrong, hf, softplus_scale=False)
    ours_wrong = _llama_soft_tokens(text, wrong, clip.samples.astype(np.float32))
    assert (ours_wrong - reference).abs().max() > 3 * bound


def test_engine_modalities_follow_the_mmproj_beside_the_model(
    audio_visual: tuple[Any, Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The E2B-shaped mmproj gives images and audio, given or found beside the model; a model
    file alone takes text; with two mmproj files beside it none is taken, and the log says so."""
    _, text, mmproj = audio_visual
    given = Engine.load(text, mmproj=mmproj, progress=False)
    assert given.modalities == ("text", "image", "audio")
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "model.gguf").symlink_to(text)
    assert Engine.load(alone / "model.gguf", progress=False).modalities == ("text",)
    (alone / "mmproj-a.gguf").symlink_to(mmproj)
    found = Engine.load(alone / "model.gguf", progress=False)
    assert found.modalities == ("text", "image", "audio")
    (alone / "mmproj-b.gguf").symlink_to(mmproj)
    with caplog.at_level(logging.WARNING, logger="hearth.checkpoint"):
        assert Engine.load(alone / "model.gguf", progress=False).modalities == ("text",)
    assert "several mmproj files beside the model (mmproj-a.gguf, mmproj-b.gguf)" in caplog.text
