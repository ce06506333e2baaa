"""Batch-1 timings (decode, prefill, time to first token) and their rooflines.

Decode at context C: the caches are filled with C - 1 tokens of random K/V (writing them
costs nothing next to prefilling C tokens), then `steps` greedy steps run as the engine runs
them: replayed from CUDA graphs over static caches on a GPU (dense models), eagerly over the
growing caches otherwise. Prefill runs the prompt in the engine's chunks (4096 tokens on a
GPU, 512 on a CPU: the plan's `prefill_chunk`).

Rooflines: a decode step must read every weight it uses once (`decode_bytes`) and the K/V of
the context (`kv_bytes`), at `bandwidth`; a prefill must do `prefill_flops`, at `peak_flops`.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from hearth.config import FULL_ATTENTION, Gemma4Config, ModelConfig
from hearth.kv import DENSE, KVPolicy, LayerCache
from hearth.kv.footprint import token_bytes
from hearth.models import Model, model_class
from hearth.ops.native.bf16_gemm import linear as cpu_linear
from hearth.runtime.runner import ModelRunner
from hearth.runtime.sampling import Sampler, SamplingParams

WARMUP_STEPS = 2  # eager decode steps run before timing (kernel selection, allocations)


# ---------------------------------------------------------------------------------------------
# Rooflines


def decode_bytes(model: nn.Module, rows: int = 1) -> int:
    """Weight bytes one decode step of `rows` tokens reads: every tensor once, except rows
    only looked up (an untied token table, the per-layer table, RoPE tables) and idle experts:
    a MoE step reads the experts its tokens chose, top_k of num_experts at one token and, at
    more, the expected share of distinct experts under uniform routing, 1 - (1 - top_k / E)^rows
    (26B-A4B at 16 tokens: 64% of its experts, ten times one token's)."""
    config = model.config
    tied = config.tie_word_embeddings
    total = 0
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if "rotary" in name or "embed_tokens_per_layer" in name:
            continue
        if name.startswith("embed_tokens.") and not tied:
            continue  # only looked up; the separate lm_head is the one read whole
        share = 1.0
        if ".experts." in name and getattr(config, "moe", None) is not None:
            share = 1.0 - (1.0 - config.moe.top_k / config.moe.num_experts) ** rows
        total += int(tensor.numel() * tensor.element_size() * share)
    return total


def _attention_layers(config: ModelConfig) -> list[tuple[int, int, int, int | None]]:
    """(query heads, KV heads, head_dim, window) of every layer, KV-sharing ones included."""
    layers = []
    for kind in config.layer_types:
        gemma4 = isinstance(config, Gemma4Config)
        head_dim = config.head_dim_of(kind) if gemma4 else config.head_dim
        kv_heads = config.kv_heads_of(kind) if gemma4 else config.num_key_value_heads
        window = None if kind == FULL_ATTENTION else config.sliding_window
        layers.append((config.num_attention_heads, kv_heads, head_dim, window))
    return layers


def kv_bytes(
    config: ModelConfig, context: int, element_bytes: int, policy: KVPolicy | None = None
) -> int:
    """K/V bytes a decode step at `context` reads: each layer its keys within reach (all on
    full layers, the window on sliding ones), in the layout `policy` stores them (plain
    `element_bytes` values when None). Gemma 4's KV-sharing layers read their donor's K/V
    again, so they count too."""
    total = 0
    for index, (_, heads, head_dim, window) in enumerate(_attention_layers(config)):
        codec = DENSE if policy is None else policy.codec_of(index, window)
        per_token = token_bytes(codec, heads, head_dim, _DTYPES[element_bytes])
        total += per_token * min(context, window or context)
    return total


_DTYPES = {2: torch.bfloat16, 4: torch.float32}


def _matrix_params(config: ModelConfig) -> tuple[float, float]:
    """Multiply-adds per token: (of modules every prompt token runs through, of modules only
    the last token of each chunk reaches: the head and Gemma 4's KV-sharing layers)."""
    with torch.device("meta"):
        model = model_class(config)(config)
    first_shared = getattr(config, "first_kv_shared_layer", config.num_hidden_layers)
    moe = getattr(config, "moe", None)
    every_token = last_token = 0.0
    for name, parameter in model.named_parameters():
        if parameter.dim() < 2 or "embed_tokens_per_layer" in name:
            continue  # norms and scales: no matmul; the per-layer table: looked up
        if name.startswith("embed_tokens."):
            if config.tie_word_embeddings:
                last_token += parameter.numel()  # as the head
            continue
        count = float(parameter.numel())
        if ".experts." in name and moe is not None:
            count *= moe.top_k / moe.num_experts
        shared_layer = name.startswith("layers.") and int(name.split(".")[1]) >= first_shared
        if name.startswith("lm_head.") or shared_layer:
            last_token += count
        else:
            every_token += count
    return every_token, last_token


def _keys_seen(position: int, window: int | None) -> int:
    return min(position + 1, window or position + 1)


def _keys_seen_sum(first: int, last: int, window: int | None) -> int:
    """Σ over positions first..last-1 of the keys each attends to (causal, windowed)."""
    total = 0
    ramp_end = min(last, window or last)  # positions below this see position + 1 keys
    if first < ramp_end:
        total += (ramp_end * (ramp_end + 1) - first * (first + 1)) // 2
    if window is not None and last > max(first, window):
        total += (last - max(first, window)) * window
    return total


def prefill_flops(config: ModelConfig, tokens: int, chunk: int = 512) -> float:
    """FLOPs of a chunked prefill of `tokens`: 2 per multiply-add of every matmul token by
    token, with the head and KV-sharing layers on the last token of each chunk only (as the
    model runs them), plus attention's QK^T and PV over the keys each query may see."""
    every_token, last_token = _matrix_params(config)
    chunks = -(-tokens // chunk)
    flops = 2.0 * (every_token * tokens + last_token * chunks)
    first_shared = getattr(config, "first_kv_shared_layer", config.num_hidden_layers)
    for index, (heads, _, head_dim, window) in enumerate(_attention_layers(config)):
        if index < first_shared:
            keys = _keys_seen_sum(0, tokens, window)
        else:
            ends = [min(start + chunk, tokens) - 1 for start in range(0, tokens, chunk)]
            keys = sum(_keys_seen(end, window) for end in ends)
        flops += 4.0 * heads * head_dim * keys  # 2 matmuls x 2 FLOPs per multiply-add
    return flops


# ---------------------------------------------------------------------------------------------
# Timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, work: Callable[[], object]) -> float:
    """Seconds `work` takes, its device work included."""
    synchronize(device)
    begin = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - begin


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _random_ids(model: Model, count: int, device: torch.device) -> torch.Tensor:
    config = model.config
    vocab = min(config.vocab_size, getattr(config, "vocab_size_per_layer_input", None) or 2**62)
    return torch.randint(0, vocab, (1, count), device=device)


def fill_caches(caches: list[Any], model: Model, tokens: int) -> None:
    """Store `tokens` tokens of random K/V in each layer's cache, as a prefill would leave them
    (positions and counters included), without running the model."""
    if tokens == 0:
        return
    device, dtype = model.device, model.compute_dtype
    for cache, spec in zip(caches, model.cache_specs(), strict=True):
        shape = (1, spec.kv_heads, tokens, spec.head_dim)
        keys = torch.randn(shape, dtype=dtype, device=device)
        cache.update_and_fetch(keys, torch.randn_like(keys))


@torch.inference_mode()
def time_decode(runner: ModelRunner, context: int, steps: int) -> tuple[float, str]:
    """Seconds per greedy decode step with `context - 1` tokens already cached (in the
    runner's KV layout), and the path."""
    model, device = runner.model, runner.device
    if runner.decodes_with_graphs:
        seconds = _time_graph_decode(runner, context, steps)
        release(device)  # the static caches and the graphs' memory pools
        return seconds, "CUDA graph"
    caches: list[LayerCache] = runner.new_caches()
    fill_caches(caches, model, context - 1)
    token = _random_ids(model, 1, device)
    position = context - 1

    def run(count: int) -> None:
        nonlocal token, position
        for _ in range(count):
            token = runner.decode(token, caches, position).argmax(-1, keepdim=True)
            position += 1

    run(WARMUP_STEPS)
    return timed(device, lambda: run(steps)) / steps, "eager"


def _time_graph_decode(runner: ModelRunner, context: int, steps: int) -> float:
    from hearth.runtime.graphs import GraphDecoder

    model, device = runner.model, runner.device
    decoder = GraphDecoder(model, context + steps, runner.plan, runner.kv_policy)
    fill_caches(decoder.caches, model, context - 1)
    token = _random_ids(model, 1, device)

    def run() -> None:
        nonlocal token
        for _ in range(steps):
            token = decoder.step(token).argmax(-1, keepdim=True)

    def rewind() -> None:
        for cache in decoder.caches:
            cache.reset(context - 1)
        decoder.length = context - 1

    decoder.length = context - 1
    run()  # captures a graph for every key-length bucket the timed steps reach
    rewind()
    return timed(device, run) / steps


class PrefillRun:
    """A fresh prefill of `ids` as the engine runs it (a call returns the last logits);
    `path` says how the last call ran: from a prefill graph or eagerly in chunks."""

    def __init__(self, runner: ModelRunner, ids: torch.Tensor) -> None:
        self.runner, self.ids = runner, ids
        self.chunk = runner.plan.prefill_chunk
        self.path = "chunked"

    def __call__(self) -> torch.Tensor:
        runner = self.runner
        if not runner.decodes_with_graphs:
            return runner.prefill(self.ids, runner.new_caches())
        # As generate_tokens gets its decoder: the runner's, reused from request to request.
        decoder = runner.acquire_decoder(self.ids.shape[1] + 1)
        try:
            logits = decoder.prefill(self.ids, self.chunk)
        finally:
            runner.release_decoder(decoder)
        bucket = decoder.graph_bucket
        self.path = "chunked" if bucket is None else f"CUDA graph, padded to {bucket}"
        return logits


def warm_up(run: PrefillRun) -> None:
    """Run a prefill until it is in its steady state: kernels chosen, the allocator's blocks
    at this size, and on a GPU its prefill graph captured (a bucket's second prompt does)."""
    run()
    run()


# A timed prefill repeats until this much time has run (at most PREFILL_REPEATS times) and the
# median counts: one ~40 ms prefill (E4B at 4k tokens) spread 43-64% of peak run to run.
PREFILL_TIMING_SECONDS = 1.0
PREFILL_REPEATS = 9


@torch.inference_mode()
def time_prefill(runner: ModelRunner, tokens: int) -> tuple[float, str]:
    """Median seconds of a prefill of `tokens` random tokens (after full-size warm-ups),
    repeated while short, each run as a request's; and how it ran (graph or chunks)."""
    device = runner.device
    run = PrefillRun(runner, _random_ids(runner.model, tokens, device))
    warm_up(run)
    runs = [timed(device, run)]
    while len(runs) < PREFILL_REPEATS and sum(runs) < PREFILL_TIMING_SECONDS:
        runs.append(timed(device, run))
    release(device)
    return statistics.median(runs), run.path


@torch.inference_mode()
def time_first_token(runner: ModelRunner, tokens: int) -> float:
    """Seconds from a prompt of `tokens` ids on the device to the first token id on the host:
    prefill, then greedy sampling as the generate loop does it."""
    device = runner.device
    ids = _random_ids(runner.model, tokens, device)
    run = PrefillRun(runner, ids)
    sampler = Sampler(SamplingParams(), device=device)
    history = ids[0].tolist()
    warm_up(run)
    synchronize(device)
    begin = time.perf_counter()
    int(sampler.sample(run(), history))
    seconds = time.perf_counter() - begin
    release(device)
    return seconds


# Sizes of the roofline probes: the copy well past any cache (a GPU's L2 is 50-60 MB, a CPU's
# last level tens of MB), the matmul large enough that its tiles fill every SM or core.
_COPY_BYTES = {"cuda": 2**30, "cpu": 2**28}
_MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}


def copy_bandwidth(device: torch.device, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write), the decode roofline's bandwidth."""
    source = torch.empty(_COPY_BYTES[device.type], dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    seconds = timed(device, lambda: [target.copy_(source) for _ in range(repeats)])
    return 2 * source.numel() * repeats / seconds


def matmul_peak(device: torch.device, dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of a large square matmul in `dtype`, the best of three timings: the prefill
    roofline's peak as this device reaches it in practice, not its data-sheet number. On a CPU
    the product runs as Hearth's CPU prefill runs one (`hearth.ops.native.bf16_gemm.linear`: an
    fp32 GEMM for bf16 where the CPU has no bf16 instructions; torch.mm in bf16 ran at ~1
    GFLOP/s on such a CPU)."""
    size = _MATMUL_SIZE[device.type]
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    if device.type == "cpu":
        product = partial(cpu_linear, a, b)  # a @ bᵀ: the FLOPs of a @ b
    else:
        product = partial(torch.mm, a, b, out=torch.empty_like(a))
    product()
    seconds = min(timed(device, lambda: [product() for _ in range(repeats)]) for _ in range(3))
    return 2 * size**3 * repeats / seconds
