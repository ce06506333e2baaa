"""MLX-format Gemma 4 checkpoints written by mlx-lm's own converter, loaded by Hearth, against
mlx-lm.

Tiny random Gemma 4 models of test_gemma4 are saved by HF transformers, converted by
`mlx_lm.convert` (fp32; float, or affine-quantized with 4 or 8 bits, or per-module bits through
a `quant_predicate`, experts included) and run by both mlx-lm (`mlx_lm.load`) and Hearth on the
same directory.

Weights: every matrix of mlx-lm's model (projections, embeddings, router, the experts' switch
layers) equals Hearth's, dequantized by `mx.dequantize` on one side and by Hearth on the other,
bit for bit (torch.equal); packed experts are read one expert at a time, as the MoE block does.

Logits, fp32 on both sides, ATOL 5e-5 (test_gemma4's bound against HF) on logits up to ~25
(the softcap's range), where one fp32 ulp is 1.9e-6: the weights are identical and Hearth's
float logits equal HF's, so what differs is mlx's kernels against torch's (rms_norm, quantized
and gather matmuls, attention, RoPE, the router's norm with its scale folded into the weight and
its softmax over the top-k scores rather than over all), a few ulps per op that scale-1
attention on normed q/k (scores up to ~±20) amplifies. Measured at most 1.24e-5 (ple-float);
quantizing moves these logits by 0.26 (8 bits) to 5.8 (4 bits), and a wrong bit layout or
expert split scrambles them.

mlx-lm builds and runs every tiny config used here; test_gemma4's MoE experts are 24 wide, which
no group size divides, so mlx-lm keeps their down_proj in float (tested as such), and a 32-wide
variant quantizes all three expert projections.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as mlx_nn
import pytest
import torch
from mlx_lm import convert, load
from torch import nn

from hearth.checkpoint import open_checkpoint
from hearth.layers.affine import MLXQuantizedEmbedding, MLXQuantizedExperts, MLXQuantizedLinear
from hearth.layers.experts import Experts
from hearth.layers.linear import StackedLinear
from hearth.models.gemma4 import Gemma4Model
from hearth.models.loading import build_model
from test_gemma4 import CONFIGS
from test_mlx_affine import to_torch
from test_mlx_checkpoints import _write_tokenizer
from tiny import TINY_VOCAB, save_hf, tiny_gemma4_model

ATOL = 5e-5
LENGTH = 30  # longer than the sliding window of 8

# test_gemma4's MoE has experts 24 wide, which no group size divides, so mlx-lm leaves every
# expert down_proj in float; 32 lets all three expert projections be quantized.
MODELS: dict[str, dict[str, Any]] = {
    "windows": CONFIGS["windows"],
    "ple_sharing_double_wide": CONFIGS["ple_sharing_double_wide"],
    "k_eq_v_moe": CONFIGS["k_eq_v_moe"],
    "k_eq_v_moe_32": {**CONFIGS["k_eq_v_moe"], "moe_intermediate_size": 32},
}

Predicate = Callable[[str, Any], bool | dict[str, int]]


def _write_mlx_fields(path: Path) -> None:
    """Fields of mlx-lm's gemma4_text that HF 5's config.json leaves out, whose defaults are
    E2B's (global_head_dim 512): written from HF's per-layer override of the full layers.
    (`sliding_window_pattern` is read only without `layer_types`, which HF writes.)"""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    full = config["layer_types"].index("full_attention")
    override = config["per_layer_config"][str(full)]
    rope = config["rope_parameters"]
    config.update(
        global_head_dim=override["head_dim"],
        num_global_key_value_heads=override.get(
            "num_key_value_heads", config["num_key_value_heads"]
        ),
        global_partial_rotary_factor=rope["full_attention"]["partial_rotary_factor"],
        partial_rotary_factor=rope["sliding_attention"].get("partial_rotary_factor", 1.0),
        rope_traditional=False,
    )
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The HF directory of a model of MODELS, written once."""
    written: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in written:
            hf = tiny_gemma4_model(seed=list(MODELS).index(name), **MODELS[name])
            path = save_hf(hf, tmp_path_factory.mktemp(name))
            _write_tokenizer(path)
            _write_mlx_fields(path)
            written[name] = path
        return written[name]

    return get


def _mixed_bits(path: str, module: Any) -> bool | dict[str, int]:
    """Bits per module kind; layer 0's expert up_proj differs from its gate_proj, so Hearth
    must dequantize that pair at load, while the other layers keep theirs packed."""
    if path.endswith("layers.0.experts.switch_glu.up_proj"):
        return {"group_size": 32, "bits": 8}
    if "switch_glu" in path:
        return {"group_size": 32, "bits": 3 if path.endswith("down_proj") else 4}
    if "self_attn" in path:
        return {"group_size": 32, "bits": 8}
    if path.endswith("router.proj"):
        return {"group_size": 64, "bits": 8}  # as mlx-lm's own Gemma 4 predicate
    if "mlp" in path:
        return {"group_size": 32, "bits": 4}
    if "per_layer" in path:
        return {"group_size": 32, "bits": 5}
    return {"group_size": 64, "bits": 6}  # the embedding (and tied head): 6 bits straddle words


# (model, quant_predicate, convert options). Without a predicate mlx-lm applies its Gemma 4
# one, which lists every router.proj as 8 bits in config.json.
VARIANTS: dict[str, tuple[str, Predicate | None, dict[str, int]]] = {
    "windows-float": ("windows", None, {}),
    "windows-q4": ("windows", None, {"q_bits": 4, "q_group_size": 32}),
    "ple-float": ("ple_sharing_double_wide", None, {}),
    "ple-q8": ("ple_sharing_double_wide", None, {"q_bits": 8, "q_group_size": 32}),
    "ple-mixed": ("ple_sharing_double_wide", _mixed_bits, {"q_group_size": 32}),
    "moe-float": ("k_eq_v_moe", None, {}),
    "moe-q4-float-down": ("k_eq_v_moe", None, {"q_bits": 4, "q_group_size": 32}),
    "moe32-q4": ("k_eq_v_moe_32", None, {"q_bits": 4, "q_group_size": 32}),
    "moe32-q8": ("k_eq_v_moe_32", None, {"q_bits": 8, "q_group_size": 32}),
    "moe32-mixed": ("k_eq_v_moe_32", _mixed_bits, {"q_group_size": 32}),
}


def _convert(source: Path, target: Path, predicate: Predicate | None, **options: Any) -> Path:
    quantize = predicate is not None or bool(options)
    convert(
        str(source),
        str(target),
        quantize=quantize,
        dtype="float32",
        quant_predicate=predicate,
        **options,
    )
    return target


@pytest.fixture(scope="module")
def converted(
    sources: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """The MLX directory of a variant of VARIANTS, converted once."""
    done: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in done:
            model, predicate, options = VARIANTS[variant]
            target = tmp_path_factory.mktemp(variant) / "mlx"
            done[variant] = _convert(sources(model), target, predicate, **options)
        return done[variant]

    return get


def _ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(4, len(TINY_VOCAB), (1, LENGTH), generator=generator)
    ids[0, 0] = 2
    return ids


def _hearth(path: Path) -> Gemma4Model:
    model = build_model(open_checkpoint(path), torch.float32, progress=False)
    assert isinstance(model, Gemma4Model)
    return model


def _canonical(mlx_path: str) -> str:
    """mlx-lm's module path as Hearth names the module (spelled out here, not Hearth's rule)."""
    return mlx_path.removeprefix("model.").replace(".switch_glu.", ".")


def _mlx_weights(model: Any) -> dict[str, torch.Tensor]:
    """Every matrix of mlx-lm's model by canonical module name, mx.dequantize'd if packed."""
    weights = {}
    for path, module in model.named_modules():
        weight = module.get("weight") if isinstance(module, mlx_nn.Module) else None
        if not isinstance(weight, mx.array) or weight.ndim < 2:
            continue  # norms and scales are vectors
        if "scales" in module:
            weight = mx.dequantize(
                weight,
                module.scales,
                module.biases,
                group_size=module.group_size,
                bits=module.bits,
                mode=module.mode,
            )
        weights[_canonical(path)] = to_torch(weight)
    return weights


def _dense(weight: torch.Tensor | nn.Module) -> torch.Tensor:
    if isinstance(weight, MLXQuantizedExperts):
        return torch.stack([weight[expert] for expert in range(weight.packed.shape[0])])
    if isinstance(weight, MLXQuantizedLinear | MLXQuantizedEmbedding):
        return weight.dequantize()
    return weight.weight if isinstance(weight, nn.Module) else weight


def _split(
    weight: torch.Tensor | nn.Module, parts: dict[str, int], owner: str
) -> dict[str, torch.Tensor]:
    pieces = _dense(weight).split(list(parts.values()), dim=-2)
    return {f"{owner}.{part}": piece for part, piece in zip(parts, pieces, strict=True)}


def _hearth_weights(model: Gemma4Model) -> dict[str, torch.Tensor]:
    """Every matrix of Hearth's model by canonical module name, stacks cut into their parts."""
    weights: dict[str, torch.Tensor] = {}
    stacked: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, StackedLinear):
            stacked.add(f"{name}.proj")
            weights |= _split(module.proj, module.parts, name.rpartition(".")[0])
        elif isinstance(module, Experts):
            for attribute, parts in module.parts.items():
                weights |= _split(getattr(module, attribute), parts, name)
        elif name not in stacked and isinstance(
            module, nn.Linear | nn.Embedding | MLXQuantizedLinear | MLXQuantizedEmbedding
        ):
            weights[name] = _dense(module)
    return weights


def _assert_weights_equal_mlx(ours: Gemma4Model, theirs: Any) -> None:
    expected, actual = _mlx_weights(theirs), _hearth_weights(ours)
    assert sorted(actual) == sorted(expected)
    for name, weight in expected.items():
        assert torch.equal(actual[name], weight), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_checkpoint_matches_mlx_lm(variant: str, converted: Callable[[str], Path]) -> None:
    path = converted(variant)
    theirs, _ = load(str(path))
    ours = _hearth(path)
    _assert_weights_equal_mlx(ours, theirs)
    ids = _ids()
    with torch.inference_mode():
        logits = ours(ids)
    reference = to_torch(theirs(mx.array(ids.numpy())))
    assert reference.dtype == torch.float32
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=0)


def test_experts_stay_packed_unless_gate_and_up_differ(converted: Callable[[str], Path]) -> None:
    model = _hearth(converted("moe32-mixed"))
    first, second = (model.layers[index].experts for index in (0, 1))
    # Layer 0: 4-bit gate with 8-bit up cannot share one packed weight.
    assert type(first.gate_up_proj) is nn.Parameter
    assert isinstance(second.gate_up_proj, MLXQuantizedExperts)
    assert (second.gate_up_proj.bits, second.gate_up_proj.out_features) == (4, 2 * 32)
    for experts in (first, second):
        assert isinstance(experts.down_proj, MLXQuantizedExperts) and experts.down_proj.bits == 3
    assert isinstance(model.layers[0].router.proj, MLXQuantizedLinear)
    assert model.layers[0].router.proj.bits == 8


def test_float_down_proj_with_packed_gate_up(converted: Callable[[str], Path]) -> None:
    """mlx-lm leaves 24-wide inputs in float at group size 32: only down_proj stays a tensor."""
    experts = _hearth(converted("moe-q4-float-down")).layers[0].experts
    assert isinstance(experts.gate_up_proj, MLXQuantizedExperts)
    assert type(experts.down_proj) is nn.Parameter
