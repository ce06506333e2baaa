"""Gemma 4's fused GPU kernels wired into the model, run in Triton's interpreter on CPU.

On a GPU the model calls the Triton kernels for CUDA tensors; here their dispatchers are told
to take the kernel path for CPU tensors too, so the interpreter runs them inside a real
forward: each layer's last add + layer scalar + next input norm, the per-layer input gate's
GeGLU and the add-norm before that gate, the router's input and routing, the gathered
experts (GeGLU, weighted slot sum), the prompt's grouped experts (the GeGLU stored by the
gate/up matmul, the slots weighted and summed by the last norm), and a MoE layer's norms fused
into two kernels.
The reference is the same model on the torch path. (Attention has its own such test,
tests/layers/test_attention_kernel_path.py; each kernel has its own in
tests/ops/test_fused_kernels.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter path; the GPU runs the kernels itself"
)

from hearth.checkpoint import open_checkpoint  # noqa: E402
from hearth.layers import experts as experts_layer  # noqa: E402
from hearth.layers import per_layer  # noqa: E402
from hearth.models.loading import build_model  # noqa: E402
from hearth.ops import (  # noqa: E402
    activation,
    gemv,
    grouped_matmul,
    norm,
    router,
    slot_sum,
)
from test_gemma4 import CONFIGS  # noqa: E402
from tiny import save_hf, tiny_gemma4_model  # noqa: E402

# fp32 throughout: the kernels and torch differ by summation order (norms, softmax, the slot
# sum); through the tiny models' layers and head, logits of size ~1-25 stay within 1e-4.
ATOL = 1e-4
PROMPT, STEPS = 20, 4
FUSED_MODULES = (norm, activation, router, slot_sum, gemv, per_layer)


def _decode(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from hearth.kv import make_caches

    caches = make_caches(model.cache_specs())
    with torch.inference_mode():
        steps = [model(ids[:, :PROMPT], caches)]
        steps += [model(ids[:, p : p + 1], caches, start=p) for p in range(PROMPT, PROMPT + STEPS)]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("config", ["moe", "ple_sharing_double_wide", "ple"])
def test_fused_kernels_in_the_model_match_the_torch_path(
    config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MoE layer's norms in two kernels, the second also summing the experts' weighted
    slots (at the prompt too), the experts' GeGLU stored by their gate/up GEMV (and grouped
    matmul at the prompt), the per-layer input's GeGLU inside its projection's GEMV and the
    add-norm before it inside its gate's GEMV."""
    # The prompt's experts as a prefill's: grouped matmuls (the decode steps stay gathered).
    monkeypatch.setattr(experts_layer, "GROUPED_EXPERTS_MIN_TOKENS", PROMPT)
    hf = tiny_gemma4_model(seed=11, **CONFIGS[config])
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, "cpu", False)
    ids = torch.randint(4, 256, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))
    expected = _decode(model, ids)

    launched: list[str] = []
    for module in FUSED_MODULES:
        monkeypatch.setattr(module, "kernel_enabled", lambda tensor: True)
    monkeypatch.setattr(grouped_matmul, "kernel_enabled", lambda tensor: True)
    original_grouped = grouped_matmul.grouped_expert_matmul_triton

    def counted_grouped(x, weight, expert_ids, row_scale=None, plan=None, geglu=False):
        scaled = " scaling rows" if row_scale is not None else ""
        launched.append("grouped with a geglu output" if geglu else f"grouped{scaled}")
        return original_grouped(x, weight, expert_ids, row_scale, plan, geglu=geglu)

    monkeypatch.setattr(grouped_matmul, "grouped_expert_matmul_triton", counted_grouped)
    # The MoE block takes the gathered-expert path (graph-capturable decode) as on a GPU;
    # the expert GEMVs themselves stay on their torch reference.
    monkeypatch.setattr(experts_layer, "kernel_enabled", lambda tensor: True)
    for name in ("route_triton", "router_input_triton"):
        monkeypatch.setattr(router, name, _counted(getattr(router, name), launched, name))
    for name in ("moe_add_rms_norm_triton", "moe_combine_add_rms_norm_triton"):
        monkeypatch.setattr(norm, name, _counted(getattr(norm, name), launched, name))
    original_combine = norm.moe_combine_add_rms_norm_triton

    def counted_combine(*args):
        slot_weights = args[-1] if len(args) == 10 else None
        if slot_weights is not None and args[2].shape[-3] == PROMPT:  # [.., T, top_k, H]
            ones = bool((slot_weights == 1).all())
            launched.append("prompt slots summed" if ones else "prompt slots weighted")
        return original_combine(*args)

    monkeypatch.setattr(norm, "moe_combine_add_rms_norm_triton", counted_combine)
    slot_sum_counted = _counted(experts_layer.weighted_slot_sum, launched, "slot_sum")
    monkeypatch.setattr(experts_layer, "weighted_slot_sum", slot_sum_counted)
    geglu_counted = _counted(experts_layer.gelu_tanh_mul, launched, "gelu_tanh_mul")
    monkeypatch.setattr(experts_layer, "gelu_tanh_mul", geglu_counted)
    original_experts = experts_layer.float_expert_matmul

    def counted_experts(x, weight, expert_ids, geglu_out=False):
        launched.append("experts with a geglu output" if geglu_out else "experts")
        return original_experts(x, weight, expert_ids, geglu_out)

    monkeypatch.setattr(experts_layer, "float_expert_matmul", counted_experts)
    original_gemv = gemv.gemv_triton

    def counted_gemv(x, weight, geglu=False, config=None, up=None, add_norm=None):
        separate = "gemv geglu of a separate up" if up is not None else "gemv"
        launched.append("gemv add-norm" if add_norm is not None else separate)
        return original_gemv(x, weight, geglu, config, up=up, add_norm=add_norm)

    monkeypatch.setattr(gemv, "gemv_triton", counted_gemv)
    got = _decode(model, ids)
    ple = "gemv geglu of a separate up"
    if config.startswith("ple"):
        assert ple in launched and "gemv add-norm" in launched, launched
    if config == "moe":
        fused_norms = {"moe_add_rms_norm_triton", "moe_combine_add_rms_norm_triton"}
        assert fused_norms | {"route_triton", "experts with a geglu output"} <= set(launched)
        # The prompt's rows scaled by the down matmul, summed by the combine kernel.
        assert {"grouped with a geglu output", "grouped scaling rows"} <= set(launched)
        assert "prompt slots summed" in launched and "prompt slots weighted" not in launched
        assert not {"router_input_triton", "slot_sum", "gelu_tanh_mul"} & set(launched)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def _counted(function, launched: list[str], name: str):
    def wrapper(*args, **kwargs):
        launched.append(name)
        return function(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("pinned", ["qkv", "gate_up"])
def test_wide_projections_take_the_gemv_only_at_a_pinned_shape(
    pinned: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """qkv and gate/up (cuBLAS's by default) take the GEMV at a decode step exactly where a
    launch is pinned for their shape, and the logits stay those of the torch path."""
    hf = tiny_gemma4_model(seed=5, **CONFIGS["ple"])
    model = build_model(open_checkpoint(save_hf(hf, tmp_path)), torch.float32, "cpu", False)
    ids = torch.randint(4, 256, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(4))
    expected = _decode(model, ids)
    attention = model.layers[0].self_attn
    qkv = tuple(attention.qkv_proj.proj.weight.shape)
    gate_up = tuple(model.layers[0].mlp.gate_up_proj.proj.weight.shape)
    assert qkv != gate_up
    rows: dict[tuple[int, int], list[int]] = {}
    original_gemv = gemv.gemv_triton

    def recorded(x, weight, geglu=False, config=None, up=None):
        rows.setdefault(tuple(weight.shape), []).append(x.numel() // x.shape[-1])
        return original_gemv(x, weight, geglu, config, up=up)

    monkeypatch.setattr(gemv, "kernel_enabled", lambda tensor: True)
    monkeypatch.setattr(gemv, "gemv_triton", recorded)
    shape = {"qkv": qkv, "gate_up": gate_up}[pinned]
    monkeypatch.setitem(gemv.GEMV_LAUNCHES, shape, {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1})
    got = _decode(model, ids)
    # Every layer with that shape, once per decode step; never the prompt's rows.
    shapes = {
        "qkv": [tuple(layer.self_attn.qkv_proj.proj.weight.shape) for layer in model.layers],
        "gate_up": [tuple(layer.mlp.gate_up_proj.proj.weight.shape) for layer in model.layers],
    }[pinned]
    same_shape = shapes.count(shape)
    assert rows[shape] == [1] * (STEPS * same_shape)
    assert ({qkv, gate_up} - {shape}).isdisjoint(rows)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
