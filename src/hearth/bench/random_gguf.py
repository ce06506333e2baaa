"""Random-weight Gemma 3 and Gemma 4 GGUF files at real shapes: Hearth and llama.cpp, one file.

Each tensor is drawn when the writer reaches it, from its own seed, already in the stored
type: F16/BF16 values from a normal draw, Q8_0/Q4_0/Q4_K/Q6_K blocks from random codes and
random scales (nothing is quantized, so a 12B file costs only the draws and the disk). Q4_K_M is
llama.cpp's mix of that name: Q4_K, with Q6_K for the tied table (the head) and for `v_proj`
and `down_proj` in the layers llama.cpp gives more bits (`q4_k_m_type`). `values()`
gives the float32 tensor a reader must get back from those bytes, for round-trip checks.
The vocabulary and tokenizer come from another GGUF file (the embedded model's by default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hearth.checkpoint.gguf_writer import GGUFTensor, stream_gguf, tokenizer_metadata
from hearth.config import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    Gemma3Config,
    Gemma4Config,
    ModelConfig,
    parse_config,
)

GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q4_K_M")
BLOCK = 32  # values per Q8_0 / Q4_0 block
# Q4_K: 256 values in 144 bytes (fp16 d and dmin, 12 bytes of 6-bit scales and mins, nibbles).
K_BLOCK, Q4_K_BYTES = 256, 144
# Q6_K: 256 values in 210 bytes (low nibbles, 2 high bits each, 16 int8 scales, fp16 d).
Q6_K_BYTES = 210
WEIGHT_STD = 0.02
# Standard deviation of a uniform code: int8 over [-127, 127], a nibble over [0, 15].
_CODE_STD = {"Q8_0": (255**2 - 1) ** 0.5 / 12**0.5, "Q4_0": (16**2 - 1) ** 0.5 / 12**0.5}
# llama.cpp fixes Gemma 3's pattern: every 6th layer is full attention.
GGUF_SLIDING_PATTERN = 6


@dataclass(frozen=True)
class RandomTensor:
    """One random tensor: canonical name, torch-order shape, stored GGML type, seed.

    F32 tensors (norms, scales) are drawn in [0.5, 1.5) as stored; `stored_shift` is what the
    file adds to the canonical value (1 for Gemma 3's norms, else 0).
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: str
    seed: int
    device: str = "cpu"
    stored_shift: float = 0.0

    def _generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed)

    def _draw(self) -> dict[str, torch.Tensor]:
        """The random parts of the stored form, on the device."""
        gen, device = self._generator(), self.device
        if self.ggml_type == "F32":
            return {"stored": torch.rand(self.shape, generator=gen, device=device) + 0.5}
        if self.ggml_type in ("F16", "BF16"):
            normal = torch.randn(self.shape, generator=gen, device=device) * WEIGHT_STD
            dtype = torch.float16 if self.ggml_type == "F16" else torch.bfloat16
            return {"stored": normal.to(dtype)}
        *rows, columns = self.shape
        if self.ggml_type == "Q4_K":
            return {"blocks": self._q4_k_blocks(gen)}
        if self.ggml_type == "Q6_K":
            return {"blocks": self._q6_k_blocks(gen)}
        blocks = (*rows, columns // BLOCK)
        scale = WEIGHT_STD / _CODE_STD[self.ggml_type]
        scales = ((torch.rand(blocks, generator=gen, device=device) + 0.5) * scale).half()
        # Drawn as bytes: a 262144 x 3840 table would take 8 GB as int64.
        low, high = (-127, 128) if self.ggml_type == "Q8_0" else (0, 16)
        shape = (*blocks, BLOCK)
        codes = torch.randint(low, high, shape, generator=gen, device=device, dtype=torch.int8)
        return {"scales": scales, "codes": codes}

    def _q4_k_blocks(self, gen: torch.Generator) -> torch.Tensor:
        """Random Q4_K blocks [rows, blocks, 144]: random nibbles, 6-bit scales and mins, with
        d and dmin set so that values spread about WEIGHT_STD around zero."""
        *rows, columns = self.shape
        shape = (*rows, columns // K_BLOCK, Q4_K_BYTES)
        blocks = torch.randint(0, 256, shape, generator=gen, device=self.device, dtype=torch.uint8)
        # value = d·scale·q - dmin·min with scale, min ~ 32 and q ~ 7.5 on average.
        d = torch.full(shape[:-1], WEIGHT_STD / 32 / 4.6, dtype=torch.float16, device=self.device)
        blocks[..., 0:2] = d[..., None].view(torch.uint8)
        blocks[..., 2:4] = (d * 7.5)[..., None].view(torch.uint8)
        return blocks

    def _q6_k_blocks(self, gen: torch.Generator) -> torch.Tensor:
        """Random Q6_K blocks [rows, blocks, 210]: random 6-bit codes, int8 scales in [1, 8]
        and d set so that values spread about WEIGHT_STD around zero (q - 32 ~ 18.5, scale
        ~ 4.5 on average: d stays a normal fp16)."""
        *rows, columns = self.shape
        shape = (*rows, columns // K_BLOCK, Q6_K_BYTES)
        blocks = torch.randint(0, 256, shape, generator=gen, device=self.device, dtype=torch.uint8)
        scales = torch.randint(1, 9, (*shape[:-1], 16), generator=gen, device=self.device)
        blocks[..., 192:208] = scales.to(torch.uint8)
        d = torch.full(shape[:-1], WEIGHT_STD / 18.5 / 4.5, dtype=torch.float16, device=self.device)
        blocks[..., 208:210] = d[..., None].view(torch.uint8)
        return blocks

    def encode(self) -> np.ndarray:
        """The bytes the file stores."""
        parts = self._draw()
        if "blocks" in parts:
            rows = parts["blocks"].flatten(-2)
            return rows.reshape(-1, rows.shape[-1]).cpu().numpy()
        if "stored" in parts:
            stored = parts["stored"]
            if stored.dtype == torch.bfloat16:
                stored = stored.view(torch.int16)  # numpy has no bfloat16: store the bits
            return stored.cpu().numpy()
        scales = parts["scales"][..., None].view(torch.uint8)  # [rows, blocks, 2]
        codes = parts["codes"]
        if self.ggml_type == "Q8_0":
            payload = codes.view(torch.uint8)
        else:  # byte j holds value j in its low nibble and value j + 16 in its high one
            nibbles = codes.to(torch.uint8)
            payload = nibbles[..., :16] | (nibbles[..., 16:] << 4)
        rows = torch.cat([scales, payload], dim=-1).flatten(-2)  # [..., bytes per row]
        return rows.reshape(-1, rows.shape[-1]).cpu().numpy()

    def values(self) -> torch.Tensor:
        """The canonical float32 tensor these bytes mean (Gemma 3's norms: w, not 1 + w)."""
        parts = self._draw()
        if "stored" in parts:
            return (parts["stored"].float() - self.stored_shift).cpu()
        if "blocks" in parts:  # decoded by the `gguf` package, the reference
            import gguf

            stored = self.encode()
            values = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType[self.ggml_type])
            return torch.from_numpy(np.ascontiguousarray(values)).reshape(self.shape)
        codes = parts["codes"].float()
        if self.ggml_type == "Q4_0":
            codes = codes - 8
        values = parts["scales"].float()[..., None] * codes
        return values.reshape(self.shape).cpu()

    def as_gguf(self) -> GGUFTensor:
        return GGUFTensor(self.name, self.shape, self.ggml_type, self.encode)


def gemma3_tensor_shapes(config: Gemma3Config) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of a Gemma 3 text model with its shape, in llama.cpp's order."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_rows = config.num_attention_heads * head_dim
    kv_rows = config.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (config.vocab_size, hidden)}
    for layer in range(config.num_hidden_layers):
        prefix = f"layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q_rows, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_rows, hidden),
            f"{prefix}.self_attn.q_norm.weight": (head_dim,),
            f"{prefix}.self_attn.k_norm.weight": (head_dim,),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_rows),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.pre_feedforward_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (config.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": (config.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, config.intermediate_size),
            f"{prefix}.post_feedforward_layernorm.weight": (hidden,),
        }
    shapes["norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def gemma4_tensor_shapes(config: Gemma4Config) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor of a Gemma 4 text model with its shape, experts stacked as
    llama.cpp stores them (`experts.gate_up_proj` [E, 2·I, H], `experts.down_proj`)."""
    from hearth.models.loading import checkpoint_shapes

    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in checkpoint_shapes(config).items():
        prefix, _, part = name.rpartition(".experts.")
        if part == "gate_proj.weight":
            experts, rows, columns = shape
            shapes[f"{prefix}.experts.gate_up_proj"] = (experts, 2 * rows, columns)
        elif part == "down_proj.weight":
            shapes[f"{prefix}.experts.down_proj"] = shape
        elif part != "up_proj.weight":
            shapes[name] = shape
    return shapes


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    if isinstance(config, Gemma4Config):
        return gemma4_tensor_shapes(config)
    return gemma3_tensor_shapes(config)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third
    in between, whose v and down projections a Q4_K_M file keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int) -> str:
    """The type llama.cpp's Q4_K_M gives a matrix: Q6_K for the head (the tied table) and for
    `v_proj`/`down_proj` (experts too) in `_more_bits` layers, Q4_K elsewhere."""
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return "Q6_K"
    if name.startswith("layers.") and ("v_proj" in name or "down_proj" in name):
        layer = int(name.split(".")[1])
        return "Q6_K" if _more_bits(layer, layers) else "Q4_K"
    return "Q4_K"


def random_tensors(
    config: ModelConfig, ggml_type: str, seed: int = 0, device: str = "cpu"
) -> list[RandomTensor]:
    """The tensors of a random model: 1-D tensors F32, the rest in `ggml_type` (F16 for rows
    that do not split into 32-value blocks, as llama.cpp's converter falls back; rows that do
    not split into 256-value k-quant blocks take Q8_0)."""
    if ggml_type not in GGUF_TYPES:
        raise ValueError(f"unknown GGUF type {ggml_type!r} (choose from {', '.join(GGUF_TYPES)})")
    norm_shift = 1.0 if isinstance(config, Gemma3Config) else 0.0
    tensors = []
    for index, (name, shape) in enumerate(tensor_shapes(config).items()):
        kind = "F32" if len(shape) == 1 else ggml_type
        if kind == "Q4_K_M":
            kind = q4_k_m_type(name, config.num_hidden_layers)
        if kind in ("Q8_0", "Q4_0") and shape[-1] % BLOCK:
            kind = "F16"
        if kind in ("Q4_K", "Q6_K") and shape[-1] % K_BLOCK:
            kind = "Q8_0" if shape[-1] % BLOCK == 0 else "F16"  # as llama.cpp falls back
        shift = norm_shift if name.endswith("norm.weight") else 0.0
        tensors.append(RandomTensor(name, shape, kind, seed * 1_000_003 + index, device, shift))
    return tensors


def check_gemma4_sharing(config: Gemma4Config) -> None:
    """Raise ValueError unless llama.cpp's KV-sharing rule gives the donors HF's does: llama.cpp
    lends a sharing layer the last owner's cache (full) or the one before's (sliding)."""
    if not config.num_kv_shared_layers:
        return
    owners = config.cache_layer_types
    if owners[-2:] != (SLIDING_ATTENTION, FULL_ATTENTION):
        raise ValueError(
            "llama.cpp needs the last two layers before the KV-sharing ones to be sliding, "
            f"then full; this config has {owners[-2:]}"
        )


def check_gguf_layout(config: Gemma3Config) -> None:
    """Raise ValueError unless llama.cpp and Hearth would read `config` back from a GGUF,
    which stores neither the layer pattern nor the attention scale."""
    expected = tuple(
        FULL_ATTENTION if (i + 1) % GGUF_SLIDING_PATTERN == 0 else "sliding_attention"
        for i in range(config.num_hidden_layers)
    )
    if config.layer_types != expected:
        raise ValueError(
            f"a gemma3 GGUF implies every {GGUF_SLIDING_PATTERN}th layer is full attention; "
            "this config's layer_types differ"
        )
    if config.query_pre_attn_scalar != config.head_dim and config.hidden_size != 5376:
        raise ValueError(
            "a gemma3 GGUF implies query_pre_attn_scalar == head_dim (27B aside); "
            f"this config has {config.query_pre_attn_scalar} and {config.head_dim}"
        )


def write_random_gguf(
    path: Path,
    config: Mapping[str, Any],
    tokenizer: Mapping[str, Any],
    ggml_type: str = "F16",
    seed: int = 0,
    device: str = "cpu",
) -> tuple[Path, dict[str, Any]]:
    """Write a random Gemma 3 or Gemma 4 GGUF of `config` with `tokenizer` metadata.

    The vocabulary size becomes the tokenizer's token count (llama.cpp requires the two to
    agree; HF configs pad it, e.g. 262208 for 262144 tokens). Returns the path and the config
    as written.
    """
    tokens = tokenizer.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the tokenizer metadata has no tokenizer.ggml.tokens")
    config = {**dict(config), "vocab_size": len(tokens)}
    parsed = parse_config(config)
    if isinstance(parsed, Gemma3Config):
        check_gguf_layout(parsed)
    else:
        check_gemma4_sharing(parsed)
    tensors = [t.as_gguf() for t in random_tensors(parsed, ggml_type, seed, device)]
    return stream_gguf(path, config, tensors, tokenizer), config


def embedded_tokenizer() -> dict[str, Any]:
    """The embedded Gemma 3 model's tokenizer metadata (262144 tokens, Gemma 3's vocabulary)."""
    from hearth.checkpoint.gguf_file import GGUFFile
    from hearth.embedded import embedded_model_path

    return tokenizer_metadata(GGUFFile(embedded_model_path()).metadata)
