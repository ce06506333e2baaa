"""`hearth fit`: whether a model at a context fits the memory, answered before anything loads.

The weights are sized by the loader itself, run on the meta device over the checkpoint's
headers (`Checkpoint.tensors(meta=True)`), so every conversion a real load makes counts as
it would: MLX-packed modules stay packed, GGUF blocks widen to the compute dtype or become
int8 for the CPU, floats are cast. The K/V caches are sized by `hearth.kv.footprint`.

Besides those, a process holds a runtime (Python, torch and Hearth, the tokenizer on the CPU;
the CUDA context on a GPU), a prefill chunk's activations, and while it loads, a quantizing
load's widened copy of one tensor: constants measured here, stated below, with a margin. The
same checkpoint, options and memory always give the same answer.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from hearth.checkpoint import open_checkpoint
from hearth.checkpoint.loader import Checkpoint
from hearth.config import ModelConfig
from hearth.devices import parse_device
from hearth.embedded import embedded_model_path
from hearth.engine import DTYPES, resolve_precision
from hearth.errors import HearthError
from hearth.kv.footprint import KVFootprint
from hearth.kv.policy import parse_kv_quant
from hearth.models import Model
from hearth.models.loading import STORED_BLOCKS, build_model
from hearth.ops.plan import ExecutionPlan
from hearth.quant.mlx import parse_quantization

BYTES_PER_GB = 10**9
# Shares of a machine's memory a model may take when none is given: a CPU's RAM also holds
# the system and other programs (the reference system's rule, RAM x 0.75); a GPU holds
# little besides the CUDA context.
USABLE_RAM = 0.75
USABLE_GPU_MEMORY = 0.9
# Resident memory of Python with torch and Hearth imported, before any model: 0.25-0.33 GB
# measured on a 2-core AMD EPYC (torch 2.13 CPU build, 2026-12-06), as more or fewer of
# torch's library pages are resident; rounded up for other CPUs' builds.
CPU_RUNTIME_BYTES = 400_000_000
# A tokenizer in memory per vocabulary entry: the embedded model's (262,144 entries, its BPE
# rebuilt from GGUF metadata) took 0.30 GB.
TOKENIZER_BYTES_PER_ENTRY = 1200
# Device memory a CUDA process takes besides its tensors: the context and cuBLAS's workspace,
# 0.62 GB after a first bf16 matmul on an H100 (torch 2.11, CUDA 13; 2026-12-06).
CUDA_RUNTIME_BYTES = 700_000_000
# Values a prefill chunk's activations hold per token, in 4-byte floats at most: the
# residual, norm and attention streams (6 x hidden) and the MLP's gate, up and product
# (3 x intermediate). CPU attention over a long context adds little: torch's SDPA works in
# blocks (+30 MB at 16k keys, measured).
ACTIVATION_WIDTHS = (6, 3)


@dataclass(frozen=True)
class Fit:
    """What a model needs at `context` tokens against `memory_bytes`."""

    model: Path
    device: str
    dtype: torch.dtype
    weights: str  # how they are held, e.g. "int8", "MLX 4-bit", "bfloat16"
    kv_quant: str
    context: int
    weight_bytes: int
    kv_bytes: int
    runtime_bytes: int  # the process without the model: torch, Hearth, the tokenizer
    workspace_bytes: int  # a prefill chunk's activations and the logits
    load_bytes: int  # held only while loading: a quantizing load's widest tensor, widened
    memory_bytes: int
    longest_context: int  # the most tokens whose K/V fit beside everything else
    max_context: int  # the model's positions
    step_bytes: int  # what a decode step at `context` reads: weights used and K/V in reach

    @property
    def needed_bytes(self) -> int:
        """The peak: the load's, or the run's at `context`, whichever is higher."""
        running = self.kv_bytes + self.workspace_bytes
        return self.weight_bytes + self.runtime_bytes + max(running, self.load_bytes)

    @property
    def fixed_bytes(self) -> int:
        """What the process holds at any context: weights, runtime and workspace."""
        return self.weight_bytes + self.runtime_bytes + self.workspace_bytes

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.memory_bytes


def usable_memory(device: torch.device) -> int:
    """Bytes a model may take on `device` when no budget is given (`USABLE_*`)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise HearthError("no CUDA device here to measure: give --memory")
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * USABLE_GPU_MEMORY)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * USABLE_RAM)


def plan_fit(
    model: str | Path | None = None,
    context: int = 8192,
    memory_gb: float | None = None,
    device: str | torch.device | None = None,
    dtype: str | None = None,
    quantize: str = "auto",
    kv_quant: str = "off",
    random: str | None = None,
    quant: str | None = None,
) -> Fit:
    """The `Fit` of a model as `Engine.load` would load it with the same options, or, with
    `random` (a preset or config.json) and `quant`, as `hearth bench --random` builds it."""
    from hearth.bench.measure import decode_bytes, kv_bytes

    if dtype is not None and dtype not in DTYPES:
        raise HearthError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    target = parse_device(device, available=False)  # a GPU's fit is planned from anywhere
    if random is not None:
        if model is not None:
            raise HearthError("give a MODEL or --random CONFIG, not both")
        name = Path(random)
        sized, weights, checkpoint_dir = _random(random, quant, dtype)
    else:
        if quant is not None:
            raise HearthError("--quant sizes a --random model; a checkpoint keeps its own")
        name = Path(model) if model is not None else embedded_model_path()
        sized, weights, checkpoint_dir = _loaded(name, target, dtype, quantize)
    config, compute_dtype = sized.config, sized.compute_dtype
    if context > config.max_position_embeddings:
        raise HearthError(
            f"--context {context} is past the model's {config.max_position_embeddings} positions"
        )
    policy = parse_kv_quant(kv_quant, checkpoint=checkpoint_dir)
    policy.check(sized.cache_specs())
    tensors = sized.state_dict().values()
    weight_bytes = sum(tensor.nbytes for tensor in tensors)
    footprint = KVFootprint.of(sized.cache_specs(), compute_dtype, policy)
    memory = usable_memory(target) if memory_gb is None else round(memory_gb * BYTES_PER_GB)
    runtime = runtime_bytes(target, config.vocab_size)
    workspace = workspace_bytes(config, target)
    quantizing = target.type == "cpu" and weights in ("int8", "int4")
    # A quantizing load widens each tensor to the compute dtype before packing it.
    load = max(t.numel() for t in tensors) * compute_dtype.itemsize if quantizing else 0
    room = memory - weight_bytes - runtime - workspace
    if weight_bytes + runtime + load > memory:
        room = 0  # the load itself does not fit
    return Fit(
        model=name,
        device=target.type,
        dtype=compute_dtype,
        weights=weights,
        kv_quant=kv_quant,
        context=context,
        weight_bytes=weight_bytes,
        kv_bytes=footprint.bytes_at(context),
        runtime_bytes=runtime,
        workspace_bytes=workspace,
        load_bytes=load,
        memory_bytes=memory,
        longest_context=footprint.longest_context(room, config.max_position_embeddings),
        max_context=config.max_position_embeddings,
        step_bytes=decode_bytes(sized) + kv_bytes(config, context, compute_dtype.itemsize, policy),
    )


def runtime_bytes(device: torch.device, vocab_size: int) -> int:
    """The process without the model: on the CPU Python, torch, Hearth and the tokenizer; on
    a GPU the CUDA context (the tokenizer lives in host memory)."""
    if device.type == "cuda":
        return CUDA_RUNTIME_BYTES
    return CPU_RUNTIME_BYTES + TOKENIZER_BYTES_PER_ENTRY * vocab_size


def workspace_bytes(config: ModelConfig, device: torch.device) -> int:
    """A prefill chunk's activations (`ACTIVATION_WIDTHS`, 4-byte values) and a few logits
    rows (the sampler's copies), at the engine's chunk size on `device`."""
    every, mlp = ACTIVATION_WIDTHS
    per_token = every * config.hidden_size + mlp * config.intermediate_size
    chunk = ExecutionPlan.for_device(device).prefill_chunk
    return 4 * (chunk * per_token + 4 * config.vocab_size)


def _loaded(
    path: Path, device: torch.device, dtype: str | None, quantize: str
) -> tuple[Model, str, Path | None]:
    """(the model a load of `path` makes, on the meta device; how it holds its weights; the
    directory a `--kv-quant config` reads)."""
    checkpoint = open_checkpoint(path)
    compute_dtype, cpu_quant = resolve_precision(
        checkpoint.format, device, DTYPES.get(dtype or ""), quantize, checkpoint.stored_dtype
    )
    # Sized under the target's plan: on a GPU the block kernels keep every table on blocks.
    plan = ExecutionPlan.for_device(device)
    sized = build_model(_MetaTensors(checkpoint), compute_dtype, "meta", False, cpu_quant, plan)
    if cpu_quant == STORED_BLOCKS:
        weights = "as-stored GGUF"
    elif cpu_quant is not None:
        weights = cpu_quant
    elif parse_quantization(checkpoint.config) is not None:
        weights = "MLX-packed"
    else:
        weights = _dtype_name(compute_dtype)
    return sized, weights, path if path.is_dir() else None


def _random(spec: str, quant: str | None, dtype: str | None) -> tuple[Model, str, None]:
    """(the model `hearth bench --random spec --quant quant` builds, on the meta device; how
    it holds its weights)."""
    from hearth.bench.random_model import build_random_model, resolve_config

    compute_dtype = DTYPES.get(dtype or "", torch.bfloat16)
    quant = quant or "bf16"
    sized = build_random_model(resolve_config(spec), "meta", quant, compute_dtype)
    weights = _dtype_name(compute_dtype) if quant == "bf16" else f"MLX {quant[0]}-bit"
    return sized, weights, None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _MetaTensors:
    """A checkpoint whose tensors come as meta tensors: the loader sizes, reads nothing."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint

    def __getattr__(self, name: str) -> object:
        return getattr(self._checkpoint, name)

    def tensors(
        self, dtype: torch.dtype | None = None, skip: Collection[str] = ()
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self._checkpoint.tensors(dtype, skip, meta=True)


def describe_fit(fit: Fit, bandwidth_gbs: float | None = None) -> str:
    """The report `hearth fit` prints."""
    verdict = "fits" if fit.fits else "does not fit"
    kv_layout = "dense" if fit.kv_quant == "off" else f"--kv-quant {fit.kv_quant}"
    lines = [
        f"model: {fit.model}",
        f"on {fit.device}: {fit.weights} weights, computing in {_dtype_name(fit.dtype)}; "
        f"KV cache {kv_layout}",
        f"weights: {_gb(fit.weight_bytes)} GB",
        f"KV cache at {fit.context:,} tokens: {_gb(fit.kv_bytes)} GB",
        f"runtime: {_gb(fit.runtime_bytes)} GB, workspace: {_gb(fit.workspace_bytes)} GB",
        *(
            [f"loading: +{_gb(fit.load_bytes)} GB at its peak (a tensor widened to quantize it)"]
            if fit.load_bytes
            else []
        ),
        f"needed: {_gb(fit.needed_bytes)} GB of {_gb(fit.memory_bytes)} GB: {verdict}",
        f"longest context that fits: {fit.longest_context:,} tokens "
        f"(the model's positions: {fit.max_context:,})"
        if fit.longest_context
        else "longest context that fits: none, the model alone is over",
    ]
    if bandwidth_gbs is not None:
        ceiling = bandwidth_gbs * BYTES_PER_GB / fit.step_bytes
        lines.append(
            f"decode at {fit.context:,} tokens: at most {ceiling:,.1f} tok/s "
            f"({_gb(fit.step_bytes)} GB a step at {bandwidth_gbs:g} GB/s)"
        )
    return "\n".join(lines)


def _gb(size: int) -> str:
    return f"{size / BYTES_PER_GB:.3g}"
