"""Gemma 3 text decoder in PyTorch.

Module and parameter names follow HF transformers (without the `model.` prefix), so canonical
checkpoint tensors load by name. Norms and softmax run in fp32; matmuls in the model dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hearth import native
from hearth.config import SLIDING_ATTENTION, Gemma3Config, RopeConfig
from hearth.kernels import kernel_enabled
from hearth.kernels.activation import gelu_tanh_mul
from hearth.kernels.affine_matmul import CodesMajor
from hearth.kernels.decode_attention import decode_attention as decode_attention_kernel
from hearth.kernels.decode_attention import formats_of
from hearth.kernels.gemv import gemv, has_pinned_launch
from hearth.kernels.norm import Partials, add_rms_norm, rms_norm
from hearth.kernels.prefill_attention import prefill_attention
from hearth.kernels.rope import CacheWrite, ValueMode, norm_rope, rotary_tables
from hearth.kv.cache import DENSE, KVView, LayerCache
from hearth.kv.static import StaticCache
from hearth.models import gemma_native
from hearth.native.bf16_gemm import linear as cpu_linear


class StackedLinear(nn.Module):
    """Several projections of one input as one matmul (fewer, larger kernels per token).

    Checkpoints store the parts separately; the loader stacks them along the output dim in
    `parts` order, so `layers.0.self_attn.k_proj.weight` fills the middle of `qkv_proj`.
    """

    def __init__(self, in_features: int, parts: dict[str, int]) -> None:
        super().__init__()
        self.parts = dict(parts)
        self.proj = nn.Linear(in_features, sum(parts.values()), bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.proj(x).split(list(self.parts.values()), dim=-1)


def is_float_linear(module: nn.Module) -> bool:
    """A plain float projection without bias: what the GEMV kernels take in its place."""
    return isinstance(module, nn.Linear) and module.bias is None


def project(
    linear: nn.Module, x: torch.Tensor, geglu: bool = False, prefer_cublas: bool = False
) -> torch.Tensor:
    """`linear(x)` (after GeGLU of a stacked gate/up x if asked); float weights go through
    `gemv`, which at a GPU decode step is one kernel with no split-K reduce launches.
    `prefer_cublas`: a projection with many outputs (qkv, gate/up), which cuBLAS reads near
    copy bandwidth: it takes the GEMV only at a shape with a pinned launch (measured faster
    than cuBLAS there) or under WIDE_GEMV; the switches below pick the measured-faster path."""
    float_weight = is_float_linear(linear)
    if geglu and not (FUSED_GEGLU and float_weight):
        x, geglu = gelu_tanh_mul(x), False
        prefer_cublas = not DOWN_GEMV  # down, after the GeGLU kernel
    if float_weight and not geglu and (y := native.row_matmul(x, linear.weight)) is not None:
        return y  # a CPU bf16 decode step
    if float_weight and (WIDE_GEMV or not prefer_cublas or has_pinned_launch(x, linear.weight)):
        return gemv(x, linear.weight, geglu)
    if float_weight and x.device.type == "cpu":
        return cpu_linear(x, linear.weight)  # a CPU prefill: an fp32 GEMM where bf16 is slow
    return linear(x)


def project_for_norm(
    linear: nn.Module, x: torch.Tensor, geglu: bool = False
) -> torch.Tensor | Partials:
    """`project(linear, x, geglu)` for a residual add-norm to read (o_proj, down): an
    MLX-packed weight whose GPU GEMV splits K leaves its partials for the norm kernel to add
    (`norm.Partials`), so the GEMV's own sum launch goes (SPLITS_TO_NORM)."""
    split_partials = getattr(linear, "split_partials", None)
    if not (SPLITS_TO_NORM and split_partials is not None):
        return project(linear, x, geglu)
    x = gelu_tanh_mul(x) if geglu else x
    partials = split_partials(x)
    return linear(x) if partials is None else partials


# A K-split 4-bit GEMV before a residual add-norm hands the norm kernel its partials rather
# than adding them in a launch of its own (`project_for_norm`). A/B on an H100, logits
# bit-identical: 4-bit decode 12B 240.4 -> 244.6 tok/s (+1.7%), E4B +0.5%, 26B-A4B +0.1%
# (o_proj only there; benchmarks/results/ab_*_4bit_split_norm_h100-2026-12-06.md). An A/B
# switch.
SPLITS_TO_NORM = True
# The pre-feed-forward add-norm stores its output codes-major where the 4-bit gate/up GEMV
# after it reads x so (`CodesMajor`), so that GEMV's own x reorder launch goes. An A/B switch.
NORM_STORES_CODES_MAJOR = True
# A 4-bit gate/up GEMV without a K split stores gelu_tanh(gate) · up itself (its programs
# pair gate and up rows), so the GeGLU launch goes; the same bits. An A/B switch.
GATE_UP_STORES_GEGLU = True


def codes_major_input(linear: nn.Module, x: torch.Tensor) -> tuple[int, int] | None:
    """What `linear`'s GPU GEMV wants x's producer to store it as (`CodesMajor`'s codes per
    word and words per block), or None: input order (NORM_STORES_CODES_MAJOR)."""
    wanted = getattr(linear, "codes_major_input", None)
    return wanted(x) if NORM_STORES_CODES_MAJOR and wanted is not None else None


def ordered_input(normed: torch.Tensor, order: tuple[int, int] | None, shape: torch.Size):
    """A norm stored as `order` asked (see `codes_major_input`), typed for the GEMV to read."""
    return normed if order is None else CodesMajor(normed, shape)


# GeGLU inside the down projection's GEMV: off, as measured slower than the GeGLU kernel
# and then the GEMV (each program recomputes GeGLU for its slice of K): -1.4% vs cuBLAS down,
# -2.4% vs the Triton GEMV on 12B decode (results/ab_12b_pdl*-2026-12-03.md).
FUSED_GEGLU = False
# qkv and gate/up through the Triton GEMV as well: off, cuBLAS reads them at ~97% of copy
# bandwidth; -3.8% on 12B decode (results/ab_12b_pdl-2026-12-03.md). An A/B switch.
WIDE_GEMV = False
# down after the GeGLU kernel through the Triton GEMV rather than cuBLAS (which splits K and
# adds a memset and a reduce kernel): +1.0% on 12B decode with PDL
# (results/ab_12b_pdl_choices-2026-12-03.md).
DOWN_GEMV = True


class RMSNorm(nn.Module):
    """x̂ · weight, computed in fp32 and cast back; `weight` is kept in fp32.

    Gemma 3 checkpoints hold w and the norm multiplies by 1 + w: the loader stores 1 + w
    here once (`Gemma3Model.module_tensor`), rather than adding it on every call.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin for absolute positions, built in fp32 then cast to the activations' dtype."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # Built on the CPU explicitly: models are constructed on the meta device.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (rope.theta**exponents) / rope.linear_factor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos, sin as [tokens, 1, head_dim] (activations are [batch, tokens, heads, dim])."""
        return rotary_tables(positions, self.inv_freq, dtype)


def attention_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None
) -> torch.Tensor:
    """Boolean [queries, keys]: causal, and within `window` keys (q − k < window) if given."""
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance < window
    return allowed


def _slow_half_sdpa(q: torch.Tensor) -> bool:
    """PyTorch's CPU SDPA is ~3x slower in bf16/fp16 than two matmuls for one query."""
    return q.device.type == "cpu" and q.dtype != torch.float32


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, length: int
) -> torch.Tensor:
    """One query per head over the first `length` keys of K/V, in fp32; output in q's dtype.

    One 2-D matmul pair per KV head over the filled keys only, in fp32: on the CPU a bf16
    matmul of these shapes ([4, 256] @ [256, 512]) takes ~35 µs against ~10 in fp32, more than
    the conversion saves, and batched (3-D/4-D) ones take a slower path still.
    """
    kernels = native.for_cpu_bf16(q, k, v)
    if kernels is not None and native.attention_layout(k, v):
        return kernels.decode_attention(q.contiguous(), k, v, scale, length)
    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch * kv_heads, heads // kv_heads, dim).float()
    keys, values = k[:, :, :length].flatten(0, 1), v[:, :, :length].flatten(0, 1)
    outputs = []
    for index in range(batch * kv_heads):
        scores = (grouped[index] @ keys[index].float().T) * scale
        outputs.append(scores.softmax(dim=-1) @ values[index].float())
    return torch.stack(outputs).to(q.dtype).reshape(batch, heads, 1, dim)


def attend(
    q: torch.Tensor, view: KVView, positions: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    """q [batch, heads, queries, dim] over a cache view; softmax in fp32, GQA by grouping.

    One query on the GPU: the Triton decode kernel, which reads the cache's planes as stored
    (dense, affine or TurboQuant) and masks by position on the device; several: the Triton
    prefill (flash) kernel over the view's exact K/V.
    """
    if q.shape[2] == 1 and kernel_enabled(q):
        return _kernel_decode_attention(q, view, positions, window, scale)
    if kernel_enabled(q):
        keys, values = view.real()
        if _plainly_causal(q, view, window):
            # SDPA's flash kernel: 20 µs vs ~300 for ours at 512 tokens, 262 vs 329 at 4096
            # on an H200 (results/gpu_kernels_prefill_attention-2026-12-03.md).
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
            )
        # Otherwise a flash kernel masking by position (SDPA with a bool mask cannot use its
        # flash path, and at head_dim 512 falls to slow kernels).
        key_positions = view.positions
        if key_positions is None:
            key_positions = torch.arange(view.length, device=q.device)
        return prefill_attention(q, keys, values, positions, key_positions, window, scale)
    mask = view_mask(positions, view, window)
    if q.shape[2] == 1 and mask is None and _slow_half_sdpa(q):
        return decode_attention(q, view.keys, view.values, scale, view.length)
    keys, values = view.real()
    grouped = q.shape[1] != keys.shape[1]
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=grouped
    )


def _plainly_causal(q: torch.Tensor, view: KVView, window: int | None) -> bool:
    """Whether the queries are exactly the view's keys 0..length-1 (a fresh prefill chunk) and
    the window does not bind: then the mask is SDPA's `is_causal` (top-left aligned, which
    equals ours only when queries and keys coincide). Flash attention stops at head_dim 256."""
    length = view.length
    return (
        view.positions is None
        and q.shape[2] == length
        and (window is None or length <= window)
        and q.shape[-1] <= 256
    )


def _kernel_decode_attention(
    q: torch.Tensor, view: KVView, positions: torch.Tensor, window: int | None, scale: float
) -> torch.Tensor:
    if view.stored is not None:
        planes, codec = view.stored
    else:
        planes, codec = view.real(), DENSE
    key_format, value_format, key_planes = formats_of(codec)
    if view.positions is None:
        # Keys 0..length-1 in order, the query last. The window still applies: a KV-sharing
        # layer's one query reads its donor's whole first chunk, which may be longer.
        slots = torch.arange(view.length, device=q.device)
        query_position = slots[-1]
    else:
        slots, query_position = view.positions[: view.length], positions.reshape(())
    out = decode_attention_kernel(
        q[:, :, 0],
        planes[:key_planes],
        planes[key_planes:],
        key_format,
        value_format,
        slots,
        query_position,
        window,
        scale,
    )
    return out.unsqueeze(2)


def decode_write(
    cache: LayerCache | None, positions: torch.Tensor, tokens: int
) -> CacheWrite | None:
    """Where a one-token step writes K/V directly: a dense static cache on the GPU."""
    if tokens != 1 or not isinstance(cache, StaticCache):
        return None
    return cache.decode_write(positions)


def store_keys_values(
    cache: LayerCache | None,
    write: CacheWrite | None,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    batch_length: tuple[int, int],
) -> KVView:
    """The view attention reads after K/V [tokens, Hk, D] were made (or written by `write`)."""
    if write is not None:
        assert isinstance(cache, StaticCache)
        return cache.view_after_write()
    assert k is not None and v is not None
    k, v = (t.unflatten(0, batch_length).transpose(1, 2) for t in (k, v))
    if cache is None:
        return KVView(k, v, k.shape[2], None)
    return cache.update_and_fetch(k, v, positions)


def view_mask(positions: torch.Tensor, view: KVView, window: int | None) -> torch.Tensor | None:
    """The causal/sliding mask of queries at `positions` over a view; None when all visible."""
    key_positions = view.positions
    if key_positions is None:
        # Keys are positions 0..length-1 in order: one query at the end needs no causal mask.
        if positions.shape[0] == 1 and (window is None or view.length <= window):
            return None
        key_positions = torch.arange(view.length, device=positions.device)
    return attention_mask(positions, key_positions, window)


class Attention(nn.Module):
    def __init__(self, config: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.attention_scale
        self.window = config.sliding_window if layer_type == SLIDING_ATTENTION else None
        hidden, q_dim, kv_dim = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        self.qkv_proj = StackedLinear(hidden, {"q_proj": q_dim, "k_proj": kv_dim, "v_proj": kv_dim})
        self.o_proj = nn.Linear(q_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: LayerCache | None,
    ) -> torch.Tensor | Partials:
        """The attention output, for the layer's add-norm (`project_for_norm`)."""
        batch, length, _ = x.shape
        cos, sin = rope
        write = decode_write(cache, positions, batch * length)
        # Norms, rotation and the V split in one kernel on the GPU (the torch reference here),
        # which at a GPU decode step also stores K/V in the cache.
        q, k, v = norm_rope(
            project(self.qkv_proj.proj, x, prefer_cublas=True).flatten(0, 1),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.q_norm.weight,
            self.k_norm.weight,
            cos[:, 0],
            sin[:, 0],
            self.q_norm.eps,
            ValueMode.RAW,
            write,
        )
        q = q.unflatten(0, (batch, length)).transpose(1, 2)
        view = store_keys_values(cache, write, k, v, positions, (batch, length))
        out = attend(q, view, positions, self.window, self.scale)
        return project_for_norm(self.o_proj, out.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """GeGLU: down(gelu_tanh(gate(x)) · up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = StackedLinear(
            hidden, {"gate_proj": intermediate, "up_proj": intermediate}
        )
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor | CodesMajor) -> torch.Tensor:
        return project(self.down_proj, *self._hidden(x))

    def for_norm(self, x: torch.Tensor | CodesMajor) -> torch.Tensor | Partials:
        """`forward(x)` for a residual add-norm to read (`project_for_norm`)."""
        return project_for_norm(self.down_proj, *self._hidden(x))

    def input_order(self, x: torch.Tensor) -> tuple[int, int] | None:
        """How x's producer should store it for gate/up (`codes_major_input`)."""
        return codes_major_input(self.gate_up_proj.proj, x)

    def _hidden(self, x: torch.Tensor | CodesMajor) -> tuple[torch.Tensor, bool]:
        """gate/up's output, and whether the GeGLU is still to be applied: a packed gate/up
        whose GEMV stores gelu_tanh(gate) · up itself (GATE_UP_STORES_GEGLU) has applied it."""
        stores = getattr(self.gate_up_proj.proj, "geglu_out", None)
        if GATE_UP_STORES_GEGLU and stores is not None and (hidden := stores(x)) is not None:
            return hidden, False
        return project(self.gate_up_proj.proj, x, prefer_cublas=True), True


class DecoderLayer(nn.Module):
    """The four-norm sandwich: norm → attention → norm → add; norm → MLP → norm → add."""

    def __init__(self, config: Gemma3Config, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        eps = config.rms_norm_eps
        self.self_attn = Attention(config, layer_type)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        normed_input: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: LayerCache | None,
        next_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream after this layer and its norm by `next_norm`.

        `normed_input` is `input_layernorm(x)`, computed by the layer before (fused with its
        last residual add): each norm here is fused with the add before it.
        """
        attended = self.self_attn(normed_input, rope, positions, cache)
        order = self.mlp.input_order(x)
        x, normed = add_rms_norm(
            x,
            attended,
            self.post_attention_layernorm.weight,
            self.post_attention_layernorm.eps,
            self.pre_feedforward_layernorm.weight,
            normalize_next=True,
            codes_major=order,
        )
        assert normed is not None
        post_ff = self.post_feedforward_layernorm
        hidden = self.mlp.for_norm(ordered_input(normed, order, x.shape))
        x, normed_next = add_rms_norm(
            x, hidden, post_ff.weight, post_ff.eps, next_norm.weight, True
        )
        assert normed_next is not None
        return x, normed_next


def last_of(x: torch.Tensor, last_index: torch.Tensor | None) -> torch.Tensor:
    """x[:, last_index] kept as a length-1 dim (the last token when `last_index` is None)."""
    return x[:, -1:] if last_index is None else x.index_select(1, last_index.reshape(1))


class Embedding(nn.Embedding):
    """The token table, which is also the tied output head."""

    def reset_parameters(self) -> None:
        """nn.Embedding's random init, except on the meta device (where a model is built before
        its checkpoint fills it): there normal_ would import torch._dynamo, a second of a CPU
        load, and nothing else needs it."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def embed(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        y = native.row_matmul(x, self.weight)  # a CPU bf16 decode step
        return F.linear(x, self.weight) if y is None else y


class Gemma3Model(nn.Module):
    """Embedding (scaled by √hidden in the weight dtype), decoder layers, final norm, tied head."""

    def __init__(self, config: Gemma3Config, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.compute_dtype = dtype
        self.embed_tokens: nn.Module = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, kind) for kind in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = nn.ModuleDict(
            {kind: RotaryEmbedding(config.head_dim, rope) for kind, rope in config.rope.items()}
        )

    def module_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A canonical checkpoint tensor as this module stores it.

        Norm weights become 1 + w in fp32, from w rounded to the compute dtype first, which
        is what HF computes on every call (`1.0 + weight.float()` on a weight of that dtype).
        """
        tensor = tensor.to(self.compute_dtype)
        return 1.0 + tensor.float() if name.endswith("norm.weight") else tensor

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        caches: list[LayerCache] | None = None,
        start: int | torch.Tensor = 0,
        last_only: bool = False,
        last_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [batch, tokens, vocab] (or [batch, 1, vocab] with `last_only`).

        `last_index` (with `last_only`; a device scalar): the chunk's last real token, when
        the chunk is padded past it (a CUDA-graph prefill); the last token otherwise.
        """
        x = self.embed_tokens.embed(input_ids, self.compute_dtype)
        # HF scales by √hidden rounded to the table's dtype (25.25, not 25.298, in bf16).
        x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=x.dtype)
        # `start` may be a device tensor, so a captured decode step reads it at replay.
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + start
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        normed = self.layers[0].input_layernorm(x)
        natively = gemma_native.applies(x, caches)  # a CPU bf16 decode step
        for index, layer in enumerate(self.layers):
            cache = caches[index] if caches is not None else None
            following = index + 1 < len(self.layers)
            next_norm = self.layers[index + 1].input_layernorm if following else self.norm
            rope = ropes[layer.layer_type]
            if natively and gemma_native.decode_layer(layer, x, normed, rope, cache, next_norm):
                continue
            x, normed = layer(x, normed, rope, positions, cache, next_norm)
        x = last_of(normed, last_index) if last_only else normed  # normed by the last layer
        tied = self.config.tie_word_embeddings
        logits = self.embed_tokens.head(x) if tied else self.lm_head(x)
        softcap = self.config.final_logit_softcapping
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return logits
