"""Tiny random Gemma 3 checkpoints on disk, loaded through Hearth's readers, against HF logits.

Tolerance: 2e-5 absolute on logits of magnitude ~1-10 in fp32. Both sides run the same math in
fp32; the difference is summation order (SDPA vs HF's attention, cached vs full forward), which
leaves errors of a few fp32 ulps per op, ~1e-6 relative after 4 layers. A wrong mask, RoPE or
norm convention moves logits by >1e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hearth.checkpoint import open_checkpoint
from hearth.checkpoint.gguf_writer import write_gguf
from hearth.errors import CheckpointError
from hearth.kv import make_caches
from hearth.models.loading import build_model
from tiny import TINY_VOCAB, save_hf, tiny_gemma3_model

ATOL = 2e-5


def _ids(length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, len(TINY_VOCAB), (1, length), generator=generator)
    ids[0, 0] = 2
    return ids


def _hf_logits(model: object, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits  # type: ignore[operator]


def _hearth(path: Path) -> torch.nn.Module:
    return build_model(open_checkpoint(path), torch.float32, progress=False)


@pytest.mark.parametrize("shard", [None, "60KB"], ids=["single", "sharded"])
def test_hf_checkpoint_full_forward_matches_hf(tmp_path: Path, shard: str | None) -> None:
    hf = tiny_gemma3_model()
    path = save_hf(hf, tmp_path, shard)
    if shard:
        assert (path / "model.safetensors.index.json").exists()
    ids = _ids(30)  # longer than the sliding window of 8
    with torch.inference_mode():
        ours = _hearth(path)(ids)
    torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    path = save_hf(tiny_gemma3_model(), tmp_path, "60KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard {shard.name}"):
        _hearth(path)


@pytest.mark.parametrize("chunk", [5, 13, 30])
def test_cached_prefill_and_decode_match_hf(tmp_path: Path, chunk: int) -> None:
    """Chunked prefill (chunks shorter and longer than the window) then 20 cached decode steps."""
    hf = tiny_gemma3_model(seed=2)
    model = _hearth(save_hf(hf, tmp_path))
    ids = _ids(50, seed=3)
    prompt_length = 30
    caches = make_caches(model.cache_specs())
    pieces = []
    with torch.inference_mode():
        for start in range(0, prompt_length, chunk):
            end = min(start + chunk, prompt_length)
            pieces.append(model(ids[:, start:end], caches, start=start))
        for position in range(prompt_length, 50):
            pieces.append(model(ids[:, position : position + 1], caches, start=position))
    torch.testing.assert_close(torch.cat(pieces, dim=1), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_untied_head_and_linear_rope_scaling(tmp_path: Path) -> None:
    rope = {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    hf = tiny_gemma3_model(
        seed=4, tie_word_embeddings=False, rope_parameters=rope, final_logit_softcapping=5.0
    )
    ids = _ids(20)
    with torch.inference_mode():
        ours = _hearth(save_hf(hf, tmp_path))(ids)
    torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_bf16_runs_close_to_fp32(tmp_path: Path) -> None:
    """bf16 keeps 8 bits of mantissa: logits within 5% of the fp32 logit range."""
    hf = tiny_gemma3_model(seed=5)
    path = save_hf(hf, tmp_path)
    ids = _ids(20)
    with torch.inference_mode():
        low = build_model(open_checkpoint(path), torch.bfloat16, progress=False)(ids).float()
    reference = _hf_logits(hf, ids)
    assert (low - reference).abs().max() < 0.05 * reference.abs().max()


def _hf_from_gguf(path: Path) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _gguf_from(hf: object, path: Path, matrix_type: str) -> Path:
    tensors = {
        name.removeprefix("model."): t
        for name, t in hf.state_dict().items()  # type: ignore[attr-defined]
        if name != "lm_head.weight"
    }
    return write_gguf(path, hf.config.to_dict(), tensors, TINY_VOCAB, matrix_type)  # type: ignore[attr-defined]


# GGUF stores no layer pattern and no attention scale: llama.cpp uses 5 sliding : 1 full layers
# and 1/sqrt(head_dim), HF's GGUF loader the pattern and its default scalar 256. These configs
# satisfy both, so the two readers must agree.
GGUF_SHAPES = {
    "num_hidden_layers": 6,
    "head_dim": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "layer_types": None,
}


@pytest.mark.parametrize("matrix_type", ["F32", "F16", "Q8_0", "Q5_0"])
def test_gguf_checkpoint_matches_hf_loading_the_same_file(tmp_path: Path, matrix_type: str) -> None:
    hf = tiny_gemma3_model(seed=6, **GGUF_SHAPES)
    path = _gguf_from(hf, tmp_path / "tiny.gguf", matrix_type)
    ids = _ids(24)
    with torch.inference_mode():
        ours = _hearth(path)(ids)
        theirs = _hf_logits(_hf_from_gguf(path), ids)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)


def test_gguf_attention_scale_follows_llama_cpp(tmp_path: Path) -> None:
    """With head_dim 32 llama.cpp scales by 1/sqrt(32); so must Hearth (HF's loader says 256)."""
    hf = tiny_gemma3_model(seed=7, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=32)
    path = _gguf_from(hf, tmp_path / "tiny.gguf", "F32")
    ids = _ids(24)
    with torch.inference_mode():
        ours = _hearth(path)(ids)
    torch.testing.assert_close(ours, _hf_logits(hf, ids), atol=ATOL, rtol=0)
