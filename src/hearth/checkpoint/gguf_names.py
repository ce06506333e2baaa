"""llama.cpp's GGUF tensor names and Hearth's canonical (HF) names, per architecture.

Names are whole (`attn_q.weight`, not `attn_q`): llama.cpp's converter files Gemma 4's router
scale as `ffn_gate_inp.scale` and the per-expert scale as `ffn_down_exps.scale`, beside the
weights of other modules. Gemma 4's experts keep HF's stacked form here (`experts.gate_up_proj`,
gate rows then up rows), which the readers split into canonical per-projection weights.
"""

from __future__ import annotations

from hearth.errors import UnsupportedModelError

# Within a block: `blk.{i}.<key>` <-> `layers.{i}.<value>`.
_GEMMA3_BLOCK = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA4_BLOCK = {
    **_GEMMA3_BLOCK,
    "layer_output_scale.weight": "layer_scalar",
    # The per-layer input (E2B/E4B).
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    # The expert block beside the dense MLP (26B-A4B).
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
}
_GEMMA3_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GEMMA4_GLOBAL = {
    **_GEMMA3_GLOBAL,
    "per_layer_token_embd.weight": "embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "per_layer_projection_norm.weight",
}
_TABLES = {"gemma3": (_GEMMA3_BLOCK, _GEMMA3_GLOBAL), "gemma4": (_GEMMA4_BLOCK, _GEMMA4_GLOBAL)}
ARCHITECTURES = tuple(_TABLES)
# Gemma 4's full-attention RoPE frequency factors: config, not a weight (see gguf.py).
ROPE_FREQS = "rope_freqs.weight"


def _tables(architecture: str) -> tuple[dict[str, str], dict[str, str]]:
    try:
        return _TABLES[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        ) from None


def canonical_name(gguf_name: str, architecture: str = "gemma3") -> str:
    """The canonical name of a llama.cpp tensor name, e.g. blk.0.attn_q.weight."""
    block, global_names = _tables(architecture)
    index, _, tail = gguf_name.removeprefix("blk.").partition(".")
    if gguf_name.startswith("blk.") and index.isdigit() and tail in block:
        return f"layers.{index}.{block[tail]}"
    if gguf_name in global_names:
        return global_names[gguf_name]
    raise UnsupportedModelError(f"unknown {architecture} GGUF tensor {gguf_name!r}")


def gguf_name(canonical: str, architecture: str = "gemma3") -> str:
    """llama.cpp's name for a canonical tensor name (experts in HF's stacked form)."""
    block, global_names = _tables(architecture)
    if canonical.startswith("layers."):
        _, index, tail = canonical.split(".", 2)
        for gguf_tail, canonical_tail in block.items():
            if canonical_tail == tail:
                return f"blk.{index}.{gguf_tail}"
    for name, canonical_global in global_names.items():
        if canonical_global == canonical:
            return name
    raise UnsupportedModelError(f"{canonical!r} has no {architecture} GGUF name")
