"""End-to-end A/B of variants: batch-1 CUDA-graph decode tok/s (or prefill tok/s) per variant.

Each variant patches module globals (kernel launch defaults) for its timings only. Variants
alternate for several rounds in one process, on one random-weight model at a time, so drift
of the machine hits them alike; the median counts.

    OUT=/tmp/out python benchmarks/ab_decode.py --models gemma3-12b --variants base,attn-n32
    OUT=/tmp/out python benchmarks/ab_decode.py --models 26b-a4b --prefill 4096 \
        --variants base,grouped-m64
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from datetime import date
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton

import hearth.ops
from hearth.bench.measure import (
    copy_bandwidth,
    decode_bytes,
    fill_caches,
    kv_bytes,
    prefill_flops,
    time_decode,
    time_prefill,
)
from hearth.bench.random_model import PRESETS, build_random_model
from hearth.models import gemma, gemma4
from hearth.ops import (
    activation,
    affine_matmul,
    gemv,
    grouped_matmul,
    norm,
    prefill_attention,
    rope,
    router,
)
from hearth.ops import decode_attention as attention
from hearth.ops import launch as fast_launch
from hearth.runtime import graphs as cuda_graph
from hearth.runtime.generate import default_prefill_step
from hearth.runtime.graphs import GraphDecoder

Patch = Callable[[], contextlib.AbstractContextManager]


def _few_heads_tiles(
    block_n: int, warps: int, stages: int
) -> Callable[[], contextlib.AbstractContextManager]:
    """Dense decode attention at fixed tiles where few (batch, KV head) rows read the cache
    (`attention.FEW_KV_ROWS`); other launches keep their defaults."""
    original = attention._default_tiles

    def tiles(head_dim: int, key_format, value_format, kv_rows: int = 0):
        dense = key_format.kind == value_format.kind == "dense"
        if dense and 0 < kv_rows <= attention.FEW_KV_ROWS:
            return attention._Launch(block_n, warps, stages, False)
        return original(head_dim, key_format, value_format, kv_rows)

    return lambda: mock.patch.object(attention, "_default_tiles", tiles)


def _dense_tiles(
    block_n: int, warps: int, stages: int
) -> Callable[[], contextlib.AbstractContextManager]:
    """Dense decode attention at fixed tiles (quantized formats keep their defaults)."""
    original = attention._default_tiles

    def tiles(head_dim: int, key_format, value_format, kv_rows: int = 0):
        if key_format.kind == value_format.kind == "dense":
            return attention._Launch(block_n, warps, stages, False)
        return original(head_dim, key_format, value_format, kv_rows)

    return lambda: mock.patch.object(attention, "_default_tiles", tiles)


def _stacked(*patches: Patch) -> Patch:
    @contextlib.contextmanager
    def apply() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch())
            yield

    return apply


def _set(
    module: object, name: str, value: object
) -> Callable[[], contextlib.AbstractContextManager]:
    return lambda: mock.patch.object(module, name, value)


FUSED_MERGE = _set(attention, "FUSED_MERGE_MAX_BYTES", 1 << 40)


def _gemv_rule(name: str, value: object) -> Patch:
    """`_set` of a switch that `gemv_config` reads: its cached launches are dropped on the
    way in and out, so that neither the variant nor base keeps the other's."""

    @contextlib.contextmanager
    def patched() -> Iterator[None]:
        affine_matmul.gemv_config.cache_clear()
        try:
            with mock.patch.object(affine_matmul, name, value):
                yield
        finally:
            affine_matmul.gemv_config.cache_clear()

    return patched


def _prefill_attention_d512(config: prefill_attention.LaunchConfig) -> Patch:
    """Prefill attention tiles `config` at head dim 512 in bf16/fp16 (other shapes keep theirs)."""
    original = prefill_attention.default_config

    def chosen(head_dim: int, dtype: torch.dtype) -> prefill_attention.LaunchConfig:
        if head_dim > 256 and dtype != torch.float32:
            return config
        return original(head_dim, dtype)

    return _set(prefill_attention, "default_config", chosen)


def _gemv4_rows(block_n: int, block_g: int = 0) -> Patch:
    """4-bit GEMV launches without a K split (but the head) at `block_n` rows per program
    (and `block_g` groups per step, if given)."""
    original = affine_matmul.gemv_config

    def config(n: int, k: int, bits: int, group: int, multiprocessors: int = 132):
        chosen = original(n, k, bits, group, multiprocessors)
        if bits == 4 and chosen.split_k == 1 and n < affine_matmul.HEAD_ROWS:
            return dataclasses.replace(chosen, block_n=block_n, block_g=block_g or chosen.block_g)
        return chosen

    return lambda: mock.patch.object(affine_matmul, "gemv_config", config)


def _gemv4_split(codes_major_x: bool, unsplit_below_k: int = 0) -> Patch:
    """4-bit GEMV launches with a K split: x codes-major too, and (for K below
    `unsplit_below_k`) no split at all, 32 rows per program."""
    original = affine_matmul.gemv_config

    def config(n: int, k: int, bits: int, group: int, multiprocessors: int = 132):
        chosen = original(n, k, bits, group, multiprocessors)
        if bits != 4 or chosen.split_k == 1:
            return chosen
        if k < unsplit_below_k:
            return dataclasses.replace(chosen, split_k=1, codes_major_x=True)
        return dataclasses.replace(chosen, codes_major_x=codes_major_x)

    return lambda: mock.patch.object(affine_matmul, "gemv_config", config)


def _gemv_from_json() -> Patch:
    """Group-64 affine GEMVs at the launch per ("{bits}bit {N}x{K}") of a JSON file
    ($GEMV_CONFIGS_JSON): the fastest of benchmarks/gpu_gemv_affine_sweep.py (the default, in
    $OUT), or any other set; shapes it lacks keep `gemv_config`'s launch."""
    original = affine_matmul.gemv_config

    def config(n: int, k: int, bits: int, group: int, multiprocessors: int = 132):
        default = Path(os.environ.get("OUT", ".")) / f"gpu_gemv_affine_sweep_{bits}bit.json"
        chosen = json.loads(Path(os.environ.get("GEMV_CONFIGS_JSON", default)).read_text())
        fields = chosen.get(f"{bits}bit {n}x{k}") if group == 64 else None
        if fields is None:
            return original(n, k, bits, group, multiprocessors)
        return affine_matmul.GemvConfig(**fields)

    return lambda: mock.patch.object(affine_matmul, "gemv_config", config)


def _bf16_gemv_from_json(sweep: str = "gpu_gemv_bf16_sweep_pipelined") -> Patch:
    """bf16 GEMVs pinned per weight shape ("{N}x{K}") from a JSON file ($GEMV_BF16_JSON, by
    default the `sweep`'s in $OUT: the fastest of `gpu_gemv_bf16_sweep.py --pipelined`, or
    with `gpu_gemv_bf16_sweep_wide` the wide shapes where the GEMV beat cuBLAS, which the
    pin routes to the GEMV)."""

    def launches() -> dict[tuple[int, int], dict[str, int]]:
        default = Path(os.environ.get("OUT", ".")) / f"{sweep}.json"
        chosen = json.loads(Path(os.environ.get("GEMV_BF16_JSON", default)).read_text())
        return {tuple(map(int, shape.split("x"))): c for shape, c in chosen.items()}

    return lambda: mock.patch.dict(gemv.GEMV_LAUNCHES, launches())


def _unsplit_rows(rows: int, block_n: int) -> Patch:
    """The 4-bit GEMV of `rows`-row weights launched without a K split (26B-A4B's dense
    gate/up, 4224 rows: then it stores the GeGLU itself, one sum and one GeGLU launch fewer)."""
    original = affine_matmul.gemv_config

    def config(n: int, k: int, bits: int, group: int, multiprocessors: int = 132):
        if n == rows and bits == 4:
            return affine_matmul.GemvConfig(block_n, 4, prefetch=True)
        return original(n, k, bits, group, multiprocessors)

    return lambda: mock.patch.object(affine_matmul, "gemv_config", config)


def _unsplit_4bit(block_n: int, block_g: int) -> Patch:
    """Every 4-bit launch `gemv_config` splits launched unsplit instead, `block_n` rows and
    `block_g` groups a step, x in input order, no prefetching loop (the launches the gathered
    experts' sweep found fastest at a few hundred programs). Unsplit, the dense gate/up stores
    its GeGLU and o/down hand the norm a finished output: launches fewer."""
    original = affine_matmul.gemv_config

    def config(n: int, k: int, bits: int, group: int, multiprocessors: int = 132):
        chosen = original(n, k, bits, group, multiprocessors)
        if bits == 4 and chosen.split_k > 1:
            return affine_matmul.GemvConfig(block_n, block_g)
        return chosen

    return lambda: mock.patch.object(affine_matmul, "gemv_config", config)


def _gemv4_register_cap(registers: int) -> Patch:
    """4-bit launches without a K split (many row blocks: 12B gate/up, the head) with ptxas
    capped at `registers` a thread, so that more programs share an SM."""
    original = affine_matmul.gemv_config

    def config(n: int, k: int, bits: int, group: int, multiprocessors: int = 132):
        chosen = original(n, k, bits, group, multiprocessors)
        if bits == 4 and chosen.split_k == 1:
            return dataclasses.replace(chosen, max_registers=registers)
        return chosen

    return lambda: mock.patch.object(affine_matmul, "gemv_config", config)


def _affine_loop_stages(stages: int) -> Patch:
    """Every affine GEMV launch with its whole steps in a loop Triton software-pipelines
    (`GemvConfig.loop_stages`; cp.async into shared memory) instead of `prefetch`."""
    original = affine_matmul.gemv_config

    def config(n: int, k: int, bits: int, group: int, multiprocessors: int = 132):
        return dataclasses.replace(original(n, k, bits, group, multiprocessors), loop_stages=stages)

    return lambda: mock.patch.object(affine_matmul, "gemv_config", config)


def _prefetch(lines: int, slots: int, affine_lines: int | None = None) -> Patch:
    """Weight lines per row (bf16 GEMVs and float experts; the affine GEMVs too unless
    `affine_lines` says otherwise) and K/V slots (decode attention) prefetched to L2."""
    return _stacked(
        _set(hearth.ops, "PREFETCH_LINES", lines),
        _set(hearth.ops, "EXPERT_PREFETCH_LINES", lines),
        _set(hearth.ops, "AFFINE_PREFETCH_LINES", lines if affine_lines is None else affine_lines),
        _set(attention, "PREFETCH_SLOTS", slots),
    )


VARIANTS: dict[str, Patch] = {
    "base": contextlib.nullcontext,
    "attn-n32": _dense_tiles(32, 4, 3),
    "attn-n32-w8": _dense_tiles(32, 8, 3),
    "attn-n16": _dense_tiles(16, 4, 3),
    "attn-n64-w4": _dense_tiles(64, 4, 3),
    "attn-fused-merge": FUSED_MERGE,
    "attn-n32-fused-merge": _stacked(_dense_tiles(32, 4, 3), FUSED_MERGE),
    "attn-pps4": _set(attention, "PROGRAMS_PER_SM", 4),
    "attn-few-heads-off": _set(attention, "FEW_KV_ROWS", 0),  # every model's usual tiles
    "attn-few-n32": _few_heads_tiles(32, 4, 3),  # few KV heads: 32-slot blocks
    "attn-few-n16-w2": _few_heads_tiles(16, 2, 3),
    "attn-few-n16-s2": _few_heads_tiles(16, 4, 2),
    "attn-pps1": _set(attention, "PROGRAMS_PER_SM", 1),
    "cublas-gemv": _set(gemv, "GEMV_ROUTED_ROWS", 0),  # o_proj through cuBLAS too
    "fused-geglu-down": _set(gemma, "FUSED_GEGLU", True),  # down through the Triton GEMV
    "wide-gemv": _set(gemma, "WIDE_GEMV", True),  # qkv, gate/up through the Triton GEMV
    "norm-w4": _set(norm, "_warps", lambda columns: 4),  # RMSNorm launch width
    "norm-w16": _set(norm, "_warps", lambda columns: 16),
    "gelu-512": _set(activation, "BLOCK", 512),  # GeGLU kernel's elements per program
    "gelu-2048": _set(activation, "BLOCK", 2048),
    "rope-w4": _set(rope, "_warps", lambda head_dim: 4),  # norm_rope launch width
    "rope-w1": _set(rope, "_warps", lambda head_dim: 1),
    "down-cublas": _set(gemma, "DOWN_GEMV", False),  # down (after the GeGLU kernel): cuBLAS
    "all-gemv": _stacked(_set(gemma, "WIDE_GEMV", True), _set(gemma, "FUSED_GEGLU", True)),
    # MoE prefill tiles of at most 64 rows (no TALL_BLOCK_M at many rows per expert).
    "grouped-m64": _stacked(
        _set(grouped_matmul, "TALL_BLOCK_MIN_ROWS", 2**62),
        _set(grouped_matmul, "TALL_BLOCK_MIN_ROWS_PACKED", 2**62),
    ),
    "grouped-m256": _set(grouped_matmul, "TALL_BLOCK_M", 256),  # taller still
    "grouped-tall-from-64": _set(grouped_matmul, "TALL_BLOCK_MIN_ROWS", 64),  # bf16 too
    "plan-torch": _set(grouped_matmul, "TRITON_PLAN", False),  # MoE plan from torch ops
    "pdl-off": _set(hearth.ops, "PDL", False),  # no programmatic dependent launch
    "x-input-order": _set(affine_matmul, "GEMV_CODES_MAJOR_X", False),  # affine GEMV's x
    "gemv4-n32": _gemv4_rows(32),
    "gemv4-n128": _gemv4_rows(128),
    "gemv4-n16": _gemv4_rows(16),
    "gemv4-g8": _gemv4_rows(64, block_g=8),
    "x-codes-major-fp32": _set(affine_matmul, "CODES_MAJOR_DTYPE", torch.float32),
    "gemv4-split-x-codes-major": _gemv4_split(True),
    "gemv4-unsplit-short-k": _gemv4_split(False, unsplit_below_k=8192),
    "gemv-json": _gemv_from_json(),
    "gemv-bf16-json": _bf16_gemv_from_json(),
    "wide-gemv-json": _bf16_gemv_from_json("gpu_gemv_bf16_sweep_wide"),
    "affine-stages2": _affine_loop_stages(2),
    "affine-stages3": _affine_loop_stages(3),
    "affine-stages4": _affine_loop_stages(4),
    "gemv4-r80": _gemv4_register_cap(80),
    "codes-major-copy": _set(affine_matmul, "CODES_MAJOR_KERNEL", False),  # torch's reorder
    "gemv4-r72": _gemv4_register_cap(72),
    "narrow-cublas": _set(gemma4, "NARROW_GEMV", False),  # PLE and router projections
    "exact-codes": _set(affine_matmul, "GEMV_FOLDED_OFFSETS", False),  # a FADD per 4-bit code
    "moe-norms-apart": _set(gemma4, "FUSED_MOE_NORMS", False),  # five norm launches, not two
    "ple-geglu-apart": _set(gemma4, "FUSED_PER_LAYER_GEGLU", False),  # its own GeGLU kernel
    "ple-norm-apart": _set(gemma4, "FUSED_PER_LAYER_NORM", False),  # add_rms_norm, then gate
    "ple-norm-fused": _set(gemma4, "FUSED_PER_LAYER_NORM", True),  # in the gate's GEMV
    "triton-launch": _set(fast_launch, "FAST_LAUNCH", False),  # every launch through Triton
    # L2 prefetch before the PDL wait: weights (GEMVs, lines per row) and K/V (decode attention),
    # each variant explicit so that the A/B does not depend on the defaults
    "prefetch-off": _prefetch(0, 0),
    "prefetch-on": _prefetch(16, 64),
    "gemv-prefetch": _prefetch(16, 0),
    "gemv-prefetch-8": _prefetch(8, 0),
    "gemv-prefetch-32": _prefetch(32, 0),
    "bf16-gemv-prefetch": _prefetch(16, 0, affine_lines=0),
    "affine-prefetch-1": _prefetch(8, 0, affine_lines=1),
    "affine-prefetch-2": _prefetch(8, 0, affine_lines=2),
    "expert-prefetch-8": _set(hearth.ops, "EXPERT_PREFETCH_LINES", 8),
    "expert-prefetch-16": _set(hearth.ops, "EXPERT_PREFETCH_LINES", 16),
    "slot-sum-apart": _set(gemma4, "FUSED_SLOT_SUM", False),  # its own launch before the norm
    "expert-gate-geglu-off": _set(gemma4, "FUSED_EXPERT_GATE_GEGLU", False),  # GeGLU launch
    "route-w4": _set(router, "ROUTE_WARPS", 4),  # the routing kernel on 4 warps, not one
    "attn-prefetch": _prefetch(0, 64),
    "prefetch-lines-8": _prefetch(8, 64),
    "prefetch-lines-32": _prefetch(32, 64),
    "prefetch-lines-64": _prefetch(64, 64),
    "attn-prefetch-16": _prefetch(16, 16),
    "attn-prefetch-256": _prefetch(16, 256),
    # Prefill: the attention output head-major (a copy before o_proj); the grouped experts'
    # GeGLU in its own kernel; the down matmul scaling rows and a torch sum over the slots.
    "attn-out-head-major": _set(prefill_attention, "TOKEN_MAJOR_OUTPUT", False),
    # D=512 prefill attention: 64-row tiles, one program for all value columns (the default
    # before 2026-12-06: 128-row tiles, each program half the value columns).
    "attn512-unsplit": _prefill_attention_d512(prefill_attention.LaunchConfig(64, 32, 8, 2, 1)),
    # The affine GEMV's K-split partials added by the last split (not by a launch of their
    # own, the default since 2026-12-06; "split-sum-launch" was that A/B's variant).
    "split-sum-launch": _set(affine_matmul, "SPLIT_SUM_LAUNCH", True),
    "split-sum-last": _set(affine_matmul, "SPLIT_SUM_LAUNCH", False),
    # o_proj's and down's split partials added by their own launch, not by the norm after.
    "split-norm-apart": _set(gemma, "SPLITS_TO_NORM", False),
    # 2026-12-06 (morning, second session): the 4-bit MLP's launches fewer, each off alone
    # and both.
    "norm-order-off": _set(gemma, "NORM_STORES_CODES_MAJOR", False),
    "gate-up-geglu-off": _set(gemma, "GATE_UP_STORES_GEGLU", False),
    # The norm kernels' warps (8 from 1025 columns by default): fewer make the row's
    # reductions cheaper at one row a program.
    "norm-warps-4": _set(norm, "_warps", lambda columns: 4 if columns <= 8192 else 16),
    "norm-warps-2": _set(norm, "_warps", lambda columns: 2 if columns <= 4096 else 4),
    "norm-warps-16": _set(norm, "_warps", lambda columns: 4 if columns <= 1024 else 16),
    "gate-up-4224-unsplit-64": _unsplit_rows(4224, 64),
    "gate-up-4224-unsplit-32": _unsplit_rows(4224, 32),
    "mlp-fusions-off": _stacked(
        _set(gemma, "NORM_STORES_CODES_MAJOR", False),
        _set(gemma, "GATE_UP_STORES_GEGLU", False),
    ),
    # 2026-12-06 (third session): MoE decode's packed experts through the tile GEMV (the
    # default before), and the unrolled gathered gate/up storing the GeGLU.
    "gathered-tile": _set(affine_matmul, "GATHERED_UNROLLED", False),
    "unsplit-n32-g16": _unsplit_4bit(32, 16),
    "unsplit-n16-g16": _unsplit_4bit(16, 16),
    # 4-bit weights of few short rows split as before (`UNSPLIT_SHORT_ROWS`); the A/B's
    # variant `short-rows-480` took the rule from rows of 352 words to 480 (12B's q/k/v).
    "short-rows-split": _gemv_rule("UNSPLIT_SHORT_ROWS", False),
    # The unrolled gathered GEMV at `gemv_config`'s launch for the pairs' rows (before the
    # sweep that made `gathered_gemv_config`).
    "gathered-dense-launch": _set(
        affine_matmul,
        "gathered_gemv_config",
        lambda k, bits, group: (
            affine_matmul.GemvConfig(64, 4, prefetch=True, codes_major_x=True)
            if bits == 4
            else affine_matmul.GemvConfig(32, 8)
        ),
    ),
    "packed-gate-geglu": _set(gemma4, "FUSED_PACKED_EXPERT_GATE_GEGLU", True),
    # 2026-12-06 (fourth session): a packed token table's rows through torch's ops (the
    # default before: ~23 launches a table a step) rather than one dequantize launch.
    "embed-torch": _set(affine_matmul, "EMBED_KERNEL", False),
    # RoPE's cos/sin tables by torch's seven launches a kind, not one kernel (the default
    # since its 2026-12-06 A/B as `rotary-kernel`: +0.2 to +1.1% on an H100).
    "rotary-torch": _set(rope, "ROTARY_KERNEL", False),
    "grouped-geglu-apart": _set(gemma4, "FUSED_GROUPED_GEGLU", False),
    "prefill-slot-sum-apart": _set(gemma4, "FUSED_PREFILL_SLOT_SUM", False),
    "prefill-fusions-off": _stacked(
        _set(prefill_attention, "TOKEN_MAJOR_OUTPUT", False),
        _set(gemma4, "FUSED_GROUPED_GEGLU", False),
        _set(gemma4, "FUSED_PREFILL_SLOT_SUM", False),
    ),
    # Prefill graphs at powers of two only (up to 2x padding, not 1.5x).
    "pow2-buckets": _set(cuda_graph, "PREFILL_BUCKETS", (64, 128, 256, 512, 1024, 2048, 4096)),
    # Every prefill eager, a new decoder (caches, graphs) per request.
    "no-prefill-graphs": _stacked(
        _set(cuda_graph, "PREFILL_GRAPHS", False), _set(cuda_graph, "REUSE_DECODERS", False)
    ),
}
PEAK_FLOPS = 790e12  # bf16 dense matmul, measured on the H200 (issue 6)


@torch.inference_mode()
def _graph_logits(model, context: int, steps: int = 8) -> torch.Tensor:
    """Logits of `steps` greedy CUDA-graph decode steps after seeded random K/V."""
    torch.manual_seed(0)
    decoder = GraphDecoder(model, max_context=context + steps)
    fill_caches(decoder.caches, model, context - 1)
    decoder.length = context - 1
    token = torch.randint(0, 1000, (1, 1), device=model.device)
    logits = []
    for _ in range(steps):
        logits.append(decoder.step(token).float())
        token = logits[-1].argmax(-1, keepdim=True)
    return torch.stack(logits)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"{(a - b).abs().max():.3g}"


def _logit_checks(model, model_name: str, names: list[str], context: int) -> list[str]:
    """A row per variant: are its decode logits bit-identical to base's (else max diff)?"""
    with _variant(model, names[0]):
        base = _graph_logits(model, context)
        again = _graph_logits(model, context)
    cells = [f"{names[0]} again: " + ("bit-identical" if torch.equal(again, base) else "DIFFERS")]
    for name in names[1:]:
        with _variant(model, name):
            other = _graph_logits(model, context)
        # After a step whose argmax differs the steps decode other tokens, so step 1 is the
        # like-for-like comparison; its largest logit gives the scale.
        diff = (
            "bit-identical"
            if torch.equal(other, base)
            else f"step 1 max |diff| {_max_diff(other[0], base[0])} (max |logit| "
            f"{base[0].abs().max():.3g}), 8 steps {_max_diff(other, base)}"
        )
        cells.append(f"{name}: {diff}")
    return [f"| {model_name} | logits vs {names[0]} (8 steps) | {'; '.join(cells)} | | | |"]


@torch.inference_mode()
@contextlib.contextmanager
def _variant(model, name: str):
    """Variant `name` switched on, with no prefill graph captured under another variant:
    a replayed graph would run the kernels its capture chose."""
    GraphDecoder.discard_idle(model)
    try:
        with VARIANTS[name]():
            yield
    finally:
        GraphDecoder.discard_idle(model)


def _prefill_logits(model, tokens: int) -> torch.Tensor:
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (1, tokens), device=model.device)
    chunk = default_prefill_step(model.device)
    for _ in range(3):  # as requests do: eager, then a captured graph, then its replay
        decoder = GraphDecoder.acquire(model, tokens + 1)
        logits = decoder.prefill(ids, chunk).float()
        GraphDecoder.release(decoder)
    return logits


def _prefill_logit_checks(model, model_name: str, names: list[str], tokens: int) -> list[str]:
    """A row: is each variant's last prefill logit row bit-identical to base's?"""
    with _variant(model, names[0]):
        base = _prefill_logits(model, tokens)
    cells = []
    for name in names[1:]:
        with _variant(model, name):
            other = _prefill_logits(model, tokens)
        same = torch.equal(other, base)
        diff = f"max |diff| {_max_diff(other, base)} (max |logit| {base.abs().max():.3g})"
        cells.append(f"{name}: " + ("bit-identical" if same else diff))
    return [f"| {model_name} | prefill logits vs {names[0]} | {'; '.join(cells)} | | | |"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gemma3-12b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="decode")
    parser.add_argument("--prefill", type=int, default=0, help="time an N-token prefill")
    parser.add_argument(
        "--check", action="store_true", help="compare each variant's decode logits with base's"
    )
    args = parser.parse_args()
    names = args.variants.split(",")
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    if args.prefill:
        what = (
            f"Prefill of {args.prefill} tokens (median of repeats; % of "
            f"{PEAK_FLOPS / 1e12:.0f} TFLOP/s)"
        )
    else:
        what = (
            f"Batch-1 CUDA-graph decode at context {args.context}, {args.steps} steps a timing "
            f"(% of (weights + KV bytes) / {bandwidth / 1e12:.2f} TB/s measured copy)"
        )
    lines = [
        f"# A/B: {', '.join(names)} ({date.today()}, {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__})",
        "",
        f"{what}, {args.quant} weights, variants alternating for {args.rounds} rounds in one "
        "process.",
        "",
        "| model | variant | tok/s (each round) | median | vs base | % of roofline or peak |",
        "|---|---|---|---|---|---|",
    ]
    for model_name in args.models.split(","):
        model = build_random_model(PRESETS[model_name], device, quant=args.quant)
        step_bytes = decode_bytes(model) + kv_bytes(model.config, args.context, 2)
        if args.prefill:  # a token's share of the prefill's FLOPs, at the matmul peak
            chunk = default_prefill_step(device)
            per_token = prefill_flops(model.config, args.prefill, chunk) / args.prefill
            step_bytes, bandwidth = per_token, PEAK_FLOPS
        rates: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                with _variant(model, name):
                    if args.prefill:
                        rate = args.prefill / time_prefill(model, args.prefill)[0]
                    else:
                        rate = 1.0 / time_decode(model, args.context, args.steps)[0]
                rates[name].append(rate)
        base = statistics.median(rates[names[0]])
        for name in names:
            median = statistics.median(rates[name])
            each = ", ".join(f"{r:.1f}" for r in rates[name])
            lines.append(
                f"| {model_name} | {name} | {each} | {median:.1f} | {median / base - 1:+.1%} | "
                f"{median * step_bytes / bandwidth:.1%} |"
            )
        print("\n".join(lines[-len(names) :]), flush=True)
        if args.check and not args.prefill:
            lines += _logit_checks(model, model_name, names, args.context)
            print(lines[-1], flush=True)
        if args.check and args.prefill:
            lines += _prefill_logit_checks(model, model_name, names, args.prefill)
            print(lines[-1], flush=True)
        del model
        torch.cuda.empty_cache()
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ab_{args.name}.md").write_text(table)


if __name__ == "__main__":
    main()
