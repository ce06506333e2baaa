"""Attention over a KV cache's view: masks, the cache write of a decode step, and the kernel
each case takes (the native CPU one-query kernel, Triton's decode kernel reading the cache's
planes as stored, SDPA's flash kernel, Triton's position-masked prefill kernel, or SDPA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hearth.kv.cache import KVView, LayerCache, Segment
from hearth.layers.linear import StackedLinear, project, project_for_norm
from hearth.layers.norm import RMSNorm
from hearth.ops import kernel_enabled, native
from hearth.ops.decode_attention import decode_attention as decode_attention_kernel
from hearth.ops.decode_attention import formats_of
from hearth.ops.norm import Partials
from hearth.ops.paged_attention import paged_decode_attention
from hearth.ops.prefill_attention import prefill_attention
from hearth.ops.rope import CacheWrite, ValueMode, norm_rope
from hearth.quant.kv_codecs import DENSE

Blocks = tuple[tuple[int, int], ...]  # [start, end) position runs that see each other whole


def attention_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    blocks: Blocks = (),
    window_bounds_blocks: bool = True,
) -> torch.Tensor:
    """Boolean [queries, keys]: causal, or both in one of `blocks` (an image's soft tokens),
    and within `window` keys (q − k < window) if given, as HF composes Gemma 4's sliding mask.
    Without `window_bounds_blocks` the window bounds only the causal part and a block is seen
    whole (HF's `gemma4_unified` forward, Gemma 3's composition)."""
    distance = query_positions[:, None] - key_positions[None, :]
    allowed = distance >= 0
    if window is not None and not window_bounds_blocks:
        allowed &= distance < window
    for start, end in blocks:
        in_query = (query_positions >= start) & (query_positions < end)
        in_key = (key_positions >= start) & (key_positions < end)
        allowed |= in_query[:, None] & in_key[None, :]
    if window is not None and window_bounds_blocks:
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
    q: torch.Tensor,
    view: KVView,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
    blocks: Blocks = (),
    window_bounds_blocks: bool = True,
) -> torch.Tensor:
    """q [batch, heads, queries, dim] over a cache view; softmax in fp32, GQA by grouping.

    One query on the GPU: the Triton decode kernel, which reads the cache's planes as stored
    (dense, affine or TurboQuant) and masks by position on the device; several: the Triton
    prefill (flash) kernel over the view's exact K/V. With `blocks` (a prompt's images seen
    whole): SDPA under the explicit mask. A paged view (a batched decode step: one query per
    sequence, the B queries side by side): attention over each row's blocks of the pool.
    """
    if view.paged is not None:
        return _paged_attention(q, view, window, scale)
    if view.segments is not None:
        return _segmented_attention(q, view.segments, positions, window, scale)
    if blocks:
        key_positions = view.positions
        if key_positions is None:
            key_positions = torch.arange(view.length, device=q.device)
        keys, values = view.real()
        mask = attention_mask(
            positions, key_positions[: view.length], window, blocks, window_bounds_blocks
        )
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != keys.shape[1]
        )
    if view.mask is not None:  # several sequences side by side (`SequenceBatch`)
        keys, values = view.real()
        grouped = q.shape[1] != keys.shape[1]
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=view.mask, scale=scale, enable_gqa=grouped
        )
    if q.shape[2] == 1 and kernel_enabled(q):
        return _kernel_decode_attention(q, view, positions, window, scale)
    if kernel_enabled(q):
        keys, values = view.real()
        if _plainly_causal(q, view, window):
            # SDPA's flash kernel: faster than ours where it applies (docs/kernels.md).
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


def _segmented_attention(
    q: torch.Tensor,
    segments: tuple[Segment, ...],
    positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """A ragged forward's queries, each sequence's run over its own view, as that sequence's
    chunk alone is attended (the same kernel on the same keys)."""
    outputs = []
    start = 0
    for view, queries, _ in segments:
        end = start + queries
        outputs.append(attend(q[:, :, start:end], view, positions[start:end], window, scale))
        start = end
    return torch.cat(outputs, dim=2)


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


def _paged_attention(
    q: torch.Tensor, view: KVView, window: int | None, scale: float
) -> torch.Tensor:
    """q [1, heads, B, dim] (sequence b's query the b-th token) -> [1, heads, B, dim]."""
    assert view.paged is not None and view.stored is not None
    planes, codec = view.stored
    key_format, value_format, key_planes = formats_of(codec)
    out = paged_decode_attention(
        q[0].transpose(0, 1).contiguous(),
        planes[:key_planes],
        planes[key_planes:],
        key_format,
        value_format,
        view.paged.tables,
        view.paged.positions,
        window,
        scale,
    )
    return out.transpose(0, 1).unsqueeze(0)


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
    """Where a one-token GPU step writes K/V directly (the norm + RoPE kernel stores them)."""
    if tokens != 1 or cache is None:
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
        assert cache is not None
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


class SequenceBatch:
    """One layer's caches of several sequences whose tokens one forward computes side by side,
    each sequence's new tokens a run of the forward's tokens (`counts`, in order): each cache
    stores its own sequence's K/V, and attention sees all their keys in one view whose mask
    keeps every query to its own sequence (and to its causal window there)."""

    def __init__(self, caches: Sequence[LayerCache], counts: Sequence[int]) -> None:
        self.caches = list(caches)
        self.counts = list(counts)

    def decode_write(self, positions: torch.Tensor) -> None:
        """No kernel writes several caches at once: K/V come back to `update_and_fetch`."""
        return None

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        assert positions is not None, "a batch's tokens carry their positions"
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        masks = []
        start = 0
        for cache, count in zip(self.caches, self.counts, strict=True):
            end = start + count
            own = positions[start:end]
            view = cache.update_and_fetch(keys[:, :, start:end], values[:, :, start:end], own)
            parts.append(view.real())
            mask = view_mask(own, view, cache.window)
            masks.append(
                mask if mask is not None else own.new_ones((count, view.length), dtype=torch.bool)
            )
            start = end
        merged_keys = torch.cat([k for k, _ in parts], dim=2)
        merged_values = torch.cat([v for _, v in parts], dim=2)
        mask = torch.block_diag(*masks)
        return KVView(merged_keys, merged_values, merged_keys.shape[2], None, mask=mask)


class RaggedBatch:
    """One layer's caches of several sequences whose prompt chunks one forward computes, their
    tokens side by side (`counts`, in order): each cache stores its own sequence's K/V and
    each sequence's queries attend over its own view only (`KVView.segments`), as its chunk
    would alone. `last_needed`: the sequences whose last position's logits are asked."""

    def __init__(
        self, caches: Sequence[LayerCache], counts: Sequence[int], last_needed: Sequence[bool]
    ) -> None:
        self.caches = list(caches)
        self.counts = list(counts)
        self.last_needed = list(last_needed)

    def decode_write(self, positions: torch.Tensor) -> None:
        """No kernel writes several caches at once: K/V come back to `update_and_fetch`."""
        return None

    def update_and_fetch(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor | None = None
    ) -> KVView:
        assert positions is not None, "a ragged batch's tokens carry their positions"
        segments = []
        start = 0
        for cache, count, needed in zip(self.caches, self.counts, self.last_needed, strict=True):
            end = start + count
            own = positions[start:end]
            view = cache.update_and_fetch(keys[:, :, start:end], values[:, :, start:end], own)
            segments.append(Segment(view, count, needed))
            start = end
        return KVView(None, None, 0, None, segments=tuple(segments))


def last_queries(view: KVView) -> KVView:
    """A ragged view as the layers after the model drops all but the asked last positions
    read it: the segments whose logits are asked, one query each (any other view as is)."""
    if view.segments is None:
        return view
    kept = tuple(Segment(s.view, 1, True) for s in view.segments if s.last_needed)
    return view._replace(segments=kept)


def numbered(view: KVView) -> KVView:
    """`view` with its keys' positions spelled out (0..length-1 where implicit), so one query
    that is not the last key masks the keys after it."""
    if view.positions is not None or view.keys is None:
        return view
    numbered = torch.arange(view.length, device=view.keys.device)
    return KVView(view.keys, view.values, view.length, numbered, view.stored)


class Attention(nn.Module):
    """A decoder layer's self-attention: stacked q/k/v, per-head q/k RMSNorm and RoPE (one
    kernel on the GPU, which at a decode step also writes K/V into the cache), attention over
    the cache's view, o_proj.

    `value_mode` says how V is made: as projected (Gemma 3), RMS-normalised without a weight
    (Gemma 4), the normalised raw K (Gemma 4's k_eq_v layers, no v_proj), or not at all (a
    KV-sharing layer: only q_proj, attending over its donor's view).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        window: int | None,
        value_mode: ValueMode = ValueMode.RAW,
        window_bounds_blocks: bool = True,
    ) -> None:
        super().__init__()
        self.window_bounds_blocks = window_bounds_blocks  # see `attention_mask`
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.eps = eps
        self.scale = scale
        self.window = window
        self.value_mode = value_mode
        self.shares_kv = value_mode == ValueMode.ABSENT
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        parts = {"q_proj": q_dim}
        if not self.shares_kv:
            parts["k_proj"] = kv_dim
            if value_mode != ValueMode.UNIT_NORM_OF_K:
                parts["v_proj"] = kv_dim
            self.k_norm = RMSNorm(head_dim, eps)
        self.qkv_proj = StackedLinear(hidden, parts)
        self.q_norm = RMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(q_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: LayerCache | None,
        shared: KVView | None = None,
        blocks: Blocks = (),
    ) -> tuple[torch.Tensor | Partials, KVView]:
        """The output (for the layer's add-norm: `project_for_norm`) and the K/V view attended
        over, which KV-sharing layers get as `shared`; `blocks`: see `attention_mask`."""
        batch, length, _ = x.shape
        cos, sin = rope
        write = decode_write(cache, positions, batch * length) if shared is None else None
        q, k, v = norm_rope(
            project(self.qkv_proj.proj, x, wide=True).flatten(0, 1),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.q_norm.weight,
            None if self.shares_kv else self.k_norm.weight,
            cos[:, 0],
            sin[:, 0],
            self.eps,
            self.value_mode,
            write,
        )
        q = q.unflatten(0, (batch, length)).transpose(1, 2)
        if shared is not None:
            view = shared
        else:
            view = store_keys_values(cache, write, k, v, positions, (batch, length))
        out = attend(q, view, positions, self.window, self.scale, blocks, self.window_bounds_blocks)
        heads = out.transpose(1, 2).reshape(batch, length, -1)
        return project_for_norm(self.o_proj, heads), view
