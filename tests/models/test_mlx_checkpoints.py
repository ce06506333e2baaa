"""MLX-format checkpoints written by mlx-lm's own converter, loaded by Hearth, against mlx-lm.

Tiny random Gemma 3 models are saved by HF transformers, converted by `mlx_lm.convert`
(quantized with per-module bits through a `quant_predicate`, or not) and run by both mlx-lm
(`mlx_lm.load`) and Hearth on the same directory.

Weights: every packed module Hearth builds dequantizes to exactly `mx.dequantize` of mlx-lm's
module (torch.equal), stacked projections included.

Logits, fp32 on both sides, ATOL 1e-5 on logits up to ~0.7: the weights are bit-identical, so
what differs is summation order (mlx's quantized matmul, rms_norm and attention kernels vs
torch's), a few fp32 ulps per op; measured <= 1.1e-6 over the variants. Quantizing itself
moves these logits by 0.17, and a wrong bit layout scrambles them entirely.

Logits, bf16 on both sides: mlx's CPU quantized matmul accumulates in bf16 (on one 96-wide
layer it errs by 2.5% of its largest output, mx.matmul by 0.26%), so mlx-lm's bf16 logits sit
8.1% of the logit range from an fp32 evaluation of the same weights, and Hearth's (fp32
accumulation, fp32 norms) 2.2%. Bounds: Hearth within 5% of that fp32 evaluation (the bound of
test_gemma3_tiny's bf16 test) and within 12% of mlx-lm (the two deviations add up to 10.3%;
measured 8.4%).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import tokenizers
import torch
from mlx_lm import convert, load
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from torch import nn

from hearth.checkpoint import open_checkpoint
from hearth.errors import CheckpointError
from hearth.layers.affine import MLXQuantizedEmbedding, MLXQuantizedLinear
from hearth.models.loading import build_model
from test_mlx_affine import to_torch
from tiny import TINY_VOCAB, save_hf, tiny_gemma3_model

ATOL = 1e-5
BF16_VS_FP32 = 0.05
BF16_VS_MLX = 0.12

Predicate = Callable[[str, Any], bool | dict[str, int]]


def _write_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: mlx-lm's converter copies one."""
    from transformers import PreTrainedTokenizerFast

    backend = tokenizers.Tokenizer(
        WordLevel({token: i for i, token in enumerate(TINY_VOCAB)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(path)


def _write_mlx_fields(path: Path) -> None:
    """Fields mlx-lm's gemma3_text reads but HF 5 does not write, whose defaults (sliding
    pattern 6) differ from this model: written explicitly from the HF config."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    types = config["layer_types"]
    pattern = types.index("full_attention") + 1
    assert types == [types[i % pattern] for i in range(len(types))], "not periodic"
    rope = config["rope_parameters"]
    config.update(
        sliding_window_pattern=pattern,
        rope_theta=rope["full_attention"]["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
        rope_scaling=None,
    )
    config_path.write_text(json.dumps(config))


def _hf_directory(path: Path, **overrides: Any) -> Path:
    save_hf(tiny_gemma3_model(seed=3, **overrides), path)
    _write_tokenizer(path)
    _write_mlx_fields(path)
    return path


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hf_directory(tmp_path_factory.mktemp("tied"))


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _hf_directory(tmp_path_factory.mktemp("untied"), tie_word_embeddings=False)


def _mixed_bits(path: str, module: Any) -> bool | dict[str, int]:
    """8-bit attention, 4-bit MLP, 6-bit embedding (6 bits straddle words)."""
    if "self_attn" in path:
        return {"group_size": 32, "bits": 8}
    if "mlp" in path:
        return {"group_size": 32, "bits": 4}
    return {"group_size": 64, "bits": 6}


def _uneven_parts(path: str, module: Any) -> bool | dict[str, int]:
    """q/k/v of layer 0 quantized differently, layer 1's v_proj kept float, a 5-bit head."""
    if path.endswith("layers.0.self_attn.q_proj"):
        return {"group_size": 32, "bits": 8}
    if path.endswith("layers.1.self_attn.v_proj"):
        return False
    if path == "lm_head":
        return {"group_size": 64, "bits": 5}
    return True


def _convert(
    source: Path, target: Path, dtype: str, predicate: Predicate | None, **options: Any
) -> Path:
    quantize = predicate is not None or bool(options)
    convert(
        str(source),
        str(target),
        quantize=quantize,
        dtype=dtype,
        quant_predicate=predicate,
        **options,
    )
    return target


def _ids(length: int = 20) -> torch.Tensor:
    ids = torch.randint(4, len(TINY_VOCAB), (1, length), generator=torch.Generator().manual_seed(1))
    ids[0, 0] = 2
    return ids


def _mlx_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return to_torch(model(mx.array(ids.numpy())).astype(mx.float32))


def _hearth(path: Path, dtype: torch.dtype) -> nn.Module:
    return build_model(open_checkpoint(path), dtype, progress=False)


def _mx_weight(module: Any) -> torch.Tensor:
    """mlx-lm's weight of a module: mx.dequantize'd if packed."""
    if not hasattr(module, "scales"):
        return to_torch(module.weight)
    return to_torch(
        mx.dequantize(
            module.weight,
            module.scales,
            module.biases,
            group_size=module.group_size,
            bits=module.bits,
        )
    )


def _assert_weights_equal_mlx(ours: nn.Module, theirs: Any) -> None:
    """Every projection and the embedding, stacked or not, packed or not: bit for bit."""

    def weight(module: nn.Module) -> torch.Tensor:
        is_packed = isinstance(module, MLXQuantizedLinear | MLXQuantizedEmbedding)
        return module.dequantize() if is_packed else module.weight

    assert torch.equal(weight(ours.embed_tokens), _mx_weight(theirs.model.embed_tokens))
    for layer, their_layer in zip(ours.layers, theirs.model.layers, strict=True):
        attention, mlp = their_layer.self_attn, their_layer.mlp
        qkv = [_mx_weight(m) for m in (attention.q_proj, attention.k_proj, attention.v_proj)]
        gate_up = [_mx_weight(m) for m in (mlp.gate_proj, mlp.up_proj)]
        assert torch.equal(weight(layer.self_attn.qkv_proj.proj), torch.cat(qkv))
        assert torch.equal(weight(layer.self_attn.o_proj), _mx_weight(attention.o_proj))
        assert torch.equal(weight(layer.mlp.gate_up_proj.proj), torch.cat(gate_up))
        assert torch.equal(weight(layer.mlp.down_proj), _mx_weight(mlp.down_proj))
    if "lm_head" in theirs:
        assert torch.equal(weight(ours.lm_head), _mx_weight(theirs.lm_head))


# mlx-lm skips modules whose width the *global* group size does not divide, whatever the
# predicate says: 32 keeps the 96-wide down_proj quantized.
MIXED_OPTIONS = {"q_group_size": 32}
VARIANTS: dict[str, tuple[str, Predicate | None, dict[str, int]]] = {
    "float": ("tied", None, {}),
    "q4-g32": ("tied", None, {"q_bits": 4, "q_group_size": 32}),
    # 96-wide down_proj is not a multiple of 64: mlx-lm leaves it float.
    "q3-g64": ("tied", None, {"q_bits": 3, "q_group_size": 64}),
    "mixed-bits": ("tied", _mixed_bits, MIXED_OPTIONS),
    "uneven-parts": ("untied", _uneven_parts, {"q_bits": 4, "q_group_size": 32}),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_checkpoint_matches_mlx_lm(
    variant: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    source, predicate, options = VARIANTS[variant]
    path = _convert(
        request.getfixturevalue(source), tmp_path / "mlx", "float32", predicate, **options
    )
    theirs, _ = load(str(path))
    ours = _hearth(path, torch.float32)
    _assert_weights_equal_mlx(ours, theirs)
    ids = _ids()
    with torch.inference_mode():
        logits = ours(ids)
    torch.testing.assert_close(logits, _mlx_logits(theirs, ids), atol=ATOL, rtol=0)


def test_packed_modules_keep_their_layout(tied: Path, tmp_path: Path) -> None:
    model = _hearth(
        _convert(tied, tmp_path / "mlx", "float32", _mixed_bits, **MIXED_OPTIONS), torch.float32
    )
    qkv, gate_up = model.layers[0].self_attn.qkv_proj.proj, model.layers[0].mlp.gate_up_proj.proj
    assert isinstance(model.embed_tokens, MLXQuantizedEmbedding)
    assert (model.embed_tokens.bits, model.embed_tokens.group_size) == (6, 64)
    assert isinstance(qkv, MLXQuantizedLinear) and (qkv.bits, qkv.out_features) == (8, 256)
    assert isinstance(gate_up, MLXQuantizedLinear) and (gate_up.bits, gate_up.group_size) == (4, 32)


def test_parts_quantized_differently_are_dequantized_at_load(untied: Path, tmp_path: Path) -> None:
    path = _convert(untied, tmp_path / "mlx", "float32", _uneven_parts, q_bits=4, q_group_size=32)
    model = _hearth(path, torch.float32)
    for index in (0, 1):  # 8-bit q with 4-bit k/v; a float v_proj with packed q/k
        assert type(model.layers[index].self_attn.qkv_proj.proj) is nn.Linear
    assert isinstance(model.layers[2].self_attn.qkv_proj.proj, MLXQuantizedLinear)
    assert isinstance(model.lm_head, MLXQuantizedLinear) and model.lm_head.bits == 5


def test_bf16_checkpoint(tied: Path, tmp_path: Path) -> None:
    path = _convert(tied, tmp_path / "mlx", "bfloat16", _mixed_bits, **MIXED_OPTIONS)
    checkpoint = open_checkpoint(path)
    assert checkpoint.quantized_dtype == torch.bfloat16
    theirs, _ = load(str(path))
    ours = build_model(checkpoint, torch.bfloat16, progress=False)
    _assert_weights_equal_mlx(ours, theirs)
    ids = _ids()
    with torch.inference_mode():
        logits = ours(ids).float()
        exact = _hearth(path, torch.float32)(ids)  # the same packed weights, computed in fp32
    scale = exact.abs().max()
    assert (logits - exact).abs().max() <= BF16_VS_FP32 * scale
    assert (logits - _mlx_logits(theirs, ids)).abs().max() <= BF16_VS_MLX * scale


def test_unsupported_mode_is_refused_at_open(tied: Path, tmp_path: Path) -> None:
    path = _convert(tied, tmp_path / "mlx", "float32", None, q_bits=4, q_group_size=32)
    config = json.loads((path / "config.json").read_text())
    config["quantization"]["mode"] = "mxfp4"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="mode 'mxfp4'"):
        open_checkpoint(path)


def test_cpu_quantization_of_a_packed_checkpoint_is_refused(tied: Path, tmp_path: Path) -> None:
    path = _convert(tied, tmp_path / "mlx", "float32", None, q_bits=4, q_group_size=32)
    with pytest.raises(ValueError, match="already quantized"):
        build_model(open_checkpoint(path), torch.bfloat16, progress=False, quantize="int8")
